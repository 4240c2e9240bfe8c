"""The fast unpack path (stager/stage/unpack.py): its tar walker refuses exactly what
stager.formats.ustar.iter_members refuses, its chunked reader sees every byte once, durability is
journaled only after a syncfs, and the group is inherited from setgid class directories."""

from __future__ import annotations

import io
import os
import random
import stat
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stager.checksum import new_hasher
from stager.errors import CorruptSampleError, StagerError, UnsafeArchiveError, VerificationError
from stager.formats.ustar import header_sum, iter_members
from stager.manifest import Manifest, ShardInfo, load_manifest
from stager.pack import pack
from stager.stage.unpack import ChunkReader, SyncfsBatcher, Unpacker, walk_tar


@pytest.fixture(scope="module")
def packed(imagenet_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("walk") / "tar"
    pack(imagenet_tiny, out, format="tar", samples_per_shard=6)
    return out


def _reference(data: bytes, where: str = "s") -> tuple[list[tuple[str, int, bytes]], type | None]:
    """iter_members' members up to its first error, and the error's type (None: accepted)."""
    out: list[tuple[str, int, bytes]] = []
    try:
        for name, off, d in iter_members(io.BytesIO(data), len(data), where):
            out.append((name, off, bytes(d)))
    except (CorruptSampleError, UnsafeArchiveError) as exc:
        return out, type(exc)
    return out, None


def _walk(data: bytes, sizes: dict[int, int], chunk: int, hasher: object | None = None
          ) -> tuple[list[tuple[str, int, bytes]], type | None]:
    out: list[tuple[str, int, bytes]] = []
    try:
        for name, off, d in walk_tar(ChunkReader(io.BytesIO(data), hasher, chunk), len(data), "s", sizes):
            out.append((name, off, bytes(d)))
    except (CorruptSampleError, UnsafeArchiveError) as exc:
        return out, type(exc)
    return out, None


def _tar(members: list[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]], fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for m in members:
            ti, payload = m if isinstance(m, tuple) else (m, b"")
            ti.size = len(payload)
            tf.addfile(ti, io.BytesIO(payload))
    return buf.getvalue()


def _link(kind: bytes, name: str) -> tarfile.TarInfo:
    """A member of type ``kind`` (link, device, FIFO, directory) with no data."""
    ti = tarfile.TarInfo(name)
    ti.type = kind
    if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
        ti.linkname = "/etc/passwd"
    return ti


HOSTILE = {
    "dotdot": _tar([(tarfile.TarInfo("c/a.jpg"), b"a" * 700), (tarfile.TarInfo("../../x.jpg"), b"x")]),
    "absolute": _tar([(tarfile.TarInfo("/tmp/x.jpg"), b"x")]),
    "symlink": _tar([_link(tarfile.SYMTYPE, "c/s.jpg")]),
    "hardlink": _tar([_link(tarfile.LNKTYPE, "c/h.jpg")]),
    "chardev": _tar([_link(tarfile.CHRTYPE, "c/d.jpg")]),
    "fifo": _tar([_link(tarfile.FIFOTYPE, "c/f.jpg")]),
    "pax-dotdot": _tar([(tarfile.TarInfo("c/" + "p" * 120 + "/../../../x.jpg"), b"x")], tarfile.PAX_FORMAT),
    "gnu-long-abs": _tar([(tarfile.TarInfo("/" + "g" * 150 + ".jpg"), b"x")], tarfile.GNU_FORMAT),
    "pax-long-ok": _tar([(tarfile.TarInfo("c/" + "q" * 150 + ".jpg"), b"y" * 1000)], tarfile.PAX_FORMAT),
    "gnu-long-ok": _tar([(tarfile.TarInfo("c/" + "r" * 150 + ".jpg"), b"z" * 513)], tarfile.GNU_FORMAT),
    "dir-then-file": _tar([_link(tarfile.DIRTYPE, "c"), (tarfile.TarInfo("c/a.jpg"), b"a")]),
    "no-end-marker": _tar([(tarfile.TarInfo("c/a.jpg"), b"a" * 10)])[:1024],
    "empty": b"",
}


def _regular_sizes(data: bytes) -> dict[int, int]:
    members, _ = _reference(data)
    return {off: len(d) for _, off, d in members}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
@pytest.mark.parametrize("chunk", [512, 4096, 1 << 20])
def test_walker_agrees_with_iter_members_on_hostile_shards(kind: str, chunk: int) -> None:
    data = HOSTILE[kind]
    ref, ref_err = _reference(data)
    got, err = _walk(data, {off: len(d) for _, off, d in ref}, chunk)
    assert (got, err) == (ref, ref_err)
    if kind in ("dotdot", "absolute", "symlink", "hardlink", "chardev", "fifo", "pax-dotdot", "gnu-long-abs"):
        assert err is UnsafeArchiveError


def test_walker_yields_only_listed_members_and_refuses_a_size_mismatch_before_reading() -> None:
    data = _tar([(tarfile.TarInfo("c/a.jpg"), b"a" * 700), (tarfile.TarInfo("c/a.cls"), b"3"),
                 (tarfile.TarInfo("c/b.jpg"), b"b" * 5000)])
    ref, _ = _reference(data)
    first, third = ref[0][1], ref[2][1]
    got, err = _walk(data, {first: 700, third: 5000}, 1024)
    assert err is None and [g[0] for g in got] == ["c/a.jpg", "c/b.jpg"] and got[1][2] == b"b" * 5000
    got, err = _walk(data, {first: 700, third: 10}, 1024)  # manifest says 10 bytes: refused
    assert err is UnsafeArchiveError and [g[0] for g in got] == ["c/a.jpg"]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), chunk=st.sampled_from([512, 1000, 8192, 1 << 20]))
def test_walker_agrees_with_iter_members_on_damaged_real_shards(packed: Path, seed: int, chunk: int) -> None:
    """Byte flips and truncations of a real shard: both walkers accept the same members or refuse."""
    m = load_manifest(packed)
    info = m.shards[seed % len(m.shards)]
    good = (packed / info.name).read_bytes()
    rng = random.Random(seed)
    data = bytearray(good)
    for _ in range(rng.randint(1, 4)):
        pos = rng.choice([rng.randrange(len(data)), rng.randrange(0, len(data), 512) + rng.randrange(160)])
        data[pos] = rng.randrange(256)
    if rng.random() < 0.3:
        del data[rng.randrange(len(data)):]
    sizes = dict(zip(info.offsets.tolist(), info.sizes.tolist(), strict=True))
    ref, ref_err = _reference(bytes(data))
    got, err = _walk(bytes(data), sizes, chunk)
    # walk_tar yields the manifest's members only, and refuses a listed member of another size first.
    expect, expect_err = [], ref_err
    for name, off, d in ref:
        if off in sizes:
            if len(d) != sizes[off]:
                expect_err = UnsafeArchiveError
                break
            expect.append((name, off, d))
    if ref_err is not None and err is UnsafeArchiveError and expect_err is not UnsafeArchiveError:
        # A member truncated by the damage whose size field no longer matches the manifest: walk_tar
        # checks the size before reading, iter_members finds the truncation while reading. Both refuse.
        assert got == expect[: len(got)]
        return
    assert (got, err) == (expect, expect_err)


def test_chunk_reader_hashes_every_byte_once_across_take_skip_drain() -> None:
    data = os.urandom(50_000)

    class ReadOnly:  # a stream with read() but no readinto()
        def __init__(self, b: bytes) -> None:
            self.f = io.BytesIO(b)

        def read(self, n: int = -1) -> bytes:
            return self.f.read(min(n, 777))

    for raw in (io.BytesIO(data), ReadOnly(data)):
        h = new_hasher("xxh3_128")
        r = ChunkReader(raw, h, 1000)
        parts = [bytes(r.take(10)), b"", bytes(r.take(3000))]  # 3000 > buffer: it grows
        assert r.skip(20_000) == 20_000
        parts.append(bytes(r.take(5)))
        r.drain()
        assert r.nbytes == len(data) and bytes(r.take(1)) == b""
        assert b"".join(parts) == data[:3010] + data[23_010:23_015]
        ref = new_hasher("xxh3_128")
        ref.update(data)
        assert h.hexdigest() == ref.hexdigest()


@given(st.binary(min_size=512, max_size=512))
def test_header_sum_is_sum(hdr: bytes) -> None:
    assert header_sum(hdr) == sum(hdr)


def test_header_sum_extremes() -> None:
    for hdr in (bytes(512), b"\xff" * 512, b"\xff" * 256 + bytes(256)):
        assert header_sum(hdr) == sum(hdr)


# ---- Unpacker: byte-identical output whatever the chunk size; refusal removes the shard's files --------
@pytest.mark.parametrize("chunk", [512, 3000, 1 << 20])
def test_unpack_tar_is_byte_identical_for_any_chunk_size(packed: Path, imagenet_tiny: Path, tmp_path: Path,
                                                        chunk: int) -> None:
    m = load_manifest(packed)
    u = Unpacker(tmp_path / "out", m)
    u.chunk_size = chunk
    for info in m.shards:
        h = new_hasher(m.hash_algo)
        with open(packed / info.name, "rb", buffering=0) as f:
            assert u.unpack_tar(f, info, h) == info.samples
    u.close()
    src = {str(p.relative_to(imagenet_tiny).with_suffix("")): p.read_bytes() for p in imagenet_tiny.rglob("*")
           if p.is_file()}
    out = {str(p.relative_to(tmp_path / "out").with_suffix("")): p.read_bytes()
           for p in (tmp_path / "out").rglob("*") if p.is_file()}
    assert out == src and u.files == len(src) and u.bytes == sum(map(len, src.values()))


def test_damaged_shard_leaves_none_of_its_files(packed: Path, tmp_path: Path) -> None:
    m = load_manifest(packed)
    info = m.shards[0]
    data = bytearray((packed / info.name).read_bytes())
    data[-2000] ^= 0xFF  # after the last image: only the hash can tell
    u = Unpacker(tmp_path / "out", m)
    with pytest.raises(VerificationError, match=info.name):
        u.unpack_tar(io.BytesIO(bytes(data)), info, new_hasher(m.hash_algo))
    u.close()
    assert [p for p in (tmp_path / "out").rglob("*") if p.is_file()] == []


def test_two_samples_to_one_file_are_refused(tmp_path: Path) -> None:
    payload = b"\xff\xd8x\xff\xd9"
    # In class "c", key "c/a_k" (class prefix stripped) and key "a/k" ("/" -> "_") both become a_k.
    data = _tar([(tarfile.TarInfo("c/a_k.jpg"), payload), (tarfile.TarInfo("a/k.jpg"), payload)])
    offs = [off for _, off, _ in _reference(data)[0]]
    info = ShardInfo("s.tar", len(data), "", ["c/a_k", "a/k"], np.zeros(2, np.int64), np.array(offs, np.int64),
                     np.array([len(payload)] * 2, np.int64))
    u = Unpacker(tmp_path / "out", Manifest(format="tar", classes=["c"], shards=[info]))
    with pytest.raises(UnsafeArchiveError, match="both unpack to"):
        u.unpack_tar(io.BytesIO(data), info)
    u.close()
    assert not (tmp_path / "out" / "c" / "a_k.jpg").exists()


def test_a_leftover_symlink_is_replaced_not_written_through(packed: Path, tmp_path: Path) -> None:
    m = load_manifest(packed)
    info = m.shards[0]
    cls = m.classes[int(info.labels[0])]
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (tmp_path / "out" / cls).mkdir(parents=True)
    u = Unpacker(tmp_path / "out", m)
    target = Path(u.target(info, 0, "jpg"))
    target.symlink_to(victim)
    u._targets.clear()
    with open(packed / info.name, "rb", buffering=0) as f:
        u.unpack_tar(f, info)
    u.close()
    assert victim.read_bytes() == b"keep" and not target.is_symlink() and target.stat().st_size == info.sizes[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files another group")
def test_group_comes_from_setgid_class_dirs(packed: Path, tmp_path: Path) -> None:
    m = load_manifest(packed)
    u = Unpacker(tmp_path / "out", m, file_mode=0o640, dir_mode=0o750, gid=4242)
    for info in m.shards:
        with open(packed / info.name, "rb", buffering=0) as f:
            u.unpack_tar(f, info)
    assert all(d[2] == 0 for d in u._dirs.values())  # inherited: no fchown per file
    u.close()
    for p in (tmp_path / "out").rglob("*"):
        st_ = p.lstat()
        assert st_.st_gid == 4242, p
        assert not stat.S_IMODE(st_.st_mode) & 0o007, p
        if p.is_dir():
            assert st_.st_mode & stat.S_ISGID, p


# ---- write-behind: a shard is journaled only after a syncfs that began after it finished ------------
def test_write_behind_journals_only_after_a_sync(tmp_path: Path) -> None:
    journaled: list[str] = []
    wb = SyncfsBatcher(tmp_path, journaled.append, every=100)
    wb.shard_done("a")
    assert journaled == []  # no kick yet: nothing is durable, nothing journaled
    wb.wrote(150)  # kicks a background syncfs
    for _ in range(500):
        if journaled:
            break
        time.sleep(0.01)
    assert journaled == ["a"]
    wb.shard_done("b")
    wb.finish()
    assert journaled == ["a", "b"]


def test_write_behind_surfaces_a_journal_failure(tmp_path: Path) -> None:
    def boom(name: str) -> None:
        raise OSError(f"journal write failed for {name}")

    wb = SyncfsBatcher(tmp_path, boom, every=1)
    wb.shard_done("a")
    wb.wrote(10)
    with pytest.raises(OSError, match="journal write failed"):
        wb.finish()


def test_hostile_shapes_are_stager_errors() -> None:
    for kind, data in HOSTILE.items():
        _, err = _walk(data, _regular_sizes(data), 4096)
        assert err is None or issubclass(err, StagerError), kind
