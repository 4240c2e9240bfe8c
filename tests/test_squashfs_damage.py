"""Damaged and hostile SquashFS input: one-line stager errors naming the image, never a traceback or a
hang. Truncation at every table boundary, flipped metadata headers and index entries, table offsets
out of bounds, a file that is not SquashFS, a directory loop, names that are not file names, and
random mutations of the tables (Hypothesis)."""

from __future__ import annotations

import datetime as dt
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.errors import SourceError, StagerError, UnsafeArchiveError
from stager.formats.squashfs import SquashImage
from stager.formats.squashfs.layout import SUPERBLOCK, Superblock
from stager.formats.squashfs.writer import SquashWriter
from tests.squashfs_trees import HAVE_TOOLS, mksquashfs

FILES = {f"c{i % 4}/f{i:03d}.{'txt' if i % 2 else 'jpg'}": (b"%d " % i) * (i * 37 % 3000) for i in range(200)}


def ours(path: Path, compression: str = "gzip", files: dict[str, bytes] = FILES) -> Path:
    with SquashWriter(path, compression=compression, block_size=4096) as w:
        for rel, data in files.items():
            w.add_file(rel, data)
    return path


def read_all(path: Path) -> None:
    """Open, list and read every file (what ``stager index`` and the loader do)."""
    with SquashImage(path) as im:
        lst = im.listing()
        im.read_many(lst.files())
        lst.problems()


def outcome(path: Path) -> str:
    """"ok", or the error's class name; fails on anything but a one-line StagerError naming the image."""
    try:
        read_all(path)
    except StagerError as exc:
        msg = str(exc)
        assert "\n" not in msg and str(path) in msg, msg
        return type(exc).__name__
    return "ok"


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("sqfs-damage")
    out = {f"ours-{c}": ours(d / f"{c}.sqfs", c).read_bytes() for c in ("gzip", "none", "zstd")}
    if HAVE_TOOLS:
        src = d / "src"
        for rel, data in FILES.items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(data)
        out["mksquashfs"] = mksquashfs(src, d / "mk.sqfs", "-b", "4K").read_bytes()
    return out


def boundaries(raw: bytes) -> list[int]:
    sb = Superblock.unpack(raw)
    cuts = {0, 4, 95, 96, 97, sb.inode_table_start, sb.inode_table_start + 1, sb.directory_table_start,
            sb.directory_table_start + 3, sb.id_table_start, sb.id_table_start + 7, sb.bytes_used - 1,
            (96 + sb.inode_table_start) // 2}
    for t in (sb.fragment_table_start, sb.lookup_table_start):
        if t < sb.bytes_used:
            cuts |= {t, t + 1}
    return sorted(c for c in cuts if 0 <= c < sb.bytes_used)


def test_truncated_at_every_table_boundary(images: dict[str, bytes], tmp_path: Path) -> None:
    for name, raw in images.items():
        for cut in boundaries(raw):
            p = tmp_path / f"{name}-{cut}.sqfs"
            p.write_bytes(raw[:cut])
            with pytest.raises(SourceError) as e:
                read_all(p)
            assert "\n" not in str(e.value) and str(p) in str(e.value)
            assert ("truncated" in str(e.value) or "not a SquashFS" in str(e.value)), str(e.value)
        p = tmp_path / f"{name}-unpadded.sqfs"  # the padding is not needed
        p.write_bytes(raw[: Superblock.unpack(raw).bytes_used])
        assert outcome(p) == "ok"


def _meta_headers(raw: bytes, start: int, end: int) -> list[int]:
    out, p = [], start
    while p + 2 <= end:
        out.append(p)
        p += 2 + (struct.unpack_from("<H", raw, p)[0] & 0x7FFF)
    return out


def test_flipped_metadata_headers_and_index_entries(images: dict[str, bytes], tmp_path: Path) -> None:
    seen = set()
    for name, raw in images.items():
        sb = Superblock.unpack(raw)
        spots = _meta_headers(raw, sb.inode_table_start, sb.directory_table_start)
        dir_end = sb.fragment_table_start if sb.fragments else sb.lookup_table_start
        spots += _meta_headers(raw, sb.directory_table_start, min(dir_end, sb.bytes_used))[:8]
        spots += [sb.id_table_start, sb.id_table_start + 4]
        if sb.fragments:
            spots += [sb.fragment_table_start, sb.fragment_table_start + 6]
        for k, at in enumerate(spots):
            for mask in (0x80, 0x01, 0xFF):
                bad = bytearray(raw)
                bad[at] ^= mask
                bad[at + 1] ^= mask >> 1
                p = tmp_path / f"{name}-{k}-{mask}.sqfs"
                p.write_bytes(bad)
                seen.add(outcome(p))
    assert "SourceError" in seen


def patched(raw: bytes, **fields: int) -> bytes:
    sb = Superblock.unpack(raw)
    return Superblock(**{**sb.__dict__, **fields}).pack() + raw[SUPERBLOCK.size :]


def test_bad_superblocks(images: dict[str, bytes], tmp_path: Path) -> None:
    raw = images["ours-gzip"]
    sb = Superblock.unpack(raw)
    cases = {
        "not a SquashFS image": b"\xff\xd8\xff\xe0 a JPEG, not an image" * 10,
        "not a SquashFS image ": b"",
        "SquashFS 3.1": patched(raw, major=3, minor=1),
        "block size": patched(raw, block_size=3000),
        "unknown SquashFS compressor id 9": patched(raw, compression=9),
        "out of order or outside": patched(raw, directory_table_start=sb.bytes_used + 10),
        "inode and directory tables": patched(raw, inode_table_start=sb.directory_table_start),
        "root inode": patched(raw, root_inode=(sb.directory_table_start - sb.inode_table_start) << 16),
        "id table": patched(raw, id_table_start=sb.bytes_used - 2),
        "truncated": patched(raw, bytes_used=len(raw) + 1),
    }
    for k, (want, data) in enumerate(cases.items()):
        p = tmp_path / f"bad{k}.sqfs"
        p.write_bytes(data)
        with pytest.raises(SourceError) as e:
            read_all(p)
        assert want.strip() in str(e.value) and "\n" not in str(e.value), (want, str(e.value))
    with pytest.raises(SourceError, match="a directory, not a SquashFS image"):
        SquashImage(tmp_path)


def _root_listing(path: Path) -> tuple[int, int, int]:
    """``(image offset of the root's listing, root inode reference, root inode number)`` of an
    uncompressed image whose directory table is one stored block."""
    raw = path.read_bytes()
    sb = Superblock.unpack(raw)
    blk, off = sb.root_inode >> 16, sb.root_inode & 0xFFFF
    at = sb.inode_table_start + blk + 2 + off
    itype, number = struct.unpack_from("<H", raw, at)[0], struct.unpack_from("<I", raw, at + 12)[0]
    assert itype == 1
    dblk, _nlink, _size, doff = struct.unpack_from("<IIHH", raw, at + 16)
    return sb.directory_table_start + dblk + 2 + doff, sb.root_inode, number


def test_a_directory_loop_is_refused(tmp_path: Path) -> None:
    path = ours(tmp_path / "loop.sqfs", "none", {"a/x.jpg": b"x"})
    listing, root_ref, root_number = _root_listing(path)
    raw = bytearray(path.read_bytes())
    struct.pack_into("<III", raw, listing, 0, root_ref >> 16, root_number)  # header: the root's block and number
    struct.pack_into("<Hh", raw, listing + 12, root_ref & 0xFFFF, 0)  # entry "a" -> the root itself
    path.write_bytes(raw)
    with pytest.raises(SourceError, match="reached twice"):
        read_all(path)


@pytest.mark.parametrize("name", [b"..", b"a/", b"\x01b", b"a\x00", b"a\x7f", b"\x1f\xc3"])
def test_names_that_are_not_file_names_are_refused(tmp_path: Path, name: bytes) -> None:
    path = ours(tmp_path / "names.sqfs", "none", {"ab": b"x", "cd": b"y"})
    listing, _, _ = _root_listing(path)
    raw = bytearray(path.read_bytes())
    assert raw[listing + 12 + 8 : listing + 12 + 10] == b"ab"
    raw[listing + 12 + 8 : listing + 12 + 10] = name
    path.write_bytes(raw)
    with pytest.raises(UnsafeArchiveError, match="not a file name"):
        read_all(path)


@settings(max_examples=300, deadline=dt.timedelta(seconds=10), derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_tables_never_crash(images: dict[str, bytes], tmp_path: Path, data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(images)))
    raw = bytearray(images[name])
    sb = Superblock.unpack(bytes(raw))
    region = data.draw(st.sampled_from([(0, 96), (sb.inode_table_start, sb.bytes_used),
                                        (sb.directory_table_start, sb.bytes_used), (96, sb.bytes_used)]))
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(region[0], region[1] - 1))
        raw[at] = data.draw(st.integers(0, 255))
    p = tmp_path / "m.sqfs"
    p.write_bytes(raw)
    outcome(p)


@pytest.mark.skipif(not HAVE_TOOLS, reason="needs squashfs-tools (tools/setup_venv.sh installs it)")
@pytest.mark.parametrize(("field", "value"), [(20, 1 << 20), (24, 4095)])
def test_a_damaged_tail_beside_directories_is_refused_naming_its_file(tmp_path: Path, field: int,
                                                                      value: int) -> None:
    """The fragment checks run over every entry, masked to the files with a tail (no gather of
    those rows): a bad fragment index (byte 20) or a tail running past its fragment block (offset,
    byte 24) in one file among directories and other files is still refused, naming that file."""
    src = tmp_path / "src"
    for c in ("a", "b", "c"):
        (src / c).mkdir(parents=True)
        for k in range(5):
            (src / c / f"{k}.txt").write_bytes(bytes([65 + k]) * (100 + k))
    # Uncompressed tables (-noI), small files as tails in fragment blocks (mksquashfs's default).
    path = mksquashfs(src, tmp_path / "tails.sqfs", "-noI", "-noD", "-noF", "-noX", "-b", "4K")
    with SquashImage(path) as im:
        lst = im.listing()
        target = next(int(i) for i in lst.files() if lst.paths[int(i)] == "b/3.txt")
        assert (lst.fragment[lst.files()] >= 0).all() and (lst.kind == 1).sum() == 3  # tails beside directories
        ref = int(lst.inode_ref[target])
        start = im.superblock.inode_table_start
    raw = bytearray(path.read_bytes())
    at = start + (ref >> 16) + 2 + (ref & 0xFFFF)  # a stored metadata block: header, then the inode
    assert struct.unpack_from("<H", raw, at)[0] == 2
    struct.pack_into("<I", raw, at + field, value)
    path.write_bytes(raw)
    with pytest.raises(SourceError, match=r"damaged inode of 'b/3\.txt'"):
        read_all(path)
