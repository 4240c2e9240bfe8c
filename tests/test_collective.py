"""Collective staging: real processes on loopback acting as nodes, each with its own DEST.

SRC bytes are counted independently of stager's own counters: the node processes read SRC through
a test-only fsspec file system (``countfs://``) that logs every read to a file.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from stager.errors import UsageError, VerificationError
from stager.manifest import load_manifest
from stager.order.partition import assign_shards_to_nodes
from stager.receipt import load_receipt
from stager.shardcheck import verify
from stager.stage import stage
from stager.stage.collective.group import resolve_endpoint
from stager.stage.collective.io import IoCounters, ShareReader, StreamSink, copy_share
from stager.stage.collective.plan import FileEntry, StreamLayout, assign_read_shares, chunk_size_for, stream_layouts
from tests.test_stage_support import make_dataset

LAUNCHER = r'''
import os, sys
import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

class CountingOpener(LocalFileOpener):
    def _log(self, n):
        with open(os.environ["COUNTFS_LOG"], "a") as f:
            f.write(f"{os.path.basename(self.path)}\t{n}\n")

    def read(self, n=-1):
        data = super().read(n)
        self._log(len(data))
        return data

    def readinto(self, b):
        n = self.f.readinto(b)
        self._log(n or 0)
        return n

class CountingFS(LocalFileSystem):
    protocol = "countfs"
    def _open(self, path, mode="rb", block_size=None, **kw):
        return CountingOpener(self._strip_protocol(path), mode, fs=self, **kw)

fsspec.register_implementation("countfs", CountingFS, clobber=True)
from stager.cli import main
sys.exit(main(sys.argv[1:]))
'''


@pytest.fixture
def packed(imagenet_tiny_tar: Path) -> Path:
    """12 tar shards of 2 JPEGs (~20 KB each, ~250 KB in all): the session's pack (read-only)."""
    return imagenet_tiny_tar


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(tmp: Path, src: str, n: int, *, ranks: list[int] | None = None, extra: list[str] | None = None,
            env_extra: dict[str, str] | None = None, timeout: float = 180.0) -> list[subprocess.Popen[str]]:
    """Start one `stager stage --collective` process per simulated node (rank = node)."""
    (tmp / "launcher.py").write_text(LAUNCHER)
    port = _free_port()
    procs = []
    for i in ranks if ranks is not None else range(n):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(i), WORLD_SIZE=str(n),
                   LOCAL_WORLD_SIZE="1", COUNTFS_LOG=str(tmp / f"count{i}.log"))
        env.update(env_extra or {})
        cmd = [sys.executable, str(tmp / "launcher.py"), "stage", src, str(tmp / f"dest{i}"), "--collective",
               "--chunk-size", "8192", "--timeout", str(timeout), "--json", *(extra or [])]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _finish(procs: list[subprocess.Popen[str]], limit: float = 300) -> list[tuple[int, dict, str]]:
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        lines = [ln for ln in so.splitlines() if ln.startswith("{")]
        out.append((p.returncode, json.loads(lines[-1]) if lines else {}, se))
    return out


def _src_reads(tmp: Path, n: int) -> dict[str, int]:
    """Bytes read per SRC file name, summed over all nodes' countfs logs."""
    reads: dict[str, int] = {}
    for i in range(n):
        log = tmp / f"count{i}.log"
        if log.exists():
            for line in log.read_text().splitlines():
                name, k = line.split("\t")
                reads[name] = reads.get(name, 0) + int(k)
    return reads


def test_four_nodes_read_src_once_and_end_identical(packed: Path, tmp_path: Path) -> None:
    m = load_manifest(packed)
    n = 4
    data = m.num_bytes  # what the collective moves: shards (the manifest and sample index are read per node)
    results = _finish(_launch(tmp_path, f"countfs://{packed}", n))
    for rc, res, err in results:
        assert rc == 0, err
        assert res["collective"] and res["fallback"] is None
        assert res["totals"]["src_bytes"] == data
        assert res["totals"]["exchange_bytes"] == (n - 1) * data
    # Independent count: every shard byte left SRC exactly once across the four nodes; the sample
    # index, like the manifest, is read by every node.
    reads = _src_reads(tmp_path, n)
    assert m.index is not None and reads.pop(m.index.name) == n * m.index.bytes
    assert {k: v for k, v in reads.items() if k != "manifest.json"} == {s.name: s.bytes for s in m.shards}
    # Every DEST verified, identical to SRC, with a collective receipt and no partial files.
    for i in range(n):
        dest = tmp_path / f"dest{i}"
        assert verify(dest, deep=True).ok
        for s in m.shards:
            assert (dest / s.name).read_bytes() == (packed / s.name).read_bytes()
        assert (dest / "manifest.json").read_bytes() == (packed / "manifest.json").read_bytes()
        rec = load_receipt(dest)
        assert rec is not None and rec.mode == "full" and rec.verified == "xxh3_128 while copying (collective)"
        assert sorted(rec.shards) == sorted(s.name for s in m.shards)
        assert not list(dest.glob("*.partial"))
    # The read shares are disjoint and cover the dataset: per-node SRC bytes add up.
    per_node = sorted(r["src_bytes"] for _, r, _ in results)
    assert sum(per_node) == data and per_node[0] > 0


def test_partition_each_node_holds_its_share(packed: Path, tmp_path: Path) -> None:
    m = load_manifest(packed)
    n = 3
    results = _finish(_launch(tmp_path, str(packed), n, extra=["--partition", "--seed", "7"]))
    shares = assign_shards_to_nodes(m.shard_bytes, n, 7)
    for i, (rc, res, err) in enumerate(results):
        assert rc == 0, err
        assert res["mode"] == "partition" and res["exchange_bytes"] == 0
        assert res["totals"]["src_bytes"] == m.num_bytes
        dest = tmp_path / f"dest{i}"
        held = sorted(p.name for p in dest.glob("*.tar"))
        assert held == sorted(m.shards[j].name for j in shares[i])
        rec = load_receipt(dest)
        assert rec is not None and rec.mode == "partition"
        assert rec.partition == {"num_nodes": n, "node": i, "seed": 7, "ranks_per_node": 1}


def test_killed_node_fails_everyone_cleanly_and_rerun_resumes(packed: Path, tmp_path: Path) -> None:
    m = load_manifest(packed)
    n = 3
    procs = _launch(tmp_path, str(packed), n, env_extra={"STAGER_TEST_COLLECTIVE_KILL": "1:3"}, timeout=120)
    results = _finish(procs, limit=300)  # hang guard: survivors must exit on their own
    assert results[1][0] == -signal.SIGKILL
    for i in (0, 2):
        rc, _res, err = results[i]
        assert rc == 5, err
        assert "node 1" in err and "exit 5" in err, err
        assert not (tmp_path / f"dest{i}" / "stager-receipt.json").exists()
    kept_before = [
        {json.loads(ln)["f"] for ln in (tmp_path / f"dest{i}" / ".stager-journal.jsonl").read_text().splitlines()[1:]}
        for i in range(n)
        if (tmp_path / f"dest{i}" / ".stager-journal.jsonl").exists()
    ]
    held_by_all = set.intersection(*kept_before) if len(kept_before) == n else set()
    # Rerun: completes, every DEST verified, nothing already held by everyone is read again.
    results = _finish(_launch(tmp_path, str(packed), n))
    for i, (rc, _res, err) in enumerate(results):
        assert rc == 0, err
        assert verify(tmp_path / f"dest{i}").ok
    tot = results[0][1]["totals"]
    assert sum(r["files_kept"] for _, r, _ in results) > 0
    skipped = sum(s.bytes for s in m.shards if s.name in held_by_all)
    assert tot["src_bytes"] + tot["local_bytes"] + skipped == m.num_bytes


def test_hung_node_peers_still_report_json_and_exit_5(packed: Path, tmp_path: Path) -> None:
    """A node that hangs mid-exchange (SIGSTOP) leaves its peers blocked inside the all_gather, where
    no exception can reach them: their watchdog ends the process. `--json` must still print one JSON
    object (scripts parse it), naming the hung node, and the exit code is 5."""
    # --timeout only bounds forming the group and backs the watchdog up (the heartbeat's 10 s staleness
    # is what ends the survivors), so it is wide: three interpreters importing torch beside the suite's
    # other xdist worker on a busy 2-core machine may take longer than 30 s to form.
    procs = _launch(tmp_path, str(packed), 3, env_extra={"STAGER_TEST_COLLECTIVE_KILL": "1:3:STOP"}, timeout=120)
    try:
        survivors = _finish([procs[0], procs[2]], limit=300)  # hang guard
    finally:
        procs[1].kill()
        procs[1].wait()
    for rc, res, err in survivors:
        assert rc == 5, err
        assert res.get("ok") is False and res.get("type") == "StagerTimeoutError", (res, err)
        assert "node 1" in res["error"] and "no heartbeat" in res["error"], res
        assert err.count("error: collective staging aborted") == 1, err


def test_fallback_direct_when_no_peers_show_up(packed: Path, tmp_path: Path) -> None:
    # Node 1 of 2 alone: node 0's store never appears. Node 0 of 2 alone: nobody joins its store.
    (tmp_path / "none").mkdir()
    procs = _launch(tmp_path, str(packed), 2, ranks=[1], timeout=2)
    procs += _launch(tmp_path / "none", str(packed), 2, ranks=[0], timeout=2, extra=["--fallback", "none"])
    (rc1, res1, err1), (rc0, _, err0) = _finish(procs)
    assert rc1 == 0, err1
    assert res1["fallback"] == "direct" and not res1["collective"]
    assert verify(tmp_path / "dest1", deep=True).ok
    rec = load_receipt(tmp_path / "dest1")
    assert rec is not None and rec.mode == "full" and "collective" not in rec.verified
    assert rc0 == 5, err0
    assert "did not form" in err0
    assert not (tmp_path / "none" / "dest0" / "stager-receipt.json").exists()


def test_collective_copies_take_the_sources_access_like_a_plain_stage(tmp_path: Path) -> None:
    """A group-only (0640) dataset stays group-only on every node: shards, manifest and receipt get the
    source's mode, exactly as a plain stage gives them (the collective receipt and copies were 0644)."""
    src = tmp_path / "src"
    m = make_dataset(src, n=6, size=16 << 10, mode=0o640)
    os.chmod(src / "manifest.json", 0o640)
    plain = tmp_path / "plain"
    stage(src, plain)
    names = [*(s.name for s in m.shards), "manifest.json", "stager-receipt.json"]
    modes = {n: stat.S_IMODE(os.stat(plain / n).st_mode) for n in names}
    assert set(modes.values()) == {0o640}
    for rc, res, err in _finish(_launch(tmp_path, str(src), 2)):
        assert rc == 0, err
        assert res["collective"] and res["fallback"] is None
    for i in range(2):
        dest = tmp_path / f"dest{i}"
        assert {n: stat.S_IMODE(os.stat(dest / n).st_mode) for n in names} == modes, i
        assert {os.stat(dest / n).st_gid for n in names} == {os.stat(src / "manifest.json").st_gid}


TOKEN_LAUNCHER = r'''
import json, sys
import fsspec
from fsspec.implementations.local import LocalFileSystem

class TokenFS(LocalFileSystem):  # an object store stand-in: every open needs the credential
    protocol = "stagertoken"

    def __init__(self, token=None, **kw):
        super().__init__(**kw)
        self.token = token

    def _open(self, path, mode="rb", **kw):
        if self.token != "s3cret":
            raise PermissionError(f"{path}: no credentials")
        return super()._open(path, mode, **kw)

fsspec.register_implementation("stagertoken", TokenFS, clobber=True)
from stager.stage.collective import stage_collective
res = stage_collective(sys.argv[1], sys.argv[2], timeout=180, chunk_bytes=8192, storage_options={"token": "s3cret"})
print(json.dumps(res.to_json()))
'''


def test_storage_options_reach_the_collective_share_reads(tmp_path: Path) -> None:
    """stage_collective's storage_options reach every node's reads of its share, not only the
    manifest read: a store that needs a credential is staged completely on both nodes."""
    src = tmp_path / "src"
    m = make_dataset(src, n=6, size=16 << 10)
    (tmp_path / "launcher.py").write_text(TOKEN_LAUNCHER)
    port = _free_port()
    procs = []
    for i in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(i), WORLD_SIZE="2", LOCAL_WORLD_SIZE="1")
        procs.append(subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), f"stagertoken://{src}",
                                       str(tmp_path / f"dest{i}")], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for rc, res, err in _finish(procs):
        assert rc == 0, err
        assert res["collective"] and res["totals"]["src_bytes"] == m.num_bytes
    for i in range(2):
        assert verify(tmp_path / f"dest{i}").ok
        assert sorted(p.name for p in (tmp_path / f"dest{i}").glob("shard-*")) == sorted(s.name for s in m.shards)


# ---- pure pieces ------------------------------------------------------------------------------------
@pytest.mark.parametrize("nodes", [1, 2, 3, 5, 13])
def test_read_shares_are_disjoint_cover_and_balanced(packed: Path, nodes: int) -> None:
    m = load_manifest(packed)
    sizes = np.array([s.bytes for s in m.shards])
    for osts in (None, [i % 4 for i in range(len(m.shards))]):
        shares = assign_read_shares(m, nodes, seed=3, osts=osts)
        flat = sorted(i for sh in shares for i in sh)
        assert flat == list(range(len(m.shards)))
        loads = [int(sizes[sh].sum()) for sh in shares]
        if len(m.shards) >= nodes:
            # Balanced to within one shard per OST group.
            assert max(loads) - min(loads) <= int(sizes.max()) * (1 if osts is None else 4)
        if osts is not None and nodes <= 4:
            # Every node reads an equal slice (+-1 shard) of every OST, and nodes start on different OSTs.
            for o in range(4):
                counts = [sum(1 for i in sh if osts[i] == o) for sh in shares]
                assert max(counts) - min(counts) <= 1
            firsts = [osts[sh[0]] for sh in shares if sh]
            assert len(set(firsts)) == len(firsts)
    assert assign_read_shares(m, nodes, seed=3) == assign_shards_to_nodes(m.shard_bytes, nodes, 3)


def test_chunk_size_respects_memory_budget() -> None:
    for n in (1, 4, 64, 4096):
        c = chunk_size_for(n, 8 << 20, 256 << 20)
        assert c % 4096 == 0 and 4096 <= c <= 8 << 20
        if n >= 64:
            assert 3 * (n + 1) * c <= max(256 << 20, 3 * (n + 1) * (64 << 10))
    with pytest.raises(UsageError):
        chunk_size_for(4, 100, 1 << 20)


def test_endpoint_from_slurm_nodelist() -> None:
    env = {"SLURM_JOB_NODELIST": "gpu[07-09],login1", "SLURM_JOB_ID": "123456"}
    assert resolve_endpoint(env) == ("gpu07", 20000 + 123456 % 20000)
    assert resolve_endpoint({"MASTER_ADDR": "h", "MASTER_PORT": "1234"}) == ("h", 1234)
    with pytest.raises(UsageError):
        resolve_endpoint({})


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=6), chunk=st.integers(1, 7000),
       seed=st.integers(0, 2**16))
def test_stream_roundtrip(tmp_path_factory: pytest.TempPathFactory, sizes: list[int], chunk: int, seed: int) -> None:
    """Any file sizes (empty included), any chunking: the sink rebuilds every file exactly, verified."""
    tmp = tmp_path_factory.mktemp("rt")
    src, dest = tmp / "src", tmp / "dest"
    src.mkdir()
    dest.mkdir()
    rng = np.random.default_rng(seed)
    files = []
    for i, n in enumerate(sizes):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        (src / f"f{i}").write_bytes(data)
        files.append(FileEntry(f"f{i}", n, xxhash.xxh3_128_hexdigest(data), i))
    lay = StreamLayout(0, tuple(files))
    c = IoCounters()
    have: set[str] = set()
    copy_share(ShareReader(str(src), dest, lay, counters=c), StreamSink(dest, lay, algo="xxh3_128", counters=c,
                                                                        have=have), max(chunk, 1))
    assert have == {f.name for f in files}
    for f in files:
        assert (dest / f.name).read_bytes() == (src / f.name).read_bytes()
    assert c.src_bytes == sum(sizes) and c.written_bytes == sum(sizes)
    assert not list(dest.glob("*.partial"))


def test_sink_refuses_corrupt_bytes_and_leaves_no_partial(tmp_path: Path) -> None:
    data = b"x" * 10000
    entry = FileEntry("f0", len(data), xxhash.xxh3_128_hexdigest(data), 0)
    lay = StreamLayout(0, (entry,))
    sink = StreamSink(tmp_path, lay, algo="xxh3_128", counters=IoCounters(), have=set(), origin=" from node 3")
    sink.feed(memoryview(b"x" * 5000))
    with pytest.raises(VerificationError, match="from node 3"):
        sink.feed(memoryview(b"y" * 5000))
    assert list(tmp_path.iterdir()) == []


def test_stream_layouts_skips_files_everyone_has(packed: Path) -> None:
    m = load_manifest(packed)
    shares = assign_read_shares(m, 3)
    skip = {m.shards[0].name, m.shards[5].name}
    lays = stream_layouts(m, shares, skip)
    names = [f.name for lay in lays for f in lay.files]
    assert sorted(names) == sorted(s.name for s in m.shards if s.name not in skip)
    assert sum(lay.length for lay in lays) == m.num_bytes - sum(m.shards[i].bytes for i in (0, 5))


def test_collective_fills_the_cache_and_a_rerun_links_everything(packed: Path, tmp_path: Path) -> None:
    """`--collective --cache`: what the nodes received goes into the cache (each object once); a later
    collective stage links it all into new DESTs, and nothing is read from SRC or exchanged."""
    m = load_manifest(packed)
    n = 2
    cache = tmp_path / "cache"
    files = len(list(m.files()))
    results = _finish(_launch(tmp_path, str(packed), n, extra=["--cache", str(cache)]))
    for rc, res, err in results:
        assert rc == 0, err
        assert res["collective"] and res["cache"]["dir"] == str(cache)
    assert sum(res["cache"]["files_filled"] for _, res, _ in results) == files
    again = tmp_path / "again"
    again.mkdir()
    results = _finish(_launch(again, str(packed), n, extra=["--cache", str(cache)]))
    for i, (rc, res, err) in enumerate(results):
        assert rc == 0, err
        assert res["src_bytes"] == 0 and res["exchange_bytes"] == 0, res
        assert res["cache"]["files_hit"] == files
        assert verify(again / f"dest{i}").ok
        rec = load_receipt(again / f"dest{i}")
        assert rec is not None and rec.cache is not None and rec.cache["dir"] == str(cache)
