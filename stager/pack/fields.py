"""Checking and preparing a sample's fields before it is written (schema: :mod:`stager.manifest.fields`).

:func:`prepare_fields` runs on the source's sample *before* the image is re-encoded, because it needs
the stored image's size: it checks every field against the image (a mask of the image's size, boxes
inside the image with ``x0 <= x1`` and ``y0 <= y1``, per-box lists as long as the boxes), resizes
masks (nearest neighbour) and scales boxes when ``--resize`` changes the image's size, and records the
output size in ``meta`` (``height``, ``width``: the record format normalises boxes by it). Every
problem is a :class:`SourceError` naming ``where`` (file and row) and the field, so ``--on-error``
applies per sample as it does to images.

:func:`ragged_value` turns a source's JSON value into the ragged kinds' arrays (boxes ``(n, 4)``
float32, box_labels ``(n,)`` int64, per_box ``(n, ...)``).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from stager.errors import SourceError
from stager.formats.base import Sample
from stager.manifest.fields import FieldSpec

BOX_SLACK = 0.5  # pixels a box may stick out of the image (rounding in annotation tools)


def _hw_of(data: Any, where: str) -> tuple[int, int]:
    """``(height, width)`` of encoded image bytes (header only) or of an array."""
    if isinstance(data, np.ndarray):
        return int(data.shape[0]), int(data.shape[1])
    from PIL import Image, UnidentifiedImageError  # noqa: PLC0415 (PIL only where images are decoded or re-encoded)

    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise SourceError(f"{where}: cannot read the image header ({exc}); fix it or use --on-error skip") from exc
    return int(h), int(w)


def ragged_value(spec: FieldSpec, value: Any, where: str) -> np.ndarray:
    """A JSON value (list of boxes / labels / per-box entries) as the field's array; SourceError if not."""
    try:
        arr = np.asarray(value if value is not None else [], dtype=np.dtype(spec.dtype))
    except (TypeError, ValueError) as exc:
        raise SourceError(f"{where}: field {spec.name!r}: expected a list of numbers ({exc})") from exc
    if arr.size == 0:
        return np.zeros((0, *spec.item), dtype=spec.dtype)
    if spec.kind == "boxes" and (arr.ndim != 2 or arr.shape[1] != 4):
        raise SourceError(f"{where}: field {spec.name!r}: boxes must be [[x0, y0, x1, y1], ...], got shape {arr.shape}")
    if spec.kind == "box_labels" and arr.ndim != 1:
        raise SourceError(f"{where}: field {spec.name!r}: box labels must be a flat list of ints")
    return np.ascontiguousarray(arr)


def check_boxes(boxes: np.ndarray, hw: tuple[int, int], where: str, name: str) -> None:
    """Boxes inside the ``(H, W)`` image with ``x0 <= x1`` and ``y0 <= y1``; SourceError naming the first bad one."""
    if not len(boxes):
        return
    h, w = hw
    bad_order = (boxes[:, 2] < boxes[:, 0]) | (boxes[:, 3] < boxes[:, 1])
    outside = ((boxes[:, :2] < -BOX_SLACK).any(axis=1) | (boxes[:, 2] > w + BOX_SLACK) | (boxes[:, 3] > h + BOX_SLACK))
    bad = np.flatnonzero(bad_order | outside | ~np.isfinite(boxes).all(axis=1))
    if len(bad):
        i = int(bad[0])
        why = "x1 < x0 or y1 < y0" if bad_order[i] else f"outside the {w}x{h} image"
        raise SourceError(f"{where}: field {name!r}: box {i} {boxes[i].tolist()} is {why}; fix the annotation "
                          "or use --on-error skip")


def _mask_hw(data: bytes, where: str, name: str) -> tuple[int, int]:
    try:
        return _hw_of(data, where)
    except SourceError as exc:
        raise SourceError(f"{where}: field {name!r}: not a readable mask image; fix it or use --on-error skip") from exc


def _resize_mask(data: bytes, hw: tuple[int, int]) -> bytes:
    from PIL import Image  # noqa: PLC0415 (PIL only where images are decoded or re-encoded)

    with Image.open(io.BytesIO(data)) as im:
        out = im.resize((hw[1], hw[0]), Image.Resampling.NEAREST)
        buf = io.BytesIO()
        out.save(buf, format="PNG")
    return buf.getvalue()


def prepare_fields(sample: Sample, specs: Sequence[FieldSpec], where: str, resize: tuple[int, int] | None) -> Sample:
    """Check ``sample``'s fields against its image; apply ``resize`` to masks and boxes (see module doc)."""
    hw = _hw_of(sample.data, where)
    out_hw = resize or hw
    sy, sx = out_hw[0] / hw[0], out_hw[1] / hw[1]
    values = dict(sample.fields)
    nboxes: int | None = None
    for spec in specs:
        if spec.name not in values:
            raise SourceError(f"{where}: field {spec.name!r} is missing; every sample needs every field")
        v = values[spec.name]
        if spec.kind == "mask":
            mhw = _mask_hw(v, where, spec.name)
            if mhw != hw:
                raise SourceError(f"{where}: field {spec.name!r}: mask is {mhw[0]}x{mhw[1]} but the image is "
                                  f"{hw[0]}x{hw[1]}; masks must match their image")
            if out_hw != hw:
                values[spec.name] = _resize_mask(v, out_hw)
        elif spec.kind == "boxes":
            boxes = ragged_value(spec, v, where)
            check_boxes(boxes, hw, where, spec.name)
            nboxes = len(boxes)
            if out_hw != hw:
                boxes = (boxes * np.array([sx, sy, sx, sy])).astype(np.float32)
            values[spec.name] = np.clip(boxes, 0, [hw[1] * sx, hw[0] * sy] * 2).astype(np.float32)
        elif spec.ragged:
            values[spec.name] = ragged_value(spec, v, where)
    for spec in specs:
        if spec.kind in ("box_labels", "per_box") and nboxes is not None and len(values[spec.name]) != nboxes:
            raise SourceError(f"{where}: field {spec.name!r} has {len(values[spec.name])} entries but there are "
                              f"{nboxes} boxes; per-box lists must be as long as the boxes")
    meta = {**sample.meta, "height": out_hw[0], "width": out_hw[1]}
    return dataclasses.replace(sample, fields=values, meta=meta)
