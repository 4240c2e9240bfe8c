"""Conformance of every shard format to the writer/reader protocol (stager/formats/base.py).

One test class, run for each of tar, hdf5, record and zarr: a shard is written with the format's
writer under a ``.partial`` name, published with its companion files, described by a real
:class:`Manifest` (read back through ``load_manifest`` so the digest and extent checks run), then
read back both ways (``iter_samples`` parsing the container, ``read`` using the manifest index).
Damage (truncation, flipped bytes) must surface as a :class:`StagerError` naming the shard, never
as a stray exception. Hypothesis round-trips cover the tar and record codecs with awkward keys.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.checksum import hash_file
from stager.errors import CorruptSampleError, ShardMissingError, StagerError, UnsafeArchiveError, UsageError
from stager.formats import FORMAT_NAMES, get_format
from stager.formats.base import Extent, Sample
from stager.fs.atomic import partial_path
from stager.manifest import AuxFile, Manifest, ShardInfo, check_safe_name, load_manifest

CLASSES = ["cat", "dog", "fish"]
IMAGE_SHAPE = (6, 5, 3)


def make_samples(fmt: str, n: int, seed: int = 0) -> list[Sample]:
    """``n`` samples suited to ``fmt``: random encoded bytes, or fixed-shape arrays for decoded formats."""
    rng = np.random.default_rng((seed, n))
    decoded = get_format(fmt).sample_kind == "decoded"
    out = []
    for i in range(n):
        key = f"k{i:04d}" if i % 3 else f"sub/dir.v1/k{i:04d}"
        label = int(rng.integers(0, len(CLASSES)))
        data: bytes | np.ndarray
        if decoded:
            data = rng.integers(0, 256, IMAGE_SHAPE, dtype=np.uint8)
        else:
            data = rng.bytes(int(rng.integers(1, 3000)))
        out.append(Sample(key, label, data, "png" if i % 2 else "jpg", {"source": f"train/{key}.src"}))
    return out


def write_dataset(fmt: str, out: Path, samples: Sequence[Sample], **options: Any) -> tuple[Manifest, list[Extent]]:
    """Write one shard of ``samples`` the way ``stager pack`` does (writer ``options``, e.g. tar's
    ``json_member``); return the reloaded manifest."""
    f = get_format(fmt)
    out.mkdir(parents=True, exist_ok=True)
    name = f.shard_name(0)
    final = out / name
    tmp = partial_path(final)
    w = f.open_writer(str(tmp), shard_name=name, classes=CLASSES, **options)
    try:
        extents = [w.write(s) for s in samples]
        companions = w.close()
    except BaseException:
        w.abort()
        raise
    os.replace(tmp, final)
    aux = []
    for aux_name, aux_tmp in companions:
        assert Path(aux_tmp).parent == out, "companion temp files must live next to the shard"
        os.replace(aux_tmp, out / aux_name)
        nb, h = hash_file(out / aux_name)
        aux.append(AuxFile(aux_name, nb, h))
    nbytes, digest = hash_file(final)
    info = ShardInfo(
        name=name,
        bytes=nbytes,
        hash=digest,
        keys=[s.key for s in samples],
        labels=np.array([s.label for s in samples], dtype=np.int64),
        offsets=np.array([e.offset for e in extents], dtype=np.int64),
        sizes=np.array([e.size for e in extents], dtype=np.int64),
        aux=aux,
    )
    decoded = f.sample_kind == "decoded"
    m = Manifest(
        format=fmt,
        classes=CLASSES,
        shards=[info],
        sample_kind=f.sample_kind,
        image_shape=IMAGE_SHAPE if decoded and samples else None,
    )
    m.write(out)
    return load_manifest(out), extents


def same_payload(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a_arr, b_arr = np.asarray(a), np.asarray(b)
        return a_arr.dtype == b_arr.dtype and a_arr.shape == b_arr.shape and np.array_equal(a_arr, b_arr)
    return bytes(a) == bytes(b)  # type: ignore[arg-type]


def iter_all(fmt: str, out: Path, m: Manifest) -> list[Sample]:
    f = get_format(fmt)
    r = f.open_reader(str(out / m.shards[0].name), m.shards[0], m)
    try:
        return list(r.iter_samples())
    finally:
        r.close()


@pytest.fixture(params=FORMAT_NAMES)
def fmt(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class TestFormatConformance:
    """The protocol every format must honour (run once per format)."""

    def test_shard_name_is_safe_and_numbered(self, fmt: str) -> None:
        f = get_format(fmt)
        names = [f.shard_name(i) for i in (0, 7, 12345)]
        assert names[1] == f"shard-00007{f.suffix}"
        assert all(check_safe_name(n) == n and n.endswith(f.suffix) for n in names)
        assert len(set(names)) == 3 and sorted(names) == names  # zero-padded: lexical = numeric order
        assert f.name == fmt and f.sample_kind in ("encoded", "decoded")

    def test_iter_samples_round_trips(self, fmt: str, tmp_path: Path) -> None:
        samples = make_samples(fmt, 23)
        m, _ = write_dataset(fmt, tmp_path, samples)
        got = iter_all(fmt, tmp_path, m)
        assert [s.key for s in got] == [s.key for s in samples]
        assert [s.label for s in got] == [s.label for s in samples]
        assert all(same_payload(a.data, b.data) for a, b in zip(got, samples, strict=True))
        assert m.num_samples == 23 and m.shards[0].keys == [s.key for s in samples]
        # Nothing but the shard, its companions and the manifest is left behind.
        expected = {m.shards[0].name, "manifest.json", m.index.name, *(a.name for a in m.shards[0].aux)}
        assert {p.name for p in tmp_path.iterdir()} == expected

    def test_read_positions_in_any_order(self, fmt: str, tmp_path: Path) -> None:
        samples = make_samples(fmt, 31, seed=3)
        m, extents = write_dataset(fmt, tmp_path, samples)
        info = m.shards[0]
        rng = np.random.default_rng(5)
        reader = get_format(fmt).open_reader(str(tmp_path / info.name), info, m)
        try:
            for positions in (
                rng.permutation(31),
                np.array([30, 0, 30, 5, 5, 1]),  # repeats and reversals
                np.arange(31),
                [],
                [17],
            ):
                got = reader.read(positions)
                assert len(got) == len(positions)
                for p, payload in zip(positions, got, strict=True):
                    assert same_payload(payload, samples[int(p)].data), (fmt, int(p))
        finally:
            reader.close()
        if get_format(fmt).sample_kind == "encoded":
            # Extents locate the exact image bytes in the file: readable with no format knowledge.
            blob = (tmp_path / info.name).read_bytes()
            for s, e in zip(samples, extents, strict=True):
                assert blob[e.offset : e.offset + e.size] == s.data

    def test_identical_input_gives_identical_bytes(self, fmt: str, tmp_path: Path) -> None:
        samples = make_samples(fmt, 12, seed=9)
        m1, e1 = write_dataset(fmt, tmp_path / "a", samples)
        m2, e2 = write_dataset(fmt, tmp_path / "b", samples)
        assert e1 == e2
        for name, _, _h in m1.files():
            assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
        assert [h for *_, h in m1.files()] == [h for *_, h in m2.files()]
        other = make_samples(fmt, 12, seed=10)
        m3, _ = write_dataset(fmt, tmp_path / "c", other)
        assert m3.shards[0].hash != m1.shards[0].hash

    def test_empty_shard_is_valid_and_empty(self, fmt: str, tmp_path: Path) -> None:
        m, _ = write_dataset(fmt, tmp_path, [])
        info = m.shards[0]
        assert info.samples == 0 and info.bytes == (tmp_path / info.name).stat().st_size  # 0 for record
        assert iter_all(fmt, tmp_path, m) == []
        reader = get_format(fmt).open_reader(str(tmp_path / info.name), info, m)
        try:
            assert reader.read([]) == []
        finally:
            reader.close()

    def test_wrong_sample_kind_is_refused(self, fmt: str, tmp_path: Path) -> None:
        f = get_format(fmt)
        wrong: bytes | np.ndarray = (
            b"\xff\xd8 not an array" if f.sample_kind == "decoded" else np.zeros(IMAGE_SHAPE, np.uint8)
        )
        tmp = partial_path(tmp_path / f.shard_name(0))
        w = f.open_writer(str(tmp), shard_name=f.shard_name(0), classes=CLASSES)
        with pytest.raises(StagerError):
            w.write(Sample("k0", 0, wrong, "jpg"))
        w.abort()

    def test_missing_shard_raises_shard_missing(self, fmt: str, tmp_path: Path) -> None:
        m, _ = write_dataset(fmt, tmp_path, make_samples(fmt, 3))
        (tmp_path / m.shards[0].name).unlink()
        with pytest.raises(ShardMissingError):
            iter_all(fmt, tmp_path, m)

    def test_truncated_shard_raises_our_error(self, fmt: str, tmp_path: Path) -> None:
        samples = make_samples(fmt, 9, seed=4)
        m, extents = write_dataset(fmt, tmp_path, samples)
        path = tmp_path / m.shards[0].name
        blob = path.read_bytes()
        # Cut points that leave a container which is provably incomplete. (A record file cut exactly
        # at a record boundary is a valid shorter file; only the manifest size/hash catches that.)
        boundaries = set()
        for a in m.shards[0].aux:
            if a.name.endswith(".idx"):
                for line in (tmp_path / a.name).read_text().splitlines():
                    off, size = map(int, line.split())
                    boundaries.update((off, off + size))
        cuts = {len(blob) - 1, len(blob) // 2, len(blob) // 3, 11}
        for cut in sorted(c + 1 if c in boundaries else c for c in cuts):
            path.write_bytes(blob[:cut])
            with pytest.raises(StagerError) as exc_info:
                iter_all(fmt, tmp_path, m)
            assert path.name in str(exc_info.value), (cut, exc_info.value)
        # read() through the manifest index past the end of a truncated file also reports damage.
        if get_format(fmt).sample_kind == "encoded":
            last = int(np.argmax(m.shards[0].offsets))
            path.write_bytes(blob[: extents[last].offset + 1])
            reader = get_format(fmt).open_reader(str(path), m.shards[0], m)
            try:
                with pytest.raises(StagerError):
                    reader.read([last])
            finally:
                reader.close()

    def test_flipped_bytes_never_escape_as_foreign_errors(self, fmt: str, tmp_path: Path) -> None:
        """Any single flipped byte gives our error or a parse; never a random exception."""
        samples = make_samples(fmt, 6, seed=8)
        m, _ = write_dataset(fmt, tmp_path, samples)
        path = tmp_path / m.shards[0].name
        blob = path.read_bytes()
        rng = np.random.default_rng(0)
        positions = sorted({0, len(blob) - 1, len(blob) - 22, *rng.integers(0, len(blob), 40).tolist()})
        detected = 0
        for pos in positions:
            damaged = bytearray(blob)
            damaged[pos] ^= 0xFF
            path.write_bytes(bytes(damaged))
            try:
                got = iter_all(fmt, tmp_path, m)
            except StagerError as exc:
                assert path.name in str(exc), exc
                detected += 1
                continue
            assert len(got) <= len(samples) + 1  # parsed something; the file hash is what catches it
        assert detected > 0

    def test_header_damage_is_detected(self, fmt: str, tmp_path: Path) -> None:
        """A flipped byte in the container's own structure (not a payload) is always refused."""
        m, _ = write_dataset(fmt, tmp_path, make_samples(fmt, 4))
        path = tmp_path / m.shards[0].name
        blob = bytearray(path.read_bytes())
        pos = STRUCTURE_BYTE[fmt](len(blob))
        blob[pos] ^= 0x5A
        path.write_bytes(bytes(blob))
        with pytest.raises((CorruptSampleError, UnsafeArchiveError)) as exc_info:
            iter_all(fmt, tmp_path, m)
        assert path.name in str(exc_info.value)


STRUCTURE_BYTE = {
    "tar": lambda n: 130,  # the first header's size field (covered by the header checksum)
    "record": lambda n: 3,  # the first record's length (covered by the length CRC)
    "hdf5": lambda n: 1,  # the superblock signature
    "zarr": lambda n: n - 21,  # the zip end-of-central-directory signature
}


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
