"""Extra per-sample columns of adopted sets (manifest v2 ``ShardInfo.columns``), and their sample kind.

* ``field/label_values`` (ragged float32): a RecordIO record's label values, the IRHeader's label or
  all of its ``flag`` array labels; kept when any record of the set has array labels, and described
  by the manifest's ``fields`` entry ``{"name": "label_values", "kind": "values", "dtype": "float32",
  "ragged": true, "column": "field/label_values"}``.
* ``shape`` (int64, ``(N, 3)``): a raw Caffe Datum's ``(C, H, W)``; the set is ``sample_kind:
  "decoded"`` and its ``image_shape`` is ``(H, W, C)`` when every Datum has the same shape.

Every shard of a dataset carries the same columns (one schema), so a column is filled for every shard
once any shard has it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stager.errors import UsageError
from stager.index.fields import field_columns
from stager.index.scan import ShardScan
from stager.manifest.table import Column, Ragged

LABEL_VALUES = "field/label_values"
SHAPE = "shape"
LABEL_VALUES_FIELD = {"name": "label_values", "kind": "values", "dtype": "float32", "ragged": True,
                      "column": LABEL_VALUES}


def extra_columns(scans: list[ShardScan], directory: str = "") -> tuple[list[dict[str, Column]], list[dict[str, Any]]]:
    """Per shard, its extra columns; and the manifest's ``fields`` entries describing them (with the
    adopted fields of :mod:`stager.index.fields`)."""
    out, fields = _label_columns(scans)
    adopted, specs = field_columns(scans, directory)
    for cols, more in zip(out, adopted, strict=True):
        cols.update(more)
    return out, fields + specs


def _label_columns(scans: list[ShardScan]) -> tuple[list[dict[str, Column]], list[dict[str, Any]]]:
    arrays = any(len(v) != 1 for s in scans for v in s.columns.get("label_values", []))
    out: list[dict[str, Column]] = []
    for s in scans:
        cols: dict[str, Column] = {}
        if arrays:
            values = s.columns["label_values"]
            starts = np.zeros(len(values) + 1, dtype=np.int64)
            np.cumsum([len(v) for v in values], out=starts[1:])
            flat = np.array([x for v in values for x in v], dtype=np.float32)
            cols[LABEL_VALUES] = Ragged(flat, starts)
        if SHAPE in s.columns:
            cols[SHAPE] = np.asarray(s.columns[SHAPE], dtype=np.int64).reshape(-1, 3)
        out.append(cols)
    return out, ([dict(LABEL_VALUES_FIELD)] if arrays else [])


def sample_kind(scans: list[ShardScan], directory: str) -> tuple[str, tuple[int, int, int] | None]:
    """``(sample_kind, image_shape)`` of the set: encoded image bytes, or decoded raw pixels (raw Datums),
    with their ``(H, W, C)`` when all share one shape (else None: the ``shape`` column has each)."""
    kinds = {s.sample_kind for s in scans if s.keys}
    if len(kinds) > 1:
        raise UsageError(f"{directory}: some files hold encoded images and others raw Datums; index them apart")
    if kinds != {"decoded"}:
        return "encoded", None
    shapes = {tuple(x) for s in scans for x in s.columns.get(SHAPE, [])}
    if len(shapes) != 1:
        return "decoded", None
    c, h, w = next(iter(shapes))
    return "decoded", (h, w, c)
