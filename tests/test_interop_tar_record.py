"""Third-party readers read our tar and record shards unchanged.

* tar: the real ``webdataset`` library (raw and decoded), Python's ``tarfile`` and, when present, GNU
  ``tar`` in a subprocess see every sample with its bytes, label and metadata, fixed header fields,
  and data offsets equal to the manifest extents.
* record: the ``tfrecord`` package reads our shard through our ``.idx`` (its index-based,
  sharded reader), protobuf (``tfrecord.example_pb2``) parses every payload, and, because
  ``tfrecord`` does not verify CRCs, the framing CRCs are checked here with ``google_crc32c``,
  independently of stager's code. TensorFlow, when importable, reads the shard as a slow test.
* The hand-written ``tf.train.Example`` codec is byte-identical to protobuf's deterministic
  serialisation (hypothesis).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from stager.formats.base import Sample
from stager.formats.example_pb import Feature, decode_example, encode_example
from stager.manifest import Manifest
from tests.test_formats import write_dataset

CLASSES = ["cat", "dog", "fish"]  # as in tests/test_formats.py


def real_samples(imagenet: Path, cifar_batches: Path) -> list[Sample]:
    """Real JPEGs (ImageNet-like tree) and PNGs (CIFAR-like), keyed and labelled like pack does."""
    out = []
    for i, p in enumerate(sorted(imagenet.rglob("*.JPEG"))[:9]):
        key = f"{p.parent.name}/{p.stem}"
        out.append(Sample(key, i % 3, p.read_bytes(), p.suffix[1:], {"source": f"{p.parent.name}/{p.name}"}))
    for i, p in enumerate(sorted((cifar_batches.parent / "cifar-png" / "train").rglob("*.png"))[:5]):
        out.append(Sample(f"cifar/{p.stem}", (i + 1) % 3, p.read_bytes(), "png", {"source": p.name}))
    # A key too long for the ustar name field and one that is not ASCII (PAX headers).
    jpeg = out[0].data
    out.append(Sample("deep/" + "x" * 130 + "/y" * 20 + "/long", 2, jpeg, "jpg", {"source": "long"}))
    out.append(Sample("unicodé/ファイル", 1, jpeg, "jpg", {"source": "ü"}))
    return out


@pytest.fixture(scope="module")
def samples(imagenet_tiny: Path, cifar_tiny: Path) -> list[Sample]:
    return real_samples(imagenet_tiny, cifar_tiny)


# ---- tar ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["lean", "tar-json"])
def tar_shard(
    request: pytest.FixtureRequest, samples: list[Sample], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Manifest, bool]:
    """A tar shard as `stager pack` writes it by default (KEY.<ext> + KEY.cls) and with --tar-json."""
    out = tmp_path_factory.mktemp("tar")
    m, _ = write_dataset("tar", out, samples, json_member=request.param)
    return out / m.shards[0].name, m, request.param


def test_webdataset_reads_every_sample_unchanged(
    samples: list[Sample], tar_shard: tuple[Path, Manifest, bool]
) -> None:
    import webdataset as wds

    path, _, with_json = tar_shard
    got = list(wds.WebDataset(str(path), shardshuffle=False, empty_check=False))
    assert [g["__key__"] for g in got] == [s.key for s in samples]
    for g, s in zip(got, samples, strict=True):
        assert g[s.ext.lower()] == s.data
        assert int(g["cls"]) == s.label
        extra = {"json"} if with_json else set()
        assert set(g) == {"__key__", "__url__", "__local_path__", s.ext.lower(), "cls", *extra}
        if with_json:
            meta = json.loads(g["json"])
            assert meta == {**s.meta, "key": s.key, "label": s.label, "class": CLASSES[s.label]}


def test_webdataset_decodes_the_images(samples: list[Sample], tar_shard: tuple[Path, Manifest, bool]) -> None:
    import webdataset as wds

    path, _, _ = tar_shard
    ds = wds.WebDataset(str(path), shardshuffle=False, empty_check=False).decode("rgb8").to_tuple("__key__", "cls")
    assert [(k, int(c)) for k, c in ds] == [(s.key, s.label) for s in samples]
    ds = wds.WebDataset(str(path), shardshuffle=False, empty_check=False).decode("rgb8")
    for g, s in zip(ds, samples, strict=True):
        expect = np.asarray(Image.open(io.BytesIO(s.data)).convert("RGB"))
        assert np.array_equal(g[s.ext.lower()], expect)


def test_tarfile_sees_deterministic_regular_members(
    samples: list[Sample], tar_shard: tuple[Path, Manifest, bool]
) -> None:
    path, m, with_json = tar_shard
    per = 3 if with_json else 2
    with tarfile.open(path) as t:
        members = t.getmembers()
        assert len(members) == per * len(samples)
        for mem in members:
            assert mem.isreg() and mem.mode == 0o644 and mem.uid == 0 and mem.gid == 0
            assert mem.uname == "" and mem.gname == "" and mem.mtime == 946684800
        for i, s in enumerate(samples):
            img, cls, *js = members[per * i : per * i + per]
            names = [f"{s.key}.{s.ext.lower()}", f"{s.key}.cls", *([f"{s.key}.json"] if with_json else [])]
            assert [img.name, cls.name, *(j.name for j in js)] == names
            f = t.extractfile(img)
            assert f is not None and f.read() == s.data
            # The manifest extent is exactly where tarfile finds the member's data.
            assert (img.offset_data, img.size) == (int(m.shards[0].offsets[i]), int(m.shards[0].sizes[i]))
            assert t.extractfile(cls).read() == str(s.label).encode()  # type: ignore[union-attr]


@pytest.mark.skipif(shutil.which("tar") is None, reason="no tar executable (apt-get install -y tar)")
def test_gnu_tar_extracts_every_file(
    samples: list[Sample], tar_shard: tuple[Path, Manifest, bool], tmp_path: Path
) -> None:
    path, _, with_json = tar_shard
    res = subprocess.run(["tar", "-xf", str(path), "-C", str(tmp_path)], capture_output=True, text=True, check=False)
    assert res.returncode == 0 and res.stderr == "", res.stderr  # no warnings (e.g. implausible mtimes)
    for s in samples:
        assert (tmp_path / f"{s.key}.{s.ext.lower()}").read_bytes() == s.data
        assert (tmp_path / f"{s.key}.cls").read_text() == str(s.label)
    listing = subprocess.run(["tar", "-tvf", str(path)], capture_output=True, text=True, check=True).stdout
    assert listing.count("0/0") == (3 if with_json else 2) * len(samples)


# ---- record -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def record_shard(samples: list[Sample], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Manifest]:
    out = tmp_path_factory.mktemp("record")
    m, _ = write_dataset("record", out, samples)
    (aux,) = m.shards[0].aux
    return out / m.shards[0].name, out / aux.name, m


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def independent_records(path: Path) -> list[tuple[int, int, bytes]]:
    """Parse TFRecord framing with google_crc32c (not stager's crc32c): [(offset, size, payload)]."""
    import google_crc32c

    blob = path.read_bytes()
    pos, out = 0, []
    while pos < len(blob):
        (n,) = struct.unpack_from("<Q", blob, pos)
        (len_crc,) = struct.unpack_from("<I", blob, pos + 8)
        assert _masked(google_crc32c.value(blob[pos : pos + 8])) == len_crc, f"length CRC at {pos}"
        payload = blob[pos + 12 : pos + 12 + n]
        (data_crc,) = struct.unpack_from("<I", blob, pos + 12 + n)
        assert _masked(google_crc32c.value(payload)) == data_crc, f"data CRC at {pos}"
        out.append((pos, 16 + n, payload))
        pos += 16 + n
    assert pos == len(blob)
    return out


def test_record_crcs_and_index_are_correct(record_shard: tuple[Path, Path, Manifest], tmp_path: Path) -> None:
    from tfrecord.tools.tfrecord2idx import create_index

    path, idx, m = record_shard
    records = independent_records(path)
    assert idx.read_text() == "".join(f"{off} {size}\n" for off, size, _ in records)
    create_index(str(path), str(tmp_path / "theirs.idx"))  # the tfrecord package's own indexer
    assert (tmp_path / "theirs.idx").read_bytes() == idx.read_bytes()
    assert len(records) == m.shards[0].samples


def test_protobuf_parses_every_example(samples: list[Sample], record_shard: tuple[Path, Path, Manifest]) -> None:
    from tfrecord import example_pb2

    path, _, m = record_shard
    blob = path.read_bytes()
    for (off, _, payload), s, e_off, e_size in zip(
        independent_records(path), samples, m.shards[0].offsets, m.shards[0].sizes, strict=True
    ):
        ex = example_pb2.Example()
        ex.ParseFromString(payload)
        f = ex.features.feature
        assert sorted(f) == ["image/class/label", "image/class/text", "image/encoded", "image/filename", "image/format"]
        assert list(f["image/encoded"].bytes_list.value) == [s.data]
        assert list(f["image/class/label"].int64_list.value) == [s.label]
        assert list(f["image/class/text"].bytes_list.value) == [CLASSES[s.label].encode()]
        assert list(f["image/filename"].bytes_list.value) == [s.key.encode()]
        assert list(f["image/format"].bytes_list.value) == [b"PNG" if s.ext == "png" else b"JPEG"]
        assert ex.SerializeToString(deterministic=True) == payload  # canonical encoding
        assert off + 12 <= e_off and blob[e_off : e_off + e_size] == s.data


def test_tfrecord_reads_through_our_index(samples: list[Sample], record_shard: tuple[Path, Path, Manifest]) -> None:
    from tfrecord.reader import tfrecord_loader

    path, idx, _ = record_shard
    desc = {"image/encoded": "byte", "image/class/label": "int", "image/filename": "byte", "image/format": "byte"}

    def read(shard: tuple[int, int] | None) -> list[tuple[str, int, bytes]]:
        rows = tfrecord_loader(str(path), str(idx) if shard else None, desc, shard=shard)
        return [
            (bytes(r["image/filename"]).decode(), int(r["image/class/label"][0]), bytes(r["image/encoded"]))
            for r in rows
        ]

    expect = [(s.key, s.label, s.data) for s in samples]
    assert read(None) == expect
    # Index-based sharding (what DALI/tfrecord do per worker) partitions the records exactly.
    parts = [read((i, 3)) for i in range(3)]
    assert [r for p in parts for r in p] == expect and all(parts)


@pytest.mark.slow
def test_tensorflow_reads_record_shard(samples: list[Sample], record_shard: tuple[Path, Path, Manifest]) -> None:
    tf = pytest.importorskip("tensorflow", reason="tensorflow is not installed here (pip install tensorflow-cpu)")
    path, _, _ = record_shard
    spec = {
        "image/encoded": tf.io.FixedLenFeature([], tf.string),
        "image/class/label": tf.io.FixedLenFeature([], tf.int64),
        "image/filename": tf.io.FixedLenFeature([], tf.string),
    }
    got = [tf.io.parse_single_example(r, spec) for r in tf.data.TFRecordDataset(str(path))]  # verifies CRCs
    assert [
        (g["image/filename"].numpy().decode(), int(g["image/class/label"]), g["image/encoded"].numpy()) for g in got
    ] == [(s.key, s.label, s.data) for s in samples]


# ---- the Example codec against protobuf ----------------------------------------------------------
_features = st.dictionaries(
    st.text(max_size=20),
    st.one_of(
        st.builds(lambda v: Feature("bytes", tuple(v)), st.lists(st.binary(max_size=300), max_size=4)),
        st.builds(lambda v: Feature("int64", tuple(v)), st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=5)),
        st.builds(
            lambda v: Feature("float", tuple(v)),
            st.lists(st.floats(width=32, allow_nan=False), max_size=5),
        ),
    ),
    max_size=6,
)


def _pb_example(features: dict[str, Feature]) -> object:
    from tfrecord import example_pb2

    ex = example_pb2.Example()
    for name, f in features.items():
        target = ex.features.feature[name]
        if f.kind == "bytes":
            target.bytes_list.value.extend(f.values)  # type: ignore[arg-type]
        elif f.kind == "int64":
            target.int64_list.value.extend(f.values)  # type: ignore[arg-type]
        else:
            target.float_list.value.extend(f.values)  # type: ignore[arg-type]
    return ex


def _strip_tag_and_length(buf: bytes) -> bytes:
    """The payload of a message whose only content is one LEN field (tag byte + varint length)."""
    pos, shift, n = 1, 0, 0
    while True:
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    assert len(buf) == pos + n
    return buf[pos:]


@settings(max_examples=150, deadline=None)
@given(features=_features)
def test_example_codec_matches_protobuf(features: dict[str, Feature]) -> None:
    """Byte-identical to protobuf with map entries in lexicographic key order (C++ and pure-Python
    protobuf's deterministic order; the upb backend orders keys that prefix each other differently,
    so entries are compared one by one)."""
    ex = _pb_example(features)
    ours, offsets = encode_example(features)
    assert type(ex).FromString(ours) == ex  # type: ignore[attr-defined]
    entries = b"".join(
        _strip_tag_and_length(_pb_example({k: features[k]}).SerializeToString(deterministic=True))  # type: ignore[attr-defined]
        for k in sorted(features)
    )
    assert ours == (b"\x0a" + _varint(len(entries)) + entries if features else b"")
    for name, offs in offsets.items():
        assert [ours[o : o + len(v)] for o, v in zip(offs, features[name].values, strict=True)] == list(
            features[name].values
        )
    # Decoding protobuf's own serialisation gives the same features back.
    decoded = decode_example(ex.SerializeToString())  # type: ignore[attr-defined]
    assert decoded.keys() == features.keys()
    for name, f in features.items():
        assert (decoded[name].kind, decoded[name].values) == (f.kind, f.values)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def test_example_decoder_rejects_garbage_without_overreading() -> None:
    from stager.formats.example_pb import ExampleDecodeError

    good, _ = encode_example({"image/encoded": Feature("bytes", (b"abc" * 10,))})
    for cut in range(len(good)):  # every prefix: a clean ExampleDecodeError or a parse, no IndexError
        with contextlib.suppress(ExampleDecodeError):
            decode_example(good[:cut])
    for bad in (b"\x0a\xff\xff\xff\xff\x0f", b"\x0b", b"\x0a\x05\x0a\x03\x0a\x01", b"\xff" * 11, b"\x00"):
        with pytest.raises(ExampleDecodeError):
            decode_example(bad)
