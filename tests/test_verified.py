"""The one verified copy (stager/fs/verified.py), on real files, and the scan that keeps it the only one.

``copy_verified`` / ``PartialCopy``: what arrives is what was expected or nothing is left (no partial
file, one :class:`VerificationError` naming the file, expected vs got, and the fix); a name planted
where the partial file goes is never written through; a published copy never grants more than its
source. tests/test_one_mechanism.py keeps it the only one.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from stager.checksum import hash_bytes
from stager.errors import OutOfSpaceError, VerificationError
from stager.fs.access import copy_mode
from stager.fs.copy import DIRECT_ALIGN, aligned_buffer
from stager.fs.safe import SafeDir
from stager.fs.verified import Expected, PartialCopy, copy_verified, mismatch, verify_file

BLOCK = 4 * DIRECT_ALIGN
FIX = "restore it or re-pack"


def _source(tmp_path: Path, size: int, seed: int = 0) -> tuple[Path, bytes, Expected]:
    data = np.random.default_rng(seed).bytes(size)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    return src, data, Expected("shard-000.tar", size, hash_bytes(data), "xxh3_128")


def _leftovers(d: Path, *keep: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n not in keep)


class _Counting(io.RawIOBase):
    """A readable source that counts what was taken from it (to see where a copy stopped)."""

    def __init__(self, data: bytes) -> None:
        self._f = io.BytesIO(data)
        self.taken = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        n = self._f.readinto(buf)
        self.taken += n
        return n


# ---- a copy that matches -------------------------------------------------------------------------
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, BLOCK, 3 * BLOCK + 17])
def test_a_matching_copy_is_published_whole_and_nothing_else_stays(tmp_path: Path, size: int, direct: bool) -> None:
    src, data, expect = _source(tmp_path, size, seed=size)
    out = tmp_path / "out"
    out.mkdir()
    blocks: list[int] = []
    part = copy_verified(src, out / "shard-000.tar", expect, context=" copying src", fix=FIX,
                         buf=aligned_buffer(BLOCK), direct=direct, window=0, on_block=blocks.append)
    assert sum(blocks) == size and not (out / "shard-000.tar").exists()  # verified, not yet published
    assert _leftovers(out) == [part.tmp.name] and stat.S_IMODE(os.fstat(part.fd).st_mode) == 0o600
    part.publish(0o644, fsync=True, sync_dir=True)
    assert (out / "shard-000.tar").read_bytes() == data and _leftovers(out) == ["shard-000.tar"]
    assert verify_file(out / "shard-000.tar", expect) is None


def test_pushed_pieces_are_the_same_copy_as_a_pulled_stream(tmp_path: Path) -> None:
    """The collective's sinks write a stream's pieces as they arrive: same check, same result."""
    src, data, expect = _source(tmp_path, 5 * BLOCK + 3)
    part = PartialCopy(tmp_path / "pushed", expect=expect)
    for i in range(0, len(data), 1000):
        part.write(memoryview(data)[i : i + 1000])
    part.verify(fix=FIX)
    part.publish()
    copy_verified(src, tmp_path / "pulled", expect, context="", fix=FIX).publish()
    assert (tmp_path / "pushed").read_bytes() == (tmp_path / "pulled").read_bytes() == data


# ---- a copy that does not match ------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["flipped byte", "shorter", "longer"])
@pytest.mark.parametrize("direct", [False, True])
def test_a_mismatch_is_one_error_naming_the_file_and_leaves_nothing(tmp_path: Path, damage: str,
                                                                     direct: bool) -> None:
    src, data, expect = _source(tmp_path, 3 * BLOCK)
    bad = {"flipped byte": data[:100] + bytes([data[100] ^ 1]) + data[101:], "shorter": data[:-1],
           "longer": data + b"tail" * (4 * BLOCK)}[damage]
    src.write_bytes(bad)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(VerificationError) as err:
        copy_verified(src, out / "shard-000.tar", expect, context=f" copying {src}", fix=FIX,
                      buf=aligned_buffer(BLOCK), direct=direct)
    msg = str(err.value)
    assert msg.startswith("shard-000.tar: verification failed copying ") and msg.endswith(f"; {FIX}")
    assert "\n" not in msg and f"expected {expect.hash if damage == 'flipped byte' else expect.bytes}" in msg
    assert _leftovers(out) == []


def test_a_source_larger_than_expected_is_not_read_to_its_end(tmp_path: Path) -> None:
    expect = Expected("f", BLOCK, hash_bytes(b"x" * BLOCK), "xxh3_128")
    src = _Counting(b"x" * (50 * BLOCK))
    with pytest.raises(VerificationError, match=f"f: verification failed: read {2 * BLOCK} bytes, expected {BLOCK}"):
        copy_verified(src, tmp_path / "f", expect, context="", fix=FIX, buf=memoryview(bytearray(BLOCK)))
    assert src.taken == 2 * BLOCK and _leftovers(tmp_path) == []


def test_a_pushed_mismatch_leaves_nothing(tmp_path: Path) -> None:
    _, data, expect = _source(tmp_path, 1000)
    part = PartialCopy(tmp_path / "f", expect=expect)
    part.write(data[:-1] + b"?")
    with pytest.raises(VerificationError, match=r"after transfer from node 3: xxh3_128 checksum .*, expected "):
        part.verify(context=" after transfer from node 3", fix=FIX)
    assert _leftovers(tmp_path, "src.bin") == []


def test_a_failing_callback_or_a_full_disk_leaves_nothing(tmp_path: Path) -> None:
    src, _, expect = _source(tmp_path, 4 * BLOCK)

    def cancel(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        copy_verified(src, tmp_path / "f", expect, context="", fix=FIX, on_block=cancel)
    assert _leftovers(tmp_path, "src.bin") == []
    if not os.path.exists("/dev/full"):
        return
    # /dev/full refuses every write with ENOSPC: a full disk, for real, behind the partial's descriptor.
    with SafeDir.open(tmp_path) as d:
        part = PartialCopy("g", expect=expect, within=d)
        full = os.open("/dev/full", os.O_WRONLY)
        try:
            os.dup2(full, part.fd)
        finally:
            os.close(full)
        with pytest.raises(OutOfSpaceError, match=r"/g: write failed \(disk full"):
            part.write(b"data")
    assert _leftovers(tmp_path, "src.bin") == []


def test_a_planted_name_at_the_partial_is_never_written_through(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever could guess the partial name and plant a link there gets FileExistsError, and the
    link's target keeps its bytes (O_EXCL|O_NOFOLLOW); the planted entry is not ours to remove."""
    src, _, expect = _source(tmp_path, 1000)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    fixed = bytes.fromhex("abcdef012345")
    monkeypatch.setattr(os, "urandom", lambda n: fixed[:n])  # the standard library's: makes the name guessable
    out = tmp_path / "out"
    out.mkdir()
    planted = out / f"shard.{fixed.hex()}.partial"
    for target in (victim, tmp_path / "absent"):  # a link to a file, and a dangling one
        os.symlink(target, planted)
        for direct in (False, True):
            with pytest.raises(FileExistsError):
                copy_verified(src, out / "shard", expect, context="", fix=FIX, buf=aligned_buffer(BLOCK),
                              direct=direct)
        assert os.path.islink(planted) and not (out / "shard").exists()
        os.unlink(planted)
    assert victim.read_bytes() == b"precious" and not (tmp_path / "absent").exists()


# ---- access --------------------------------------------------------------------------------------
@pytest.mark.parametrize("src_mode", [0o400, 0o600, 0o604, 0o640, 0o644, 0o660, 0o666, 0o755, 0o777])
@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_a_published_copy_never_grants_more_than_its_source(tmp_path: Path, src_mode: int, umask: int) -> None:
    src, _, expect = _source(tmp_path, 100)
    src.chmod(src_mode)
    part = copy_verified(src, tmp_path / "copy", expect, context="", fix=FIX)
    part.publish(copy_mode(src.stat().st_mode, umask))
    got = stat.S_IMODE((tmp_path / "copy").stat().st_mode)
    assert got & ~(src_mode | 0o600) == 0, oct(got)  # nothing the source does not grant (owner rw aside)
    assert got & (0o022 | 0o111 | umask) == 0, oct(got)  # never writable by others, never executable
    # Whatever a caller asks for, a copy is never writable by group or others, nor executable.
    part = copy_verified(src, tmp_path / "greedy", expect, context="", fix=FIX)
    part.publish(0o777)
    assert stat.S_IMODE((tmp_path / "greedy").stat().st_mode) == 0o644


def test_a_copy_inside_a_directory_handle_follows_the_handle(tmp_path: Path) -> None:
    """Relative to a checked handle: renaming the directory and planting a link under its old
    path does not redirect the copy."""
    src, data, expect = _source(tmp_path, 3000)
    (tmp_path / "dest").mkdir(mode=0o700)
    (tmp_path / "elsewhere").mkdir()
    with SafeDir.open(tmp_path / "dest") as d:
        os.rename(tmp_path / "dest", tmp_path / "moved")
        os.symlink(tmp_path / "elsewhere", tmp_path / "dest")
        copy_verified(src, "shard", expect, context="", fix=FIX, within=d).publish(0o640, sync_dir=True)
        with pytest.raises(ValueError, match="one file name"):
            PartialCopy("a/b", expect=expect, within=d)
    assert (tmp_path / "moved" / "shard").read_bytes() == data and os.listdir(tmp_path / "elsewhere") == []


def test_seal_leaves_a_complete_file_under_its_partial_name(tmp_path: Path) -> None:
    part = PartialCopy(tmp_path / "manifest.json")
    part.write(b"{}\n")
    tmp, group_ok = part.seal(0o640)
    assert group_ok and tmp.read_bytes() == b"{}\n" and stat.S_IMODE(tmp.stat().st_mode) == 0o640
    assert not (tmp_path / "manifest.json").exists()


# ---- re-checking what exists ---------------------------------------------------------------------
def test_verify_file_rehashes_by_path_or_descriptor(tmp_path: Path) -> None:
    src, data, expect = _source(tmp_path, 2 * BLOCK + 5)
    assert verify_file(src, expect) is None
    with open(src, "rb") as f:
        f.read(7)  # a descriptor is read from offset 0, wherever it stands
        assert verify_file(f.fileno(), expect, buf=memoryview(bytearray(BLOCK))) is None
    src.write_bytes(data[:-1] + b"!")
    assert verify_file(src, expect) == mismatch(expect, len(data), hash_bytes(data[:-1] + b"!"))
    assert (verify_file(src, expect) or "").startswith("xxh3_128 checksum ")
    src.write_bytes(data[:-1])
    assert verify_file(src, expect) == f"read {len(data) - 1} bytes, expected {len(data)}"
