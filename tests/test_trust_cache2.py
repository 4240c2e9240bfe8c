"""The site cache and shared directories, a second trust round (issue 39), attacked for real: the
node's users and the site cache's service account are unprivileged uids (tests/asuser.py), the
prolog service is the unmodified tools/slurm scripts with stand-in squeue/scontrol
(tests/test_trust_prolog.py). Each test is a row of the issue's table or an attack on the code that
closed one; each failed before the fix.

* ``leases/``, the one directory of a site cache its users may write, can neither break the cache
  (a directory, a FIFO, a link, JSON with ``NaN``, a NUL in a path: skipped, reported in one line)
  nor pin it (a lease keeps only what its writer could read, for at most the site's lease days; a
  hard link to an object keeps nothing in a site cache).
* What others wrote never reaches a terminal with its control characters (``stager cache ls``).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from tests.asuser import ATTACKER, OTHER, Node, User, python_as, stager_as
from tests.test_cache_users import LICENSED_GID, MEMBER, _chmod_tree, public, site  # noqa: F401 (fixtures)
from tests.test_stage_support import make_dataset
from tests.test_trust_prolog import JOB, service  # noqa: F401 (the fixture)

SERVICE_AS_MEMBER = User("service", OTHER.uid, MEMBER.gid, MEMBER.groups)  # the prolog's fill for a member


def _json(r) -> dict:
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _fill(node: Node, conf_env: dict[str, str], src: Path, cache: Path, user: User = OTHER) -> dict:
    return _json(stager_as(user, "stage", str(src), "--cache", str(cache), "--cache-only", "--json",
                           env=node.env(OTHER, **conf_env)))


def _licensed(node: Node) -> Path:
    """A group-only dataset (root:LICENSED_GID, 0750/0640): MEMBER may read it, ATTACKER may not."""
    src = node.data / "licensed"
    make_dataset(src, n=3, size=16 << 10, seed=11)
    _chmod_tree(src, 0o750, 0o640, gid=LICENSED_GID)
    return src


def _gc(node: Node, conf_env: dict[str, str], cache: Path, *extra: str) -> dict:
    return _json(stager_as(OTHER, "cache", "gc", str(cache), "--max-bytes", "0", "--json", *extra,
                           env=node.env(OTHER, **conf_env)))


def _objects(cache: Path) -> list[Path]:
    return [p for p in (cache / "objects").rglob("*") if p.is_file()]


# ---- row 2: a directory in leases/ -------------------------------------------------------------------
PLANT_JUNK = r"""
import json, math, os, sys, time
d = sys.argv[1]
os.makedirs(os.path.join(d, "x.lease", "sub"))                       # the row: a directory with a subdirectory
os.mkfifo(os.path.join(d, "f.lease"))
os.symlink("/etc/shadow", os.path.join(d, "l.lease"))
base = {"schema": "stager.cache.lease/1", "keys": [], "time": time.time()}
bodies = {
    "nan.lease": '{"schema": "stager.cache.lease/1", "kind": "dest", "keys": [], "expires": NaN, "time": Infinity, '
                 '"pid": Infinity, "dest": [["/", 1, 2]]}',
    "nul.lease": json.dumps({**base, "kind": "dest", "expires": time.time() + 1e9, "dest": [["/tmp/a\x00b", 1, 2]]}),
    "big.lease": json.dumps({**base, "kind": "process", "pid": 10**400 if False else 1e308, "reserve": {"x": 1}}),
    "list.lease": "[1, 2, 3]",
    "deep.lease": "[" * 100000,
}
for name, text in bodies.items():
    with open(os.path.join(d, name), "w") as f:
        f.write(text)
"""


def test_nothing_planted_in_leases_breaks_the_cache(node: Node, site, public: Path) -> None:  # noqa: F811
    """Row 2 (medium): a directory (with a subdirectory) planted in ``leases/`` made the service
    account's ``cache gc`` and every fill over quota fail with IsADirectoryError. Now every entry that
    is not a lease (and the JSON a parser trips on: NaN, Infinity, a NUL in a path, deep nesting) is
    skipped and reported in one line, and eviction goes on."""
    cache, conf_env = site
    n = _fill(node, conf_env, public, cache)["cache"]["files_filled"]
    r = python_as(ATTACKER, PLANT_JUNK, str(cache / "leases"), env=node.env(ATTACKER))
    assert r.returncode == 0, r.stderr
    rep = _gc(node, conf_env, cache)
    assert len(rep["evicted"]) == n and rep["in_use"]["objects"] == 0, rep
    assert rep["junk_leases"] >= 7 and rep["junk"].count("\n") == 0 and "not a lease" in rep["junk"], rep["junk"]
    assert (cache / "leases" / "x.lease" / "sub").is_dir()  # another user's directory: left, never fatal
    # Human output: the same one line.
    human = stager_as(OTHER, "cache", "gc", str(cache), env=node.env(OTHER, **conf_env))
    assert human.returncode == 0 and sum("not a lease" in ln for ln in human.stdout.splitlines()) == 1, human
    # A fill over the quota evicts (with the junk still there) instead of failing.
    other = node.data / "other"
    make_dataset(other, n=4, size=32 << 10, seed=5)
    _chmod_tree(other)
    _fill(node, conf_env, public, cache)
    quota = sum(p.stat().st_size for p in _objects(cache))
    conf = Path(conf_env["STAGER_PROLOG_CONF"])
    conf.write_text(conf.read_text() + f"STAGER_CACHE_QUOTA={quota + 1000}\n")
    res = _fill(node, conf_env, other, cache)
    assert res["cache"]["files_filled"] > 0 and res["cache"]["evicted_files"] > 0, res
    assert any("not a lease" in w for w in res["warnings"]), res["warnings"]
    ls = stager_as(OTHER, "cache", "ls", str(cache), env=node.env(OTHER, **conf_env))
    assert ls.returncode == 0 and "Traceback" not in ls.stderr, ls.stderr


# ---- row 3: a 100-year destination lease over every object ------------------------------------------------
FOREVER = """
import json, os, sys, time
leases, objects, mine = sys.argv[1:4]
keys = [f for _, _, fs in os.walk(objects) for f in fs]
st = os.stat(mine)
body = {"schema": "stager.cache.lease/1", "kind": "dest", "keys": keys, "time": time.time() + 1e9,
        "expires": time.time() + 100 * 365 * 86400, "dest": [[mine, st.st_dev, st.st_ino]], "what": "forever",
        "uid": os.getuid(), "pid": os.getpid()}
with open(os.path.join(leases, "forever.lease"), "w") as f:
    f.write(json.dumps(body))
os.chmod(os.path.join(leases, "forever.lease"), 0o644)
"""


def test_a_users_lease_pins_only_what_they_could_read_and_not_for_ever(
        node: Node, site, public: Path) -> None:  # noqa: F811
    """Row 3 (low): a destination lease with a 100-year ``expires`` over every object (naming a
    directory of the writer's own) kept everything from eviction for ever. Now a lease of anyone but
    the cache's owner keeps only the objects its writer could read (not the licensed ones), for no
    longer than the site's STAGER_CACHE_LEASE_DAYS after it last changed, and its time is no later
    than the file's (no LRU games)."""
    cache, conf_env = site
    _fill(node, conf_env, public, cache)
    _fill(node, conf_env, _licensed(node), cache, user=SERVICE_AS_MEMBER)
    licensed = {p.name for p in _objects(cache) if stat.S_IMODE(p.stat().st_mode) == 0o440}
    public_objects = {p.name for p in _objects(cache)} - licensed
    assert licensed and public_objects
    mine = node.home(ATTACKER) / "job"
    r = python_as(ATTACKER, f"import os; os.mkdir({str(mine)!r})", env=node.env(ATTACKER))
    assert r.returncode == 0, r.stderr
    r = python_as(ATTACKER, FOREVER, str(cache / "leases"), str(cache / "objects"), str(mine), env=node.env(ATTACKER))
    assert r.returncode == 0, r.stderr
    before = {p.name: p.stat().st_mtime for p in _objects(cache)}
    rep = _gc(node, conf_env, cache, "--dry-run")
    assert {e["key"] for e in rep["evicted"]} == licensed, rep  # what the writer may read is kept, only that
    assert rep["in_use"]["objects"] == len(public_objects)
    assert {p.name: p.stat().st_mtime for p in _objects(cache)} == before  # a dry run changes nothing
    # The site's lease days bound it: here a moment (the lease is older than that when gc runs).
    conf = Path(conf_env["STAGER_PROLOG_CONF"])
    conf.write_text(conf.read_text() + "STAGER_CACHE_LEASE_DAYS=0.000000001\n")
    rep = _gc(node, conf_env, cache)
    assert rep["in_use"]["objects"] == 0 and {e["key"] for e in rep["evicted"]} == licensed | public_objects, rep
    assert not _objects(cache)


def test_a_hard_link_to_a_site_caches_object_keeps_nothing(node: Node, site, public: Path) -> None:  # noqa: F811
    """Attacking the fix: a hard link is how a user's cache keeps what a DEST holds, but a site cache
    links only symbolically, so there a hard link is someone else's (with ``fs.protected_hardlinks=0``
    any user can make one to a file they cannot read: made here by root, as this node protects hard
    links) and must not pin the object."""
    cache, conf_env = site
    _fill(node, conf_env, public, cache)
    objs = _objects(cache)
    for i, p in enumerate(objs):
        os.link(p, node.home(ATTACKER) / f"pin{i}")
    rep = _gc(node, conf_env, cache)
    assert len(rep["evicted"]) == len(objs) and rep["linked"]["objects"] == 0, rep


# ---- row 7: stager cache ls and the terminal -----------------------------------------------------------------
ESCAPES = r"""
import json, os, sys, time
d, dest = sys.argv[1], sys.argv[2]
st = os.stat(dest)
body = {"schema": "stager.cache.lease/1", "kind": "dest", "keys": [], "time": time.time(),
        "expires": time.time() + 3600, "dest": [[dest, st.st_dev, st.st_ino]],
        "what": "\x1b]0;owned\x07\x1b[2J\x1b[1;31mERASED", "host": "h\x9b31m", "pid": 1, "uid": os.getuid()}
with open(os.path.join(d, "\x1b[2Jname.lease"), "w") as f:
    f.write(json.dumps(body))
"""


def test_cache_ls_never_prints_what_users_wrote_raw(node: Node, site, public: Path) -> None:  # noqa: F811
    """Row 7 (low): ``stager cache ls`` showed a lease's free-text fields raw to the admin who ran it,
    terminal escapes included. Now every control character is escaped, in the text and the JSON."""
    cache, conf_env = site
    _fill(node, conf_env, public, cache)
    mine = node.home(ATTACKER) / "job"
    r = python_as(ATTACKER, f"import os; os.mkdir({str(mine)!r})", env=node.env(ATTACKER))
    assert r.returncode == 0, r.stderr
    r = python_as(ATTACKER, ESCAPES, str(cache / "leases"), str(mine), env=node.env(ATTACKER))
    assert r.returncode == 0, r.stderr
    for args in ((), ("--json",)):
        out = stager_as(OTHER, "cache", "ls", str(cache), *args, env=node.env(OTHER, **conf_env))
        assert out.returncode == 0, out.stderr
        text = out.stdout + out.stderr
        assert not any((ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F for c in text), repr(text)
        assert "ERASED" in text and "\\x1b" in text, text


# ---- row 1: licensed data through the service account's rights ---------------------------------------------
FORGE = r"""
import json, os, sys
import numpy as np
from pathlib import Path
from stager.manifest import Manifest, ShardInfo
objects, out, how = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
out.mkdir(mode=0o755)
empty = np.zeros(0, np.int64)
shards = []
found = sorted(p for p in objects.rglob("*") if p.is_file())
if how == "shard_root":                  # no link at all: the manifest says the shards are in the cache
    found = [p for p in found if p.parent == found[0].parent]
for i, obj in enumerate(found):
    name = obj.name if how == "shard_root" else f"s{i}.tar"
    if how == "fifo":
        os.mkfifo(out / name, 0o644)      # a fill that opened it blocking would hang the prolog
    elif how != "shard_root":
        (out / name).symlink_to(obj)      # the "shard" is the licensed object itself
    shards.append(ShardInfo(name, obj.stat().st_size, obj.name.split("-")[0], [], empty, empty, empty))
m = Manifest(format="tar", classes=[], shards=shards)
if how == "shard_root":
    m.shard_root = str(found[0].parent)
m.write(out)
for p in [out, *out.iterdir()]:
    if not p.is_symlink():
        p.chmod(0o755 if p.is_dir() else 0o644)
print(json.dumps(len(shards)))
"""

READ_ALL = r"""
import json, os, stat, sys
got = {}
for root in sys.argv[1:]:
    for d, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(d, f)
            try:
                fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            except OSError:
                continue
            with os.fdopen(fd, "rb") as f:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    got[p] = f.read().hex()
print(json.dumps(got))
"""


def _readable_to(user: User, node: Node, *roots: Path) -> dict[str, bytes]:
    """Every file under ``roots`` that ``user`` can read, with its bytes."""
    r = python_as(user, READ_ALL, *map(str, roots), env=node.env(user))
    assert r.returncode == 0, r.stderr
    return {p: bytes.fromhex(h) for p, h in json.loads(r.stdout).items()}


def test_the_service_account_never_lends_its_rights(service, node: Node) -> None:  # noqa: F811
    """Row 1 (critical): after a member's job filled the site cache with a group-only dataset, a
    non-member wrote a manifest whose shards carry the licensed objects' hashes and sizes (object names
    and sizes are world-readable), with symbolic links to those objects as the shards. The prolog's
    fill, as the service account that owns every object, read them; the group it could not give the
    copy only warned, and the new object (service:<the user's group> 0440) was linked into the user's
    job<id>/. Now the fill reads a source only if the job's user may, never one of the service
    account's or under the cache (no symbolic link), and never places a copy whose group it cannot
    give: the non-member's job gets nothing it could not read itself."""
    from stager.pack import pack
    from tests.test_cache_prolog import LOADER
    from tests.test_trust_prolog import ATTACKER as NONMEMBER
    from tests.test_trust_prolog import VICTIM as MEMBER_ACCOUNT
    from tools.datagen import make_imagefolder

    cache = node.base / "site-cache"
    service.conf.write_text(service.conf.read_text() + f"STAGER_CACHE_DIR={cache}\nSTAGER_CACHE_USER={OTHER.uid}\n")
    src = node.data / "licensed"
    pack(make_imagefolder(node.base / "img", num_classes=2, per_class=4, seed=2, size=(64, 48)), src, format="tar",
         samples_per_shard=2)
    _chmod_tree(src, 0o750, 0o640, gid=MEMBER_ACCOUNT.gid)
    licensed = {p.read_bytes() for p in src.iterdir() if p.suffix == ".tar"}
    service.comment(f"stager:{src}")
    r = service.run("stager-prolog", MEMBER_ACCOUNT)
    assert r.returncode == 0 and not service.failure_record.exists(), (r.stderr, service.admin_comment)
    objs = _objects(cache)
    assert objs and all(p.stat().st_gid == MEMBER_ACCOUNT.gid and stat.S_IMODE(p.stat().st_mode) == 0o440
                        for p in objs)
    # The member's job reads it, from the cache.
    tp = service.run("stager-taskprolog", MEMBER_ACCOUNT, as_user=MEMBER_ACCOUNT)
    exports = dict(ln.removeprefix("export ").split("=", 1) for ln in tp.stdout.splitlines() if ln.startswith("export"))
    out = _json(python_as(MEMBER_ACCOUNT, LOADER, str(src), env=node.env(MEMBER_ACCOUNT, **exports)))
    assert out["staged_mode"] == "cache" and out["samples"] == 8, out
    assert service.run("stager-epilog", MEMBER_ACCOUNT).returncode == 0
    # The non-member forges a dataset of links to the licensed objects and submits a job with it; then,
    # attacking the fix, hard links to them (made by root: this node protects hard links, a node with
    # fs.protected_hardlinks=0 lets anyone make them), a manifest whose shard_root is in the cache, and
    # FIFOs as the shards (the fill must neither block nor read them).
    home = node.home(NONMEMBER)
    home.chmod(0o755)
    for how in ("symlinks", "hard links", "shard_root", "fifo"):
        forged = home / how.replace(" ", "-")
        r = python_as(NONMEMBER, FORGE, str(cache / "objects"), str(forged), how, env=node.env(NONMEMBER))
        assert r.returncode == 0, r.stderr
        if how == "hard links":
            for link in [p for p in forged.iterdir() if p.is_symlink()]:
                target = link.resolve()
                link.unlink()
                os.link(target, link)
        service.comment(f"stager:{forged}")
        r = service.run("stager-prolog", NONMEMBER)
        assert r.returncode == 0, r.stderr
        leaked = {p for p, data in _readable_to(NONMEMBER, node, service.root, cache).items() if data in licensed}
        assert not leaked, f"{how}: the non-member reads licensed bytes at {sorted(leaked)}"
        assert all(p.stat().st_gid == MEMBER_ACCOUNT.gid for p in _objects(cache)
                   if p.read_bytes() in licensed), f"{how}: a copy of licensed bytes without the licensed group"
        assert service.failure_record.exists(), f"{how}: the non-member's job staged what they may not read"
        fill_err = (service.state / f"job{JOB}" / "fill-1.json").read_text()
        assert "not copied into the site cache" in fill_err, fill_err
        assert service.run("stager-epilog", NONMEMBER).returncode == 0
    forged = home / "symlinks"
    # Every other way in: the non-member's own stage and loader of the forged dataset, `cache ls` (the
    # licensed dataset's record is its group's only) and `cache verify` (its objects are not readable
    # to them: skipped, never read, never called damaged).
    conf_env = node.env(NONMEMBER, STAGER_PROLOG_CONF=str(service.conf))
    r = stager_as(NONMEMBER, "stage", forged, home / "d", "--cache", cache, "--json", env=conf_env)
    assert r.returncode != 0 and not any(data in licensed for data in _readable_to(NONMEMBER, node, home).values())
    r = python_as(NONMEMBER, LOADER, str(forged), env=conf_env)
    assert r.returncode != 0 or json.loads(r.stdout.splitlines()[-1])["staged_mode"] != "cache", r.stdout
    ls = _json(stager_as(NONMEMBER, "cache", "ls", cache, "--json", env=conf_env))
    from stager.manifest import load_manifest

    assert all(d["dataset_id"] != load_manifest(src).dataset_id for d in ls["datasets"]), ls
    assert str(src) not in json.dumps(ls), ls
    r = stager_as(NONMEMBER, "cache", "verify", cache, "--json", env=conf_env)
    rep = _json(r)
    assert rep["ok"] and not rep["damaged"] and rep["not_readable"] == len(objs), rep
    member_ls = _json(stager_as(MEMBER_ACCOUNT, "cache", "ls", cache, "--json",
                                env=node.env(MEMBER_ACCOUNT, STAGER_PROLOG_CONF=str(service.conf))))
    assert any(d["dataset_id"] == load_manifest(src).dataset_id and d["complete"] for d in member_ls["datasets"])


# ---- row 8: an object changed after its fill --------------------------------------------------------------
FLIP = r"""
import os, sys
p, keep_mtime = sys.argv[1], sys.argv[2] == "1"
st = os.stat(p)
os.chmod(p, 0o600)
with open(p, "r+b") as f:
    f.seek(st.st_size // 2)
    b = f.read(1)
    f.seek(st.st_size // 2)
    f.write(bytes([b[0] ^ 0xFF]))
os.chmod(p, st.st_mode & 0o7777)
if keep_mtime:                      # a flip that moves nothing (as a disk's would)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
"""


def test_a_changed_object_is_never_linked(node: Node) -> None:
    """Row 8 (low): an object changed after its fill was still linked into the next DEST, which then
    reported verified; a byte flipped in a user's own cache reached every later DEST, and `stager
    verify DEST` was the first to notice. Now a hit whose seal (size, mtime, inode when verified) no
    longer matches is re-hashed; a damaged object is removed and filled again (its owner's stage) and
    the receipt says how each file was verified. A flip that moves nothing is caught by
    ``stage --verify-cache``, which re-hashes every hit."""
    from tests.asuser import VICTIM

    src = node.data / "ds"
    make_dataset(src, n=3, size=32 << 10, seed=21)
    _chmod_tree(src)
    home = node.home(VICTIM)
    cache = home / "cache"
    env = node.env(VICTIM)

    def stage(dest: str, *extra: str) -> dict:
        return _json(stager_as(VICTIM, "stage", src, home / dest, "--cache", cache, "--json", *extra, env=env))

    stage("d1")
    victim_obj = next(p for p in _objects(cache) if p.stat().st_size > 1000)
    r = python_as(VICTIM, FLIP, str(victim_obj), "0", env=env)
    assert r.returncode == 0, r.stderr
    res = stage("d2")
    assert stager_as(VICTIM, "verify", home / "d2", "-q", env=env).returncode == 0, "the changed object was linked"
    assert res["cache"]["files_damaged"] == 1 and res["cache"]["files_filled"] == 1, res["cache"]
    assert any("did not match" in w for w in res["warnings"]), res["warnings"]
    receipt = json.loads((home / "d2" / "stager-receipt.json").read_text())
    files = receipt["cache"]["files"]
    assert list(files.values()).count("copied") == 1, files  # the repaired one; the rest linked as verified
    assert all(v == "copied" or v.startswith("cached, verified ") for v in files.values()), files
    # A flip that keeps the seal: the default stage trusts the seal, --verify-cache does not.
    victim_obj = next(p for p in _objects(cache) if p.stat().st_size > 1000)
    r = python_as(VICTIM, FLIP, str(victim_obj), "1", env=env)
    assert r.returncode == 0, r.stderr
    res = stage("d3", "--verify-cache")
    assert res["cache"]["files_rehashed"] == len(_objects(cache)) and res["cache"]["files_damaged"] == 1, res["cache"]
    assert stager_as(VICTIM, "verify", home / "d3", "-q", env=env).returncode == 0


def test_a_reader_never_links_a_changed_site_object(node: Node, site, public: Path) -> None:  # noqa: F811
    """Row 8 in a site cache: an object the service account's fill sealed, changed afterwards, is
    re-hashed by a user's stage, refused, and its file copied from SRC instead."""
    from tests.asuser import VICTIM

    cache, conf_env = site
    _fill(node, conf_env, public, cache)
    obj = next(p for p in _objects(cache) if p.stat().st_size > 1000)
    r = python_as(OTHER, FLIP, str(obj), "0", env=node.env(OTHER))
    assert r.returncode == 0, r.stderr
    env = node.env(VICTIM, **conf_env)
    res = _json(stager_as(VICTIM, "stage", public, node.home(VICTIM) / "d", "--cache", cache, "--json", env=env))
    r = stager_as(VICTIM, "verify", node.home(VICTIM) / "d", "-q", env=env)
    assert r.returncode == 0, f"the changed object was linked: {r.stderr}"
    assert res["cache"]["files_damaged"] == 1 and res["cache"]["files_uncached"] == 1, res["cache"]
    # The owner's next fill repairs it.
    fill = _fill(node, conf_env, public, cache)
    assert fill["cache"]["files_damaged"] == 1 and fill["cache"]["files_filled"] == 1, fill["cache"]
