"""hdf5 and zarr shards read by plain third-party code, byte-exact extents, determinism, damage.

The "plain" tests use only h5py / zarr / open() and the layout described in docs/formats.md: if
they pass, a user without stager can read our shards.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from zarr.storage import ZipStore

from stager.errors import CorruptSampleError, ShardMissingError, SourceError
from stager.formats import get_format
from stager.formats.base import Extent, Sample
from stager.manifest import Manifest, ShardInfo, check_safe_name

CLASSES = ["n00000000", "n00000001", "n00000002", "n00000003"]
ZARR_SHAPE = (24, 32, 3)  # (H, W, C) every zarr test image is resized to


def _jpeg_samples(root: Path) -> list[Sample]:
    samples = []
    for label, cls in enumerate(CLASSES):
        for p in sorted((root / cls).iterdir()):
            samples.append(
                Sample(key=f"{cls}/{p.stem}", label=label, data=p.read_bytes(), ext="jpg", meta={"src": p.name})
            )
    return samples


def _decoded_samples(root: Path, shape: tuple[int, int, int] | None = ZARR_SHAPE) -> list[Sample]:
    out = []
    for s in _jpeg_samples(root):
        with Image.open(root / s.key.split("/")[0] / s.meta["src"]) as im:
            im = im.convert("RGB")
            if shape is not None:
                im = im.resize((shape[1], shape[0]), Image.BILINEAR)
            out.append(Sample(key=s.key, label=s.label, data=np.asarray(im, dtype=np.uint8), ext="raw"))
    return out


def _write(fmt_name: str, path: Path, samples: list[Sample], **options: object) -> list[Extent]:
    fmt = get_format(fmt_name)
    w = fmt.open_writer(str(path), shard_name=path.name, classes=CLASSES, **options)
    try:
        extents = [w.write(s) for s in samples]
    except BaseException:
        w.abort()
        raise
    assert w.close() == []
    return extents


def _info(path: Path, samples: list[Sample], extents: list[Extent]) -> tuple[ShardInfo, Manifest]:
    info = ShardInfo(
        name=path.name,
        bytes=path.stat().st_size,
        hash="",
        keys=[s.key for s in samples],
        labels=np.array([s.label for s in samples], dtype=np.int64),
        offsets=np.array([e.offset for e in extents], dtype=np.int64),
        sizes=np.array([e.size for e in extents], dtype=np.int64),
    )
    return info, Manifest(format="hdf5", classes=CLASSES, shards=[info])


@pytest.fixture(scope="module")
def jpegs(imagenet_tiny: Path) -> list[Sample]:
    return _jpeg_samples(imagenet_tiny)


@pytest.fixture(scope="module")
def decoded(imagenet_tiny: Path) -> list[Sample]:
    return _decoded_samples(imagenet_tiny)


# ---- hdf5 ---------------------------------------------------------------------------------------
def test_hdf5_plain_h5py_reads_every_sample(tmp_path: Path, jpegs: list[Sample]) -> None:
    path = tmp_path / "shard-00000.h5"
    extents = _write("hdf5", path, jpegs)
    with h5py.File(path, "r") as f:
        assert f.attrs["stager_format"] == "stager.hdf5/1"
        assert f.attrs["layout"] == "contiguous-uint8"
        assert int(f.attrs["num_samples"]) == len(jpegs)
        assert json.loads(f.attrs["classes"]) == CLASSES
        images = f["images"]
        assert images.dtype == np.uint8 and images.chunks is None and images.compression is None
        bounds = f["offsets"][...]
        assert bounds.dtype == np.int64 and bounds[0] == 0 and bounds[-1] == images.shape[0]
        keys = [k.decode() for k in f["keys"][...]]
        exts = [e.decode() for e in f["exts"][...]]
        labels = f["labels"][...]
        base = images.id.get_offset()
        for i, s in enumerate(jpegs):
            assert images[bounds[i] : bounds[i + 1]].tobytes() == s.data
            assert (keys[i], int(labels[i]), exts[i]) == (s.key, s.label, s.ext)
            # The manifest extent is exactly "dataset file offset + in-array offset".
            assert extents[i] == Extent(base + int(bounds[i]), int(bounds[i + 1] - bounds[i]))


def test_hdf5_extents_are_file_bytes(tmp_path: Path, jpegs: list[Sample]) -> None:
    path = tmp_path / "shard-00000.h5"
    extents = _write("hdf5", path, jpegs)
    with open(path, "rb") as f:
        for e, s in zip(extents, jpegs, strict=True):
            f.seek(e.offset)
            assert f.read(e.size) == s.data


def test_hdf5_reader_roundtrip_and_random_read(tmp_path: Path, jpegs: list[Sample]) -> None:
    path = tmp_path / "shard-00000.h5"
    extents = _write("hdf5", path, jpegs)
    info, manifest = _info(path, jpegs, extents)
    reader = get_format("hdf5").open_reader(str(path), info, manifest)
    try:
        assert list(reader.iter_samples()) == jpegs
        order = np.random.default_rng(0).permutation(len(jpegs))
        assert reader.read(order) == [jpegs[i].data for i in order]
        assert reader.read([3, 4, 5, 3]) == [jpegs[i].data for i in (3, 4, 5, 3)]
        assert reader.read([]) == []
    finally:
        reader.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payloads=st.lists(st.binary(max_size=3000), max_size=12))
def test_hdf5_extents_property(tmp_path: Path, payloads: list[bytes]) -> None:
    """Any payloads, including empty ones and empty shards, land exactly at their extents."""
    samples = [Sample(key=f"k{i}", label=i % len(CLASSES), data=p) for i, p in enumerate(payloads)]
    path = tmp_path / "prop.h5"
    extents = _write("hdf5", path, samples)
    raw = path.read_bytes()
    assert [raw[e.offset : e.offset + e.size] for e in extents] == payloads
    from stager.formats.hdf5 import Hdf5Reader

    assert [s.data for s in Hdf5Reader(str(path)).iter_samples()] == payloads


def test_hdf5_deterministic_bytes(tmp_path: Path, jpegs: list[Sample]) -> None:
    a, b = tmp_path / "a" / "shard-00000.h5", tmp_path / "b" / "shard-00000.h5.x.partial"
    a.parent.mkdir()
    b.parent.mkdir()
    _write("hdf5", a, jpegs)
    _write("hdf5", b, jpegs)
    assert a.read_bytes() == b.read_bytes()
    c = tmp_path / "c.h5"
    _write("hdf5", c, [*jpegs[:-1], Sample(jpegs[-1].key, jpegs[-1].label, jpegs[-1].data + b"\0")])
    assert c.read_bytes() != a.read_bytes()


def test_hdf5_refuses_arrays(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="k0"):
        _write("hdf5", tmp_path / "x.h5", [Sample("k0", 0, np.zeros((2, 2, 3), np.uint8))])


def test_hdf5_truncated_and_damaged(tmp_path: Path, jpegs: list[Sample]) -> None:
    path = tmp_path / "shard-00000.h5"
    extents = _write("hdf5", path, jpegs)
    info, manifest = _info(path, jpegs, extents)
    raw = path.read_bytes()
    bad = tmp_path / "shard-00001.h5"
    bad.write_bytes(raw[: len(raw) // 2])
    reader = get_format("hdf5").open_reader(str(bad), info, manifest)
    with pytest.raises(CorruptSampleError, match=r"shard-00001\.h5"):
        list(reader.iter_samples())
    # The loader path reads by extent without parsing HDF5: the short read is reported the same way.
    with pytest.raises(CorruptSampleError, match=r"shard-00001\.h5"):
        reader.read([len(jpegs) - 1])
    reader.close()
    # A valid HDF5 file that is not our layout is refused with the same error, naming the file.
    other = tmp_path / "shard-00002.h5"
    with h5py.File(other, "w") as f:
        f.create_dataset("images", data=np.zeros(10, np.uint8), chunks=(5,))
    with pytest.raises(CorruptSampleError, match=r"shard-00002\.h5.*stager_format") as err:
        list(get_format("hdf5").open_reader(str(other), info, manifest).iter_samples())
    assert str(err.value).count("damaged") == 1  # one line, not a wrapped wrapper
    with pytest.raises(ShardMissingError):
        list(get_format("hdf5").open_reader(str(tmp_path / "gone.h5"), info, manifest).iter_samples())


# ---- zarr ---------------------------------------------------------------------------------------
def test_zarr_plain_zarr_reads_images_and_labels(tmp_path: Path, decoded: list[Sample]) -> None:
    path = tmp_path / "shard-00000.zarr.zip"
    assert check_safe_name(get_format("zarr").shard_name(0)) == path.name  # one plain file per shard
    extents = _write("zarr", path, decoded)
    h, w, c = ZARR_SHAPE
    assert extents == [Extent(i, h * w * c) for i in range(len(decoded))]
    store = ZipStore(path, mode="r")
    try:
        g = zarr.open_group(store, mode="r")
        images, labels = g["images"], g["labels"]
        assert images.shape == (len(decoded), *ZARR_SHAPE) and images.dtype == np.uint8
        # The whole images array is one zarr shard of single-image inner chunks.
        assert images.shards is not None and images.shards[0] >= len(decoded)
        assert images.chunks == (1, *ZARR_SHAPE)
        np.testing.assert_array_equal(images[...], np.stack([s.data for s in decoded]))
        np.testing.assert_array_equal(labels[...], [s.label for s in decoded])
        attrs = g.attrs.asdict()
        assert attrs["keys"] == [s.key for s in decoded]
        assert attrs["classes"] == CLASSES
        assert attrs["image_shape"] == list(ZARR_SHAPE)
        assert attrs["num_samples"] == len(decoded)
    finally:
        store.close()
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        names = [i.filename for i in infos]
        assert names == sorted(names)
        assert all(i.compress_type == zipfile.ZIP_STORED and i.date_time == (1980, 1, 1, 0, 0, 0) for i in infos)
        assert "images/c/0/0/0/0" in names  # a single zarr shard


def test_zarr_reader_read_and_rows(tmp_path: Path, decoded: list[Sample]) -> None:
    path = tmp_path / "shard-00000.zarr.zip"
    extents = _write("zarr", path, decoded, rows_per_chunk=4)
    info, manifest = _info(path, decoded, extents)
    reader = get_format("zarr").open_reader(str(path), info, manifest)
    try:
        got = list(reader.iter_samples())
        assert [(s.key, s.label, s.ext) for s in got] == [(s.key, s.label, s.ext) for s in decoded]
        for a, b in zip(got, decoded, strict=True):
            np.testing.assert_array_equal(a.data, b.data)
        positions = [5, 6, 7, 0, 23, 22, 9]
        for p, arr in zip(positions, reader.read(positions), strict=True):
            assert arr.shape == ZARR_SHAPE
            np.testing.assert_array_equal(arr, decoded[p].data)
        rows = reader.read_rows(3, 11)  # type: ignore[attr-defined]
        np.testing.assert_array_equal(rows, np.stack([s.data for s in decoded[3:11]]))
        with pytest.raises(IndexError):
            reader.read_rows(20, 99)  # type: ignore[attr-defined]
    finally:
        reader.close()


def test_zarr_deterministic_bytes(tmp_path: Path, decoded: list[Sample]) -> None:
    a, b = tmp_path / "a.zarr.zip", tmp_path / "b.zarr.zip.partial"
    _write("zarr", a, decoded)
    _write("zarr", b, decoded)
    assert a.read_bytes() == b.read_bytes()


def test_zarr_shape_mismatch_names_key(tmp_path: Path, imagenet_tiny: Path) -> None:
    natural = _decoded_samples(imagenet_tiny, shape=None)
    shapes = [s.data.shape for s in natural]  # type: ignore[union-attr]
    first_odd = next(i for i, sh in enumerate(shapes) if sh != shapes[0])
    path = tmp_path / "shard-00000.zarr.zip"
    with pytest.raises(SourceError, match=f"{natural[first_odd].key}.*--resize"):
        _write("zarr", path, natural)
    assert not path.exists()
    with pytest.raises(SourceError, match="k0"):
        _write("zarr", path, [Sample("k0", 0, b"\xff\xd8 jpeg bytes")])
    with pytest.raises(SourceError, match="k1"):
        _write("zarr", path, [Sample("k1", 0, np.zeros((4, 4, 3), np.float32))])


def test_zarr_truncated_and_damaged(tmp_path: Path, decoded: list[Sample]) -> None:
    path = tmp_path / "shard-00000.zarr.zip"
    extents = _write("zarr", path, decoded)
    info, manifest = _info(path, decoded, extents)
    raw = path.read_bytes()
    trunc = tmp_path / "shard-00001.zarr.zip"
    trunc.write_bytes(raw[: len(raw) - 200])
    with pytest.raises(CorruptSampleError, match=r"shard-00001\.zarr\.zip"):
        list(get_format("zarr").open_reader(str(trunc), info, manifest).iter_samples())
    # Flip one byte of image 3: the per-image crc32c (or the zip CRC) catches it on read.
    i = raw.index(np.ascontiguousarray(decoded[3].data).tobytes())
    flipped = bytearray(raw)
    flipped[i + 7] ^= 0xFF
    bad = tmp_path / "shard-00002.zarr.zip"
    bad.write_bytes(bytes(flipped))
    reader = get_format("zarr").open_reader(str(bad), info, manifest)
    try:
        with pytest.raises(CorruptSampleError, match=r"shard-00002\.zarr\.zip.*crc32c") as err:
            reader.read([3])
        assert str(err.value).count("damaged") == 1
        np.testing.assert_array_equal(reader.read([4])[0], decoded[4].data)  # other images still readable
    finally:
        reader.close()
    with pytest.raises(ShardMissingError):
        list(get_format("zarr").open_reader(str(tmp_path / "gone.zarr.zip"), info, manifest).iter_samples())


# ---- both ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt_name", ["hdf5", "zarr"])
def test_reader_survives_fork(tmp_path: Path, jpegs: list[Sample], decoded: list[Sample], fmt_name: str) -> None:
    """A reader used before fork() gives correct data in the child (DataLoader workers fork)."""
    samples = jpegs if fmt_name == "hdf5" else decoded
    path = tmp_path / get_format(fmt_name).shard_name(0)
    info, manifest = _info(path, samples, _write(fmt_name, path, samples))
    reader = get_format(fmt_name).open_reader(str(path), info, manifest)
    reader.read([0])
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report success through the exit code only
        ok = False
        try:
            got = reader.read([7, 8, 2])
            ok = all(
                np.array_equal(np.asarray(g), np.asarray(samples[p].data)) for g, p in zip(got, [7, 8, 2], strict=True)
            )
            reader.close()
        finally:
            os.write(wfd, b"1" if ok else b"0")
            os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        verdict = r.read()
    os.waitpid(pid, 0)
    assert verdict == b"1"
    assert np.array_equal(np.asarray(reader.read([1])[0]), np.asarray(samples[1].data))
    reader.close()


@pytest.mark.parametrize("rows_per_chunk", [1, 3])
def test_zarr_direct_rows_equal_zarr(tmp_path: Path, decoded: list[Sample], rows_per_chunk: int) -> None:
    """The pread fast path returns exactly what zarr returns, for every run, absent chunks included."""
    samples = list(decoded[:20])
    samples[4] = Sample("zero", 0, np.zeros(ZARR_SHAPE, np.uint8))  # all-fill chunk: zarr does not store it
    samples[5] = Sample("zero2", 1, np.zeros(ZARR_SHAPE, np.uint8))
    path = tmp_path / "shard-00000.zarr.zip"
    extents = _write("zarr", path, samples, rows_per_chunk=rows_per_chunk)
    info, manifest = _info(path, samples, extents)
    reader = get_format("zarr").open_reader(str(path), info, manifest)
    try:
        assert reader.direct  # type: ignore[attr-defined]
        n = len(samples)
        for start in range(n + 1):
            for stop in range(start, n + 1):
                fast = reader.read_rows(start, stop)  # type: ignore[attr-defined]
                slow = reader.read_rows(start, stop, via_zarr=True)  # type: ignore[attr-defined]
                assert fast.shape == slow.shape == (stop - start, *ZARR_SHAPE)
                np.testing.assert_array_equal(fast, slow)
        np.testing.assert_array_equal(reader.read_rows(0, n), np.stack([s.data for s in samples]))  # type: ignore[attr-defined]
    finally:
        reader.close()


def test_zarr_reader_falls_back_to_zarr_for_other_layouts(tmp_path: Path, decoded: list[Sample]) -> None:
    """A group with our attributes but another array layout (no sharding, zstd) is read through zarr."""
    from zarr.codecs import ZstdCodec

    from stager.formats.zarr import write_zip

    members: dict[str, object] = {}
    store = zarr.storage.MemoryStore(members)  # type: ignore[arg-type]
    n = len(decoded)
    attrs = {
        "stager_format": "stager.zarr/1",
        "num_samples": n,
        "image_shape": list(ZARR_SHAPE),
        "classes": CLASSES,
        "keys": [s.key for s in decoded],
        "exts": [s.ext for s in decoded],
        "meta": [{} for _ in decoded],
    }
    g = zarr.create_group(store=store, attributes=attrs, zarr_format=3)
    g.create_array("images", shape=(n, *ZARR_SHAPE), dtype="uint8", chunks=(2, *ZARR_SHAPE), compressors=[ZstdCodec()])
    g["images"][...] = np.stack([s.data for s in decoded])
    g.create_array("labels", shape=(n,), dtype="int64", chunks=(n,))
    g["labels"][...] = [s.label for s in decoded]
    path = tmp_path / "shard-00000.zarr.zip"
    write_zip(str(path), members)
    reader = get_format("zarr").open_reader(str(path), *_info(path, decoded, [Extent(i, 0) for i in range(n)]))
    try:
        assert not reader.direct  # type: ignore[attr-defined]
        for p, arr in zip([9, 3, 4, 5], reader.read([9, 3, 4, 5]), strict=True):
            np.testing.assert_array_equal(arr, decoded[p].data)
        assert [s.key for s in reader.iter_samples()] == [s.key for s in decoded]
    finally:
        reader.close()


@pytest.mark.parametrize("fmt_name", ["hdf5", "zarr"])
def test_unserialisable_metadata_names_the_sample(tmp_path: Path, fmt_name: str) -> None:
    data: bytes | np.ndarray = b"x" if fmt_name == "hdf5" else np.zeros(ZARR_SHAPE, np.uint8)
    with pytest.raises(SourceError, match="bad-meta"):
        _write(fmt_name, tmp_path / "s", [Sample("bad-meta", 0, data, meta={"f": object()})])
