"""Fields of adopted sets (docs/fields.md, "stager index"): what a scan finds beside each image.

A scanner calls :meth:`FieldRows.add` once per sample with that sample's fields, each a
:class:`Found`: a *byte* field (kinds image/mask/array/json/bytes) as the extent of its bytes in the
shard file, a *ragged* field (boxes/box_labels/per_box) as its values, parsed once here so that no
reader parses JSON per sample. The rows live in ``ShardScan.columns`` under the index column names of
:mod:`stager.manifest.fields` (``field/<name>/offset``, ``field/<name>/size``, ``field/<name>``;
plain lists, so a scan saved for resume is JSON) and the schema in ``ShardScan.field_specs``.

Every sample of a set must carry the same fields: the first sample of a shard fixes the shard's
schema (a later sample with other fields is an error naming it), and every shard must have the same
schema (:func:`field_columns`). The inputs: webdataset tar members (:func:`tar_member_spec`), the
TensorFlow Object Detection API keys of TFRecord Examples (:mod:`stager.index.record`), parquet
columns (:mod:`stager.index.parquet`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from stager.errors import UsageError
from stager.index.scan import DamagedShardError, ShardScan
from stager.manifest.fields import (
    FIELD_PREFIX,
    MASK_HINTS,
    FieldSpec,
    build_field_columns,
    check_unique,
    offset_column,
    size_column,
    values_column,
)
from stager.manifest.table import Column, Ragged

IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff"})
LABEL_VALUES = "field/label_values"  # RecordIO array labels (stager.index.columns), not a field of this module


@dataclass(frozen=True)
class Found:
    """One field of one sample: ``extent`` (offset, size) in the shard for byte kinds, else ``values``."""

    spec: FieldSpec
    extent: tuple[int, int] | None = None
    values: Any = None


def tar_member_spec(suffix: str) -> FieldSpec | None:
    """The field a webdataset member suffix holds (``mask.png``, ``boxes.json``, ``npy``, ``json``), or None
    when its name is no valid field name (``cls``, ``JPEG.x``...): such members are not adopted.

    The name is the suffix up to its first dot (a bare ``json`` is ``meta``, as in a sidecar folder);
    the kind: ``boxes.json`` / ``box_labels.json`` the ragged kinds, a ``.png`` whose name hints at a
    mask (``mask``, ``seg``, ``label``) ``mask``, other images ``image``, ``.npy`` ``array``,
    ``.json`` ``json``, anything else ``bytes``."""
    name, _, rest = suffix.partition(".")
    ext = (rest.rsplit(".", 1)[-1] if rest else name).lower()
    if not rest:
        name = "meta" if name == "json" else name
    if ext == "json" and name in ("boxes", "box_labels"):
        kind = name
    elif ext == "png" and any(h in name for h in MASK_HINTS):
        kind = "mask"
    elif ext in IMAGE_EXTS:
        kind = "image"
    else:
        kind = {"npy": "array", "json": "json"}.get(ext, "bytes")
    try:
        return FieldSpec(name, kind, "jpg" if ext == "jpeg" else ext)
    except UsageError:
        return None


def parse_ragged(spec: FieldSpec, data: Any, where: str) -> list[Any]:
    """A JSON list (of boxes ``[x0, y0, x1, y1]`` or numbers) as a flat list of ``spec.dtype`` values;
    DamagedShardError naming ``where`` when it is not one, or a box has x1 < x0 or y1 < y0."""
    try:
        value = json.loads(bytes(data)) if isinstance(data, (bytes, bytearray, memoryview)) else data
        arr = np.asarray(value if value is not None else [], dtype=np.dtype(spec.dtype))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, TypeError, ValueError) as exc:
        raise DamagedShardError(f"{where}: field {spec.name!r}: expected a JSON list of numbers ({exc})") from exc
    if spec.kind == "boxes" and arr.size:
        if arr.ndim != 2 or arr.shape[1] != 4:
            raise DamagedShardError(f"{where}: field {spec.name!r}: boxes must be [[x0, y0, x1, y1], ...], "
                                    f"got shape {arr.shape}")
        if ((arr[:, 2] < arr[:, 0]) | (arr[:, 3] < arr[:, 1])).any():
            raise DamagedShardError(f"{where}: field {spec.name!r}: a box has x1 < x0 or y1 < y0")
    elif spec.kind == "box_labels" and arr.ndim > 1:
        raise DamagedShardError(f"{where}: field {spec.name!r}: box labels must be a flat list of ints")
    return list(arr.reshape(-1).tolist())


class FieldRows:
    """Accumulates the fields of a shard's samples into ``scan.columns`` / ``scan.field_specs``."""

    def __init__(self, scan: ShardScan, path: str) -> None:
        self.scan, self.path = scan, path
        self.specs: list[FieldSpec] | None = None

    def add(self, key: str, found: list[Found]) -> None:
        """The fields of the next sample (``key`` names it in errors), in any order."""
        found = sorted(found, key=lambda f: f.spec.name)
        specs = [f.spec for f in found]
        if self.specs is None:
            check_unique(specs, f"{self.path}: sample {key!r}")
            _check_lengths(found, f"{self.path}: sample {key!r}")
            self.specs = specs
            self.scan.field_specs = [s.to_json() for s in specs]
            for s in specs:
                for c in s.columns():
                    self.scan.columns[c] = []
        elif specs != self.specs:
            have = ", ".join(s.name for s in specs) or "none"
            want = ", ".join(s.name for s in self.specs) or "none"
            raise DamagedShardError(f"{self.path}: sample {key!r} has fields ({have}) but the shard's first "
                                    f"sample has ({want}); every sample must carry the same fields (or index "
                                    "with --no-fields)")
        else:
            _check_lengths(found, f"{self.path}: sample {key!r}")
        cols = self.scan.columns
        for f in found:
            if f.spec.ragged:
                cols[values_column(f.spec.name)].append(f.values)
            else:
                assert f.extent is not None
                cols[offset_column(f.spec.name)].append(f.extent[0])
                cols[size_column(f.spec.name)].append(f.extent[1])


def _check_lengths(found: list[Found], where: str) -> None:
    """Per-box lists as long as the boxes (``values`` are flat: boxes hold 4 numbers per box)."""
    boxes = next((f for f in found if f.spec.kind == "boxes"), None)
    for f in found:
        if f.spec.kind in ("box_labels", "per_box") and boxes is not None:
            n = len(boxes.values) // 4
            per = int(np.prod(f.spec.item)) if f.spec.item else 1
            if len(f.values) != n * per:
                raise DamagedShardError(f"{where}: field {f.spec.name!r} has {len(f.values) // max(per, 1)} "
                                        f"entries for {n} boxes")


def field_columns(scans: list[ShardScan], directory: str) -> tuple[list[dict[str, Column]], list[dict[str, Any]]]:
    """Per shard its field columns, and the manifest's ``fields``; UsageError when shards differ."""
    with_keys = [s for s in scans if s.keys]
    schema = with_keys[0].field_specs if with_keys else []
    for s in with_keys:
        if s.field_specs != schema:
            have = ", ".join(d["name"] for d in s.field_specs) or "none"
            want = ", ".join(d["name"] for d in schema) or "none"
            raise UsageError(f"{directory}/{s.name}: its samples have fields ({have}), those of "
                             f"{with_keys[0].name} ({want}); every shard must carry the same fields (or index with "
                             "--no-fields)")
    specs = _specs(schema)
    return [_shard_columns(s, specs) for s in scans], [sp.to_json() for sp in specs]


def _specs(schema: list[dict[str, Any]]) -> list[FieldSpec]:
    return [FieldSpec(d["name"], d["kind"], d.get("ext", ""), d.get("dtype", ""), tuple(d.get("item", ())))
            for d in schema]


def _shard_columns(scan: ShardScan, specs: list[FieldSpec]) -> dict[str, Column]:
    return build_field_columns(specs, scan.columns)


def compare_fields(scan: ShardScan, columns: dict[str, Column]) -> str | None:
    """``verify --deep``: a reason when a re-scan's field columns differ from the indexed ones, else None."""
    got = _shard_columns(scan, _specs(scan.field_specs))
    have = {c for c in columns if c.startswith(FIELD_PREFIX) and c != LABEL_VALUES}
    if set(got) != have:
        return f"field columns {sorted(got)} found, index says {sorted(have)}"
    for c, new in got.items():
        old = columns[c]
        if isinstance(new, Ragged) and isinstance(old, Ragged):
            same = (np.array_equal(new.starts, old.starts) and new.values.shape == old.values.shape
                    and np.allclose(new.values, old.values, rtol=1e-6, atol=1e-4))
        else:
            same = np.array_equal(np.asarray(new), np.asarray(old))
        if not same:
            return f"{c} differs from the index"
    return None
