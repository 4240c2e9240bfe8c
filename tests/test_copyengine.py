"""The copy engine (stager/fs/copy.py) and the stage copier's tunings, on real files."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from test_stage_support import assert_verified_copy, make_dataset

from stager.checksum import hash_bytes, new_hasher
from stager.errors import VerificationError
from stager.fs.copy import (
    DIRECT_ALIGN,
    O_DIRECT,
    CopyTuning,
    aligned_buffer,
    copy_hashed,
    copy_hashed_direct,
    open_partial,
)
from stager.fs.kernel import sync_file_range
from stager.fs.writeback import WriteBehind
from stager.manifest import MANIFEST_NAME
from stager.stage import stage

BLOCK = 4096


@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 17])
@pytest.mark.parametrize("window", [None, 0, BLOCK, 3 * BLOCK])
def test_copy_hashed_copies_and_hashes_every_byte(tmp_path: Path, size: int, window: int | None) -> None:
    data = np.random.default_rng(size).bytes(size)
    (tmp_path / "src").write_bytes(data)
    blocks: list[int] = []
    fd = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with open(tmp_path / "src", "rb", buffering=0) as f:
            h = new_hasher()
            wb = None if window is None else WriteBehind(fd, window)
            n = copy_hashed(f, fd, memoryview(bytearray(BLOCK)), h, limit=size, write_behind=wb,
                            on_block=blocks.append)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert n == size == sum(blocks)
    assert all(0 < b <= BLOCK for b in blocks)
    assert (tmp_path / "dst").read_bytes() == data
    assert h.hexdigest() == hash_bytes(data)


def test_copy_hashed_stops_once_past_the_limit(tmp_path: Path) -> None:
    """A source larger than expected is not read to its end (it may be huge or growing)."""
    (tmp_path / "src").write_bytes(b"x" * (10 * BLOCK))
    fd = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with open(tmp_path / "src", "rb", buffering=0) as f:
            n = copy_hashed(f, fd, memoryview(bytearray(BLOCK)), new_hasher(), limit=2 * BLOCK + 1)
    finally:
        os.close(fd)
    assert n == 3 * BLOCK


def test_sync_file_range_on_files_and_pipes(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"y" * BLOCK)
        assert sync_file_range(fd, 0, BLOCK, 2) is sys.platform.startswith("linux")
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        assert sync_file_range(w, 0, 1, 2) is False  # ESPIPE: not supported, nothing done, no error
        wb = WriteBehind(w, BLOCK)
        wb.wrote(0, 10)
        assert wb.enabled is False
    finally:
        os.close(r)
        os.close(w)


class ShortReads:
    """A source that returns at most ``step`` bytes per ``readinto``, as network file systems and
    some fsspec files do before EOF."""

    def __init__(self, path: Path, step: int) -> None:
        self.f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the test
        self.step = step

    def readinto(self, buf: memoryview) -> int:
        return self.f.readinto(buf[: self.step]) or 0


DBLOCK = 4 * DIRECT_ALIGN


@pytest.mark.parametrize("size", [0, 1, DIRECT_ALIGN - 1, DIRECT_ALIGN, DIRECT_ALIGN + 1, DBLOCK, DBLOCK + 1,
                                  3 * DBLOCK + 5])
@pytest.mark.parametrize("step", [None, 1000])
def test_copy_hashed_direct_copies_every_byte(tmp_path: Path, size: int, step: int | None) -> None:
    """O_DIRECT for whole aligned blocks, the unaligned tail buffered; short reads do not misalign."""
    data = np.random.default_rng(size).bytes(size)
    (tmp_path / "src").write_bytes(data)
    fd, direct = open_partial(tmp_path / "dst", direct=True)
    try:
        if sys.platform.startswith("linux") and direct:
            import fcntl

            assert fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT
        src = ShortReads(tmp_path / "src", step) if step else open(tmp_path / "src", "rb", buffering=0)  # noqa: SIM115
        blocks: list[int] = []
        h = new_hasher()
        n = copy_hashed_direct(src, fd, aligned_buffer(DBLOCK), h, limit=size, on_block=blocks.append)
        (src.f if isinstance(src, ShortReads) else src).close()
        os.fsync(fd)
    finally:
        os.close(fd)
    assert n == size == sum(blocks)
    assert all(b == DBLOCK for b in blocks[:-1])  # full blocks despite short reads: alignment kept
    assert (tmp_path / "dst").read_bytes() == data
    assert h.hexdigest() == hash_bytes(data)


def test_copy_hashed_direct_refuses_a_misaligned_buffer(tmp_path: Path) -> None:
    fd, _ = open_partial(tmp_path / "dst", direct=True)
    try:
        with open(__file__, "rb") as f, pytest.raises(ValueError, match="multiple"):
            copy_hashed_direct(f, fd, aligned_buffer(DIRECT_ALIGN + 512), new_hasher(), limit=1 << 20)
    finally:
        os.close(fd)


def test_open_partial_is_exclusive_and_buffered_on_request(tmp_path: Path) -> None:
    fd, direct = open_partial(tmp_path / "p", direct=False)
    os.close(fd)
    assert direct is False
    with pytest.raises(FileExistsError):
        open_partial(tmp_path / "p", direct=True)


TUNINGS = [
    CopyTuning(window=-1, sync_threads=0),  # each stream fsyncs its own files, no write-behind
    CopyTuning(window=0, sync_threads=1),
    CopyTuning(block=64 << 10, window=128 << 10, sync_threads=3),
    CopyTuning(block=64 << 10, direct=True),
    CopyTuning(block=(64 << 10) + 512, direct=True),  # not O_DIRECT-aligned: buffered
]


@pytest.mark.parametrize("tuning", TUNINGS)
@pytest.mark.parametrize("workers", [1, 3])
def test_every_tuning_stages_a_verified_copy(tmp_path: Path, tuning: CopyTuning, workers: int) -> None:
    m = make_dataset(tmp_path / "src", n=7, size=200 << 10, seed=workers)
    r = stage(tmp_path / "src", tmp_path / "dest", workers=workers, tuning=tuning)
    assert r.files_copied == 7 and r.bytes_copied == sum(s.bytes for s in m.shards)
    assert_verified_copy(m, tmp_path / "dest")
    assert (tmp_path / "dest" / MANIFEST_NAME).read_bytes() == (tmp_path / "src" / MANIFEST_NAME).read_bytes()
    journal = (tmp_path / "dest" / ".stager-journal.jsonl").read_text().splitlines()
    assert len(journal) == 1 + 7
    if not tuning.direct or (tuning.block or 0) % DIRECT_ALIGN:
        assert r.io == "buffered"
    elif sys.platform.startswith("linux"):
        assert r.io in ("direct", "buffered")  # buffered only where DEST's file system refuses O_DIRECT


@pytest.mark.parametrize("tuning", TUNINGS)
def test_a_damaged_shard_leaves_no_manifest_and_no_partial(tmp_path: Path, tuning: CopyTuning) -> None:
    """Verification fails mid-run: no partial file, no manifest promising shards that are not there."""
    m = make_dataset(tmp_path / "src", n=6, size=150 << 10, seed=3)
    bad = tmp_path / "src" / m.shards[2].name
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(VerificationError, match=m.shards[2].name):
        stage(tmp_path / "src", tmp_path / "dest", workers=2, tuning=tuning)
    left = sorted(p.name for p in (tmp_path / "dest").iterdir())
    assert not [n for n in left if n.endswith(".partial")]
    assert MANIFEST_NAME not in left and m.shards[2].name not in left


def test_shared_dest_peer_starting_mid_copy_keeps_the_manifest(tmp_path: Path) -> None:
    """Shared DEST: a node that starts while another is copying removes the other's stale-looking
    ``manifest.json.<uuid>.partial``; the copying node still publishes the manifest and finishes."""
    import time

    from test_stage_support import last_json, spawn

    src = tmp_path / "src"
    m = make_dataset(src, n=4, size=64 << 10)
    dest = tmp_path / "beeond"
    slow = spawn("stage", str(src), str(dest), "--shared", "--node", "0", "--num-nodes", "2", "--json",
                 "--timeout", "120", env={"STAGER_TEST_THROTTLE_BPS": str(16 << 10)})
    deadline = time.monotonic() + 60
    while not list(dest.glob(f"{MANIFEST_NAME}.*.partial")) and slow.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    late = spawn("stage", str(src), str(dest), "--shared", "--node", "1", "--num-nodes", "2", "--json",
                 "--timeout", "120")
    for p in (slow, late):
        so, se = p.communicate(timeout=180)
        assert p.returncode == 0, se
        assert last_json(so)["ok"]
    assert_verified_copy(m, dest)
    assert (dest / MANIFEST_NAME).read_bytes() == (src / MANIFEST_NAME).read_bytes()


def test_cli_direct_flag_writes_with_o_direct(tmp_path: Path) -> None:
    from test_stage_support import last_json, stager

    m = make_dataset(tmp_path / "src", n=3, size=300 << 10)
    r = stager("stage", str(tmp_path / "src"), str(tmp_path / "dest"), "--direct", "--json")
    assert r.returncode == 0, r.stderr
    out = last_json(r.stdout)
    assert out["durable"] is True
    fd, supported = open_partial(tmp_path / "dest" / "probe", direct=True)  # does DEST take O_DIRECT?
    os.close(fd)
    os.unlink(tmp_path / "dest" / "probe")
    assert out["io"] == ("direct" if supported else "buffered")
    assert_verified_copy(m, tmp_path / "dest")
