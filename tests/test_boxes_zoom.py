"""Boxes under crops that zoom into objects (docs/fields.md, "Geometry"): a box is dropped only when its
visible part is degenerate (``BoxFilter``: minimum side and area in output pixels), never because a
small fraction of a large object shows; ``min_visibility`` (albumentations' rule) is an option.

The data: every image is cut in two objects (classes 1 and 2) at a random place, so each object is
large and random-resized crops (down to 8 % of the image) often lie inside one of them, or show a
part of one that fills much of the output but is under 10 % of the object's own area (the rule that
dropped such boxes). The mask follows the same geometry as the boxes, so it tells
which objects the output shows: every object that covers at least 2 x 2 output pixels of the mask
must have its box, and that box must cover those pixels. Checked for every format and both transports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stager.errors import UsageError
from stager.loader.fields import Geometry
from stager.loader.options import BoxFilter
from stager.pack.api import pack
from tools.datagen import png_bytes

H, W, N, S = 60, 80, 24, 32
FIELDS = "mask:mask,boxes:boxes,box_labels:box_labels"


def _halves(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, list[list[float]]]:
    """An (H, W, 3) image, its (H, W) class mask and the boxes of its two objects (classes 1 and 2):
    the image cut in two at a random place, across or down."""
    if rng.random() < 0.5:
        cx = int(W * rng.uniform(0.3, 0.7))
        boxes = [[0, 0, cx, H], [cx, 0, W, H]]
    else:
        cy = int(H * rng.uniform(0.3, 0.7))
        boxes = [[0, 0, W, cy], [0, cy, W, H]]
    mask = np.zeros((H, W), np.uint8)
    for cls, (x0, y0, x1, y1) in enumerate(boxes, start=1):
        mask[y0:y1, x0:x1] = cls
    img = rng.integers(0, 256, (3, 3))[mask].astype(np.uint8)
    return img, mask, [[float(v) for v in b] for b in boxes]


@pytest.fixture(scope="module")
def tiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiled set packed in every format (one list file, fields mask/boxes/box_labels)."""
    root = tmp_path_factory.mktemp("tiled")
    rng = np.random.default_rng(4)
    rows = []
    for i in range(N):
        img, mask, boxes = _halves(rng)
        (root / f"{i}.png").write_bytes(png_bytes(img))
        (root / f"{i}.mask.png").write_bytes(png_bytes(mask))
        rows.append({"path": f"{i}.png", "mask": f"{i}.mask.png", "boxes": boxes, "box_labels": [1, 2]})
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {fmt: Path(pack(root / "train.jsonl", root / fmt, fmt, fields=FIELDS, samples_per_shard=6).out)
            for fmt in ("tar", "hdf5", "record", "zarr")}


def _batches(path: Path, transport: str, epoch: int, **kw: Any) -> Any:
    args = {"transform": "train", "image_size": S, "seed": 3, "fields": ["mask", "boxes", "box_labels"],
            "drop_last": False, **kw}
    if transport == "torch":
        from stager.loader import make_loader

        ld = make_loader(str(path), 4, **args)
    else:
        from stager.loader.numpy_loader import make_numpy_loader

        ld = make_numpy_loader(str(path), 4, **args)
    ld.set_epoch(epoch)
    return ld


def check_visible_objects_keep_their_boxes(mask: np.ndarray, boxes: np.ndarray, labels: np.ndarray) -> bool:
    """Every class covering >= 2 x 2 output pixels has a box with its label covering those pixels;
    every box is at least 1 pixel wide and high. True when one object fills >= 90 % of the output."""
    assert len(boxes) == len(labels) and len(set(labels.tolist())) == len(labels)
    by_label = dict(zip(labels.tolist(), boxes, strict=True))
    for b in boxes:
        assert b[2] - b[0] >= 1 - 1e-4 and b[3] - b[1] >= 1 - 1e-4, b
    for cls in (1, 2):
        ys, xs = np.nonzero(mask == cls)
        if not len(xs) or xs.max() - xs.min() < 1 or ys.max() - ys.min() < 1:
            continue
        assert cls in by_label, f"object {cls} covers {len(xs)} output pixels but lost its box"
        x0, y0, x1, y1 = by_label[cls]
        # A mask pixel i is inside the object when its centre i + 0.5 is inside the mapped box.
        assert x0 <= xs.min() + 0.5 + 1e-3 and x1 >= xs.max() + 0.5 - 1e-3, (cls, by_label[cls], xs.min(), xs.max())
        assert y0 <= ys.min() + 0.5 + 1e-3 and y1 >= ys.max() + 0.5 - 1e-3, (cls, by_label[cls], ys.min(), ys.max())
    return bool(np.bincount(mask.ravel(), minlength=3).max() >= 0.9 * mask.size)


@pytest.mark.parametrize("transport", ["torch", "numpy"])
@pytest.mark.parametrize("fmt", ["tar", "hdf5", "record", "zarr"])
def test_objects_that_fill_a_zoomed_crop_keep_their_boxes(tiled: dict[str, Path], fmt: str, transport: str) -> None:
    zoomed = seen = 0
    for epoch in (0, 1):
        for b in _batches(tiled[fmt], transport, epoch):
            masks = np.asarray(b["mask"])
            for i in range(len(b["key"])):
                seen += 1
                zoomed += check_visible_objects_keep_their_boxes(masks[i], np.asarray(b["boxes"][i]),
                                                                 np.asarray(b["box_labels"][i]))
    assert seen == 2 * N
    assert zoomed >= 2, "the crops never zoomed into one object: the test checks nothing"


def test_min_visibility_is_an_option(tiled: dict[str, Path]) -> None:
    """albumentations' rule on request: a box survives only with this fraction of its own area visible
    (checked against the mapped boxes the default filter keeps)."""
    frac = 0.3
    kept = dropped = 0
    for a, b in zip(_batches(tiled["tar"], "numpy", 0), _batches(tiled["tar"], "numpy", 0,
                                                                  box_filter={"min_visibility": frac}), strict=True):
        assert a["key"] == b["key"]
        for i in range(len(a["key"])):
            all_boxes, all_labels = np.asarray(a["boxes"][i]), np.asarray(a["box_labels"][i])
            few = dict(zip(np.asarray(b["box_labels"][i]).tolist(), np.asarray(b["boxes"][i]), strict=True))
            assert set(few) <= set(all_labels.tolist())
            for lab, box in zip(all_labels.tolist(), all_boxes, strict=True):
                if lab in few:
                    np.testing.assert_allclose(few[lab], box)
                    kept += 1
                else:
                    dropped += 1
    assert kept and dropped, (kept, dropped)


def test_box_filter_on_a_crop_inside_one_object() -> None:
    """A 20 x 20 source window inside a 100 x 100 box (4 % of it visible) fills the 32 px output."""
    g = Geometry(top=40, left=40, height=20, width=20, size=32)
    big = np.array([[0, 0, 100, 100]], np.float32)
    out, keep = g.map_boxes(big)
    assert keep.tolist() == [True] and out.tolist() == [[0, 0, 32, 32]]
    assert g.map_boxes(big, BoxFilter(min_visibility=0.1))[1].tolist() == [False]
    assert g.map_boxes(big, BoxFilter(min_visibility=0.04))[1].tolist() == [True]
    # A sliver 0.8 output pixels wide (0.5 source pixels): degenerate by default, kept when asked.
    sliver = np.array([[59.5, 45, 70, 55]], np.float32)
    assert g.map_boxes(sliver)[1].tolist() == [False]
    assert g.map_boxes(sliver, BoxFilter(min_side=0.5, min_area=0.5))[1].tolist() == [True]
    assert g.map_boxes(sliver, BoxFilter(min_side=0.5, min_area=20))[1].tolist() == [False]
    # Outside the window: nothing visible, dropped even with every threshold at 0.
    assert g.map_boxes(np.array([[0, 0, 10, 10]], np.float32), BoxFilter(0, 0, 0))[1].tolist() == [False]
    flipped, _ = Geometry(top=40, left=40, height=20, width=20, size=32, flip=True).map_boxes(
        np.array([[40, 40, 50, 60]], np.float32))
    np.testing.assert_allclose(flipped, [[16, 0, 32, 32]])


@pytest.mark.parametrize("bad", [{"min_visibility": 1.5}, {"min_side": -1}, {"min_area": "1"}, {"min_vis": 0.2},
                                 {"min_side": float("nan")}, 0.3])
def test_bad_box_filter_is_a_usage_error(tiled: dict[str, Path], bad: Any) -> None:
    from stager.loader.numpy_loader import make_numpy_loader

    with pytest.raises(UsageError, match="box_filter"):
        make_numpy_loader(str(tiled["tar"]), 4, box_filter=bad)
