"""`stager index` adopts multi-field sets in place (issue 21, docs/fields.md "stager index"): webdataset
tars with several members per key, TFRecords in the TF Object Detection API keys, parquet with
several columns, all written by their own libraries; the fields load through make_loader and
`verify --deep` compares them on a re-scan."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stager.index import IndexOptions, index_dataset
from stager.index.api import rescan_shard
from stager.loader import make_loader
from stager.loader.fields import eval_geometry
from stager.manifest import Ragged, ShardInfo, load_manifest
from stager.pack.api import pack
from stager.shardcheck import verify
from tools.datagen import make_shapes

FIELDS = "mask:mask,boxes:boxes,box_labels:box_labels"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shapes(tmp_path_factory.mktemp("shapes"), train=12, val=2, size=48, seed=5)


def _rows(shapes: Path) -> list[dict]:
    return [json.loads(line) for line in (shapes / "train.jsonl").read_text().splitlines()]


def _check_loader(root: Path, n: int, *, mask: bool = True) -> None:
    """Every sample once with its fields; masks follow the crop, per-box lists stay aligned."""
    seen = 0
    names = ["mask", "boxes", "box_labels"] if mask else ["boxes", "box_labels"]
    for b in make_loader(str(root), 4, transform="train", image_size=32, fields=names, drop_last=False,
                         shuffle=False):
        seen += len(b["key"])
        if mask:
            assert tuple(b["mask"].shape) == (len(b["key"]), 32, 32)
        assert len(b["boxes"]) == len(b["key"])
        for bx, lb in zip(b["boxes"], b["box_labels"], strict=True):
            assert bx.shape[0] == lb.shape[0] and (np.asarray(bx) >= 0).all() and (np.asarray(bx) <= 32).all()
    assert seen == n


def test_webdataset_tar_with_several_members_per_key(shapes: Path, tmp_path: Path) -> None:
    import webdataset as wds

    d = tmp_path / "wds"
    d.mkdir()
    rows = _rows(shapes)
    with wds.ShardWriter(str(d / "shard-%06d.tar"), maxcount=5, verbose=0) as w:
        for i, r in enumerate(rows):
            w.write({"__key__": f"s{i:04d}", "jpg": (shapes / r["path"]).read_bytes(), "cls": str(i % 3),
                     "mask.png": (shapes / r["mask"]).read_bytes(), "boxes.json": json.dumps(r["boxes"]),
                     "json": json.dumps({"box_labels": r["box_labels"], "boxes": r["boxes"], "id": i})})
    res = index_dataset(d)
    m = load_manifest(res.manifest_path)
    assert [(f["name"], f["kind"]) for f in m.fields] == [("box_labels", "box_labels"), ("boxes", "boxes"),
                                                          ("mask", "mask"), ("meta", "json")]
    cols = m.extra_columns()
    data = {p.name: p.read_bytes() for p in d.glob("*.tar")}
    for i, r in enumerate(rows):
        np.testing.assert_allclose(cols["field/boxes"][i], np.asarray(r["boxes"], np.float32).reshape(-1, 4))
        assert cols["field/box_labels"][i].tolist() == r["box_labels"]
        shard = m.shards[i // 5]
        o, s = int(cols["field/mask/offset"][i]), int(cols["field/mask/size"][i])
        assert data[shard.name][o : o + s] == (shapes / r["mask"]).read_bytes()
    assert verify(d, deep=True).ok
    # verify --deep's re-scan compares the field columns: an index whose boxes differ from the shard's
    info = m.shards[0]
    cols = dict(info.columns)
    boxes = cols["field/boxes"]
    assert isinstance(boxes, Ragged)
    cols["field/boxes"] = Ragged(boxes.values + 1, boxes.starts)
    tampered = ShardInfo(info.name, info.bytes, info.hash, list(info.keys), info.labels, info.offsets, info.sizes,
                         columns=cols)
    assert rescan_shard(str(d / info.name), info, m) is None
    assert "field/boxes differs" in (rescan_shard(str(d / info.name), tampered, m) or "")
    _check_loader(d, len(rows))
    b = next(iter(make_loader(str(d), 3, transform="eval", image_size=32, fields=["meta"], shuffle=False)))
    assert [x["id"] for x in b["meta"]] == [0, 1, 2]
    pack(d, tmp_path / "conv", "record")  # an adopted set converts with its fields
    conv = load_manifest(tmp_path / "conv" / "manifest.json")
    assert conv.fields == m.fields
    _check_loader(tmp_path / "conv", len(rows))


def test_tar_sample_lacking_a_field_is_one_line(shapes: Path, tmp_path: Path) -> None:
    import webdataset as wds

    d = tmp_path / "wds"
    d.mkdir()
    rows = _rows(shapes)[:3]
    with wds.TarWriter(str(d / "a.tar")) as w:
        for i, r in enumerate(rows):
            sample = {"__key__": f"s{i}", "jpg": (shapes / r["path"]).read_bytes(), "cls": "1"}
            if i != 1:
                sample["mask.png"] = (shapes / r["mask"]).read_bytes()
            w.write(sample)
    p = subprocess.run([sys.executable, "-m", "stager", "index", str(d)], check=False, capture_output=True,
                       text=True)
    assert p.returncode == 3, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "a.tar" in lines[0] and "'s1'" in lines[0] and "same fields" in lines[0]
    assert not (d / "manifest.json").exists()
    # --no-fields indexes images and labels only (a set whose extra members are not fields)
    p = subprocess.run([sys.executable, "-m", "stager", "index", str(d), "--no-fields", "--json"], check=False,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    m = load_manifest(d / "manifest.json")
    assert m.fields == [] and m.num_samples == 3 and verify(d, deep=True).ok


def test_tfrecords_in_object_detection_api_keys(shapes: Path, tmp_path: Path) -> None:
    from PIL import Image
    from tfrecord import TFRecordWriter

    d = tmp_path / "tfr"
    d.mkdir()
    rows = _rows(shapes)
    w = TFRecordWriter(str(d / "train.tfrecord"))
    for i, r in enumerate(rows):
        img = (shapes / r["path"]).read_bytes()
        with Image.open(shapes / r["path"]) as im:
            wd, ht = im.size
        bx = np.asarray(r["boxes"], np.float64).reshape(-1, 4)
        w.write({"image/encoded": (img, "byte"), "image/format": (b"jpeg", "byte"),
                 "image/height": (ht, "int"), "image/width": (wd, "int"),
                 "image/filename": (f"img{i}.jpg".encode(), "byte"),
                 "image/object/bbox/xmin": ((bx[:, 0] / wd).tolist(), "float"),
                 "image/object/bbox/ymin": ((bx[:, 1] / ht).tolist(), "float"),
                 "image/object/bbox/xmax": ((bx[:, 2] / wd).tolist(), "float"),
                 "image/object/bbox/ymax": ((bx[:, 3] / ht).tolist(), "float"),
                 "image/object/class/label": (r["box_labels"], "int"),
                 "image/object/difficult": ([0] * len(bx), "int"),
                 "image/segmentation/class/encoded": ((shapes / r["mask"]).read_bytes(), "byte"),
                 "image/segmentation/class/format": (b"png", "byte")})
    w.close()
    m = load_manifest(index_dataset(d, options=IndexOptions(label_key="none")).manifest_path)
    specs = {f["name"]: f for f in m.fields}
    assert specs["boxes"]["kind"] == "boxes" and specs["box_labels"]["kind"] == "box_labels"
    assert specs["mask"] == {"name": "mask", "kind": "mask", "ext": "png"}
    assert specs["difficult"]["kind"] == "per_box" and specs["difficult"]["dtype"] == "int64"
    cols = m.extra_columns()
    raw = (d / "train.tfrecord").read_bytes()
    for i, r in enumerate(rows):
        np.testing.assert_allclose(cols["field/boxes"][i], np.asarray(r["boxes"], np.float32).reshape(-1, 4),
                                   atol=1e-3)
        assert cols["field/box_labels"][i].tolist() == r["box_labels"]
        o, s = int(cols["field/mask/offset"][i]), int(cols["field/mask/size"][i])
        assert raw[o : o + s] == (shapes / r["mask"]).read_bytes()
    assert verify(d, deep=True).ok
    _check_loader(d, len(rows))


def test_indexing_stagers_own_record_pack_gives_its_schema(shapes: Path, tmp_path: Path) -> None:
    """Adopting the record shards that `stager pack` wrote gives the pack's own field columns."""
    packed = tmp_path / "packed"
    pack(shapes / "train.jsonl", packed, "record", fields=FIELDS, samples_per_shard=5)
    src = tmp_path / "copy"
    src.mkdir()
    for p in packed.glob("*.tfrecord"):
        shutil.copy(p, src / p.name)
    mine = load_manifest(packed / "manifest.json")
    adopted = load_manifest(index_dataset(src, options=IndexOptions(label_key="none")).manifest_path)
    assert {f["name"]: f["kind"] for f in adopted.fields} == {f["name"]: f["kind"] for f in mine.fields}
    a, b = adopted.extra_columns(), mine.extra_columns()
    order = {k: i for i, k in enumerate(mine.keys)}
    idx = np.array([order[k] for k in adopted.keys])
    np.testing.assert_array_equal(np.asarray(a["field/mask/offset"]), np.asarray(b["field/mask/offset"])[idx])
    for i, j in enumerate(idx):
        np.testing.assert_allclose(a["field/boxes"][i], b["field/boxes"][j], atol=1e-3)
        assert a["field/box_labels"][i].tolist() == b["field/box_labels"][j].tolist()


def test_parquet_with_several_columns(shapes: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "pq"
    d.mkdir()
    rows = _rows(shapes)
    t = pa.table({"image": pa.array([(shapes / r["path"]).read_bytes() for r in rows], pa.binary()),
                  "mask": pa.array([(shapes / r["mask"]).read_bytes() for r in rows], pa.binary()),
                  "boxes": [r["boxes"] for r in rows], "box_labels": [r["box_labels"] for r in rows],
                  "caption": [f"row {i}" for i in range(len(rows))]})
    pq.write_table(t.slice(0, 7), d / "a.parquet", row_group_size=5, compression="none")
    # b: images snappy-compressed (read by rows through pyarrow), the mask column stored plain
    pq.write_table(t.slice(7), d / "b.parquet", row_group_size=3,
                   compression={"image": "snappy", "mask": "none", "boxes": "snappy", "box_labels": "snappy",
                                "caption": "snappy"})
    m = load_manifest(index_dataset(d, options=IndexOptions(label_key="none")).manifest_path)
    assert {f["name"]: f["kind"] for f in m.fields} == {"mask": "mask", "boxes": "boxes", "box_labels": "box_labels"}
    cols = m.extra_columns()
    assert [s.extents for s in m.shards] == ["bytes", "rows"]
    raw = {s.name: (d / s.name).read_bytes() for s in m.shards}
    for i, r in enumerate(rows):
        o, s = int(cols["field/mask/offset"][i]), int(cols["field/mask/size"][i])
        assert raw["a.parquet" if i < 7 else "b.parquet"][o : o + s] == (shapes / r["mask"]).read_bytes()
        np.testing.assert_allclose(cols["field/boxes"][i], np.asarray(r["boxes"], np.float32).reshape(-1, 4))
    assert verify(d, deep=True).ok
    _check_loader(d, len(rows))  # the mask is one more read at its extent (not beside the image)


def test_loader_reads_hdf5_byte_fields(shapes: Path, tmp_path: Path) -> None:
    """hdf5 keeps each field in its own dataset: the loader reads masks at their extents, and they
    follow the image's geometry as in a tar pack (same seed: the same batches)."""
    pack(shapes / "train.jsonl", tmp_path / "h", "hdf5", fields=FIELDS)
    pack(shapes / "train.jsonl", tmp_path / "t", "tar", fields=FIELDS)
    _check_loader(tmp_path / "h", len(_rows(shapes)))
    kw = {"transform": "train", "image_size": 32, "fields": ["mask", "boxes"], "seed": 7, "drop_last": False}
    for a, b in zip(make_loader(str(tmp_path / "h"), 4, **kw), make_loader(str(tmp_path / "t"), 4, **kw),
                    strict=True):
        assert a["key"] == b["key"]
        np.testing.assert_array_equal(np.asarray(a["mask"]), np.asarray(b["mask"]))
        np.testing.assert_array_equal(np.asarray(a["image"]), np.asarray(b["image"]))


@pytest.mark.parametrize("target", ["record", "hdf5", "tar"])
def test_converting_a_pack_keeps_its_fields(shapes: Path, tmp_path: Path, target: str) -> None:
    """`stager pack PACKDIR OUT --format F` keeps the fields (bytes read at their extents, ragged values
    from the index), and so does converting an adopted webdataset tar."""
    src = tmp_path / "src"
    pack(shapes / "train.jsonl", src, "tar", fields=FIELDS, samples_per_shard=5)
    out = tmp_path / target
    pack(src, out, target)
    a, b = load_manifest(src / "manifest.json"), load_manifest(out / "manifest.json")
    assert a.fields == b.fields
    ca, cb = a.extra_columns(), b.extra_columns()
    order = {k: i for i, k in enumerate(a.keys)}
    raw_a = {s.name: (src / s.name).read_bytes() for s in a.shards}
    raw_b = {s.name: (out / s.name).read_bytes() for s in b.shards}

    def mask(m, cols, raw, i):
        shard = m.shards[int(np.searchsorted(np.cumsum([s.samples for s in m.shards]), i, side="right"))]
        o, s = int(cols["field/mask/offset"][i]), int(cols["field/mask/size"][i])
        return raw[shard.name][o : o + s]

    for j, key in enumerate(b.keys):
        i = order[key]
        np.testing.assert_allclose(cb["field/boxes"][j], ca["field/boxes"][i])
        assert cb["field/box_labels"][j].tolist() == ca["field/box_labels"][i].tolist()
        assert mask(b, cb, raw_b, j) == mask(a, ca, raw_a, i)


def test_tar_reader_iter_samples_yields_fields(shapes: Path, tmp_path: Path) -> None:
    from stager.formats import get_format

    pack(shapes / "train.jsonl", tmp_path / "t", "tar", fields=FIELDS)
    m = load_manifest(tmp_path / "t" / "manifest.json")
    rows = {str(Path(r["path"]).with_suffix("")): r for r in _rows(shapes)}
    info = m.shards[0]
    reader = get_format("tar").open_reader(str(tmp_path / "t" / info.name), info, m)
    got = list(reader.iter_samples())
    assert len(got) == info.samples
    for s in got:
        r = rows[s.key]
        assert s.fields["mask"] == (shapes / r["mask"]).read_bytes()
        np.testing.assert_allclose(s.fields["boxes"], np.asarray(r["boxes"], np.float32).reshape(-1, 4))
        assert s.fields["box_labels"].tolist() == r["box_labels"]


def test_zarr_stores_fields_and_the_loader_reads_them(shapes: Path, tmp_path: Path) -> None:
    """zarr: one array per field (masks decoded, ragged ones with offsets), readable with zarr itself;
    the loader's masks follow the image's crop as in a tar pack of the same resize."""
    import zarr
    from PIL import Image
    from zarr.storage import ZipStore

    pack(shapes / "train.jsonl", tmp_path / "z", "zarr", fields=FIELDS, resize=(40, 40), samples_per_shard=5)
    m = load_manifest(tmp_path / "z" / "manifest.json")
    rows = {str(Path(r["path"]).with_suffix("")): r for r in _rows(shapes)}
    info = m.shards[0]
    g = zarr.open_group(ZipStore(str(tmp_path / "z" / info.name), mode="r"), mode="r")
    keys = g.attrs["keys"]
    masks, off, vals = g["fields/mask/rows"][:], g["fields/boxes/offsets"][:], g["fields/boxes/values"][:]
    assert masks.shape == (info.samples, 40, 40) and dict(g["fields/mask"].attrs)["kind"] == "mask"
    for i, key in enumerate(keys):
        r = rows[key]
        with Image.open(shapes / r["mask"]) as im:
            sy, sx = 40 / im.height, 40 / im.width
            want = np.asarray(im.resize((40, 40), Image.Resampling.NEAREST))
        np.testing.assert_array_equal(masks[i], want)
        b = np.asarray(r["boxes"], np.float32).reshape(-1, 4) * np.float32([sx, sy, sx, sy])
        np.testing.assert_allclose(vals[off[i] : off[i + 1]], b, rtol=1e-4, atol=1e-3)
        assert g["fields/box_labels/values"][off[i] : off[i + 1]].tolist() == r["box_labels"]
    _check_loader(tmp_path / "z", len(rows))
    for b in make_loader(str(tmp_path / "z"), 4, transform="eval", image_size=40, fields=["mask"],
                         shuffle=False, drop_last=False):
        for key, mk in zip(b["key"], np.asarray(b["mask"]), strict=True):
            with Image.open(shapes / rows[key]["mask"]) as im:
                stored = np.asarray(im.resize((40, 40), Image.Resampling.NEAREST))
            rr, cc = eval_geometry(40, 40, 40).sample_rows_cols(40, 40)  # the eval window over the stored mask
            np.testing.assert_array_equal(mk, stored[rr[:, None], cc[None, :]])


def test_dali_reads_record_fields(shapes: Path, tmp_path: Path) -> None:
    """DALI's fn.readers.tfrecord reads a record pack's fields with the OD API feature spec (CPU)."""
    pytest.importorskip("nvidia.dali", reason="DALI not installed (pip install nvidia-dali-cuda120)")
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali import tfrecord as tfrec
    from PIL import Image

    pack(shapes / "train.jsonl", tmp_path / "r", "record", fields=FIELDS, samples_per_shard=5)
    m = load_manifest(tmp_path / "r" / "manifest.json")
    paths = [str(tmp_path / "r" / s.name) for s in m.shards]
    feats = {k: tfrec.VarLenFeature(tfrec.float32, 0.0) for k in
             ("image/object/bbox/xmin", "image/object/bbox/ymin", "image/object/bbox/xmax", "image/object/bbox/ymax")}
    feats.update({"image/encoded": tfrec.FixedLenFeature((), tfrec.string, ""),
                  "image/filename": tfrec.FixedLenFeature((), tfrec.string, ""),
                  "image/object/class/label": tfrec.VarLenFeature(tfrec.int64, -1),
                  "image/segmentation/class/encoded": tfrec.FixedLenFeature((), tfrec.string, "")})

    @pipeline_def(batch_size=m.num_samples, num_threads=1, device_id=None)
    def pipe():
        f = fn.readers.tfrecord(path=paths, index_path=[p + ".idx" for p in paths], features=feats,
                                random_shuffle=False)
        img = fn.decoders.image(f["image/encoded"], device="cpu")
        mask = fn.decoders.image(f["image/segmentation/class/encoded"], device="cpu", output_type=types.GRAY)
        bbox = [f[k] for k in ("image/object/bbox/xmin", "image/object/bbox/ymin", "image/object/bbox/xmax",
                               "image/object/bbox/ymax")]
        return (img, mask, f["image/object/class/label"], f["image/filename"], *bbox)

    p = pipe()
    p.build()
    img, mask, labels, names, *bbox = p.run()
    rows = {str(Path(r["path"]).with_suffix("")): r for r in _rows(shapes)}
    assert sorted(bytes(np.array(names[i])).decode() for i in range(m.num_samples)) == sorted(rows)
    for i in range(m.num_samples):
        r = rows[bytes(np.array(names[i])).decode()]
        with Image.open(shapes / r["mask"]) as im:
            np.testing.assert_array_equal(np.array(mask[i])[..., 0], np.asarray(im))
        h, w = np.array(img[i]).shape[:2]
        got = np.stack([np.array(b[i]) for b in bbox], axis=1) * np.float32([w, h, w, h])
        np.testing.assert_allclose(got, np.asarray(r["boxes"], np.float32).reshape(-1, 4), atol=1e-2)
        assert np.array(labels[i]).tolist() == r["box_labels"]


def test_zarr_pack_converts_with_its_fields(shapes: Path, tmp_path: Path) -> None:
    """zarr -> tar: the decoded masks come back as PNG members equal to the stored rows."""
    import zarr
    from PIL import Image
    from zarr.storage import ZipStore

    pack(shapes / "train.jsonl", tmp_path / "z", "zarr", fields=FIELDS, resize=(40, 40), samples_per_shard=7)
    pack(tmp_path / "z", tmp_path / "t", "tar")
    z, t = load_manifest(tmp_path / "z" / "manifest.json"), load_manifest(tmp_path / "t" / "manifest.json")
    assert t.fields == z.fields
    stored = {}
    for info in z.shards:
        g = zarr.open_group(ZipStore(str(tmp_path / "z" / info.name), mode="r"), mode="r")
        stored.update(zip(g.attrs["keys"], g["fields/mask/rows"][:], strict=True))
    cols = t.extra_columns()
    raw = {s.name: (tmp_path / "t" / s.name).read_bytes() for s in t.shards}
    ends = np.cumsum([s.samples for s in t.shards])
    for i, key in enumerate(t.keys):
        shard = t.shards[int(np.searchsorted(ends, i, side="right"))]
        o, s = int(cols["field/mask/offset"][i]), int(cols["field/mask/size"][i])
        with Image.open(__import__("io").BytesIO(raw[shard.name][o : o + s])) as im:
            np.testing.assert_array_equal(np.asarray(im), stored[key])


def test_verify_deep_checks_a_tar_packs_fields(shapes: Path, tmp_path: Path) -> None:
    """verify --deep parses the tar and compares each sample's field members with the index."""
    pack(shapes / "train.jsonl", tmp_path / "t", "tar", fields=FIELDS, samples_per_shard=6)
    assert verify(tmp_path / "t", deep=True).ok
    m = load_manifest(tmp_path / "t" / "manifest.json")
    info = m.shards[0]
    cols = dict(info.columns)
    cols["field/mask/offset"] = np.asarray(cols["field/mask/offset"]) + 1
    bad = ShardInfo(info.name, info.bytes, info.hash, list(info.keys), info.labels, info.offsets, info.sizes,
                    columns=cols)
    from stager.shardcheck import _deep_check

    assert "field 'mask'" in (_deep_check(str(tmp_path / "t"), bad, m) or "")
