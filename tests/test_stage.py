"""stager stage / clean: verified copy, idempotence, crash resume, concurrency, space errors, modes."""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stager.errors import OutOfSpaceError, StagerTimeoutError, VerificationError
from stager.fs.kernel import boot_id
from stager.fs.lock import NodeLock
from stager.manifest import load_manifest
from stager.order.partition import assign_shards_to_nodes
from stager.receipt import RECEIPT_NAME, find_staged_copy, load_receipt
from stager.stage import NodeOptions, StageOptions, plan_stage, resolve_node, stage
from stager.stage.plan import read_src_manifest
from tests.test_stage_support import assert_verified_copy, last_json, make_dataset, spawn, stager


@pytest.fixture
def ds(tmp_path: Path):
    src = tmp_path / "src"
    return src, make_dataset(src, n=6)


def test_stage_copies_verifies_and_receipt_is_found(ds, tmp_path: Path) -> None:
    src, m = ds
    dest = tmp_path / "dest"
    res = stage(src, dest, workers=3)
    assert res.files_copied == len(m.shards) and not res.already_staged
    assert_verified_copy(m, dest)
    assert (dest / "manifest.json").read_bytes() == (src / "manifest.json").read_bytes()
    rec = load_receipt(dest)
    assert rec is not None and rec.mode == "full" and sorted(rec.shards) == sorted(s.name for s in m.shards)
    found = find_staged_copy(m, [dest])
    assert found is not None and found[0] == dest
    # DEST is itself a valid packed directory.
    assert load_manifest(dest).digest == m.digest


def test_rerun_is_near_instant_and_reads_nothing(ds, tmp_path: Path) -> None:
    src, m = ds
    dest = tmp_path / "dest"
    stage(src, dest)
    # Make the source unreadable: a rerun must not read shards at all.
    for s in m.shards:
        os.chmod(src / s.name, 0)
    try:
        res = stage(src, dest)
    finally:
        for s in m.shards:
            os.chmod(src / s.name, 0o644)
    assert res.already_staged and res.files_copied == 0


def test_cli_json_summary_and_default_dest_from_env(ds, tmp_path: Path) -> None:
    src, m = ds
    root = tmp_path / "slurm_tmp"
    root.mkdir()
    env = {"STAGER_DEST": "", "SLURM_TMPDIR": str(root)}
    r = stager("stage", str(src), "--json", env=env)
    assert r.returncode == 0, r.stderr
    out = last_json(r.stdout)
    assert out["files_copied"] == len(m.shards) and out["gbps"] >= 0
    assert Path(out["dest"]).parent == root
    human = stager("stage", str(src), env=env)
    assert human.returncode == 0 and "already staged" in human.stdout


def test_no_destination_is_a_usage_error(ds) -> None:
    src, _ = ds
    r = stager("stage", str(src), env={"STAGER_DEST": "", "SLURM_TMPDIR": "", "TMPDIR": ""})
    assert r.returncode == 2 and "STAGER_DEST" in r.stderr


@pytest.mark.parametrize("where", [0, 1000, -1])
def test_flipped_byte_is_caught_and_no_bad_copy_kept(tmp_path: Path, where: int) -> None:
    src = tmp_path / "src"
    m = make_dataset(src, n=4)
    bad = m.shards[2].name
    p = src / bad
    data = bytearray(p.read_bytes())
    data[where] ^= 0x01
    p.write_bytes(bytes(data))
    dest = tmp_path / "dest"
    r = stager("stage", str(src), str(dest), "-j", "2")
    assert r.returncode == 3, r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("stager stage: error:")]
    assert len(errors) == 1 and bad in errors[0]
    assert not (dest / bad).exists()
    assert not [q for q in dest.iterdir() if q.name.endswith(".partial")]
    assert not (dest / RECEIPT_NAME).exists()
    with pytest.raises(VerificationError):
        stage(src, dest)


def test_truncated_source_is_caught(tmp_path: Path) -> None:
    src = tmp_path / "src"
    m = make_dataset(src, n=2)
    p = src / m.shards[0].name
    p.write_bytes(p.read_bytes()[:-7])
    r = stager("stage", str(src), str(tmp_path / "d"))
    assert r.returncode == 3 and m.shards[0].name in r.stderr


def _copying_past(dest: Path, size: int) -> bool:
    """A partial file is in ``dest`` and its files hold at least ``size`` bytes (the copy is that far)."""
    if not dest.is_dir():
        return False
    held, partial = 0, False
    for p in dest.iterdir():
        with contextlib.suppress(FileNotFoundError):  # renamed meanwhile
            held += p.stat().st_size
            partial = partial or p.name.endswith(".partial")
    return partial and held >= size


def test_kill_9_mid_copy_then_rerun_at_random_points(tmp_path: Path) -> None:
    src = tmp_path / "src"
    m = make_dataset(src, n=10, size=96 << 10, seed=5)
    total = m.num_bytes
    rng = random.Random(1234)
    env = {"STAGER_TEST_THROTTLE_BPS": str(total // 2)}  # 2 streams: the copy takes ~1 s
    killed_mid_copy = 0
    kept_any = 0
    for attempt in range(4):
        dest = tmp_path / f"dest{attempt}"
        proc = spawn("stage", str(src), str(dest), "-j", "2", "-q", env=env)
        # Kill at a random point of the copy, chosen by the bytes DEST holds (files' state, not a time): at
        # least a random fraction of the dataset's, a copy in progress.
        at = int(rng.uniform(0.0, 0.9) * total)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not _copying_past(dest, at):
            time.sleep(0.005)
        partial_at_kill = any(p.name.endswith(".partial") for p in dest.iterdir())
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_mid_copy += proc.returncode == -signal.SIGKILL and partial_at_kill
        assert not (dest / RECEIPT_NAME).exists() or not partial_at_kill
        r = stager("stage", str(src), str(dest), "--json")
        assert r.returncode == 0, r.stderr
        out = last_json(r.stdout)
        assert out["files_copied"] + out["files_kept"] == len(m.shards) or out["already_staged"]
        kept_any += out["files_kept"] > 0
        assert_verified_copy(m, dest)
        assert load_receipt(dest) is not None
    assert killed_mid_copy >= 2, "kills did not land mid-copy; raise the throttle"
    assert kept_any >= 1, "no rerun kept verified shards from the killed run"


def test_missing_source_shard_is_one_line_exit_3(tmp_path: Path) -> None:
    """A shard the manifest lists but SRC lacks: ShardMissingError naming it (exit 3), not a traceback."""
    src = tmp_path / "src"
    m = make_dataset(src, n=3, size=4096)
    gone = m.shards[1].name
    (src / gone).unlink()
    dest = tmp_path / "d"
    r = stager("stage", str(src), str(dest), "-q")
    assert r.returncode == 3, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and gone in r.stderr and "missing" in r.stderr, r.stderr
    assert not (dest / RECEIPT_NAME).exists() and not list(dest.glob("*.partial"))


def test_four_concurrent_stagers_copy_once(ds, tmp_path: Path) -> None:
    src, m = ds
    dest = tmp_path / "dest"
    env = {"STAGER_TEST_THROTTLE_BPS": str(m.num_bytes)}  # ~1 s of copying so the others must wait
    procs = [spawn("stage", str(src), str(dest), "--json", env=env) for _ in range(4)]
    outs = []
    for p in procs:
        so, se = p.communicate(timeout=120)
        assert p.returncode == 0, se
        outs.append(last_json(so))
    copiers = [o for o in outs if o["files_copied"] > 0]
    assert len(copiers) == 1 and copiers[0]["files_copied"] == len(m.shards)
    assert sum(o["already_staged"] for o in outs) == 3
    assert_verified_copy(m, dest)
    assert len({o["receipt"] for o in outs}) == 1


def test_live_lock_holder_times_out_with_exit_5(ds, tmp_path: Path) -> None:
    src, _ = ds
    dest = tmp_path / "dest"
    dest.mkdir()
    with NodeLock(dest / ".stager-lock"):
        r = stager("stage", str(src), str(dest), "--timeout", "0.5")
    assert r.returncode == 5 and "locked" in r.stderr
    with NodeLock(dest / ".stager-lock"), pytest.raises(StagerTimeoutError):
        stage(src, dest, timeout=0.2)


@pytest.mark.parametrize("kind", ["dead_pid", "other_boot"])
def test_dead_lock_holder_is_taken_over(ds, tmp_path: Path, kind: str) -> None:
    src, m = ds
    dest = tmp_path / "dest"
    dest.mkdir()
    if kind == "dead_pid":
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        p.wait()
        rec = {"pid": p.pid, "host": socket.gethostname(), "boot_id": boot_id(), "time": 0}
    else:
        rec = {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": "another-boot", "time": 0}
    (dest / ".stager-lock").write_text(json.dumps(rec))
    r = stager("stage", str(src), str(dest), "--json", "--timeout", "10")
    assert r.returncode == 0, r.stderr
    out = last_json(r.stdout)
    assert out["lock_takeover"]["pid"] == rec["pid"]
    assert_verified_copy(m, dest)
    assert not (dest / ".stager-lock").exists()


def test_file_size_limit_is_a_clean_out_of_space_error(tmp_path: Path) -> None:
    src = tmp_path / "src"
    m = make_dataset(src, n=3, size=1 << 20)
    dest = tmp_path / "dest"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))

    r = stager("stage", str(src), str(dest), "-q", preexec_fn=limit)
    assert r.returncode == 4, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "file size limit" in r.stderr
    names = {p.name for p in dest.iterdir()}
    assert not any(n.endswith(".partial") for n in names)
    assert not names & {s.name for s in m.shards}
    assert RECEIPT_NAME not in names
    # Without the limit the same DEST completes.
    assert stager("stage", str(src), str(dest)).returncode == 0
    assert_verified_copy(m, dest)


def test_free_space_checked_up_front(ds, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, _ = ds
    monkeypatch.setenv("STAGER_TEST_FREE_BYTES", "1000")
    with pytest.raises(OutOfSpaceError, match=r"needs .* but only"):
        stage(src, tmp_path / "dest")
    r = stager("stage", str(src), str(tmp_path / "d2"))
    assert r.returncode == 4


def test_permissions_follow_the_source(tmp_path: Path) -> None:
    for mode in (0o600, 0o640, 0o644):
        src = tmp_path / f"src{mode:o}"
        m = make_dataset(src, n=2, size=4096, mode=mode)
        dest = tmp_path / f"dest{mode:o}"
        stage(src, dest)
        for s in m.shards:
            st = os.stat(dest / s.name)
            assert stat.S_IMODE(st.st_mode) == mode
            assert st.st_gid == os.stat(src / s.name).st_gid


def test_partition_mode_stages_exactly_the_loaders_share(tmp_path: Path) -> None:
    src = tmp_path / "src"
    m = make_dataset(src, n=7, size=8 << 10)
    shares = assign_shards_to_nodes(m.shard_bytes, 3, seed=4)
    for node in range(3):
        dest = tmp_path / f"node{node}"
        if node == 1:  # identity from Slurm's environment instead of flags
            r = stager("stage", str(src), str(dest), "--partition", "--seed", "4", "--json",
                       env={"SLURM_NODEID": "1", "SLURM_NNODES": "3", "SLURM_NTASKS_PER_NODE": "4"})
        else:
            r = stager("stage", str(src), str(dest), "--partition", "--node", str(node), "--num-nodes", "3",
                       "--seed", "4", "--ranks-per-node", "4", "--json")
        assert r.returncode == 0, r.stderr
        want = sorted(m.shards[i].name for i in shares[node])
        got = sorted(p.name for p in dest.iterdir() if p.name.startswith("shard-"))
        assert got == want
        rec = load_receipt(dest)
        assert rec is not None and rec.mode == "partition" and sorted(rec.shards) == want
        assert rec.partition == {"num_nodes": 3, "node": node, "seed": 4, "ranks_per_node": 4}
        assert_verified_copy(m, dest, want)


def test_shared_dest_three_nodes_write_each_shard_once(tmp_path: Path) -> None:
    src = tmp_path / "src"
    m = make_dataset(src, n=8, size=16 << 10)
    dest = tmp_path / "beeond"
    procs = [spawn("stage", str(src), str(dest), "--shared", "--node", str(i), "--num-nodes", "3", "--json",
                   "--timeout", "60") for i in range(3)]
    outs = []
    for p in procs:
        so, se = p.communicate(timeout=120)
        assert p.returncode == 0, se
        outs.append(last_json(so))
    shares = assign_shards_to_nodes(m.shard_bytes, 3, seed=0)
    written: list[str] = []
    for node in range(3):
        lines = (dest / f".stager-journal.node{node}.jsonl").read_text().splitlines()[1:]
        names = [json.loads(x)["f"] for x in lines]
        assert sorted(names) == sorted(m.shards[i].name for i in shares[node])
        written += names
    assert sorted(written) == sorted(s.name for s in m.shards)  # every shard exactly once
    assert sum(o["files_copied"] for o in outs) == len(m.shards)
    rec = load_receipt(dest)
    assert rec is not None and rec.mode == "shared" and sorted(rec.shards) == sorted(s.name for s in m.shards)
    assert_verified_copy(m, dest)


def test_shared_mode_times_out_when_a_peer_never_comes(ds, tmp_path: Path) -> None:
    src, _ = ds
    r = stager("stage", str(src), str(tmp_path / "d"), "--shared", "--node", "0", "--num-nodes", "2",
               "--timeout", "0.5")
    assert r.returncode == 5 and "nodes [1]" in r.stderr


@pytest.mark.parametrize("flag", ["--unpack", "--shared", "--no-fsync", "--direct"])
def test_collective_usage_errors_are_usage_errors(ds, tmp_path: Path, flag: str) -> None:
    """`--collective` with a flag it cannot honour: exit 2, one error line, and under --json the CLI's
    error object (as for --follow), not free text with an empty stdout."""
    src, _ = ds
    dest = tmp_path / "d"
    r = stager("stage", str(src), str(dest), "--collective", flag, "--json")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [x for x in r.stderr.strip().splitlines()
                                             if x.startswith("stager stage: error:")]
    assert len(r.stderr.strip().splitlines()) == 1 and "cannot be combined" in r.stderr
    out = last_json(r.stdout)
    assert out["ok"] is False and out["type"] == "UsageError" and f"combined with {flag}" in out["error"]
    assert not dest.exists()


def test_resolve_node_precedence() -> None:
    assert resolve_node(2, 4, 8, env={"SLURM_NODEID": "1", "SLURM_NNODES": "3"}) == (2, 4, 8, "flags")
    assert resolve_node(None, None, None, env={"SLURM_NODEID": "1", "SLURM_NNODES": "3",
                                               "SLURM_TASKS_PER_NODE": "4(x3)"}) == (1, 3, 4, "slurm")
    n = resolve_node(None, None, None, env={"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                            "LOCAL_WORLD_SIZE": "4"})
    assert n[:3] == (1, 2, 4)


def test_options_are_validated_once_and_the_api_signatures_are_kept(tmp_path: Path) -> None:
    """stage() and stage_collective() keep their documented keywords; what they take is validated when
    the options object is built, before SRC is touched (here it does not even exist)."""
    import inspect

    from stager.errors import UsageError
    from stager.stage.collective import CollectiveOptions, stage_collective

    assert list(inspect.signature(stage).parameters) == [
        "src", "dest", "workers", "unpack", "partition", "shared", "node", "num_nodes", "ranks_per_node", "seed",
        "json", "quiet", "timeout", "unpack_dir", "storage_options", "tuning", "fsync", "repair", "mount"]
    assert list(inspect.signature(stage_collective).parameters) == [
        "src", "dest", "partition", "node", "num_nodes", "ranks_per_node", "seed", "timeout", "fallback", "backend",
        "chunk_bytes", "memory_bytes", "master_addr", "master_port", "quiet", "storage_options"]
    missing = tmp_path / "no-such-src"
    for bad in ({"unpack": "sometimes"}, {"unpack_dir": "a/b"}, {"unpack_dir": ".."}, {"workers": -1}):
        with pytest.raises(UsageError):
            stage(missing, tmp_path / "d", **bad)
    for bad_c in ({"fallback": "maybe"}, {"backend": "mpi"}):
        with pytest.raises(UsageError):
            stage_collective(missing, tmp_path / "d", **bad_c)
    opts = StageOptions(storage_options=(so := {"token": "a"}))
    so["token"] = "b"
    assert opts.storage_options == {"token": "a"}  # the caller's dict may change, the options do not
    c = CollectiveOptions(stage=StageOptions(shared=True))
    assert c.timeout == 300.0 and c.stage.shared is False


def test_registering_stage_and_clean_imports_no_numpy() -> None:
    """The names `stager stage`/`stager clean` spell out for their parsers are the engine's, and
    importing the two command modules loads neither numpy nor the staging engine (CLI start-up)."""
    from stager.commands import clean as clean_cmd
    from stager.commands import stage as stage_cmd
    from stager.stage.options import DEFAULT_UNPACK_DIR, FALLBACKS

    assert (stage_cmd.DEFAULT_UNPACK_DIR, stage_cmd.FALLBACKS) == (DEFAULT_UNPACK_DIR, FALLBACKS)
    from stager.cache.config import CACHE_ENV
    from stager.mix.file import YAML_SUFFIXES

    assert stage_cmd.CACHE_ENV == CACHE_ENV and set(stage_cmd.MIX_SUFFIXES) == {*YAML_SUFFIXES, ".json"}
    assert clean_cmd.RECEIPT_NAME == RECEIPT_NAME
    code = "import sys, stager.commands.stage, stager.commands.clean; print('numpy' in sys.modules, " \
           "'stager.stage' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert p.stdout.split() == ["False", "False"], p.stdout


def test_plan_detects_beegfs_dest_as_shared(ds, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, _ = ds
    mi = tmp_path / "mountinfo"
    mi.write_text(f"40 1 0:50 / {tmp_path}/beeond rw,relatime - beegfs beegfs_nodev rw,cfgFile=/etc/b.conf\n"
                  "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n")
    monkeypatch.setenv("STAGER_MOUNTINFO", str(mi))
    m, raw = read_src_manifest(str(src))
    plan = plan_stage(str(src), m, raw, tmp_path / "beeond" / "x", StageOptions(node=NodeOptions(0, 2)))
    assert plan.mode == "shared"
    assert plan_stage(str(src), m, raw, tmp_path / "local").mode == "full"


def test_clean_removes_only_staged_files(ds, tmp_path: Path) -> None:
    src, _ = ds
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    (dest / "shard-000000.tar.abcdef012345.partial").write_bytes(b"x")  # stale partial of a staged name
    stage(src, dest, unpack=False)
    r = stager("clean", str(dest), "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["keep.txt"]
    r = stager("clean", str(dest))
    assert r.returncode == 2 and "no stager-receipt.json" in r.stderr


def test_clean_refuses_receipt_paths_outside_dest(ds, tmp_path: Path) -> None:
    src, _ = ds
    dest = tmp_path / "dest"
    stage(src, dest)
    victim = tmp_path / "victim.txt"
    victim.write_text("do not delete")
    rec = json.loads((dest / RECEIPT_NAME).read_text())
    rec["files"].append("../victim.txt")
    (dest / RECEIPT_NAME).write_text(json.dumps(rec))
    r = stager("clean", str(dest))
    assert r.returncode == 3 and "victim" in r.stderr
    assert victim.exists() and (dest / "manifest.json").exists()


def test_other_dataset_in_dest_is_refused(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    make_dataset(a, n=2, seed=1)
    make_dataset(b, n=2, seed=2)
    dest = tmp_path / "dest"
    stage(a, dest)
    r = stager("stage", str(b), str(dest))
    assert r.returncode == 2 and "stager clean" in r.stderr


def _as_if_rebooted(dest: Path) -> None:
    """What a reboot changes for a --no-fsync copy: the boot id it was written under is no longer the
    running one (the kernel draws a new one at boot; this rewrites the recorded id instead)."""
    rp = dest / RECEIPT_NAME
    rec = json.loads(rp.read_text())
    rec["boot_id"] = "0" * 32
    rp.write_text(json.dumps(rec))
    jp = dest / ".stager-journal.jsonl"
    jp.write_text(jp.read_text().replace(boot_id(), "0" * 32))


def test_no_fsync_copy_is_verified_marked_and_not_trusted_after_a_reboot(ds, tmp_path: Path) -> None:
    src, m = ds
    dest = tmp_path / "dest"
    out = last_json(stager("stage", str(src), str(dest), "--no-fsync", "--json").stdout)
    assert out["ok"] and out["durable"] is False and out["files_copied"] == len(m.shards)
    assert_verified_copy(m, dest)
    rec = load_receipt(dest)
    assert rec is not None and rec.durable is False and rec.boot_id == boot_id() and rec.trusted()
    journal = [json.loads(x) for x in (dest / ".stager-journal.jsonl").read_text().splitlines()[1:]]
    assert journal and all(x["v"] == boot_id() for x in journal)
    assert find_staged_copy(m, [dest]) is not None
    # Same boot: a rerun (durable or not) trusts the copy and reads nothing.
    assert stage(src, dest, fsync=False).already_staged

    _as_if_rebooted(dest)
    assert find_staged_copy(m, [dest]) is None  # the loader reads SRC rather than possibly torn files
    res = stage(src, dest)  # durable this time: everything is copied again, nothing kept
    assert not res.already_staged and res.files_kept == 0 and res.files_copied == len(m.shards)
    rec = load_receipt(dest)
    assert rec is not None and rec.durable and rec.boot_id == ""
    assert find_staged_copy(m, [dest]) is not None
    assert_verified_copy(m, dest)


def test_no_fsync_resume_in_the_same_boot_keeps_verified_files(tmp_path: Path) -> None:
    """A --no-fsync run killed mid-way: a (durable) rerun in the same boot keeps what the journal lists."""
    src = tmp_path / "src"
    m = make_dataset(src, n=8, size=256 << 10)
    dest = tmp_path / "dest"
    p = spawn("stage", str(src), str(dest), "--no-fsync", "-j", "1",
              env={"STAGER_TEST_THROTTLE_BPS": str(1 << 20)})
    deadline = time.monotonic() + 60
    journal = dest / ".stager-journal.jsonl"
    while time.monotonic() < deadline and p.poll() is None:
        if journal.exists() and len(journal.read_text().splitlines()) >= 3:
            break
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    done = len(journal.read_text().splitlines()) - 1
    assert 0 < done < len(m.shards)
    from stager.stage.journal import Journal

    assert Journal(journal, m.digest).has_volatile  # the durable rerun below must flush what it keeps
    res = stage(src, dest)  # durable this time: keeps the journaled files, flushes DEST once
    assert res.files_kept >= done and res.files_kept + res.files_copied == len(m.shards)
    assert_verified_copy(m, dest)
    rec = load_receipt(dest)
    assert rec is not None and rec.durable


def test_no_fsync_is_ignored_on_a_shared_dest(ds, tmp_path: Path) -> None:
    src, _ = ds
    res = stage(src, tmp_path / "beeond", shared=True, node=0, num_nodes=1, fsync=False)
    assert res.durable and any("--no-fsync ignored" in w for w in res.warnings)
    rec = load_receipt(tmp_path / "beeond")
    assert rec is not None and rec.durable


def test_durable_rerun_upgrades_a_no_fsync_copy_without_copying(ds, tmp_path: Path) -> None:
    """Same boot: `stage` (durable) after `stage --no-fsync` flushes DEST once and marks the receipt
    durable instead of copying again; from then on the copy survives a reboot."""
    src, m = ds
    dest = tmp_path / "dest"
    stage(src, dest, fsync=False)
    for s in m.shards:  # an upgrade must not read the source
        os.chmod(src / s.name, 0)
    try:
        res = stage(src, dest)
    finally:
        for s in m.shards:
            os.chmod(src / s.name, 0o644)
    assert res.already_staged and res.durable and res.files_copied == 0
    rec = load_receipt(dest)
    assert rec is not None and rec.durable and rec.boot_id == ""
    _as_if_rebooted(dest)
    assert find_staged_copy(m, [dest]) is not None
    assert stage(src, dest).already_staged


class _CredentialFS:
    """Builds an fsspec file system (a real LocalFileSystem subclass under its own protocol) that,
    like an object store, refuses every open without the credential it was configured with."""

    @staticmethod
    def register() -> str:
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        class TokenFS(LocalFileSystem):
            protocol = "stagertoken"

            def __init__(self, token: str | None = None, **kw: object) -> None:
                super().__init__(**kw)
                self.token = token

            def _open(self, path, mode="rb", **kw):  # type: ignore[no-untyped-def]
                if self.token != "s3cret":
                    raise PermissionError(f"{path}: no credentials")
                return super()._open(path, mode, **kw)

        fsspec.register_implementation("stagertoken", TokenFS, clobber=True)
        return "stagertoken"


def test_storage_options_reach_every_shard_open(imagenet_tiny: Path, tmp_path: Path) -> None:
    """The manifest read and every shard open (copy, and the streamed ``--unpack only``) get the
    caller's storage_options: a store that needs a credential is staged completely, and without it
    nothing is staged."""
    from stager.pack import pack

    src = tmp_path / "src"
    m = pack(imagenet_tiny, src, "tar", samples_per_shard=16).manifest
    assert m is not None
    url = f"{_CredentialFS.register()}://{src}"
    with pytest.raises(PermissionError):
        stage(url, tmp_path / "nocred")
    assert not (tmp_path / "nocred" / RECEIPT_NAME).exists()
    res = stage(url, tmp_path / "dest", storage_options={"token": "s3cret"})
    assert res.files_copied == len(m.shards)
    assert_verified_copy(m, tmp_path / "dest")
    only = stage(url, tmp_path / "only", storage_options={"token": "s3cret"}, unpack="only")
    assert only.unpacked_files == m.num_samples


def test_a_whole_stage_never_imports_numpy(imagenet_tiny_tar: Path, tmp_path: Path) -> None:
    """``stager stage`` of a whole dataset reads the manifest and copies files: numpy (~0.1 s of CPU
    and its BLAS threads at exit, most of a small stage's cost beyond ``cp``) is never imported. A
    partition and an unpacked tree, which need it, import it where they use it, and work."""
    code = ("import sys; from stager.cli import main; "
            "rc = main(['stage', '-q', *sys.argv[1:]]); print(rc, 'numpy' in sys.modules)")
    runs = {"whole": [], "--partition": ["--partition", "--node", "1", "--num-nodes", "2"],
            "--unpack": ["--unpack", "also"]}
    got = {}
    for name, flags in runs.items():
        out = subprocess.run([sys.executable, "-c", code, *flags, str(imagenet_tiny_tar), str(tmp_path / name)],
                             capture_output=True, text=True, check=True)
        got[name] = out.stdout.split()
    assert got == {"whole": ["0", "False"], "--partition": ["0", "True"], "--unpack": ["0", "True"]}, got
    assert (tmp_path / "--unpack" / "unpacked").is_dir()


def test_a_stage_builds_only_its_parser_and_imports_nothing_it_does_not_use(imagenet_tiny_tar: Path,
                                                                            tmp_path: Path) -> None:
    """Start-up of ``stager stage`` (issue 40): only the stage command's module and parser, and none of
    what a plain stage (or ``--unpack``) never runs: the other commands, the mix and cache modules
    (SRC is no mix file, no cache is asked for), ``concurrent.futures`` and ``logging`` (whose exit hook
    would cost the fast exit), ``socket``, ``traceback``."""
    code = ("import sys; from stager.cli import main; rc = main(['stage', '-q', *sys.argv[1:]]); "
            "print(rc, sorted(m for m in sys.modules if m.startswith('stager.commands.')"
            " or m in ('stager.mix', 'stager.cache.config', 'concurrent.futures', 'logging', 'socket', 'traceback')))")
    env = {k: v for k, v in os.environ.items() if k != "STAGER_CACHE"}
    for name, flags in {"whole": [], "--unpack": ["--unpack", "also"]}.items():
        out = subprocess.run([sys.executable, "-c", code, *flags, str(imagenet_tiny_tar), str(tmp_path / name)],
                             capture_output=True, text=True, check=True, env=env)
        assert out.stdout.strip() == "0 ['stager.commands.stage']", (name, out.stdout, out.stderr)
