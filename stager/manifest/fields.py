"""The schema of samples with fields (manifest ``fields``) and the names of their index columns.

A sample is its primary image (``image``), an optional ``label`` and any number of named *fields*.
The manifest's top-level ``fields`` lists one object per field, in a fixed order::

    {"name": "mask", "kind": "mask", "ext": "png", "dtype": "uint8"}
    {"name": "boxes", "kind": "boxes", "ext": "json", "dtype": "float32", "item": [4]}

* ``name``: ``[a-z][a-z0-9_]*``, not a batch key (``image``, ``label``, ``key``, ...);
* ``kind``: one of :data:`KINDS` (docs/fields.md):

  ==========  =====================================================  =========================
  kind        value                                                  stored as
  ==========  =====================================================  =========================
  image       another encoded image (jpg/png/...)                    bytes (``ext``: its type)
  mask        a PNG of class ids per pixel, the image's geometry     bytes (``png``)
  boxes       ``(n, 4)`` float32 ``x0, y0, x1, y1`` in stored pixels  ragged column
  box_labels  ``(n,)`` int64, one per box                            ragged column
  per_box     ``(n, *item)`` numbers, one entry per box              ragged column
  array       an ndarray                                             bytes (``npy``)
  json        any JSON value                                         bytes (``json``, UTF-8)
  bytes       any file, kept as is                                   bytes (``ext``: the file's)
  ==========  =====================================================  =========================

* ``ext``: the extension of the stored bytes (tar member ``KEY.<name>.<ext>``);
* ``dtype`` / ``item``: for the ragged kinds, the column's dtype and per-box item shape.

Per-sample data live in the sample index (:mod:`stager.manifest.samples`):

* byte kinds: ``field/<name>/offset`` and ``field/<name>/size`` (int64), the extent of the field's
  bytes inside the sample's shard file (-1/0: not stored in the shard, e.g. record's float lists);
* ragged kinds: ``field/<name>``, a :class:`~stager.manifest.table.Ragged` column of the values
  themselves, so that no reader parses JSON per sample.

This module is the one home of these names and rules; the pack sources, the formats and the loader
import them from here (other issues, e.g. RecordIO array labels, reuse the ``array`` kind).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stager.errors import ManifestError, UsageError

KINDS = ("image", "mask", "boxes", "box_labels", "per_box", "array", "json", "bytes")
RAGGED_KINDS = frozenset({"boxes", "box_labels", "per_box"})  # values in the index, not bytes
BYTE_KINDS = frozenset(KINDS) - RAGGED_KINDS
GEOMETRIC_KINDS = frozenset({"image", "mask", "boxes"})  # follow the primary image's crop and flip
RESERVED_NAMES = frozenset({"image", "label", "key", "index", "data", "offsets", "cls", "json", "class"})
DEFAULT_EXT = {"mask": "png", "boxes": "json", "box_labels": "json", "per_box": "json", "array": "npy",
               "json": "json", "image": "jpg", "bytes": "bin"}
DEFAULT_DTYPE = {"boxes": "float32", "box_labels": "int64", "per_box": "float32"}
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_EXT_RE = re.compile(r"^[a-z0-9][a-z0-9_]{0,15}$")
FIELD_PREFIX = "field/"
MASK_HINTS = ("mask", "seg", "label")  # an undeclared PNG field so named holds class ids (a mask), not an image


def offset_column(name: str) -> str:
    """Index column of a byte field's offsets in the shard file: ``field/<name>/offset``."""
    return f"{FIELD_PREFIX}{name}/offset"


def size_column(name: str) -> str:
    """Index column of a byte field's sizes: ``field/<name>/size``."""
    return f"{FIELD_PREFIX}{name}/size"


def values_column(name: str) -> str:
    """Index column of a ragged field's values: ``field/<name>``."""
    return f"{FIELD_PREFIX}{name}"


@dataclass(frozen=True)
class FieldSpec:
    """One field of the schema (see the module docstring). ``item``: per-box item shape (per_box)."""

    name: str
    kind: str
    ext: str = ""
    dtype: str = ""
    item: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"field {self.name!r}: unknown kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if not _NAME_RE.match(self.name) or self.name in RESERVED_NAMES:
            raise UsageError(f"field name {self.name!r}: expected [a-z][a-z0-9_]* (at most 32 characters), "
                             f"not one of {', '.join(sorted(RESERVED_NAMES))}")
        ext = (self.ext or DEFAULT_EXT[self.kind]).lower()
        if not _EXT_RE.match(ext):
            raise UsageError(f"field {self.name!r}: bad extension {ext!r}")
        object.__setattr__(self, "ext", ext)
        object.__setattr__(self, "dtype", self.dtype or DEFAULT_DTYPE.get(self.kind, ""))
        item = (4,) if self.kind == "boxes" else () if self.kind == "box_labels" else tuple(int(d) for d in self.item)
        object.__setattr__(self, "item", item)

    @property
    def ragged(self) -> bool:
        return self.kind in RAGGED_KINDS

    @property
    def member_suffix(self) -> str:
        """The tar member suffix after the key: ``<name>.<ext>`` (``mask.png``, ``boxes.json``)."""
        return f"{self.name}.{self.ext}"

    def columns(self) -> tuple[str, ...]:
        """The index columns this field adds."""
        if self.ragged:
            return (values_column(self.name),)
        return (offset_column(self.name), size_column(self.name))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "ext": self.ext}
        if self.dtype:
            out["dtype"] = self.dtype
        if self.ragged:
            out["item"] = list(self.item)
        return out


def specs_from_json(entries: Iterable[Any], where: str = "manifest") -> list[FieldSpec]:
    """The :class:`FieldSpec` list of a manifest's ``fields``; :class:`ManifestError` when malformed."""
    out: list[FieldSpec] = []
    for e in entries:
        try:
            out.append(FieldSpec(str(e["name"]), str(e["kind"]), str(e.get("ext", "")), str(e.get("dtype", "")),
                                 tuple(int(x) for x in e.get("item", ()))))
        except (KeyError, TypeError, ValueError, UsageError) as exc:
            raise ManifestError(f"{where}: bad fields entry {e!r} ({exc})") from exc
    check_unique(out, where)
    return out


def sample_fields(entries: Iterable[Any]) -> list[Any]:
    """The entries of a manifest's ``fields`` that are sample fields of this schema: an indexed RecordIO
    set also lists its ``label_values`` column there (kind ``values``, :mod:`stager.index.columns`),
    which no sample field reader reads."""
    return [e for e in entries if isinstance(e, dict) and e.get("kind") in KINDS]


def check_unique(specs: Sequence[FieldSpec], where: str) -> None:
    names = [s.name for s in specs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise UsageError(f"{where}: field(s) {', '.join(sorted(dup))} declared twice")
    if any(s.kind in ("box_labels", "per_box") for s in specs) and not any(s.kind == "boxes" for s in specs):
        raise UsageError(f"{where}: box_labels/per_box fields need a boxes field")
    if sum(s.kind == "boxes" for s in specs) > 1:
        raise UsageError(f"{where}: at most one boxes field per sample")


def parse_fields_arg(text: str) -> list[FieldSpec]:
    """``--fields NAME:KIND[:EXT],...`` -> specs; :class:`UsageError` naming a bad entry (unknown kind)."""
    specs = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        bits = part.split(":")
        if len(bits) not in (2, 3):
            raise UsageError(f"--fields: expected NAME:KIND[:EXT], got {part!r}")
        specs.append(FieldSpec(bits[0].strip(), bits[1].strip(), bits[2].strip() if len(bits) == 3 else ""))
    check_unique(specs, "--fields")
    return specs


def build_field_columns(specs: Sequence[FieldSpec], rows: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    """Per-sample lists of the fields' index columns (``rows``: column name -> one entry per sample) as
    index columns: :class:`~stager.manifest.table.Ragged` for ragged fields, int64 arrays otherwise.
    A column absent from ``rows`` is empty (a shard with no samples)."""
    import numpy as np  # noqa: PLC0415 (the schema module itself stays numpy-free for the CLI parser)

    from stager.manifest.table import Ragged  # noqa: PLC0415 (table imports nothing of ours; kept lazy with numpy)

    out: dict[str, Any] = {}
    for spec in specs:
        for name in spec.columns():
            vals = rows.get(name, [])
            out[name] = Ragged.from_rows(vals, spec.dtype, spec.item) if spec.ragged else np.asarray(vals, np.int64)
    return out
