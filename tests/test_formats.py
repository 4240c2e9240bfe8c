"""Conformance of every shard format stager writes to the writer/reader protocol (stager/formats/base.py).

The suite is :class:`stager.testing.formats.FormatTests` (shipped, so a new format subclasses it): one
class here per writable format (tar, hdf5, record, zarr) runs all of it. The read-only formats run
:class:`~stager.testing.formats.ReaderTests` in tests/test_formats_adopted.py, and
tests/test_format_registry.py checks that every registered format has its class. Below the classes:
Hypothesis round-trips of the tar and record codecs with awkward keys, and tar/record/hdf5 specifics.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.errors import CorruptSampleError, UnsafeArchiveError, UsageError
from stager.formats import get_format
from stager.formats.base import Sample, SizeInputs
from stager.manifest import Manifest
from stager.testing.formats import CLASSES, FormatTests, make_samples, write_dataset

__all__ = ["CLASSES", "iter_all", "make_samples", "write_dataset"]  # what other tests import from here


def iter_all(fmt: str, out: Path, m: Manifest) -> list[Sample]:
    f = get_format(fmt)
    r = f.open_reader(str(out / m.shards[0].name), m.shards[0], m)
    try:
        return list(r.iter_samples())
    finally:
        r.close()


class TestTar(FormatTests):
    format_name = "tar"

    def structure_offset(self, size: int) -> int:
        return 130  # the first header's size field (covered by the header checksum)


class TestRecord(FormatTests):
    format_name = "record"

    def structure_offset(self, size: int) -> int:
        return 3  # the first record's length (covered by the length CRC)


class TestHdf5(FormatTests):
    format_name = "hdf5"
    disk_bytes_slack = 20_000  # its fixed part is a mean over shard sizes: within ~20 KB (1% of a 2 MB shard)

    def structure_offset(self, size: int) -> int:
        return 1  # the superblock signature


class TestZarr(FormatTests):
    format_name = "zarr"
    disk_bytes_slack = 1_000  # within ~0.5% of a large shard; its zip and group headers vary by hundreds of bytes

    def structure_offset(self, size: int) -> int:
        return size - 21  # the zip end-of-central-directory signature


class TestSquashfs(FormatTests):
    """JPEG/PNG payloads: stored contiguous, ``bytes`` extents read like tar members."""

    format_name = "squashfs"
    disk_bytes_slack = 8192  # metadata counted uncompressed, and the padding to 4 KiB

    def structure_offset(self, size: int) -> int:
        return 0  # the superblock's magic


class TestSquashfsCompressed(TestSquashfs):
    """BMP payloads the writer compresses (gzip): ``inodes`` extents, read through their inodes; the small
    ones share fragment blocks, the large ones have blocks of their own."""


    def samples(self, n: int, seed: int = 0) -> list[Sample]:
        rng = np.random.default_rng((seed, n, 7))
        out = []
        for s in make_samples("squashfs", n, seed):
            size = int(rng.choice([1, 900, 70_000, 300_001]))
            body = (b"BM" + bytes(s.key, "ascii") * 40 + rng.bytes(64)) * (size // 100 + 1)
            out.append(Sample(s.key, s.label, body[:size], "bmp", s.meta, s.fields))
        return out

    def test_disk_bytes_is_the_file_size(self, tmp_path: Path) -> None:
        """A compressed payload's size is known only once written: the estimate (its source size) bounds the
        file from above, so a shard cut at --shard-size stays below it."""
        samples = self.samples(40, seed=2)
        m, _ = self.write_shard(tmp_path, samples)
        inputs = SizeInputs([s.key for s in samples], np.array([s.label for s in samples], np.int64),
                            np.array([len(s.data) for s in samples]), [s.ext for s in samples], list(CLASSES))
        per_sample, fixed = self.fmt.disk_bytes(inputs)
        assert m.shards[0].bytes < fixed + int(per_sample.sum()) < 1.05 * sum(len(s.data) for s in samples) + 8192

    def test_compressed_payloads_are_inodes(self, tmp_path: Path) -> None:
        m, want = self.write_shard(tmp_path, self.samples(7))
        info = m.shards[0]
        assert info.extents == "inodes"
        blob = (tmp_path / info.name).read_bytes()
        assert all(bytes(s.data) not in blob for s in want if len(s.data) > 1000)  # compressed, not stored


# ---- tar and record specifics ---------------------------------------------------------------
_PART = st.text(
    alphabet=st.characters(blacklist_characters="./\\\0", blacklist_categories=("Cs",)), min_size=1, max_size=60
)


@st.composite
def sample_lists(draw: st.DrawFn) -> list[Sample]:
    """Unique webdataset-safe keys (nested, unicode, >100 bytes), arbitrary bytes (incl. empty)."""
    n = draw(st.integers(0, 12))
    keys: list[str] = []
    for _ in range(n):
        dirs = draw(st.lists(st.one_of(_PART, st.just("a.b")), max_size=3))
        key = "/".join([*dirs, draw(_PART)])
        if key.startswith("__") or key in keys:
            continue
        keys.append(key)
    return [
        Sample(
            k,
            draw(st.integers(-1, 2)),
            draw(st.binary(max_size=1500)),
            draw(st.sampled_from(["jpg", "png", "jpeg", "webp"])),
        )
        for k in keys
    ]


@pytest.mark.parametrize("fmt", ["tar", "record"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(samples=sample_lists())
def test_encoded_round_trip_property(fmt: str, samples: list[Sample], tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tmp_path_factory.mktemp(fmt)
    m, extents = write_dataset(fmt, out, samples)
    got = iter_all(fmt, out, m)
    assert [(s.key, s.label, s.data, s.ext) for s in got] == [
        (s.key, s.label, s.data, "jpg" if (fmt == "record" and s.ext == "jpeg") else s.ext) for s in samples
    ]
    blob = (out / m.shards[0].name).read_bytes()
    assert [blob[e.offset : e.offset + e.size] for e in extents] == [s.data for s in samples]
    reader = get_format(fmt).open_reader(str(out / m.shards[0].name), m.shards[0], m)
    try:
        order = list(reversed(range(len(samples))))
        assert reader.read(order) == [samples[i].data for i in order]
    finally:
        reader.close()


def test_tar_metadata_round_trips(tmp_path: Path) -> None:
    meta = {"source": "n01/ü.JPEG", "orig_size": [500, 375], "ratio": 0.75, "flag": True, "none": None}
    samples = [Sample("a", 1, b"x", "jpg", meta), Sample("b", -1, b"y", "png", {})]
    m, _ = write_dataset("tar", tmp_path, samples, json_member=True)
    got = iter_all("tar", tmp_path, m)
    assert got[0].meta == meta and got[1].meta == {}
    assert [g.label for g in got] == [1, -1]


def test_tar_without_json_member_keeps_keys_and_labels(tmp_path: Path) -> None:
    """The default tar sample is KEY.<ext> + KEY.cls: the reader gets key, label and bytes back, no
    metadata (the manifest holds the rest)."""
    samples = [Sample("d/a", 1, b"x", "jpg", {"source": "d/a.JPEG"}), Sample("b", -1, b"y" * 600, "png", {})]
    m, _ = write_dataset("tar", tmp_path, samples)
    got = iter_all("tar", tmp_path, m)
    want = [(s.key, s.label, s.data, s.ext, {}) for s in samples]
    assert [(g.key, g.label, g.data, g.ext, g.meta) for g in got] == want
    # Each sample: image header + data blocks, .cls header + one data block; then two end blocks.
    assert m.shards[0].bytes == (512 + 512 + 1024) + (512 + 1024 + 1024) + 1024


@pytest.mark.parametrize(
    "key",
    ["", "a.b", "dir/a.b", "/abs", "../up", "a/../b", "a//b", "__meta__", "a\\b", "a/", "x\0y"],
)
def test_tar_refuses_keys_webdataset_would_split_differently(key: str, tmp_path: Path) -> None:
    f = get_format("tar")
    w = f.open_writer(str(tmp_path / "s.tar"), shard_name="s.tar", classes=CLASSES)
    with pytest.raises(UsageError, match="key"):
        w.write(Sample(key, 0, b"data", "jpg"))
    w.abort()


def test_tar_refuses_duplicate_keys_and_reserved_exts(tmp_path: Path) -> None:
    f = get_format("tar")
    w = f.open_writer(str(tmp_path / "s.tar"), shard_name="s.tar", classes=CLASSES)
    w.write(Sample("a", 0, b"data", "jpg"))
    with pytest.raises(UsageError, match="duplicate"):
        w.write(Sample("a", 0, b"data", "png"))
    for ext in ("cls", "json", "", "a/b"):
        with pytest.raises(UsageError, match="extension"):
            w.write(Sample(f"b{len(ext)}", 0, b"data", ext))
    w.abort()


def _tar_member(name: str, data: bytes, typeflag: bytes = b"0", linkname: bytes = b"") -> bytes:
    from stager.formats.ustar import ustar_header

    hdr = bytearray(ustar_header(name.encode(), len(data), typeflag))
    if linkname:  # rewrite linkname and fix the checksum by hand
        hdr[157 : 157 + len(linkname)] = linkname
        hdr[148:156] = b"        "
        hdr[148:156] = b"%06o\0 " % sum(hdr)
    return bytes(hdr) + data + bytes(-len(data) % 512)


@pytest.mark.parametrize(
    ("members", "error"),
    [
        ([("a.jpg", b"x", b"2", b"/etc/passwd")], UnsafeArchiveError),  # symlink
        ([("a.jpg", b"", b"1", b"b.jpg")], UnsafeArchiveError),  # hard link
        ([("a.jpg", b"", b"3", b"")], UnsafeArchiveError),  # device
        ([("../evil.jpg", b"x", b"0", b"")], UnsafeArchiveError),
        ([("/abs.jpg", b"x", b"0", b"")], UnsafeArchiveError),
        ([("a.jpg", b"x", b"0", b""), ("b.jpg", b"y", b"0", b""), ("a.cls", b"1", b"0", b"")], CorruptSampleError),
        ([("a.cls", b"1", b"0", b"")], CorruptSampleError),  # no image member
        ([("a.jpg", b"x", b"0", b""), ("a.cls", b"one", b"0", b"")], CorruptSampleError),
        ([("a.jpg", b"x", b"0", b""), ("a.json", b"{bad", b"0", b"")], CorruptSampleError),
        ([("noext", b"x", b"0", b"")], CorruptSampleError),
    ],
)
def test_tar_reader_refuses_hostile_or_malformed_shards(
    members: list[tuple[str, bytes, bytes, bytes]], error: type[Exception], tmp_path: Path
) -> None:
    path = tmp_path / "shard-00000.tar"
    path.write_bytes(b"".join(_tar_member(*m) for m in members) + bytes(1024))
    with pytest.raises(error) as exc_info:
        list(get_format("tar").open_reader(str(path), None, None).iter_samples())  # type: ignore[arg-type]
    assert str(path) in str(exc_info.value)


def test_tar_reader_accepts_third_party_layouts(tmp_path: Path) -> None:
    """Shards from GNU tar/tarfile: directories, GNU long names, PAX headers, unlabeled samples."""
    import tarfile

    path = tmp_path / "third.tar"
    long_key = "d" * 120 + "/" + "e" * 110
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as t:
        for name, data in [("dir", None), ("dir/x.jpg", b"X"), ("dir/x.cls", b" 2\n"), (f"{long_key}.png", b"P")]:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                t.addfile(info)
            else:
                info.size = len(data)
                t.addfile(info, __import__("io").BytesIO(data))
    got = list(get_format("tar").open_reader(str(path), None, None).iter_samples())  # type: ignore[arg-type]
    assert [(s.key, s.label, s.data, s.ext) for s in got] == [("dir/x", 2, b"X", "jpg"), (long_key, -1, b"P", "png")]


def test_record_index_lists_every_record(tmp_path: Path) -> None:
    from stager.formats.record import read_index

    samples = make_samples("record", 7)
    m, extents = write_dataset("record", tmp_path, samples)
    (aux,) = m.shards[0].aux
    assert aux.name == "shard-00000.tfrecord.idx"
    idx = read_index(str(tmp_path / aux.name))
    assert idx.shape == (7, 2)
    assert idx[0, 0] == 0 and (idx[1:, 0] == idx[:-1, 0] + idx[:-1, 1]).all()
    assert idx[-1, 0] + idx[-1, 1] == m.shards[0].bytes
    for (off, size), e in zip(idx, extents, strict=True):  # each image lies inside its own record
        assert off + 12 <= e.offset and e.offset + e.size <= off + size - 4


_json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    meta=st.dictionaries(st.text(max_size=8), _json_values, max_size=5),
    key=st.text(min_size=1, max_size=10),
    label=st.integers(-1, 10**6),
    cls=st.text(max_size=10),
)
def test_tar_json_metadata_equals_json_dumps(meta: dict, key: str, label: int, cls: str) -> None:
    import json

    from stager.formats.tar import _json_meta

    expect = {**meta, "class": cls, "key": key, "label": label}
    assert _json_meta(key, label, cls, meta) == json.dumps(expect, sort_keys=True, separators=(",", ":")).encode()


def test_hdf5_written_in_pieces_gives_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Image bytes written to the file in many small pieces (pwrite at their final offsets) build a
    shard byte-identical to one written in a single piece, and h5py reads every image back."""
    import stager.formats.hdf5 as h5fmt

    samples = [Sample(f"k{i}", i % 3, bytes([i]) * (700 + 37 * i), "jpg", {"source": f"k{i}.jpg"}) for i in range(40)]
    m1, _ = write_dataset("hdf5", tmp_path / "one", samples)
    monkeypatch.setattr(h5fmt, "FLUSH_BYTES", 1000)
    monkeypatch.setattr(h5fmt, "COPY_BLOCK", 4096)
    m2, _ = write_dataset("hdf5", tmp_path / "many", samples)
    a = (tmp_path / "one" / m1.shards[0].name).read_bytes()
    assert a == (tmp_path / "many" / m2.shards[0].name).read_bytes()
    assert [s.data for s in iter_all("hdf5", tmp_path / "many", m2)] == [s.data for s in samples]
