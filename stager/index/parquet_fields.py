"""The other columns of a parquet file as fields (docs/fields.md, "stager index"): what a row holds
beside its image and label.

* a binary column, or a struct with a ``bytes`` field (``datasets``' ``Image``), stored uncompressed:
  a byte field whose per-row extents are parsed from its pages as the image's are
  (``stager.index.parquet``'s page parser); its kind from the first value's magic and the
  column's name (a PNG named ``*mask*``/``*seg*``/``*label*`` is a ``mask``, other images ``image``,
  ``.npy`` bytes ``array``, JSON text ``json``, else ``bytes``). A compressed binary column has no
  byte range per value and is not adopted (rewrite it with ``compression="none"`` for that column);
* ``boxes``: a list of ``[x0, y0, x1, y1]`` per row -> the ragged ``boxes`` field; ``box_labels``: a
  list of ints per row; any other list-of-numbers column as long as the boxes on every row: a
  ``per_box`` field. Parsed once here, into the index's ragged columns.

Other columns (strings, scalars, nested structs) are not adopted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stager.errors import UsageError
from stager.index.fields import FieldRows, Found, parse_ragged
from stager.index.scan import ShardScan
from stager.manifest.fields import MASK_HINTS, FieldSpec

# (view, pf, row group, leaf, out=ShardScan, path=str) -> None: appends the extents of ``leaf``'s values
Extents = Callable[..., None]


def scan_parquet_fields(view: memoryview, pf: Any, out: ShardScan, *, skip: set[str], extents: Extents,
                        compressed: Callable[[Any, str], bool], path: str) -> None:
    """Add the fields of ``pf``'s columns other than ``skip`` to ``out`` (see the module docstring)."""
    import pyarrow as pa  # noqa: PLC0415 (optional, heavy: only for parquet)

    schema = pf.schema_arrow
    found: dict[str, list[Found]] = {}
    ragged: dict[str, list[Any]] = {}
    for col in schema.names:
        if col in skip:
            continue
        t = schema.field(col).type
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            leaf = col
        elif pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
            leaf = f"{col}.bytes"
        elif (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
            ragged[col] = pf.read(columns=[col]).column(0).to_pylist()
            continue
        else:
            continue
        got = None if compressed(pf, leaf) else _byte_field(view, pf, col, leaf, extents=extents, path=path)
        if got is not None:
            found[col] = got
    found.update(_ragged_fields(ragged, path))
    rows = FieldRows(out, path)
    for i, key in enumerate(out.keys):
        rows.add(key, [f[i] for f in found.values()])


def _byte_field(view: memoryview, pf: Any, col: str, leaf: str, *, extents: Extents, path: str) -> list[Found] | None:
    tmp = ShardScan(col, 0, "", 0)
    for rg in range(pf.metadata.num_row_groups):
        extents(view, pf, rg, leaf, out=tmp, path=path)
    if not tmp.sizes:
        return None
    first = bytes(view[tmp.offsets[0] : tmp.offsets[0] + min(tmp.sizes[0], 16)])
    try:
        spec = FieldSpec(col, *_kind(col, first))
    except UsageError:
        return None
    return [Found(spec, extent=(o, s)) for o, s in zip(tmp.offsets, tmp.sizes, strict=True)]


def _kind(name: str, head: bytes) -> tuple[str, str]:
    if head.startswith(b"\x93NUMPY"):
        return "array", "npy"
    if head.startswith(b"\x89PNG"):
        return ("mask" if any(h in name for h in MASK_HINTS) else "image"), "png"
    if head.startswith(b"\xff\xd8"):
        return "image", "jpg"
    if head[:1] in (b"{", b"["):
        return "json", "json"
    return "bytes", "bin"


def _ragged_fields(cols: dict[str, list[Any]], path: str) -> dict[str, list[Found]]:
    """``boxes``, ``box_labels`` and per-box list columns as ragged fields (see the module docstring)."""
    boxes = cols.get("boxes")
    if boxes is None:
        return {}
    out: dict[str, list[Found]] = {}
    spec = FieldSpec("boxes", "boxes")
    out["boxes"] = [Found(spec, values=parse_ragged(spec, v, f"{path}: row {i} (boxes)")) for i, v in enumerate(boxes)]
    counts = [len(f.values) // 4 for f in out["boxes"]]
    for col, vals in cols.items():
        if col == "boxes" or any(v is not None and (len(v) != n or any(isinstance(x, list) for x in v))
                                 for v, n in zip(vals, counts, strict=True)):
            continue
        kind = "box_labels" if col == "box_labels" else "per_box"
        ints = all(isinstance(x, int) for v in vals if v for x in v)
        try:
            spec = FieldSpec(col, kind, dtype="int64" if ints else "float32")
            out[col] = [Found(spec, values=parse_ragged(spec, v, f"{path}: row {i} ({col})"))
                        for i, v in enumerate(vals)]
        except (UsageError, ValueError):
            continue
    return out
