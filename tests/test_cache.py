"""The node-local shard cache (stager/cache/, stage --cache, stager cache ..., the loader's cached reads).

Invariants, with real files and real processes:
* a stage whose files are cached copies nothing and links them into DEST; DEST verifies;
* a partly cached dataset copies only the rest; datasets that share shard files share objects;
  bytes from one source are never served as another source's (a non-cryptographic hash is scoped);
* concurrent stages of one dataset read SRC once in total, and every DEST verifies;
* eviction frees least recently used objects only, never one a live lease, a destination or a pin
  holds, and says what and why; a dead holder's lease is detected;
* the loader reads cached copies with the same checks and reports ``staged_mode: "cache"``;
* bad input is one line with exit 2 (a cache of another owner or writable by others, a quota larger
  than the disk, a directory that is not a cache), a cache on a shared file system is warned about.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stager.cache import Cache, Lease, Quota
from stager.cache.config import CacheOptions
from stager.cache.evict import collect
from stager.cache.layout import object_key, source_tag
from stager.cache.lease import read_leases
from stager.errors import UsageError
from stager.manifest import load_manifest
from stager.pack import pack
from stager.receipt import load_receipt
from stager.stage import NodeOptions, StageOptions, run_stage
from tests.test_stage_support import assert_verified_copy, last_json, make_dataset, spawn, stager


def _all_files(m) -> list[tuple[str, int, str]]:
    return list(m.files())


def _stage(src: Path, dest: Path | None, cache: Path, *, cache_quota: int | None = None, cache_only: bool = False,
           partition: bool = False, node: int | None = None, num_nodes: int | None = None) -> dict:
    """``stager stage SRC DEST --cache CACHE`` in this process (the CLI's own tests run it as a command)."""
    quota = Quota.parse(str(cache_quota)) if cache_quota is not None else None
    options = StageOptions(cache=CacheOptions(str(cache), quota=quota, only=cache_only), partition=partition,
                           node=NodeOptions(node, num_nodes), workers=2)
    return run_stage(src, dest, options).to_json()


@pytest.fixture
def ds(tmp_path: Path):
    src = tmp_path / "src"
    return src, make_dataset(src, n=6, size=48 << 10)


def _objects(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "objects").rglob("*") if p.is_file() and not p.name.endswith(".partial"))


def test_second_stage_links_every_file_and_copies_nothing(ds, tmp_path: Path) -> None:
    src, m = ds
    cache = tmp_path / "cache"
    r = stager("stage", str(src), str(tmp_path / "d1"), "--cache", str(cache), "--json", "-q")
    assert r.returncode == 0, r.stderr
    first = last_json(r.stdout)
    files = _all_files(m)
    assert first["cache"]["files_filled"] == len(files) and first["bytes_copied"] == sum(b for _, b, _ in files)
    assert (cache.stat().st_mode & 0o777) == 0o700, "a user's cache is private"
    for shard in src.glob("shard-*"):
        shard.chmod(0)  # the second stage must not read SRC's shards at all
    second = _stage(src, tmp_path / "d2", cache)
    assert second["bytes_copied"] == 0 and second["files_copied"] == 0
    assert second["cache"]["files_hit"] == len(files) and second["cache"]["links"] == "hard"
    assert_verified_copy(m, tmp_path / "d2")
    for s in m.shards:  # DEST's file is the object itself, read-only
        st = (tmp_path / "d2" / s.name).stat()
        assert st.st_nlink == 3 and not st.st_mode & 0o222
    assert second["cache"]["files_rehashed"] == 0  # every object still matched its seal: none read again
    rec = load_receipt(tmp_path / "d2")
    assert rec is not None and {k: rec.cache[k] for k in ("dir", "kind", "links")} == \
        {"dir": str(cache), "kind": "user", "links": "hard"}
    assert set(rec.cache["files"]) == {n for n, _, _ in files}
    assert all(v.startswith("cached, verified ") for v in rec.cache["files"].values()), rec.cache["files"]
    assert set(first["cache"]["verified"].values()) == {"copied"}
    assert stager("verify", str(tmp_path / "d2"), "-q").returncode == 0


def test_partly_cached_dataset_copies_only_the_rest(ds, tmp_path: Path) -> None:
    src, m = ds
    cache = tmp_path / "cache"
    _stage(src, tmp_path / "d1", cache)
    shutil.rmtree(tmp_path / "d1")
    gone = _objects(cache)[:3]
    for p in gone:
        p.unlink()
    res = _stage(src, tmp_path / "d2", cache)
    assert res["cache"]["files_filled"] == 3 and res["bytes_copied"] == sum(p.stat().st_size for p in _objects(cache)
                                                                             if p.name in {g.name for g in gone})
    assert res["cache"]["files_hit"] == len(_all_files(m)) - 3
    assert_verified_copy(m, tmp_path / "d2")


def test_a_users_cache_follows_the_umask(ds, tmp_path: Path) -> None:
    src, m = ds
    r = stager("stage", str(src), str(tmp_path / "d"), "--cache", str(tmp_path / "cache"), "-q",
               preexec_fn=lambda: os.umask(0o077))
    assert r.returncode == 0, r.stderr
    assert {stat.S_IMODE((tmp_path / "d" / s.name).stat().st_mode) for s in m.shards} == {0o400}


def test_datasets_sharing_shard_files_share_objects_and_sources_are_scoped(tmp_path: Path) -> None:
    """Two manifests over one directory's shards share objects; with xxh3 (not collision-resistant) a
    copy of the same bytes elsewhere does not (its bytes came from another source); with blake2b it does."""
    a = tmp_path / "a"
    m = make_dataset(a, n=4, size=32 << 10)
    # A second dataset over the same shard files: a manifest of three of them, in the same directory.
    sub = load_manifest(a)
    sub.shards = sub.shards[:3]
    sub.digest = ""
    (a / "subset.json").write_bytes(sub.to_bytes())
    cache = tmp_path / "cache"
    _stage(a, tmp_path / "d1", cache)
    res = _stage(a / "subset.json", tmp_path / "d2", cache)
    assert res["cache"]["files_hit"] == 3 + 1 and res["bytes_copied"] == 0  # three shards and the sample index
    # The same bytes at another path, xxh3: scoped by source, so copied (and cached) again.
    b = tmp_path / "b"
    shutil.copytree(a, b)
    res = _stage(b, tmp_path / "d3", cache)
    assert res["cache"]["files_hit"] == 0 and res["cache"]["files_filled"] == len(_all_files(m))
    # blake2b: the name is the content's, so any copy of the bytes is the same object.
    assert object_key("blake2b", "ab" * 32, str(a / "x")) == object_key("blake2b", "ab" * 32, str(b / "x"))
    assert object_key("xxh3_128", "ab" * 16, str(a / "x")) != object_key("xxh3_128", "ab" * 16, str(b / "x"))
    # A symlinked path to the same file is the same source.
    (tmp_path / "alias").symlink_to(a)
    assert source_tag(str(tmp_path / "alias" / "x")) == source_tag(str(a / "x"))


def test_blake2b_copies_share_objects(tmp_path: Path, imagenet_tiny: Path) -> None:
    a = tmp_path / "a"
    pack(imagenet_tiny, a, format="tar", samples_per_shard=8, hash_algo="blake2b")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    cache = tmp_path / "cache"
    _stage(a, tmp_path / "d1", cache)
    res = _stage(b, tmp_path / "d2", cache)
    assert res["cache"]["files_filled"] == 0 and res["bytes_copied"] == 0
    assert stager("verify", str(tmp_path / "d2"), "-q").returncode == 0


def test_hostile_hash_never_names_a_path(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_dataset(src, n=2)
    m = load_manifest(src)
    m.shards[0].hash = "../../../../etc/passwd"
    m.digest = ""
    (src / "manifest.json").write_bytes(m.to_bytes())
    r = stager("stage", str(src), str(tmp_path / "d"), "--cache", str(tmp_path / "cache"))
    assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1 and "not a hex digest" in r.stderr, r.stderr
    assert not [p for p in (tmp_path / "cache").rglob("*") if "passwd" in p.name]


def test_verify_finds_a_damaged_object_and_the_next_stage_repairs_it(ds, tmp_path: Path) -> None:
    src, m = ds
    cache = tmp_path / "cache"
    _stage(src, tmp_path / "d1", cache)
    shutil.rmtree(tmp_path / "d1")
    victim = _objects(cache)[0]
    victim.chmod(0o600)
    with open(victim, "r+b") as f:
        f.write(b"X")
    victim.chmod(0o400)
    r = stager("cache", "verify", str(cache), "--json")
    rep = last_json(r.stdout)
    assert r.returncode == 3 and len(rep["damaged"]) == 1 and rep["removed"] == [f"xxh3_128/{victim.name}"]
    res = _stage(src, tmp_path / "d2", cache)
    assert res["cache"]["files_filled"] == 1
    assert_verified_copy(m, tmp_path / "d2")
    assert stager("cache", "verify", str(cache), "-q").returncode == 0


def test_concurrent_stages_read_the_source_once(ds, tmp_path: Path) -> None:
    """Three stages of one dataset into three DESTs through one cache at once (copies throttled so
    they overlap): SRC is read once in total, each DEST verifies, nothing partial is left."""
    src, m = ds
    cache = tmp_path / "cache"
    env = {"STAGER_TEST_THROTTLE_BPS": "400000"}
    procs = [spawn("stage", str(src), str(tmp_path / f"d{i}"), "--cache", str(cache), "--json", "-q",
                   "--workers", "2", "--timeout", "120", env=env) for i in range(3)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        results.append(last_json(out))
    total = sum(b for _, b, _ in _all_files(m))
    assert sum(r["cache"]["bytes_filled"] for r in results) == total, [r["cache"] for r in results]
    assert sum(r["bytes_copied"] for r in results) == total
    for i, r in enumerate(results):
        c = r["cache"]
        assert c["bytes_hit"] + c["bytes_filled"] + c["bytes_from_peer"] == total
        assert_verified_copy(m, tmp_path / f"d{i}")
    assert not list(cache.rglob("*.partial"))
    assert stager("cache", "verify", str(cache), "-q").returncode == 0


def test_a_filler_killed_mid_copy_leaves_a_consistent_cache_and_the_next_stage_repairs_it(ds, tmp_path: Path) -> None:
    src, m = ds
    cache = tmp_path / "cache"
    p = spawn("stage", str(src), str(tmp_path / "d1"), "--cache", str(cache), "-q", "--workers", "2",
              env={"STAGER_TEST_THROTTLE_BPS": "100000"})
    deadline = time.monotonic() + 60
    while not list(cache.rglob("*.partial")) and time.monotonic() < deadline:
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.communicate()
    for o in _objects(cache):  # whatever is there under a final name is whole
        assert not o.stat().st_mode & 0o222
    assert stager("cache", "verify", str(cache), "--no-repair", "-q").returncode == 0
    res = _stage(src, tmp_path / "d2", cache)
    assert res["cache"]["files_hit"] + res["cache"]["files_filled"] == len(_all_files(m))
    assert_verified_copy(m, tmp_path / "d2")
    assert not list(cache.rglob("*.partial")), "the next filler removes a dead filler's partial files"


def test_a_waiting_stage_takes_over_from_a_killed_filler(ds, tmp_path: Path) -> None:
    """A second stage waits for the first one's objects; the first is killed mid-copy; the kernel drops
    its fill locks and the waiter copies what is missing: both-or-nothing per object, DEST verifies."""
    src, m = ds
    cache = tmp_path / "cache"
    first = spawn("stage", str(src), str(tmp_path / "d1"), "--cache", str(cache), "-q", "--workers", "1",
                  env={"STAGER_TEST_THROTTLE_BPS": "60000"})
    deadline = time.monotonic() + 60
    while not list(cache.rglob("*.partial")) and time.monotonic() < deadline:
        time.sleep(0.01)
    second = spawn("stage", str(src), str(tmp_path / "d2"), "--cache", str(cache), "--json", "-q", "--timeout", "120")
    # The first claimed every object (fewer than a claim batch): the second waits for them, polling their fill
    # locks between sleeps; nothing else in its main thread sleeps. Kill the first once the second waits.
    wchan = Path(f"/proc/{second.pid}/task/{second.pid}/wchan")
    while "nanosleep" not in wchan.read_text():
        assert second.poll() is None and first.poll() is None, "a stage ended before the second waited"
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.communicate()
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    res = last_json(out)["cache"]
    assert res["files_filled"] + res["files_from_peer"] + res["files_hit"] == len(_all_files(m))
    assert res["files_filled"] >= 1 and res["waited_s"] > 0, res  # it waited, then took over
    assert_verified_copy(m, tmp_path / "d2")
    assert stager("cache", "verify", str(cache), "--no-repair", "-q").returncode == 0
    assert not list(cache.rglob("*.partial"))


# ---- eviction -----------------------------------------------------------------------------------------
def _three(tmp_path: Path) -> list[tuple[Path, object]]:
    out = []
    for i in range(3):
        src = tmp_path / f"src{i}"
        out.append((src, make_dataset(src, n=4, size=64 << 10, seed=10 + i)))
    return out


def _bytes(m) -> int:
    return sum(b for _, b, _ in m.files())


def test_quota_evicts_least_recently_used_never_what_is_in_use(tmp_path: Path) -> None:
    (a, ma), (b, mb), (c, mc) = _three(tmp_path)
    cache = tmp_path / "cache"
    quota = int(1.5 * _bytes(ma))
    _stage(a, tmp_path / "da", cache, cache_quota=quota)
    shutil.rmtree(tmp_path / "da")  # the job that used A is over: A's objects are no longer linked
    # A loader is reading B (a live lease) while C is staged.
    _stage(b, tmp_path / "db", cache, cache_quota=quota)
    shutil.rmtree(tmp_path / "db")
    cobj = Cache.open(cache)
    keys_b = [object_key(mb.hash_algo, h, str(b / n)) for n, _, h in mb.files()]
    with Lease(cobj, keys_b, "test loader"):
        res = _stage(c, tmp_path / "dc", cache, cache_quota=quota)
        ev = res["cache"]
        assert ev["evicted_bytes"] > 0 and ev["eviction"]["in_use_bytes"] > 0
        for k in keys_b:  # nothing B's live reader holds was evicted
            assert _exists(cobj, mb.hash_algo, k)
    log = [json.loads(ln) for ln in (cache / "log.jsonl").read_text().splitlines()]
    assert log and all(e["event"] == "evict" and "least recently used" in e["reason"] for e in log)
    assert {d for e in log for d in e["datasets"]} <= {ma.dataset_id, mb.dataset_id}
    assert not {e["key"] for e in log} & set(keys_b)
    assert_verified_copy(mc, tmp_path / "dc")


def test_fills_in_flight_count_against_the_quota(tmp_path: Path) -> None:
    """Two fills at once never overshoot the quota between them: what a live filler has reserved (its
    process lease's ``reserve``: objects not in the cache yet) counts as used for every other filler;
    a lease of anyone but the cache's owner reserves nothing."""
    (a, ma), (b, mb), _ = _three(tmp_path)
    cache = tmp_path / "cache"
    quota = int(1.5 * _bytes(ma))
    cobj = Cache.open(cache, create=True, quota=Quota.parse(str(quota)))
    filling_a = {object_key(ma.hash_algo, h, str(a / n)): size for n, size, h in ma.files()}
    with Lease(cobj, filling_a, "another stage filling A") as other:
        other.reserve(filling_a)
        res = _stage(b, tmp_path / "d1", cache, cache_quota=quota)["cache"]
        assert res["files_uncached"] > 0, res
        assert res["bytes_filled"] + _bytes(ma) <= quota, "B's fill left room for A's copies in flight"
        assert_verified_copy(mb, tmp_path / "d1")  # what the cache could not take was copied plainly
        if os.geteuid() == 0:  # the same reservation in a lease of another uid counts for nothing
            from stager.cache.lease import reserved_bytes

            assert other.path is not None
            os.chown(other.path, 4242, 4242)
            assert reserved_bytes(cobj, read_leases(cobj), set()) == 0
            os.chown(other.path, os.getuid(), os.getgid())
            assert reserved_bytes(cobj, read_leases(cobj), set()) == _bytes(ma)
    shutil.rmtree(tmp_path / "d1")
    res = _stage(b, tmp_path / "d2", cache, cache_quota=quota)["cache"]
    assert res["files_uncached"] == 0 and res["bytes_hit"] + res["bytes_filled"] == _bytes(mb), res
    assert not list((cache / "leases").iterdir()), "the reservations went with their leases"


def _exists(cache: Cache, algo: str, key: str) -> bool:
    return cache.object_path(algo, key).exists()


def test_gc_explains_and_keeps_linked_pinned_and_leased(tmp_path: Path) -> None:
    (a, ma), (b, mb), (c, mc) = _three(tmp_path)
    cache = tmp_path / "cache"
    for src in (a, b, c):
        _stage(src, tmp_path / f"d{src.name}", cache)
    shutil.rmtree(tmp_path / "dsrc0")  # A unlinked: evictable
    shutil.rmtree(tmp_path / "dsrc1")  # B unlinked, but pinned below
    # C stays linked into its destination (a job still has it): never evicted.
    r = stager("cache", "pin", str(cache), str(b), "--json")
    assert r.returncode == 0 and last_json(r.stdout)["datasets"][0]["pinned"] is True, r.stderr
    r = stager("cache", "gc", str(cache), "--max-bytes", "0", "--json")
    assert r.returncode == 0, r.stderr
    rep = last_json(r.stdout)
    evicted = {e["key"] for e in rep["evicted"]}
    assert rep["freed_bytes"] == _bytes(ma) and rep["after_bytes"] == _bytes(mb) + _bytes(mc)
    assert all(e["datasets"] == [ma.dataset_id] and e["reason"] for e in rep["evicted"])
    assert rep["pinned"]["bytes"] == _bytes(mb) and rep["linked"]["bytes"] == _bytes(mc)
    assert rep["shortfall_bytes"] == _bytes(mb) + _bytes(mc)
    assert len(evicted) == len(list(ma.files()))
    # Sources are never touched.
    assert all((a / n).exists() for n, _, _ in ma.files())
    r = stager("cache", "unpin", str(cache), mb.dataset_id)
    assert r.returncode == 0, r.stderr
    rep = last_json(stager("cache", "gc", str(cache), "--max-bytes", "0", "--json").stdout)
    assert rep["freed_bytes"] == _bytes(mb)
    human = stager("cache", "ls", str(cache)).stdout
    assert mc.dataset_id in human and "evicted" in human


def test_lease_of_a_killed_holder_is_dead(ds, tmp_path: Path) -> None:
    src, m = ds
    cache = tmp_path / "cache"
    _stage(src, tmp_path / "d", cache)
    shutil.rmtree(tmp_path / "d")
    code = ("import sys, time; from stager.cache import Cache, Lease; c = Cache.open(sys.argv[1]); "
            "keys = [p.name for p in (c.root / 'objects').rglob('*') if p.is_file()]; "
            "l = Lease(c, keys, 'holder').acquire(); print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(cache)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    try:
        rep = collect(Cache.open(cache), target_bytes=0)
        assert rep.freed_bytes == 0 and rep.in_use.objects == len(_all_files(m)) and rep.live_leases == 1
    finally:
        holder.kill()
        holder.wait()
    leases = read_leases(Cache.open(cache))
    assert len(leases) == 1 and not leases[0].live and "exited" in leases[0].why
    rep = collect(Cache.open(cache), target_bytes=0)
    assert rep.freed_bytes == _bytes(m) and rep.dead_leases_removed == 1
    assert not list((cache / "leases").iterdir())


def test_symbolic_links_hold_a_destination_lease_until_dest_is_gone(ds, tmp_path: Path) -> None:
    """A site cache (owned by the caller here) is linked symbolically: a lease then keeps its objects
    as long as the destination exists."""
    src, m = ds
    cache = tmp_path / "site"
    assert stager("cache", "init", str(cache), "--site").returncode == 0
    assert oct(cache.stat().st_mode & 0o777) == oct(0o755) and (cache / "leases").stat().st_mode & 0o7777 == 0o1777
    _stage(src, tmp_path / "d1", cache)
    res = _stage(src, tmp_path / "d2", cache)
    assert res["cache"]["links"] == "symbolic" and res["bytes_copied"] == 0
    assert all((tmp_path / "d2" / s.name).is_symlink() for s in m.shards)
    assert_verified_copy(m, tmp_path / "d2")
    rep = collect(Cache.open(cache), target_bytes=0)
    assert rep.freed_bytes == 0 and rep.in_use.objects == len(_all_files(m))
    shutil.rmtree(tmp_path / "d1")
    shutil.rmtree(tmp_path / "d2")
    rep = collect(Cache.open(cache), target_bytes=0)
    assert rep.freed_bytes == _bytes(m) and rep.dead_leases_removed == 2


def test_dead_leases_do_not_pile_up(ds, tmp_path: Path) -> None:
    from stager.cache.evict import prune_leases
    from stager.cache.lease import write_dest_lease

    src, _m = ds
    cache = tmp_path / "cache"
    _stage(src, tmp_path / "d", cache)
    c = Cache.open(cache)
    gone = tmp_path / "gone"
    gone.mkdir()
    for _ in range(5):
        write_dest_lease(c, ["ab" * 16], gone)
    assert prune_leases(c, threshold=10) == 0  # few: left for eviction
    shutil.rmtree(gone)
    assert prune_leases(c, threshold=3) == 5 and not list((cache / "leases").iterdir())


def test_eviction_racing_a_new_lease_restores_the_object(ds, tmp_path: Path) -> None:
    """The race of evict.py's docstring, forced: a lease published after eviction's first look at
    the leases but before its second keeps the object."""
    src, _m = ds
    cache = tmp_path / "cache"
    _stage(src, tmp_path / "d", cache)
    shutil.rmtree(tmp_path / "d")
    c = Cache.open(cache)
    import stager.cache.evict as ev

    keys = [o.key for o in c.scan()]
    real = ev._move_aside
    held: list[Lease] = []

    def move_then_lease(o):  # a reader leases everything right after the first victim moved aside
        got = real(o)
        if not held:
            held.append(Lease(c, keys, "late reader").acquire())
        return got

    ev._move_aside = move_then_lease
    try:
        rep = collect(c, target_bytes=0)
    finally:
        ev._move_aside = real
        for h in held:
            h.release()
    assert rep.freed_bytes == 0 and not rep.evicted
    assert len(list(c.scan())) == len(keys) and not list(cache.rglob("*.partial"))


# ---- bad input ---------------------------------------------------------------------------------------
def test_bad_cache_directories_are_one_line_refusals(ds, tmp_path: Path) -> None:
    src, _m = ds
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    r = stager("stage", str(src), str(tmp_path / "d"), "--cache", str(open_dir))
    assert r.returncode == 2 and "writable by others" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    full = tmp_path / "notacache"
    full.mkdir()
    (full / "thesis.tex").write_text("precious\n")
    r = stager("stage", str(src), str(tmp_path / "d"), "--cache", str(full))
    assert r.returncode == 2 and "not a stager cache" in r.stderr and (full / "thesis.tex").exists()
    r = stager("cache", "gc", str(full), "--max-bytes", "0")
    assert r.returncode == 2 and "not a stager cache" in r.stderr and (full / "thesis.tex").exists()
    r = stager("stage", str(src), str(tmp_path / "d"), "--cache", str(tmp_path / "c"), "--cache-quota", "1000T")
    assert r.returncode == 2 and "larger than its disk" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = stager("stage", str(src), str(tmp_path / "d"), "--cache", str(tmp_path / "c"), "--cache-quota", "lots")
    assert r.returncode == 2 and "invalid quota" in r.stderr


def test_cache_refuses_foreign_files_and_never_deletes_them(ds, tmp_path: Path) -> None:
    src, _m = ds
    cache = tmp_path / "cache"
    _stage(src, tmp_path / "d", cache)
    stray = cache / "objects" / "xxh3_128" / "my-notes.txt"
    stray.write_text("mine\n")
    for cmd in (["gc", "--max-bytes", "0"], ["verify"], ["ls"]):
        r = stager("cache", cmd[0], str(cache), *cmd[1:])
        assert r.returncode == 2 and "not the cache's own" in r.stderr and "my-notes.txt" in r.stderr, r.stderr
    assert stray.exists()


def test_cache_on_a_shared_file_system_is_warned_about(ds, tmp_path: Path) -> None:
    src, _m = ds
    cache = tmp_path / "cache"
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"36 25 0:32 / {tmp_path} rw,relatime shared:1 - nfs4 server:/export rw\n")
    r = stager("stage", str(src), str(tmp_path / "d"), "--cache", str(cache), env={"STAGER_MOUNTINFO": str(mountinfo)})
    assert r.returncode == 0, r.stderr
    warn = [ln for ln in r.stderr.splitlines() if "warning" in ln and "node-local" in ln]
    assert len(warn) == 1 and "nfs4" in warn[0]


def test_quota_parsing() -> None:
    assert Quota.parse("200G").bytes == 200 << 30 and Quota.parse("500GB").bytes == 500 * 10**9
    assert Quota.parse("0.5").fraction == 0.5 and Quota.parse("25%").fraction == 0.25
    assert Quota.parse("1").fraction == 1.0 and Quota.parse("4096").bytes == 4096
    with pytest.raises(UsageError):
        Quota.parse("150%")
    with pytest.raises(UsageError, match="larger than its disk"):
        Quota.parse("2T").resolve(1 << 40, "x")


def test_cache_options_refused_where_they_cannot_work(ds, tmp_path: Path) -> None:
    src, _m = ds
    for extra in (["--unpack", "only"], ["--shared"], ["--follow", "--budget", "1G"]):
        r = stager("stage", str(src), str(tmp_path / "d"), "--cache", str(tmp_path / "c"), *extra)
        assert r.returncode == 2 and "--cache" in r.stderr, (extra, r.stderr)
    with pytest.raises(UsageError):
        StageOptions(cache=CacheOptions(str(tmp_path / "c")), unpack="only")


def test_cache_only_fills_without_a_destination(ds, tmp_path: Path) -> None:
    src, m = ds
    cache = tmp_path / "cache"
    res = _stage(src, None, cache, cache_only=True)
    assert res["mode"] == "cache-only" and res["cache"]["files_filled"] == len(_all_files(m))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "src"]  # no destination anywhere
    res = run_stage(src, tmp_path / "d", StageOptions(cache=CacheOptions(str(cache))))
    assert res.bytes_copied == 0 and res.cache is not None and res.cache["files_hit"] == len(_all_files(m))


# ---- the loader and hints ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, imagenet_tiny: Path) -> Path:
    out = tmp_path_factory.mktemp("cachepack") / "packed"
    pack(imagenet_tiny, out, format="tar", samples_per_shard=6)
    return out


def _epoch(src: Path, **kw) -> tuple[list[str], dict]:
    from stager.loader.numpy_loader import make_numpy_loader

    ld = make_numpy_loader(src, 4, decode="raw", **kw)
    keys = [k for b in ld for k in b["key"]]
    return keys, ld.stats()


def test_loader_reads_cached_copies_with_staged_mode_cache(packed: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    m = load_manifest(packed)
    want = sorted(m.keys)
    cache = tmp_path / "cache"
    _stage(packed, tmp_path / "jobs" / "d1", cache)
    keys, st = _epoch(packed, staging_roots=(str(tmp_path / "jobs"),))
    assert sorted(keys) == want and st["staged"] and st["staged_mode"] == "cache"
    assert st["reading_from"] == str(tmp_path / "jobs" / "d1")
    # No DEST at all: the loader finds the dataset in $STAGER_CACHE and reads the objects.
    shutil.rmtree(tmp_path / "jobs")
    monkeypatch.setenv("STAGER_CACHE", str(cache))
    keys, st = _epoch(packed)
    assert sorted(keys) == want and st["staged_mode"] == "cache" and st["reading_from"] == str(cache)
    monkeypatch.delenv("STAGER_CACHE")
    keys, st = _epoch(packed)
    assert sorted(keys) == want and not st["staged"]


def test_loader_never_follows_destination_links(packed: Path, tmp_path: Path) -> None:
    """DEST's symbolic links to a site cache are not followed: the loader reads the object its own
    manifest names. A link swapped to point at other bytes changes nothing it reads."""
    m = load_manifest(packed)
    cache = tmp_path / "site"
    assert stager("cache", "init", str(cache), "--site").returncode == 0
    _stage(packed, None, cache, cache_only=True)
    dest = tmp_path / "jobs" / "d"
    res = _stage(packed, dest, cache)
    assert res["cache"]["links"] == "symbolic"
    poison = tmp_path / "poison.tar"
    poison.write_bytes(b"\0" * m.shards[0].bytes)
    (dest / m.shards[0].name).unlink()
    (dest / m.shards[0].name).symlink_to(poison)
    keys, st = _epoch(packed, staging_roots=(str(tmp_path / "jobs"),))
    assert sorted(keys) == sorted(m.keys) and st["staged_mode"] == "cache"
    # An object that is gone (not a live job's: evicted by hand here) makes the copy unusable: SRC is read.
    obj = next(o for o in Cache.open(cache).scan() if o.bytes == m.shards[1].bytes)
    obj.path.unlink()
    keys, st = _epoch(packed, staging_roots=(str(tmp_path / "jobs"),))
    assert sorted(keys) == sorted(m.keys)


def test_a_loaders_lease_keeps_what_it_reads(packed: Path, tmp_path: Path) -> None:
    """A loader reading objects straight from the cache (no DEST) holds a lease for as long as its
    process lives: eviction leaves those objects alone, and takes them once the loader is gone."""
    cache = tmp_path / "cache"
    _stage(packed, None, cache, cache_only=True)
    code = ("import sys, time; from stager.loader.numpy_loader import make_numpy_loader; "
            "ld = make_numpy_loader(sys.argv[1], 4, decode='raw'); n = sum(len(b['key']) for b in ld); "
            "print(ld.stats()['staged_mode'], n, flush=True); time.sleep(600)")
    env = {**os.environ, "STAGER_CACHE": str(cache)}
    reader = subprocess.Popen([sys.executable, "-c", code, str(packed)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert reader.stdout is not None
        mode, n = reader.stdout.readline().split()
        assert mode == "cache" and int(n) == load_manifest(packed).num_samples
        rep = collect(Cache.open(cache), target_bytes=0)
        shards = len(load_manifest(packed).shards)
        assert rep.in_use.objects == shards and rep.live_leases == 1  # the index is not read from the cache
    finally:
        reader.kill()
        reader.wait()
    rep = collect(Cache.open(cache), target_bytes=0)
    assert rep.in_use.objects == 0 and not list(Cache.open(cache).scan())


def test_partition_stages_fill_the_cache_with_their_share(ds, tmp_path: Path) -> None:
    src, m = ds
    cache = tmp_path / "cache"
    filled = 0
    for node in (0, 1):
        r = _stage(src, tmp_path / f"p{node}", cache, partition=True, node=node, num_nodes=2)
        assert r["mode"] == "partition" and r["cache"]["files_hit"] == (0 if node == 0 else 1)  # the shared index
        filled += r["cache"]["files_filled"]
    assert filled == len(_all_files(m))
    full = _stage(src, tmp_path / "full", cache)
    assert full["bytes_copied"] == 0 and full["cache"]["files_hit"] == len(_all_files(m))
    du = last_json(stager("cache", "du", str(cache), "--json").stdout)
    assert du["bytes"] == sum(b for _, b, _ in m.files()) and du["linked_bytes"] == du["bytes"]


def test_hints_say_when_a_cache_would_pay(ds, tmp_path: Path) -> None:
    src, _m = ds
    env = {"STAGER_HISTORY": str(tmp_path / "history.jsonl")}
    for i in range(2):
        assert stager("stage", str(src), str(tmp_path / f"d{i}"), "-q", env=env).returncode == 0
    rep = last_json(stager("hints", str(src), "--json", env=env).stdout)
    assert rep["cache"]["pays"] and rep["cache"]["uncached_stages_24h"] == 2
    assert any("--cache DIR" in w for w in rep["warnings"])
    env2 = {"STAGER_HISTORY": str(tmp_path / "h2.jsonl")}
    for i in range(2):
        assert stager("stage", str(src), str(tmp_path / f"e{i}"), "-q", "--cache", str(tmp_path / "c"),
                      env=env2).returncode == 0
    rep = last_json(stager("hints", str(src), "--json", env=env2).stdout)
    assert not rep["cache"]["pays"] and "served by a cache" in rep["cache"]["reason"]
