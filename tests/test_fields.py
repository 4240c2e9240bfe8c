"""Samples with fields (issue 21, docs/fields.md): sources, formats read by third-party readers,
bad input through the CLI, and the loader's invariants (every sample once with its fields, one
geometry for image, masks and boxes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stager.decode.crop import random_resized_crop_box
from stager.formats import FORMAT_NAMES, format_spec
from stager.manifest import load_manifest
from stager.order import streams
from stager.pack.api import pack
from tools.datagen import jpeg_bytes, make_shapes, png_bytes

FIELDS = "mask:mask,boxes:boxes,box_labels:box_labels"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shapes(tmp_path_factory.mktemp("shapes"), train=24, val=6, size=64, seed=3)


@pytest.fixture(scope="module", params=["tar", "record"])
def packed(request: pytest.FixtureRequest, shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"p-{request.param}")
    pack(shapes / "train.jsonl", out, request.param, fields=FIELDS, samples_per_shard=7)
    return out


def _rows(shapes: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in (shapes / "train.jsonl").read_text().splitlines()]
    return {str(Path(r["path"]).with_suffix("")): r for r in rows}  # the keys pack gives them


# ---- pack: schema, index columns, third-party readers ----------------------------------------------------


def test_manifest_schema_and_ragged_columns(packed: Path, shapes: Path) -> None:
    m = load_manifest(packed / "manifest.json")
    assert [(f["name"], f["kind"]) for f in m.fields] == [("mask", "mask"), ("boxes", "boxes"),
                                                          ("box_labels", "box_labels")]
    cols = m.extra_columns()
    assert set(cols) == {"field/mask/offset", "field/mask/size", "field/boxes", "field/box_labels"}
    rows = _rows(shapes)
    for i, key in enumerate(m.keys):
        r = rows[key]
        np.testing.assert_allclose(cols["field/boxes"][i], np.asarray(r["boxes"], np.float32).reshape(-1, 4))
        assert cols["field/box_labels"][i].tolist() == r["box_labels"]
    assert m.classes == [] and (m.column("label") == -1).all()  # a list without labels is allowed


@pytest.mark.parametrize("packed", ["tar"], indirect=True)
def test_tar_reads_with_webdataset(packed: Path, shapes: Path) -> None:
    wds = pytest.importorskip("webdataset", reason="webdataset is not installed (pip install 'stager[test]')")
    urls = sorted(str(p) for p in packed.glob("*.tar"))
    ds = wds.WebDataset(urls, shardshuffle=False).decode("l8").to_tuple("__key__", "jpg", "mask.png", "boxes.json",
                                                                        "box_labels.json")
    rows = _rows(shapes)
    n = 0
    for key, img, mask, boxes, labels in ds:
        r = rows[key]
        src_mask = np.asarray(Image.open(shapes / r["mask"]))
        assert img.shape == src_mask.shape and np.array_equal(mask, src_mask)
        assert boxes == r["boxes"] and labels == r["box_labels"]
        n += 1
    assert n == 24


@pytest.mark.parametrize("packed", ["record"], indirect=True)
def test_record_reads_with_tfrecord_in_od_api_keys(packed: Path, shapes: Path) -> None:
    from tfrecord.reader import tfrecord_loader

    rows = _rows(shapes)
    n = 0
    for f in sorted(packed.glob("*.tfrecord")):
        for rec in tfrecord_loader(str(f), str(f) + ".idx"):
            r = rows[rec["image/filename"].decode()]
            h, w = int(rec["image/height"][0]), int(rec["image/width"][0])
            with Image.open(shapes / r["path"]) as im:
                assert (w, h) == im.size
            b = np.asarray(r["boxes"], np.float64).reshape(-1, 4)
            np.testing.assert_allclose(rec["image/object/bbox/xmin"], b[:, 0] / w, rtol=1e-6)
            np.testing.assert_allclose(rec["image/object/bbox/ymax"], b[:, 3] / h, rtol=1e-6)
            assert rec["image/object/class/label"].tolist() == r["box_labels"]
            assert bytes(rec["image/segmentation/class/encoded"]) == (shapes / r["mask"]).read_bytes()
            assert bytes(rec["image/segmentation/class/format"]) == b"png"
            n += 1
    assert n == 24


def test_hdf5_one_dataset_per_field(shapes: Path, tmp_path: Path) -> None:
    import h5py

    pack(shapes / "train.jsonl", tmp_path / "h", "hdf5", fields=FIELDS)
    m = load_manifest(tmp_path / "h" / "manifest.json")
    rows = _rows(shapes)
    cols = m.extra_columns()
    with h5py.File(tmp_path / "h" / m.shards[0].name) as f:
        raw = (tmp_path / "h" / m.shards[0].name).read_bytes()
        keys = [k.decode() for k in f["keys"][:]]
        off, boxes = f["fields/boxes/offsets"][:], f["fields/boxes/values"][:]
        moff, mdata = f["fields/mask/offsets"][:], f["fields/mask/data"]
        for i, key in enumerate(keys):
            r = rows[key]
            np.testing.assert_allclose(boxes[off[i] : off[i + 1]], np.asarray(r["boxes"], np.float32).reshape(-1, 4))
            mask = mdata[moff[i] : moff[i + 1]].tobytes()
            assert mask == (shapes / r["mask"]).read_bytes()
            o, s = int(cols["field/mask/offset"][i]), int(cols["field/mask/size"][i])
            assert raw[o : o + s] == mask  # the manifest's extents locate the bytes without h5py


def test_coco_and_sidecar_sources(shapes: Path, tmp_path: Path) -> None:
    pack(shapes / "annotations" / "instances_images.json", tmp_path / "coco", "tar")
    m = load_manifest(tmp_path / "coco" / "manifest.json")
    assert {f["name"] for f in m.fields} == {"boxes", "box_labels", "iscrowd", "image_id"}
    doc = json.loads((shapes / "annotations" / "instances_images.json").read_text())
    by_id = {}
    for a in doc["annotations"]:
        x, y, w, h = a["bbox"]
        by_id.setdefault(a["image_id"], []).append([x, y, x + w, y + h])
    ids = {str(Path(im["file_name"]).with_suffix("")): im["id"] for im in doc["images"]}
    cols = m.extra_columns()
    for i, key in enumerate(m.keys):
        np.testing.assert_allclose(cols["field/boxes"][i], np.asarray(by_id[ids[key]], np.float32))
    pack(shapes / "images", tmp_path / "side", "tar")
    sm = load_manifest(tmp_path / "side" / "manifest.json")
    assert [(f["name"], f["kind"]) for f in sm.fields] == [("mask", "mask")] and sm.num_samples == 30


def test_resize_resizes_masks_and_boxes(shapes: Path, tmp_path: Path) -> None:
    pack(shapes / "train.jsonl", tmp_path / "r", "tar", fields=FIELDS, resize=(32, 48))
    m = load_manifest(tmp_path / "r" / "manifest.json")
    rows = _rows(shapes)
    data = (tmp_path / "r" / m.shards[0].name).read_bytes()
    cols = m.extra_columns()
    for i, key in enumerate(m.keys[:5]):
        r = rows[key]
        with Image.open(shapes / r["path"]) as im:
            w, h = im.size
        o, s = int(cols["field/mask/offset"][i]), int(cols["field/mask/size"][i])
        mask = np.asarray(Image.open(__import__("io").BytesIO(data[o : o + s])))
        assert mask.shape == (32, 48) and set(np.unique(mask)) <= set(range(4))
        want = np.asarray(r["boxes"], np.float64).reshape(-1, 4) * [48 / w, 32 / h, 48 / w, 32 / h]
        np.testing.assert_allclose(cols["field/boxes"][i], want, rtol=1e-5, atol=1e-4)


# ---- bad input: one line naming file and row, non-zero exit, nothing written ----------------------------


def _bad_case(tmp: Path, case: str) -> tuple[list[str], str]:
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)
    (tmp / "a.jpg").write_bytes(jpeg_bytes(img))
    (tmp / "b.jpg").write_bytes(jpeg_bytes(img))
    (tmp / "m.png").write_bytes(png_bytes(np.zeros((20, 30), np.uint8)))
    (tmp / "small.png").write_bytes(png_bytes(np.zeros((10, 30), np.uint8)))
    good = {"mask": "m.png", "boxes": [[1, 1, 5, 5]], "box_labels": [1]}
    bad = dict(good)
    fields = FIELDS
    match = r"l\.jsonl:2"
    if case == "mask_size":
        bad["mask"] = "small.png"
        match += r".*mask is 10x30 but the image is 20x30"
    elif case == "box_outside":
        bad["boxes"] = [[1, 1, 50, 5]]
        match += r".*outside the 30x20 image"
    elif case == "box_order":
        bad["boxes"] = [[9, 1, 5, 5]]
        match += r".*x1 < x0"
    elif case == "per_box_length":
        bad["box_labels"] = [1, 2]
        match += r".*has 2 entries but there are 1 boxes"
    elif case == "unknown_kind":
        fields = "mask:maks"
        match = r"unknown kind 'maks'"
    elif case == "missing_field":
        del bad["mask"]
        match += r".*field 'mask' is missing"
    lines = [json.dumps({"path": "a.jpg", **good}), json.dumps({"path": "b.jpg", **bad})]
    (tmp / "l.jsonl").write_text("\n".join(lines) + "\n")
    return [str(tmp / "l.jsonl"), "--fields", fields], match


@pytest.mark.parametrize("case", ["mask_size", "box_outside", "box_order", "per_box_length", "unknown_kind",
                                  "missing_field", "coco_missing_image"])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, case: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    if case == "coco_missing_image":
        (src / "images").mkdir()
        (src / "images" / "1.jpg").write_bytes(jpeg_bytes(np.zeros((8, 8, 3), np.uint8)))
        doc = {"images": [{"id": 1, "file_name": "1.jpg"}, {"id": 7, "file_name": "7.jpg"}], "annotations": [],
               "categories": []}
        (src / "instances_images.json").write_text(json.dumps(doc))
        args, match = [str(src / "instances_images.json")], r"instances_images\.json: image id 7: .*7\.jpg does not"
    else:
        args, match = _bad_case(src, case)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "stager", "pack", *args, str(out), "--format", "tar", "-q"],
                       capture_output=True, text=True, check=False)
    assert p.returncode != 0
    err = p.stderr.strip().splitlines()
    assert len(err) == 1, p.stderr
    import re

    assert re.search(match, err[0]), err[0]
    assert not out.exists() or not [f for f in out.rglob("*") if f.is_file() and ".stager-pack" not in str(f)]


# ---- loader ----------------------------------------------------------------------------------------------


def test_every_sample_once_per_epoch_with_its_fields(packed: Path, shapes: Path) -> None:
    from stager.loader import make_loader

    rows = _rows(shapes)
    for world in (1, 2):
        for epoch in (0, 1):
            seen: list[str] = []
            for rank in range(world):
                ld = make_loader(packed, 5, rank=rank, world_size=world, num_workers=2 if rank == 0 else 0,
                                 seed=epoch, drop_last=True, fields=["box_labels"], image_size=32)
                ld.set_epoch(epoch)
                for b in ld:
                    assert "mask" not in b and "boxes" not in b  # unnamed fields are not read
                    assert len(b["key"]) == 5  # equal batches
                    for k, lab in zip(b["key"], b["box_labels"], strict=True):
                        assert lab.tolist() == rows[k]["box_labels"]
                    seen += b["key"]
            assert len(seen) == len(set(seen)) == (24 // (5 * world)) * 5 * world


def test_joint_crop_matches_a_reference_geometry(packed: Path, shapes: Path) -> None:
    from stager.loader.numpy_loader import make_numpy_loader

    rows = _rows(shapes)
    size = 40
    ld = make_numpy_loader(packed, 6, transform="train", image_size=size, seed=5, shuffle=False, num_workers=1)
    for j, b in enumerate(ld):
        rng = streams.augment(5, 0, 1, 0, j)
        assert b["image"].shape[1:3] == (size, size) and b["mask"].shape == (len(b["key"]), size, size)
        for i, key in enumerate(b["key"]):
            r = rows[key]
            with Image.open(shapes / r["path"]) as im:
                w, h = im.size
            top, left, bh, bw = random_resized_crop_box(h, w, rng)
            flip = rng.random() < 0.5
            # reference boxes: affine map, clip, drop when the visible part is < 1 px wide/high or < 1 px^2, flip
            src = np.asarray(r["boxes"], np.float64).reshape(-1, 4)
            mapped = (src - [left, top, left, top]) * [size / bw, size / bh, size / bw, size / bh]
            clipped = mapped.clip(0, size)
            cw, ch = clipped[:, 2] - clipped[:, 0], clipped[:, 3] - clipped[:, 1]
            keep = (cw >= 1) & (ch >= 1) & (cw * ch >= 1)
            ref = clipped[keep]
            if flip:
                ref = np.stack([size - ref[:, 2], ref[:, 1], size - ref[:, 0], ref[:, 3]], axis=1)
            got = b["boxes"][i]
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
            assert (got >= 0).all() and (got <= size).all()
            assert b["box_labels"][i].tolist() == np.asarray(r["box_labels"])[keep].tolist()
            # reference mask: nearest source pixel of each output pixel centre
            m = np.asarray(Image.open(shapes / r["mask"]))
            ys = np.clip(np.floor(top + (np.arange(size) + 0.5) * bh / size), 0, h - 1).astype(int)
            xs = np.clip(np.floor(left + (np.arange(size) + 0.5) * bw / size), 0, w - 1).astype(int)
            ref_mask = m[ys][:, xs]
            assert np.array_equal(b["mask"][i], ref_mask[:, ::-1] if flip else ref_mask)


def test_mask_follows_the_image_pixels(tmp_path: Path) -> None:
    """An image of flat colour blocks whose mask is a function of the colour: after the joint crop and
    flip, the colour of almost every output pixel still names its mask class."""
    from stager.loader import make_loader

    colours = np.array([[230, 20, 20], [20, 230, 20], [20, 20, 230], [240, 240, 240]], np.uint8)
    rng = np.random.default_rng(1)
    lines = []
    for i in range(8):
        h, w = 90 + i, 120
        cls = np.zeros((h, w), np.uint8)
        cls[:, w // 3 : 2 * w // 3] = 1
        cls[h // 2 :, :] += 2
        cls = cls % 4
        cls[rng.integers(0, h // 2) : h // 2, :10] = 3
        (tmp_path / f"{i}.png").write_bytes(png_bytes(colours[cls]))
        (tmp_path / f"{i}.mask.png").write_bytes(png_bytes(cls))
        lines.append(json.dumps({"path": f"{i}.png", "mask": f"{i}.mask.png"}))
    (tmp_path / "l.jsonl").write_text("\n".join(lines))
    pack(tmp_path / "l.jsonl", tmp_path / "p", "tar", fields="mask:mask")
    for transform in ("train", "eval"):
        for b in make_loader(tmp_path / "p", 4, transform=transform, image_size=64, seed=2):
            img = b["image"].permute(0, 2, 3, 1).numpy().astype(int)
            d = ((img[:, :, :, None, :] - colours[None, None, None].astype(int)) ** 2).sum(-1)
            agree = (d.argmin(-1) == b["mask"].numpy()).mean()
            assert agree > 0.97, (transform, agree)


def test_callable_transform_gets_the_whole_sample(packed: Path) -> None:
    from stager.loader import make_loader

    def crop(sample: dict, rng: np.random.Generator) -> dict:
        assert sample["image"].ndim == 3 and sample["mask"].shape == sample["image"].shape[:2]
        assert sample["boxes"].shape[1:] == (4,) and len(sample["box_labels"]) == len(sample["boxes"])
        return {**sample, "image": sample["image"][:16, :16], "mask": sample["mask"][:16, :16]}

    b = next(iter(make_loader(packed, 4, transform=crop)))
    assert tuple(b["image"].shape) == (4, 3, 16, 16) and tuple(b["mask"].shape) == (4, 16, 16)
    assert b["mask"].dtype.is_floating_point is False


def test_resume_gives_the_same_fields(packed: Path) -> None:
    from stager.loader import make_loader

    full = [b["boxes"] for b in make_loader(packed, 4, transform="train", image_size=32, seed=1)]
    ld = make_loader(packed, 4, transform="train", image_size=32, seed=1)
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    ld2 = make_loader(packed, 4, transform="train", image_size=32, seed=1)
    ld2.load_state_dict(state)
    rest = [b["boxes"] for b in ld2]
    assert len(rest) == len(full) - 1
    for a, b in zip(full[1:], rest, strict=True):
        assert all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("fmt", [n for n in FORMAT_NAMES if format_spec(n).fields and format_spec(n).writable
                                 and format_spec(n).sample_kind == "encoded"])
def test_workers_give_identical_bytes_and_columns(shapes: Path, tmp_path: Path, fmt: str) -> None:
    """Parallel segments (pack --workers 2: tar, fields beside their image) rebase field extents like
    image extents; formats with separate field datasets (hdf5) or no segments write whole shards."""
    pack(shapes / "train.jsonl", tmp_path / "w1", fmt, fields=FIELDS, samples_per_shard=10)
    pack(shapes / "train.jsonl", tmp_path / "w2", fmt, fields=FIELDS, samples_per_shard=10, workers=2)
    a = load_manifest(tmp_path / "w1" / "manifest.json")
    ja, jb = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("w1", "w2"))
    skip = ("digest", "created")  # the creation time enters the digest
    assert {k: v for k, v in ja.items() if k not in skip} == {k: v for k, v in jb.items() if k not in skip}
    for s in a.shards:
        assert (tmp_path / "w1" / s.name).read_bytes() == (tmp_path / "w2" / s.name).read_bytes()


def test_staged_copy_carries_the_fields(packed: Path, tmp_path: Path) -> None:
    from stager.loader import make_loader

    dest = tmp_path / "dest"
    p = subprocess.run([sys.executable, "-m", "stager", "stage", str(packed), str(dest), "--json"],
                       capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    def masks(path: Path) -> list[bytes]:
        return [m.numpy().tobytes() for b in make_loader(path, 4, seed=3, fields=["mask"]) for m in b["mask"]]

    assert masks(packed) == masks(dest)
