"""parquet files indexed in place by ``stager index`` (read-only: stager never writes parquet).

A shard's manifest extents are either file byte ranges of the image values (``extents: "bytes"``:
uncompressed column chunks, read like any encoded shard, zero-copy) or rows (``extents: "rows"``:
compressed chunks, where no byte range holds an image). Rows are read through pyarrow one row group
at a time: :meth:`ParquetShardReader.read` decodes each row group it needs and keeps the last
:data:`CACHED` decoded, so a run of consecutive rows costs at most one row-group decode (docs/index.md:
cost).
pyarrow is imported lazily, only when rows are read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from stager.errors import CorruptSampleError, ShardMissingError, UsageError
from stager.formats.base import ExtentReader, Format, Sample, indexed_samples
from stager.formats.registry import format_spec
from stager.manifest import Manifest, ShardInfo

CACHED = 4  # decoded row groups kept per reader (a worker holds one reader per open shard)


class ParquetShardReader(ExtentReader):
    """``read(positions)``: byte extents through ``pread`` (like tar), or rows through pyarrow."""

    def __init__(self, path: str, info: ShardInfo | None = None, manifest: Manifest | None = None) -> None:
        super().__init__(path, info, manifest)
        opts = (manifest.options.get("index") or {}) if manifest is not None else {}
        self.column = str(opts.get("image_key") or "image")
        self._pf: Any = None
        self._leaf: list[str] | None = None
        self._cached: dict[int, Any] = {}  # row group -> its decoded image column (the last CACHED ones)

    def _file(self) -> Any:
        if self._pf is None:
            try:
                import pyarrow.parquet as pq  # noqa: PLC0415 (optional, heavy: only for compressed parquet)
            except ImportError as exc:
                raise UsageError(f"{self.path}: reading compressed parquet pages needs pyarrow: pip install "
                                 "pyarrow") from exc
            try:
                self._pf = pq.ParquetFile(self.path)
            except FileNotFoundError as exc:
                raise ShardMissingError(f"{self.path}: shard missing; re-stage the dataset") from exc
            except Exception as exc:  # ArrowInvalid for a damaged file
                raise CorruptSampleError(f"{self.path}: not a readable parquet file ({exc})") from exc
            t = self._pf.schema_arrow.field(self.column).type
            self._leaf = [f"{self.column}.bytes"] if hasattr(t, "get_field_index") else [self.column]
        return self._pf

    def _row_group(self, rg: int) -> Any:
        got = self._cached.pop(rg, None)
        if got is None:
            pf = self._file()
            try:
                col = pf.read_row_group(rg, columns=self._leaf).column(0).combine_chunks()
            except Exception as exc:  # ArrowInvalid/OSError: a damaged page
                raise CorruptSampleError(f"{self.path}: row group {rg} is unreadable ({exc})") from exc
            while hasattr(col.type, "num_fields") and col.type.num_fields:
                col = col.field(0)
            got = col
            if len(self._cached) >= CACHED:
                self._cached.pop(next(iter(self._cached)))
        self._cached[rg] = got  # most recently used last
        return got

    def read(self, positions: Sequence[int] | np.ndarray) -> list[Any]:
        if self.info is None or self.info.extents != "rows":
            return super().read(positions)
        rows = self.info.offsets[np.asarray(positions, dtype=np.int64).reshape(-1)]
        pf = self._file()
        md = pf.metadata
        bounds = np.cumsum([0] + [md.row_group(i).num_rows for i in range(md.num_row_groups)])
        out: list[Any] = []
        for r in rows.tolist():
            rg = int(np.searchsorted(bounds, r, side="right") - 1)
            value = self._row_group(rg)[r - int(bounds[rg])].as_py()
            if value is None:
                raise CorruptSampleError(f"{self.path}: row {r} has no image bytes")
            out.append(value)
        return out

    def iter_samples(self) -> Iterator[Sample]:
        """The indexed samples in order, payloads read by :meth:`read` (keys and labels from the index)."""
        return indexed_samples(self, "parquet")

    def close(self) -> None:
        super().close()
        self._pf = None
        self._cached = {}


class ParquetFormat(Format):
    """parquet files adopted by ``stager index`` (reader only)."""

    spec = format_spec("parquet")
    reader = ParquetShardReader


FORMAT = ParquetFormat()
