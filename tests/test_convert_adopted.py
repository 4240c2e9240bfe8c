"""Every set ``stager index`` adopts converts to every stager format from the command line, fields included.

Sources: webdataset tars (``ShardWriter``), TFRecords in the TF Object Detection API's keys, parquet
(image, mask, boxes and box_labels columns), MXNet RecordIO (a ``.rec`` file and a directory of them)
and Caffe LMDBs (encoded and raw Datums). The first three are adopted with ``stager index`` and then
packed from their directory; RecordIO and LMDB are packed straight from the file or environment
(indexed in memory). The invariant, for each source and each of tar/hdf5/record/zarr: reading the
output back gives every sample exactly once with its label, its pixels and its fields (masks as
arrays, boxes and box labels) as the source holds them. Images are PNGs of one size, so pixels
compare exactly in every format (zarr stores them decoded). Each sample's label is its number, so a
sample is found by its label whatever key a format gives it.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stager.cli import main as stager_main
from stager.manifest import Manifest, load_manifest
from stager.pack.sources import PackSource
from tools.datagen import caffe_datum, png_bytes, recordio_pack, render_shapes, write_recordio

N = 6
SIZE = 40
FORMATS = ("tar", "hdf5", "record", "zarr")
SOURCES = ("wds", "tfrecord", "parquet", "recordio-file", "recordio-dir", "lmdb-encoded", "lmdb-raw")
WITH_FIELDS = {"wds", "tfrecord", "parquet"}


def _truth(seed: int = 11) -> list[dict[str, Any]]:
    """N samples: an RGB image, its class-id mask, boxes (xyxy pixels) and their labels; label = number."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(N):
        img, mask, boxes, labels = render_shapes(rng, SIZE, SIZE)
        out.append({"label": i, "image": img, "png": png_bytes(img), "mask": mask, "mask_png": png_bytes(mask),
                    "boxes": np.asarray(boxes, np.float32).reshape(-1, 4), "box_labels": labels})
    return out


def _write_wds(d: Path, truth: list[dict[str, Any]]) -> None:
    import webdataset as wds

    d.mkdir()
    with wds.ShardWriter(str(d / "shard-%06d.tar"), maxcount=4, verbose=0) as w:
        for t in truth:
            w.write({"__key__": f"s{t['label']:04d}", "png": t["png"], "cls": str(t["label"]),
                     "mask.png": t["mask_png"], "boxes.json": json.dumps(t["boxes"].tolist()),
                     "box_labels.json": json.dumps(t["box_labels"])})


def _write_tfrecord(d: Path, truth: list[dict[str, Any]]) -> None:
    from tfrecord import TFRecordWriter

    d.mkdir()
    for part, rows in enumerate((truth[:4], truth[4:])):
        w = TFRecordWriter(str(d / f"train-{part:05d}-of-00002"))  # TensorFlow's suffix-less names
        for t in rows:
            b = t["boxes"].astype(np.float64) / SIZE
            w.write({"image/encoded": (t["png"], "byte"), "image/format": (b"png", "byte"),
                     "image/height": (SIZE, "int"), "image/width": (SIZE, "int"),
                     "image/filename": (f"img{t['label']}.png".encode(), "byte"),
                     "image/class/label": (t["label"], "int"),
                     "image/object/bbox/xmin": (b[:, 0].tolist(), "float"),
                     "image/object/bbox/ymin": (b[:, 1].tolist(), "float"),
                     "image/object/bbox/xmax": (b[:, 2].tolist(), "float"),
                     "image/object/bbox/ymax": (b[:, 3].tolist(), "float"),
                     "image/object/class/label": (t["box_labels"], "int"),
                     "image/segmentation/class/encoded": (t["mask_png"], "byte"),
                     "image/segmentation/class/format": (b"png", "byte")})
        w.close()


def _write_parquet(d: Path, truth: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir()
    t = pa.table({"image": pa.array([x["png"] for x in truth], pa.binary()),
                  "label": [x["label"] for x in truth],
                  "mask": pa.array([x["mask_png"] for x in truth], pa.binary()),
                  "boxes": [x["boxes"].tolist() for x in truth], "box_labels": [x["box_labels"] for x in truth]})
    pq.write_table(t.slice(0, 3), d / "a.parquet", compression="none")
    # b: images snappy-compressed (read by rows through pyarrow); byte fields must be stored plain
    pq.write_table(t.slice(3), d / "b.parquet", compression={"image": "snappy", "label": "snappy", "mask": "none",
                                                             "boxes": "snappy", "box_labels": "snappy"})


def _write_recordio(d: Path, truth: list[dict[str, Any]], split: bool) -> Path:
    records = [recordio_pack(t["png"], float(t["label"]), t["label"]) for t in truth]
    if not split:
        return write_recordio(d / "train.rec", records)
    write_recordio(d / "a.rec", records[:2])
    write_recordio(d / "b.rec", records[2:], idx=False)
    return d


def _write_lmdb(d: Path, truth: list[dict[str, Any]], raw: bool) -> Path:
    import lmdb

    env = lmdb.open(str(d), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for t in truth:
            key = f"{t['label']:08d}_img{t['label']}.png".encode()
            if raw:  # convert_imageset without --encoded: planar BGR (C, H, W)
                planar = np.ascontiguousarray(t["image"][..., ::-1].transpose(2, 0, 1))
                value = caffe_datum(planar.tobytes(), t["label"], (3, SIZE, SIZE))
            else:
                value = caffe_datum(t["png"], t["label"])
            txn.put(key, value)
    env.close()
    return d


def cli(*args: Any) -> int:
    """``stager ARGS`` in this process (the command line's own parsing, errors and exit codes)."""
    return stager_main([str(a) for a in args])


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each source's path (adopted where ``stager index`` is the way in) and the truth they all hold."""
    root = tmp_path_factory.mktemp("adopted")
    truth = _truth()
    paths: dict[str, Path] = {}
    for name, write in (("wds", _write_wds), ("tfrecord", _write_tfrecord), ("parquet", _write_parquet)):
        write(root / name, truth)
        assert cli("index", root / name, "-q") == 0, name
        paths[name] = root / name
    paths["recordio-file"] = _write_recordio(root / "rec1", truth, split=False)
    paths["recordio-dir"] = _write_recordio(root / "rec2", truth, split=True)
    paths["lmdb-encoded"] = _write_lmdb(root / "lmdb-enc", truth, raw=False)
    paths["lmdb-raw"] = _write_lmdb(root / "lmdb-raw", truth, raw=True)
    return {"paths": paths, "truth": truth}


def _decode(data: Any) -> np.ndarray:
    from PIL import Image

    if isinstance(data, np.ndarray):
        return data
    with Image.open(io.BytesIO(bytes(data))) as im:
        return np.asarray(im)


def read_back(out: Path) -> tuple[Manifest, dict[int, dict[str, Any]]]:
    """Every sample of the pack at ``out`` by label: its image (decoded) and its fields, through the
    format's own reader (byte fields at their extents, ragged ones from the index)."""
    src = PackSource(out)
    try:
        samples = src.load_many(src.refs)
    finally:
        src.close()
    got: dict[int, dict[str, Any]] = {}
    for s in samples:
        assert not isinstance(s, BaseException), s
        assert s.label not in got, f"label {s.label} twice"
        got[s.label] = {"image": _decode(s.data), **s.fields}
    return src.manifest, got


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("source", SOURCES)
def test_every_adopted_source_converts_to_every_format(sources: dict[str, Any], tmp_path: Path, source: str,
                                                      fmt: str) -> None:
    out = tmp_path / "out"
    assert cli("pack", sources["paths"][source], out, "--format", fmt, "--shard-size", "64KiB", "-q") == 0
    m, got = read_back(out)
    truth = sources["truth"]
    assert sorted(got) == [t["label"] for t in truth]
    assert m.num_samples == N and m.format == fmt
    names = {f["name"] for f in m.fields}
    assert names == ({"mask", "boxes", "box_labels"} if source in WITH_FIELDS else set()), m.fields
    for t in truth:
        g = got[t["label"]]
        np.testing.assert_array_equal(g["image"], t["image"], err_msg=f"{source}->{fmt}: image {t['label']}")
        if source not in WITH_FIELDS:
            continue
        np.testing.assert_array_equal(_decode(g["mask"]), t["mask"], err_msg=f"{source}->{fmt}: mask")
        np.testing.assert_allclose(np.asarray(g["boxes"]).reshape(-1, 4), t["boxes"], atol=1e-3)
        assert np.asarray(g["box_labels"]).tolist() == t["box_labels"]


@pytest.mark.parametrize("source, fmt", [("recordio-file", "tar"), ("lmdb-raw", "zarr"), ("lmdb-encoded", "record")])
def test_pack_from_recordio_and_lmdb_as_a_command(sources: dict[str, Any], tmp_path: Path, source: str,
                                                  fmt: str) -> None:
    """``stager pack train.rec OUT`` (and an LMDB) as a user runs it: exit 0, one JSON result, a pack
    that verifies, and the provenance names the adopted container."""
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "stager", "pack", str(sources["paths"][source]), str(out),
                        "--format", fmt, "--json"], capture_output=True, text=True, timeout=240, check=False)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["ok"] and res["samples"] == N
    m = load_manifest(out)
    assert m.source["kind"] in ("recordio", "lmdb") and m.source["format"] == m.source["kind"]
    v = subprocess.run([sys.executable, "-m", "stager", "verify", str(out), "--deep"], capture_output=True,
                       text=True, timeout=240, check=False)
    assert v.returncode == 0, v.stderr


def test_an_internal_invariant_is_not_reported_as_the_users_error() -> None:
    """A manifest serialised before its sample index is a bug in the caller: a RuntimeError, never a
    StagerError the command line would print as a one-line complaint about the user's data."""
    from stager.errors import StagerError
    from stager.manifest import ShardInfo

    m = Manifest(format="tar", classes=[], shards=[ShardInfo("a.tar", 10, "0" * 32, ["k"], np.zeros(1),
                                                           np.zeros(1), np.ones(1))])
    with pytest.raises(RuntimeError, match="internal error") as exc:
        m.to_bytes()
    assert not isinstance(exc.value, StagerError)
