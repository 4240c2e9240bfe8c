"""Index parquet files: Hugging Face image datasets (``{bytes, path}`` structs) and plain binary columns.

The image column (``image_key``, default ``image``) is a struct with a ``bytes`` field (what
``datasets`` writes for its ``Image`` feature) or a binary column. Where its column chunks are stored
uncompressed (``datasets`` writes image bytes so; ``pyarrow.parquet.write_table(...,
compression="none")``), every value's bytes sit contiguously in the file: the page headers are
parsed (:mod:`stager.index._thrift`) and each sample's extent is the byte range of its value, in
PLAIN data pages or in a PLAIN dictionary page, so the loader reads it with one ``pread`` or a slice
of the mapping like any stager shard. Where any image chunk of a file is compressed (snappy, zstd,
...), no byte range holds the image: that file's extents are ``"rows"`` (``offsets`` = row in the file,
``sizes`` = the image's length) and readers decode it through pyarrow (docs/index.md says what that
costs). Labels come from ``label_key`` (ints, or strings as class names); class names from the
Hugging Face metadata in the schema (``huggingface`` -> ``info.features.<label>.names`` of a
``ClassLabel``) when present. Keys are the struct's ``path`` when present and unique, else positions.
Other columns become fields (:mod:`stager.index.parquet_fields`: uncompressed binary columns with
their byte extents, ``boxes``/``box_labels``/per-box list columns as ragged values).

pyarrow is imported lazily: it is needed only to index or read parquet.
"""

from __future__ import annotations

import json
from typing import Any

from stager.errors import UsageError
from stager.index import _thrift as th
from stager.index.parquet_fields import scan_parquet_fields
from stager.index.scan import DamagedShardError, ShardScan, mapped


def import_pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq  # noqa: PLC0415 (optional, heavy: only for parquet)
    except ImportError as exc:
        raise UsageError("indexing parquet needs pyarrow: pip install pyarrow") from exc
    return pq


def scan_parquet(path: str, name: str, image_key: str | None, label_key: str | None, algo: str, *,
              fields: bool = True) -> ShardScan:
    """Index one parquet file (see the module docstring)."""
    pq = import_pyarrow()
    col = image_key or "image"
    with mapped(path, algo) as (view, digest, st):
        out = ShardScan(name, st.st_size, digest, st.st_mtime_ns)
        try:
            pf = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for damaged files
            raise DamagedShardError(f"{path}: not a readable parquet file ({exc})") from exc
        leaf, has_path = _image_leaf(pf, col, path)
        out.classes = hf_class_names(pf, label_key)
        compressed = _image_chunks_compressed(pf, leaf)
        if compressed:
            out.extents = "rows"
            out.sizes = _lengths(pf, leaf, path)
            out.offsets = list(range(len(out.sizes)))
        else:
            for rg in range(pf.metadata.num_row_groups):
                _plain_extents(view, pf, rg, leaf, out=out, path=path)
        n = len(out.sizes)
        if pf.metadata.num_rows != n:
            raise DamagedShardError(f"{path}: {pf.metadata.num_rows} rows but {n} image values")
        out.labels = _labels(pf, label_key, n, path)
        out.keys = _keys(pf, col, has_path, n, name)
        if fields:
            scan_parquet_fields(view, pf, out, skip={col, label_key or ""}, extents=_plain_extents,
                                compressed=_image_chunks_compressed, path=path)
    return out


def _image_leaf(pf: Any, col: str, path: str) -> tuple[str, bool]:
    """The leaf column path of the image bytes (``image.bytes`` or ``image``), and whether ``.path`` exists."""
    schema = pf.schema_arrow
    names = schema.names
    if col not in names:
        raise UsageError(f"{path}: no column {col!r} (columns: {', '.join(names)}); pass --image-key")
    t = schema.field(col).type
    if hasattr(t, "get_field_index") and t.get_field_index("bytes") >= 0:
        return f"{col}.bytes", t.get_field_index("path") >= 0
    import pyarrow as pa  # noqa: PLC0415 (optional, heavy: only for parquet)

    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return col, False
    raise UsageError(f"{path}: column {col!r} is {t}; expected binary or a struct with a 'bytes' field")


def _leaf_index(pf: Any, leaf: str) -> int:
    md = pf.metadata.schema
    for i in range(len(md)):
        if md.column(i).path == leaf:
            return i
    raise UsageError(f"{pf}: no leaf column {leaf!r}")


def _image_chunks_compressed(pf: Any, leaf: str) -> bool:
    ci = _leaf_index(pf, leaf)
    md = pf.metadata
    return any(md.row_group(rg).column(ci).compression != "UNCOMPRESSED" for rg in range(md.num_row_groups))


def _plain_extents(view: memoryview, pf: Any, rg: int, leaf: str, *, out: ShardScan, path: str) -> None:
    """Append the byte extents of row group ``rg``'s image values (uncompressed chunk) to ``out``."""
    ci = _leaf_index(pf, leaf)
    desc = pf.metadata.schema.column(ci)
    max_def, max_rep = desc.max_definition_level, desc.max_repetition_level
    if max_rep:
        raise UsageError(f"{path}: image column {leaf!r} is repeated (a list); expected one image per row")
    chunk = pf.metadata.row_group(rg).column(ci)
    pos = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    end = pos + chunk.total_compressed_size
    dictionary: list[tuple[int, int]] = []
    try:
        while pos < end:
            hdr, body = th.read_struct(view, pos, end)
            size = hdr.get(3, -1)
            if size < 0 or body + size > end:
                raise th.ThriftError(f"page at byte {pos} runs past its column chunk")
            kind = hdr.get(1)
            if kind == th.DICTIONARY_PAGE:
                dictionary = _plain_values(view, body, body + size, hdr[7].get(1, 0), path)
            elif kind in (th.DATA_PAGE, th.DATA_PAGE_V2):
                _data_page(view, hdr, body, body + size, max_def=max_def, dictionary=dictionary, out=out, path=path)
            pos = body + size
    except (th.ThriftError, KeyError, IndexError) as exc:
        raise DamagedShardError(f"{path}: damaged page in column {leaf!r}, row group {rg} ({exc})") from exc


def _data_page(view: memoryview, hdr: dict[int, Any], pos: int, end: int, *, max_def: int,
               dictionary: list[tuple[int, int]], out: ShardScan, path: str) -> None:
    bw = max_def.bit_length()
    if hdr[1] == th.DATA_PAGE:
        h = hdr[5]
        n, enc = h[1], h[2]
        if max_def:
            ln = int.from_bytes(view[pos : pos + 4], "little")
            levels = th.rle_hybrid(view, pos + 4, pos + 4 + ln, bw, n)
            pos += 4 + ln
    else:
        h = hdr[8]
        n, enc = h[1], h[4]
        rep_len, def_len = h.get(6, 0), h.get(5, 0)
        if max_def:
            levels = th.rle_hybrid(view, pos + rep_len, pos + rep_len + def_len, bw, n)
        pos += rep_len + def_len
    if max_def and any(v != max_def for v in levels):
        raise DamagedShardError(f"{path}: row {len(out.sizes) + levels.index(min(levels))} has no image bytes "
                                 "(null); every row must hold an image")
    if enc == th.PLAIN:
        vals = _plain_values(view, pos, end, n, path)
    elif enc in (th.PLAIN_DICTIONARY, th.RLE_DICTIONARY):
        idx = th.rle_hybrid(view, pos + 1, end, view[pos], n)
        vals = [dictionary[i] for i in idx]
    else:
        raise UsageError(f"{path}: image values use parquet encoding {enc}; stager reads PLAIN and dictionary "
                         "pages only (rewrite with pyarrow's defaults)")
    for off, size in vals:
        out.offsets.append(off)
        out.sizes.append(size)


def _plain_values(view: memoryview, pos: int, end: int, n: int, path: str) -> list[tuple[int, int]]:
    """``(file offset, length)`` of ``n`` PLAIN BYTE_ARRAY values at ``pos`` (4-byte length + bytes each)."""
    out = []
    for _ in range(n):
        if pos + 4 > end:
            raise th.ThriftError(f"PLAIN value at byte {pos} runs past its page")
        size = int.from_bytes(view[pos : pos + 4], "little")
        if pos + 4 + size > end:
            raise th.ThriftError(f"PLAIN value at byte {pos} runs past its page")
        out.append((pos + 4, size))
        pos += 4 + size
    return out


def _column(pf: Any, cols: list[str], path: str) -> list[Any]:
    try:
        table = pf.read(columns=cols)
    except Exception as exc:  # ArrowInvalid, OSError from a damaged file
        raise DamagedShardError(f"{path}: cannot read column {cols[0]!r} ({exc})") from exc
    col = table.column(0)
    if col.type.num_fields if hasattr(col.type, "num_fields") else False:
        col = col.combine_chunks().field(0) if len(cols) == 1 and "." in cols[0] else col
    return list(col.to_pylist())


def _lengths(pf: Any, leaf: str, path: str) -> list[int]:
    """Byte length of every image value (one decode of the column, no copy of the values into Python)."""
    import pyarrow.compute as pc  # noqa: PLC0415 (optional, heavy: only for parquet)

    out: list[int] = []
    for rg in range(pf.metadata.num_row_groups):
        try:
            col = pf.read_row_group(rg, columns=[leaf]).column(0).combine_chunks()
        except Exception as exc:  # ArrowInvalid/OSError from a damaged page
            raise DamagedShardError(f"{path}: row group {rg} of column {leaf!r} is unreadable ({exc})") from exc
        while hasattr(col.type, "num_fields") and col.type.num_fields:
            col = col.field(0)
        if col.null_count:
            raise DamagedShardError(f"{path}: a row of row group {rg} has no image bytes (null); every row must hold "
                                    "an image")
        out += pc.binary_length(col).to_pylist()
    return out


def _labels(pf: Any, label_key: str | None, n: int, path: str) -> list[Any]:
    if label_key is None:
        return [None] * n
    if label_key not in pf.schema_arrow.names:
        raise UsageError(f"{path}: no column {label_key!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                         "pass --label-key COLUMN or --label-key none")
    values = _column(pf, [label_key], path)
    for v in values:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, str))):
            raise UsageError(f"{path}: label column {label_key!r} holds {type(v).__name__} values; "
                             "expected integers or class names")
    return values


def _keys(pf: Any, col: str, has_path: bool, n: int, name: str) -> list[str]:
    if has_path:
        paths = _column(pf, [f"{col}.path"], name)
        if all(isinstance(p, str) and p for p in paths) and len(set(paths)) == n:
            return paths
    return [f"{name}/{i:08d}" for i in range(n)]


def hf_class_names(pf: Any, label_key: str | None) -> list[str] | None:
    """Class names of a Hugging Face ``ClassLabel`` label column, from the file's schema metadata."""
    meta = pf.schema_arrow.metadata or {}
    raw = meta.get(b"huggingface")
    if raw is None or label_key is None:
        return None
    try:
        info = json.loads(raw)
        feat = info["info"]["features"][label_key]
    except (ValueError, KeyError, TypeError):
        return None
    names = feat.get("names") if isinstance(feat, dict) and feat.get("_type") == "ClassLabel" else None
    return [str(x) for x in names] if isinstance(names, list) else None
