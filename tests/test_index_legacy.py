"""`stager index` of MXNet RecordIO and LMDB in place, then verify, stage, pack and the loader on them.

Writers: the ``.rec``/``.idx`` files come from tools/datagen.py's RecordIO writer, an implementation
of the documented layout independent of stager's parser (dmlc-core's ``RecordIOWriter`` framing:
magic, ``lrecord = cflag << 29 | length``, a split wherever the data holds the magic at a 4-byte
aligned offset, padding to 4 bytes; ``mx.recordio.pack``'s 24-byte IRHeader ``IfQQ`` and float32
array labels; ``MXIndexedRecordIO``'s ``key\\toffset`` index lines). MXNet itself is not used: 1.9.1
installs only beside numpy<1.24 (docs/index.md). LMDBs are written by liblmdb through py-lmdb, their
values serialised by hand (Caffe ``Datum`` protobufs per caffe.proto) or by ``pickle``.

Invariant for every kind: through the loader every sample comes exactly once with the bytes (or
pixels) and label its writer stored.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stager.cli import main as cli
from stager.formats.lmdb_pages import walk
from stager.index import IndexOptions, index_dataset
from stager.loader import make_loader
from stager.manifest import MANIFEST_NAME, load_manifest
from stager.pack import pack
from stager.shardcheck import verify
from stager.stage import stage
from tests.test_index import read_all
from tools.datagen import (
    RECORDIO_MAGIC,
    caffe_datum,
    jpeg_bytes,
    make_caffe_lmdb,
    make_folder2lmdb,
    png_bytes,
    recordio_frame,
    recordio_pack,
    render_image,
    write_recordio,
)

lmdb = pytest.importorskip("lmdb", reason="lmdb is not installed (pip install 'stager[lmdb]'; make venv does)")
MAGIC = struct.pack("<I", RECORDIO_MAGIC)


def _img(i: int) -> bytes:
    arr = render_image(np.random.default_rng(i), i % 3, 3, 24 + i % 5, 30)
    return png_bytes(arr) if i % 2 else jpeg_bytes(arr)


def _with_comments(jpeg: bytes, texts: list[bytes]) -> bytes:
    """``jpeg`` with COM segments holding ``texts`` right after its SOI marker (still a valid JPEG)."""
    return jpeg[:2] + b"".join(b"\xff\xfe" + struct.pack(">H", len(t) + 2) + t for t in texts) + jpeg[2:]


def write_rec_pair(d: Path) -> dict[str, tuple[bytes, int]]:
    """``a.rec`` + ``a.idx``: an InsightFace-style header record (array label, no payload), a record split
    inside its payload (the magic at an aligned payload offset), one with the magic unaligned (not
    split), array labels, keys 1000...; ``b.rec`` without an ``.idx``, scalar labels (keys: positions).
    Returns key -> truth."""
    truth: dict[str, tuple[bytes, int]] = {}
    recs = [recordio_pack(b"", [7.0, 9.0], 0)]
    for i in range(1, 9):
        payload = _img(i)
        if i == 3:  # two JPEG comments holding the magic at payload bytes 8 and 16: (24 + 8) % 4 == 0
            payload = _with_comments(jpeg_bytes(render_image(np.random.default_rng(i), 0, 3, 20, 20)),
                                     [b"xx" + MAGIC, MAGIC])
        if i == 4:  # the magic at payload byte 9: unaligned, so it stays inside one part
            payload = _with_comments(jpeg_bytes(render_image(np.random.default_rng(i), 1, 3, 20, 20)),
                                     [b"xxx" + MAGIC])
        label: Any = [float(i % 3), 0.25, float(i)] if i % 2 else float(i % 3)
        recs.append(recordio_pack(payload, label, i))
        truth[str(1000 + i)] = (payload, i % 3)
    write_recordio(d / "a.rec", recs, keys=[1000 + i for i in range(len(recs))])
    assert recordio_frame(recs[3]).count(MAGIC) == 3 and recordio_frame(recs[4]).count(MAGIC) == 2  # split in 3
    recs_b = []
    for i in range(100, 106):
        recs_b.append(recordio_pack(_img(i), float(i % 3), i))
        truth[str(i - 100)] = (_img(i), i % 3)
    write_recordio(d / "b.rec", recs_b, idx=False)
    return truth


def test_recordio_in_place_split_records_array_labels_stage_and_pack(tmp_path: Path) -> None:
    truth = write_rec_pair(tmp_path / "rec")
    r = index_dataset(tmp_path / "rec")
    assert (r.kind, r.shards, r.samples) == ("recordio", 2, 14)
    m = load_manifest(tmp_path / "rec")
    a, b = m.shards
    assert (m.format, a.extents, b.extents) == ("recordio", "records", "bytes")  # a.rec holds a split record
    assert [x.name for x in a.aux] == ["a.idx"] and [x.name for x in b.aux] == ["b.idx"]
    # Array labels: every record's label values in the manifest v2 column the `fields` entry names.
    assert [f["column"] for f in m.fields] == ["field/label_values"]
    values = [[float(x) for x in s.columns["field/label_values"][j]] for s in (a, b) for j in range(s.samples)]
    assert values == [[i % 3, 0.25, i] if i % 2 else [i % 3] for i in range(1, 9)] + [[i % 3] for i in range(100, 106)]
    # b.idx, written by the scan as DALI's rec2idx writes it: "<record number>\t<offset of its magic>".
    data = (tmp_path / "rec" / "b.rec").read_bytes()
    starts = [i for i in range(0, len(data), 4) if data[i : i + 4] == MAGIC]
    assert (tmp_path / "rec" / "b.idx").read_text() == "".join(f"{j}\t{o}\n" for j, o in enumerate(starts))
    again = index_dataset(tmp_path / "rec")  # now with b.idx: the same keys, the same manifest
    assert [s.keys for s in load_manifest(tmp_path / "rec").shards] == [a.keys, b.keys] and again.samples == 14
    assert read_all(tmp_path / "rec", staged=False) == truth
    assert verify(tmp_path / "rec", deep=True).ok
    # label_values is an index column, not a sample field: decoding loaders read the set as image + label
    b = next(iter(make_loader(str(tmp_path / "rec"), 4, transform="eval", image_size=8, shuffle=False)))
    assert tuple(b["image"].shape) == (4, 3, 8, 8)
    # Staged per node partition: each node holds whole files with their .idx.
    for node in (0, 1):
        stage(tmp_path / "rec", tmp_path / f"n{node}", partition=True, node=node, num_nodes=2, ranks_per_node=1)
        names = sorted(p.name for p in (tmp_path / f"n{node}").iterdir() if p.suffix in (".rec", ".idx"))
        assert names in (["a.idx", "a.rec"], ["b.idx", "b.rec"])
    stage(tmp_path / "rec", tmp_path / "full")
    assert read_all(tmp_path / "full") == truth
    # --label-offset applies to RecordIO labels as to any integer label.
    index_dataset(tmp_path / "rec", tmp_path / "plus", IndexOptions(label_offset=2))
    assert {k: lab for k, (_, lab) in read_all(tmp_path / "plus", staged=False).items()} == {
        k: lab + 2 for k, (_, lab) in truth.items()}
    # pack converts the .rec files (source: the directory of .rec files, indexed in memory).
    pack(tmp_path / "plus", tmp_path / "tar", format="tar")
    back = read_all(tmp_path / "tar", staged=False)
    assert sorted((d, lab) for d, lab in back.values()) == sorted((d, lab + 2) for d, lab in truth.values())


def _corrupt_magic(d: Path) -> str:
    data = bytearray((d / "a.rec").read_bytes())
    second = data.index(MAGIC, 4)
    data[second] ^= 0xFF
    (d / "a.rec").write_bytes(bytes(data))
    return "record 1 at byte"


def _truncate(d: Path) -> str:
    data = (d / "a.rec").read_bytes()
    (d / "a.rec").write_bytes(data[: len(data) - 37])
    return "truncated"


def _idx_disagrees(d: Path) -> str:
    lines = (d / "a.idx").read_text().splitlines()
    key, off = lines[2].split("\t")
    lines[2] = f"{key}\t{int(off) + 4}"
    (d / "a.idx").write_text("\n".join(lines) + "\n")
    return f"key {key} at byte {int(off) + 4}"


def _idx_misses_one(d: Path) -> str:
    lines = (d / "a.idx").read_text().splitlines()
    (d / "a.idx").write_text("\n".join(lines[:-1]) + "\n")
    return "is not listed"


@pytest.mark.parametrize("damage", [_corrupt_magic, _truncate, _idx_disagrees, _idx_misses_one])
def test_damaged_recordio_is_one_line_exit_3_and_no_manifest(tmp_path: Path, damage: Any,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    write_rec_pair(tmp_path / "rec")
    what = damage(tmp_path / "rec")
    assert cli(["index", str(tmp_path / "rec"), "-q"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and what in err and "a." in err, err
    assert not (tmp_path / "rec" / MANIFEST_NAME).exists()


def test_verify_of_a_damaged_recordio_exits_3(tmp_path: Path) -> None:
    write_rec_pair(tmp_path / "rec")
    index_dataset(tmp_path / "rec")
    assert cli(["verify", "--deep", str(tmp_path / "rec"), "-q"]) == 0
    _corrupt_magic(tmp_path / "rec")  # same size, a header byte changed
    assert cli(["verify", str(tmp_path / "rec"), "-q"]) == 3
    assert cli(["verify", "--deep", str(tmp_path / "rec"), "-q"]) == 3


# ---- LMDB ------------------------------------------------------------------------------------------------
def _lmdb_truth(path: Path, layout: str) -> dict[str, tuple[Any, int]]:
    """key -> (image bytes or (H, W, 3) RGB pixels, label), read with liblmdb and decoded by hand."""
    env = lmdb.open(str(path), readonly=True, lock=False)
    out: dict[str, tuple[Any, int]] = {}
    with env.begin() as txn:
        for k, v in txn.cursor():
            if k in (b"__keys__", b"__len__"):
                continue
            if layout == "pickle":
                img, lab = pickle.loads(v)
                out[k.decode()] = (img, lab)
                continue
            fields, _ = _pb_fields(v)
            if fields.get(7):
                out[k.decode()] = (fields[4], fields[5])
            else:
                c, h, w = fields[1], fields[2], fields[3]
                bgr = np.frombuffer(fields[4], np.uint8).reshape(c, h, w).transpose(1, 2, 0)
                out[k.decode()] = (np.ascontiguousarray(bgr[..., ::-1]), fields[5])
    env.close()
    return out


def _pb_fields(v: bytes) -> tuple[dict[int, Any], int]:
    fields: dict[int, Any] = {}
    pos = 0

    def varint() -> int:
        nonlocal pos
        x = shift = 0
        while True:
            b = v[pos]
            pos += 1
            x |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return x

    while pos < len(v):
        tag = varint()
        if tag & 7 == 0:
            fields[tag >> 3] = varint()
        else:
            n = varint()
            fields[tag >> 3] = v[pos : pos + n]
            pos += n
    return fields, pos


@pytest.mark.parametrize("layout", ["caffe", "pickle"])
def test_encoded_lmdb_read_only_with_out_stage_and_verify(tmp_path: Path, layout: str) -> None:
    src = tmp_path / "db"
    if layout == "caffe":
        make_caffe_lmdb(src, 40, size=24, png=False)
    else:
        make_folder2lmdb(src, 40, size=24)
    truth = _lmdb_truth(src, layout)
    os.chmod(src, 0o555)  # someone else's read-only LMDB: --out
    try:
        r = index_dataset(src, tmp_path / "idx")
    finally:
        os.chmod(src, 0o755)
    assert (r.kind, r.shards, r.samples) == ("lmdb", 1, 40)
    m = load_manifest(tmp_path / "idx")
    assert m.options["index"]["layout"] == "auto" and m.sample_kind == "encoded"
    assert [s.name for s in m.shards] == ["data.mdb"]  # lock.mdb is not data
    assert read_all(tmp_path / "idx", staged=False) == truth
    assert verify(tmp_path / "idx", deep=True).ok
    res = stage(tmp_path / "idx", tmp_path / "dest")
    assert res.files_copied == 1 and sorted(p.name for p in (tmp_path / "dest").iterdir() if p.suffix == ".mdb") == [
        "data.mdb"]
    assert read_all(tmp_path / "dest") == truth
    # The staged data.mdb alone is still an LMDB liblmdb opens read-only without a lock file.
    env = lmdb.open(str(tmp_path / "dest" / "data.mdb"), subdir=False, readonly=True, lock=False)
    assert env.stat()["entries"] == len(truth) + (2 if layout == "pickle" else 0)
    env.close()


@pytest.mark.parametrize("size", [16, 32])  # 16: values inside leaf pages; 32: one overflow page each
def test_raw_datums_decode_to_rgb_and_pack_to_zarr(tmp_path: Path, size: int) -> None:
    make_caffe_lmdb(tmp_path / "raw", 30, size=size, raw=True)
    truth = _lmdb_truth(tmp_path / "raw", "caffe")
    index_dataset(tmp_path / "raw", options=IndexOptions(lmdb_layout="caffe", label_offset=1))
    m = load_manifest(tmp_path / "raw")
    assert (m.sample_kind, m.image_shape) == ("decoded", (size, size, 3))
    assert (np.asarray(m.shards[0].columns["shape"]) == [3, size, size]).all()
    got = {}
    for b in make_loader(str(tmp_path / "raw"), batch_size=7, transform=None, staged=False):
        for k, img, lab in zip(b["key"], b["image"].permute(0, 2, 3, 1).numpy(), b["label"].tolist(), strict=True):
            got[k] = (img, lab)
    assert sorted(got) == sorted(truth)
    for k, (img, lab) in truth.items():
        assert np.array_equal(got[k][0], img) and got[k][1] == lab + 1, k
    assert verify(tmp_path / "raw", deep=True).ok
    stage(tmp_path / "raw", tmp_path / "dest", unpack="also")  # raw pixels unpack as PNG files
    from PIL import Image

    pngs = sorted((tmp_path / "dest" / "unpacked").rglob("*.png"))
    assert len(pngs) == 30
    assert sorted(np.asarray(Image.open(p)).tobytes() for p in pngs) == sorted(v[0].tobytes() for v in truth.values())
    pack(tmp_path / "raw", tmp_path / "zarr", format="zarr")
    zm = load_manifest(tmp_path / "zarr")
    assert (zm.format, zm.image_shape, zm.num_samples) == ("zarr", (size, size, 3), 30)
    zgot = [img for b in make_loader(str(tmp_path / "zarr"), batch_size=30, transform=None, shuffle=False,
                                     staged=False) for img in b["image"].permute(0, 2, 3, 1).numpy()]
    assert sorted(x.tobytes() for x in zgot) == sorted(v[0].tobytes() for v in truth.values())


def test_page_walk_equals_liblmdb_over_overflow_pages_deletes_and_deep_trees(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    env = lmdb.open(str(tmp_path / "db"), map_size=1 << 30)
    with env.begin(write=True) as txn:
        for i in range(6000):
            size = int(rng.choice([0, 7, 300, 2100, 4090, 5000, 70000]))
            txn.put(b"%06d/%s" % (i, b"k" * int(rng.integers(0, 200))), rng.bytes(size))
    with env.begin(write=True) as txn:
        cur = txn.cursor()
        cur.first()
        for j in range(0, 900):
            if j % 3 == 0:
                cur.delete()
            else:
                cur.next()
    env.close()
    env = lmdb.open(str(tmp_path / "db"), readonly=True, lock=False)
    with env.begin() as txn:
        ref = list(txn.cursor())
        depth = env.stat()["depth"]
    env.close()
    data = (tmp_path / "db" / "data.mdb").read_bytes()
    got = list(walk(memoryview(data), "data.mdb"))
    assert depth >= 3 and len(got) == len(ref)
    assert all(k == rk and data[o : o + n] == rv for (k, o, n), (rk, rv) in zip(got, ref, strict=True))


def _truncated_mdb(d: Path) -> str:
    data = (d / "data.mdb").read_bytes()
    (d / "data.mdb").write_bytes(data[: len(data) // 2])
    return "data.mdb"


def _not_lmdb(d: Path) -> str:
    (d / "data.mdb").write_bytes(os.urandom(3 * 4096))
    return "not an LMDB"


def _datum_size_mismatch(d: Path) -> str:
    env = lmdb.open(str(d), map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.put(b"00000003_bad.JPEG", caffe_datum(b"\x01" * 40, 1, (3, 4, 4)))
    env.close()
    return "00000003_bad.JPEG"


@pytest.mark.parametrize("damage", [_truncated_mdb, _not_lmdb, _datum_size_mismatch])
def test_damaged_lmdb_is_one_line_exit_3_and_no_manifest(tmp_path: Path, damage: Any,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    make_caffe_lmdb(tmp_path / "db", 60, size=24, raw=True)
    what = damage(tmp_path / "db")
    assert cli(["index", str(tmp_path / "db"), "--out", str(tmp_path / "idx"), "-q"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and what in err and "data.mdb" in err, err
    assert not (tmp_path / "idx" / MANIFEST_NAME).exists()


def test_lmdb_verify_exit_3_wrong_layout_and_missing_extra(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_folder2lmdb(tmp_path / "db", 12, size=16)
    assert cli(["index", str(tmp_path / "db"), "--lmdb-layout", "caffe", "-q"]) == 3
    assert "--lmdb-layout" in capsys.readouterr().err
    index_dataset(tmp_path / "db")
    with open(tmp_path / "db" / "data.mdb", "r+b") as f:  # a value's byte flipped in place
        m = load_manifest(tmp_path / "db")
        f.seek(int(m.shards[0].offsets[3]))
        f.write(b"\x00")
    assert cli(["verify", str(tmp_path / "db"), "-q"]) == 3
    # Without py-lmdb: the usual one-line hint naming the extra, exit 2.
    block = tmp_path / "block"
    block.mkdir()
    (block / "lmdb.py").write_text("raise ImportError('py-lmdb is not installed here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(block), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "stager", "index", str(tmp_path / "db"), "--out", str(tmp_path / "o"),
                        "-q"], env=env, capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 2 and "pip install lmdb" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_collective_stage_of_recordio_and_lmdb(tmp_path: Path) -> None:
    """Two ranks stage an indexed .rec pair and an LMDB collectively (each byte read from SRC once)."""
    truth = write_rec_pair(tmp_path / "rec")
    index_dataset(tmp_path / "rec", tmp_path / "ri")
    make_caffe_lmdb(tmp_path / "db", 20, size=16)
    index_dataset(tmp_path / "db", tmp_path / "li")
    for idx, want in (("ri", truth), ("li", _lmdb_truth(tmp_path / "db", "caffe"))):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for i in range(2):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(i), WORLD_SIZE="2",
                       LOCAL_WORLD_SIZE="1")
            procs.append(subprocess.Popen([sys.executable, "-m", "stager", "stage", str(tmp_path / idx),
                                           str(tmp_path / f"{idx}{i}"), "--collective", "--timeout", "30", "-q"],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for p in procs:
            _, se = p.communicate(timeout=120)
            assert p.returncode == 0, se
        for i in range(2):
            assert read_all(tmp_path / f"{idx}{i}", staged=False) == want


# ---- cross-check with MXNet itself (slow: builds its own venv once) -----------------------------------------
MX_VENV = Path(os.environ.get("STAGER_MXNET_VENV", Path.home() / ".cache" / "stager-tests" / "mxnet-1.9.1"))
MX_WRITE = r"""
import json, sys
import mxnet as mx
out = sys.argv[1]
magic = (0xced7230a).to_bytes(4, "little")
w = mx.recordio.MXIndexedRecordIO(out + "/w.idx", out + "/w.rec", "w")
p = mx.recordio.MXRecordIO(out + "/p.rec", "w")
truth = []
for i in range(12):
    payload = bytes(range(i, i + 40)) + (magic * 2 if i % 4 == 1 else b"") + (magic if i % 4 == 2 else b"") + b"x" * i
    label = [float(i % 3), 1.5, float(i)] if i % 3 == 0 else float(i % 3)
    s = mx.recordio.pack(mx.recordio.IRHeader(0, label, i, 0), payload)
    w.write_idx(i, s)
    p.write(s)
    truth.append([payload.hex(), i % 3])
w.close(); p.close()
json.dump(truth, open(out + "/truth.json", "w"))
"""
MX_READ = r"""
import sys
import mxnet as mx
r = mx.recordio.MXIndexedRecordIO(sys.argv[1] + "/p.idx", sys.argv[1] + "/p.rec", "r")
print(",".join(mx.recordio.unpack(r.read_idx(k))[1].hex() for k in sorted(r.keys)))
"""


def _mx_python() -> Path:
    py = MX_VENV / "bin" / "python"
    if not py.exists():
        try:
            subprocess.run([sys.executable, "-m", "venv", str(MX_VENV)], check=True, timeout=300)
            subprocess.run([str(py), "-m", "pip", "install", "-q", "mxnet==1.9.1", "numpy<1.24"], check=True,
                           timeout=600, capture_output=True)
        except (subprocess.SubprocessError, OSError) as exc:
            import shutil

            shutil.rmtree(MX_VENV, ignore_errors=True)
            pytest.skip(f"cannot build an mxnet 1.9.1 venv here ({exc})")
    if subprocess.run([str(py), "-c", "import mxnet"], capture_output=True, check=False).returncode:
        pytest.skip(f"mxnet does not import in {MX_VENV}")
    return py


@pytest.mark.slow
def test_files_written_by_mxnet_itself(tmp_path: Path) -> None:
    """``mx.recordio`` writes .rec/.idx pairs (split records, array labels); stager indexes them, and MXNet
    reads a .rec through the .idx stager wrote for it."""
    import json

    py = _mx_python()
    subprocess.run([str(py), "-c", MX_WRITE, str(tmp_path)], check=True, timeout=120)
    truth = [(bytes.fromhex(h), lab) for h, lab in json.loads((tmp_path / "truth.json").read_text())]
    (tmp_path / "truth.json").unlink()
    index_dataset(tmp_path)
    m = load_manifest(tmp_path)
    assert [s.extents for s in m.shards] == ["records", "records"]  # both hold split records
    assert [x.name for s in m.shards for x in s.aux] == ["p.idx", "w.idx"]
    assert sorted(read_all(tmp_path, staged=False).values()) == sorted(truth * 2)
    assert (tmp_path / "p.idx").read_bytes() == (tmp_path / "w.idx").read_bytes()  # as MXIndexedRecordIO wrote
    got = subprocess.run([str(py), "-c", MX_READ, str(tmp_path)], check=True, capture_output=True, text=True)
    assert got.stdout.strip().split(",") == [d.hex() for d, _ in truth]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=64), st.lists(st.integers(0, 15), max_size=4),
                          st.lists(st.floats(-1e6, 1e6, width=32), max_size=3)), min_size=1, max_size=6))
def test_recordio_walk_joins_what_the_writer_split(records: list[tuple[bytes, list[int], list[float]]]) -> None:
    """Any payload, with the magic inserted at aligned and unaligned offsets, any array labels: the
    walk finds every record, and the joined payload and labels are what was packed."""
    from stager.formats.recordio import join_record, walk_records

    blobs, want = [], []
    for base, spots, labels in records:
        payload = bytearray(base)
        for s in spots:
            at = min(s, len(payload))
            payload[at:at] = MAGIC
        packed = recordio_pack(bytes(payload), labels or 2.0, len(blobs))
        blobs.append(recordio_frame(packed))
        want.append((bytes(payload), labels or None))
    data = b"".join(blobs)
    entries = walk_records(memoryview(data), "x.rec")
    assert len(entries) == len(want)
    for e, (payload, labels) in zip(entries, want, strict=True):
        assert join_record(data[e.start : e.end], "x.rec") == payload
        if e.payload is not None:
            assert data[e.payload[0] : e.payload[0] + e.payload[1]] == payload
        assert e.labels == (None if labels is None else [float(np.float32(x)) for x in labels])


def test_raw_datums_of_several_shapes_keep_theirs_in_the_shape_column(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "db"), map_size=1 << 30)
    truth = {}
    with env.begin(write=True) as txn:
        for i in range(12):
            h, w = (8, 12) if i % 3 else (20, 6)
            rgb = render_image(np.random.default_rng(i), i % 2, 2, h, w)
            txn.put(b"%08d_x" % i, caffe_datum(np.ascontiguousarray(rgb[..., ::-1].transpose(2, 0, 1)).tobytes(),
                                               i % 2, (3, h, w)))
            truth[f"{i:08d}_x"] = rgb
    env.close()
    index_dataset(tmp_path / "db")
    m = load_manifest(tmp_path / "db")
    assert (m.sample_kind, m.image_shape) == ("decoded", None)
    from stager.formats import get_format

    r = get_format("lmdb").open_reader(str(tmp_path / "db" / "data.mdb"), m.shards[0], m)
    got = r.read(np.arange(12))
    assert all(np.array_equal(got[j], truth[k]) for j, k in enumerate(m.shards[0].keys))
    crops = [x for b in make_loader(str(tmp_path / "db"), batch_size=4, transform="eval", image_size=6,
                                    staged=False) for x in b["image"]]
    assert len(crops) == 12 and all(tuple(c.shape) == (3, 6, 6) for c in crops)


def test_subdir_false_lmdb_file_and_pickle_layout_forced(tmp_path: Path) -> None:
    """``lmdb.open(path, subdir=False)`` keeps the environment in one file (``x.lmdb`` + ``x.lmdb-lock``)."""
    env = lmdb.open(str(tmp_path / "faces.lmdb"), subdir=False, map_size=1 << 28)
    truth = {}
    with env.begin(write=True) as txn:
        for i in range(9):
            img = _img(i)
            txn.put(b"%d" % i, pickle.dumps((img, i % 4), protocol=4))
            truth[str(i)] = (img, i % 4)
    env.close()
    assert (tmp_path / "faces.lmdb-lock").exists()
    r = index_dataset(tmp_path, tmp_path / "idx", IndexOptions(lmdb_layout="pickle"))
    assert (r.kind, r.shards) == ("lmdb", 1)
    assert load_manifest(tmp_path / "idx").options["index"]["layout"] == "pickle"
    assert read_all(tmp_path / "idx", staged=False) == truth
