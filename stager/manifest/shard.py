"""A shard's entry in the manifest: :class:`ShardInfo` (identity, integrity, its samples' rows) and its
companion files (:class:`AuxFile`), and :func:`table_columns`, which lays shards' rows out as the
sample index's columns.

This module sits between the sample index (:mod:`stager.manifest.samples`, below: column names and
the mapped table) and the manifest document (:mod:`stager.manifest.document`, above), so that both
use shards without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stager.errors import ManifestError
from stager.lazy import on_first_use
from stager.manifest.samples import KEY, LABEL, OFFSET, SIZE, SampleIndex
from stager.manifest.table import Column, Strings

if TYPE_CHECKING:
    import numpy as np
else:  # the index is numpy columns; a plain stage never opens it: no numpy (stager/lazy.py)
    np = on_first_use("numpy", globals(), "np")


@dataclass(frozen=True)
class AuxFile:
    """A companion file of a shard that is staged with it (e.g. a record shard's DALI index)."""

    name: str
    bytes: int
    hash: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, "hash": self.hash}


class ShardInfo:
    """One shard file: identity, integrity, and the per-sample index of its samples.

    ``keys`` (a ``Sequence[str]``), ``labels``, ``offsets`` and ``sizes`` (int64 arrays) all have
    length ``samples`` and are in the shard's physical order. ``columns`` holds extra per-sample
    columns (fields, clips: :mod:`stager.manifest.samples`), each with ``samples`` rows.

    A shard built in memory (pack, index) holds these arrays itself; a shard of a loaded v2
    manifest holds a row range of the dataset's :class:`SampleIndex` and slices it on first use
    (views into the mapped file, no copy), so loading a manifest costs O(shards).
    """

    __slots__ = ("_cols", "_keys", "_labels", "_offsets", "_rows", "_samples", "_sizes",
                 "aux", "bytes", "extents", "hash", "name")

    # The positional order is v1's dataclass order: pack, index and tests build shards positionally.
    def __init__(self, name: str, bytes: int, hash: str, keys: Sequence[str] | None = None,  # noqa: PLR0917
                 labels: np.ndarray | None = None, offsets: np.ndarray | None = None,
                 sizes: np.ndarray | None = None, aux: list[AuxFile] | None = None, extents: str = "bytes",
                 *, columns: Mapping[str, Column] | None = None, samples: int | None = None,
                 rows: tuple[SampleIndex, int] | None = None) -> None:
        self.name = name
        self.bytes = bytes
        self.hash = hash
        self.aux = list(aux or [])
        self.extents = extents  # "bytes": byte ranges; "rows": rows (parquet); "records": framed records (recordio)
        self._rows = rows
        if keys is not None:
            if labels is None or offsets is None or sizes is None:
                raise TypeError("ShardInfo needs keys, labels, offsets and sizes (or rows of a sample index)")
            n = len(keys)
            self._samples = n
            self._keys: Sequence[str] | None = keys
            self._labels: np.ndarray | None = np.asarray(labels, dtype=np.int64)
            self._offsets: np.ndarray | None = np.asarray(offsets, dtype=np.int64)
            self._sizes: np.ndarray | None = np.asarray(sizes, dtype=np.int64)
            self._cols: dict[str, Column] | None = dict(columns or {})
            for what, arr in (("labels", self._labels), ("offsets", self._offsets), ("sizes", self._sizes),
                              *self._cols.items()):
                if len(arr) != n:
                    raise ValueError(f"{name}: {what} has {len(arr)} rows, keys {n}")
        else:
            if samples is None:
                raise TypeError("ShardInfo needs keys, labels, offsets and sizes, or samples (and a sample index)")
            self._samples = samples
            self._keys = self._labels = self._offsets = self._sizes = None
            self._cols = None

    @property
    def samples(self) -> int:
        return self._samples

    def __getstate__(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in self.__slots__}
        if self._rows is not None:  # slices of the mapped index: the receiver slices its own mapping
            state.update(_keys=None, _labels=None, _offsets=None, _sizes=None, _cols=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)

    def _slice(self) -> slice:
        if self._rows is None:
            # A caller's bug (a shard built without rows or arrays), not bad data: never a StagerError.
            raise RuntimeError(f"internal error: {self.name}: the manifest's sample index is not attached "
                               "(use load_manifest)")
        start = self._rows[1]
        return slice(start, start + self._samples)

    @property
    def keys(self) -> Sequence[str]:
        if self._keys is None:
            sl = self._slice()
            assert self._rows is not None
            self._keys = self._rows[0].keys[sl]
        return self._keys

    @property
    def labels(self) -> np.ndarray:
        if self._labels is None:
            sl = self._slice()
            assert self._rows is not None
            self._labels = self._rows[0].labels[sl]
        return self._labels

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            sl = self._slice()
            assert self._rows is not None
            self._offsets = self._rows[0].offsets[sl]
        return self._offsets

    @property
    def sizes(self) -> np.ndarray:
        if self._sizes is None:
            sl = self._slice()
            assert self._rows is not None
            self._sizes = self._rows[0].sizes[sl]
        return self._sizes

    @property
    def columns(self) -> dict[str, Column]:
        """Extra per-sample columns by name (fields, clips), each with ``samples`` rows."""
        if self._cols is None:
            sl = self._slice()
            assert self._rows is not None
            self._cols = {n: c[sl] for n, c in self._rows[0].extra().items()}
        return self._cols

    def to_json(self) -> dict[str, Any]:
        """The shard's manifest v2 entry (per-shard facts only; per-sample data is in the index)."""
        out: dict[str, Any] = {"name": self.name, "bytes": self.bytes, "samples": self.samples, "hash": self.hash,
                               "aux": [a.to_json() for a in self.aux]}
        if self.extents != "bytes":
            out["extents"] = self.extents
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardInfo):
            return NotImplemented
        return (self.to_json() == other.to_json() and list(self.keys) == list(other.keys)
                and np.array_equal(self.labels, other.labels) and np.array_equal(self.offsets, other.offsets)
                and np.array_equal(self.sizes, other.sizes))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ShardInfo({self.name!r}, bytes={self.bytes}, samples={self.samples}, hash={self.hash[:12]!r})"


def table_columns(shards: Sequence[ShardInfo]) -> dict[str, list[Column]]:
    """The table's columns as per-shard parts (written back to back, never concatenated in memory).

    Every shard must carry the same extra columns (a dataset has one schema)."""
    extra = list(shards[0].columns) if shards else []
    cols: dict[str, list[Column]] = {KEY: [], LABEL: [], OFFSET: [], SIZE: [], **{n: [] for n in extra}}
    for s in shards:
        if sorted(s.columns) != sorted(extra):
            raise ManifestError(f"{s.name}: per-sample columns {sorted(s.columns)} differ from the first shard's "
                                f"{sorted(extra)}; every shard of a dataset has the same fields")
        keys = s.keys
        cols[KEY].append(keys if isinstance(keys, Strings) else Strings.from_strings(keys))
        cols[LABEL].append(np.asarray(s.labels, dtype=np.int64))
        cols[OFFSET].append(np.asarray(s.offsets, dtype=np.int64))
        cols[SIZE].append(np.asarray(s.sizes, dtype=np.int64))
        for n in extra:
            cols[n].append(s.columns[n])
    if not shards:
        cols[KEY].append(Strings.from_strings([]))
        for n in (LABEL, OFFSET, SIZE):
            cols[n].append(np.zeros(0, np.int64))
    return cols
