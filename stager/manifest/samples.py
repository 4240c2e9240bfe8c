"""The sample index of a manifest v2 dataset: its per-sample columns, in one table file.

``manifest.json`` (v2) holds per-shard facts; every per-sample fact lives in one table file
(:mod:`stager.manifest.table`) beside it, named ``index-<16 hex of its hash>.sidx`` and listed in the
manifest's ``index`` entry with its size and hash. Rows are samples in manifest order (shard after
shard, the shard's physical order inside). The core columns every dataset has:

=========  ===============  ==========================================================
column     type             meaning
=========  ===============  ==========================================================
``key``    ragged UTF-8     the sample key
``label``  int64 (N,)       ``0 <= label < len(classes)``, or -1 (unlabeled)
``offset`` int64 (N,)       where the primary payload starts in its shard (per format)
``size``   int64 (N,)       the payload's length
=========  ===============  ==========================================================

Further columns are *extra* columns, carried shard by shard in :attr:`~stager.manifest.shard.ShardInfo.columns` and kept
under their own names: samples with fields put theirs under ``field/<name>/...`` (the extents of
each field's bytes in the shard, or the field's values themselves), clips their sequence number and
frame number. The name is the contract; the manifest's ``fields``/``clips`` entries say how to read
them. A content-addressed name makes publishing atomic: the new index is written under its own
name before the manifest that names it is renamed into place, so a reader never pairs a manifest
with another index.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from stager.errors import ManifestError
from stager.lazy import on_first_use
from stager.manifest.table import Ragged, Strings, Table

if TYPE_CHECKING:
    import numpy as np
else:  # the index is numpy columns; a plain stage never opens it: no numpy (stager/lazy.py)
    np = on_first_use("numpy", globals(), "np")

KEY, LABEL, OFFSET, SIZE = "key", "label", "offset", "size"
CORE = (KEY, LABEL, OFFSET, SIZE)
INDEX_PREFIX, INDEX_SUFFIX = "index-", ".sidx"
INDEX_PARTIAL_BASE = "index.sidx"  # a sample index being written: <base>.<12 hex>.partial, then renamed
_CHUNK = 1 << 20  # rows checked at a time: no temporaries of the table's size


def index_file_name(digest: str) -> str:
    """``index-<first 16 hex digits of the table's hash>.sidx``."""
    return f"{INDEX_PREFIX}{digest[:16]}{INDEX_SUFFIX}"


def is_index_file_name(name: str) -> bool:
    return name.startswith(INDEX_PREFIX) and name.endswith(INDEX_SUFFIX)


class SampleIndex:
    """A dataset's per-sample columns, opened on first use and checked once.

    ``opener`` returns the parsed :class:`Table` (a memory map of a local file, or the bytes of a
    remote one). Until a per-sample fact is asked for, nothing is opened: loading a manifest costs
    O(shards) and no numpy. ``starts``: (shards + 1) ints, each shard's first row; ``shard_bytes``: each
    shard's size. ``byte_ranges``: the format's ``bytes`` extents are byte ranges of the shard file,
    checked against ``shard_bytes`` (not zarr's rows).
    """

    def __init__(self, opener: Callable[[], Table], where: str, *, starts: Sequence[int],
                 shard_bytes: Sequence[int], nclass: int, byte_ranges: bool, extents: Sequence[str]) -> None:
        self._opener = opener
        self.where = where
        self.starts = starts
        self._shard_bytes = shard_bytes
        self._nclass = nclass
        self._byte_ranges = byte_ranges  # the format's offsets are file byte ranges (not zarr's rows)
        self._extents = list(extents)

    def __getstate__(self) -> dict[str, Any]:
        # A pickled index (a spawned loader worker) reopens the file: never ship the mapped pages.
        state = dict(self.__dict__)
        state.pop("table", None)
        return state

    @cached_property
    def table(self) -> Table:
        t = self._opener()
        n = int(self.starts[-1])
        if t.rows != n:
            raise ManifestError(f"{self.where}: sample index has {t.rows} rows, the manifest's shards hold {n}; "
                                "restore the index or re-run the pack")
        for name in CORE:
            if name not in t:
                raise ManifestError(f"{self.where}: sample index lacks column {name!r}; re-run the pack")
        for name in (LABEL, OFFSET, SIZE):
            a = t.array(name)
            if a.dtype != np.dtype("<i8") or a.ndim != 1:
                raise ManifestError(f"{self.where}: column {name!r} must be int64 (N,), is {a.dtype} {a.shape}")
        if not isinstance(t.columns[KEY], Ragged) or t.ragged(KEY).values.dtype != np.uint8:
            raise ManifestError(f"{self.where}: column 'key' must be ragged UTF-8 bytes")
        self._check(t)
        return t

    def _check(self, t: Table) -> None:
        """Labels in range, extents non-negative and inside their shard (vectorised, chunked)."""
        labels, offsets, sizes = t.array(LABEL), t.array(OFFSET), t.array(SIZE)
        for a in range(0, t.rows, _CHUNK):
            lab = labels[a : a + _CHUNK]
            if len(lab) and (int(lab.min()) < -1 or (self._nclass and int(lab.max()) >= self._nclass)):
                row = a + int(np.flatnonzero((lab < -1) | ((lab >= self._nclass) if self._nclass else False))[0])
                raise ManifestError(f"{self.where}: row {row}: label out of range -1..{self._nclass - 1}")
            if len(lab) and (int(offsets[a : a + _CHUNK].min()) < 0 or int(sizes[a : a + _CHUNK].min()) < 0):
                raise ManifestError(f"{self.where}: rows {a}..: negative sample offset or size")
        if not self._byte_ranges:
            return
        for i in range(len(self.starts) - 1):
            a, b = int(self.starts[i]), int(self.starts[i + 1])
            if self._extents[i] != "bytes" or a == b:
                continue
            for c in range(a, b, _CHUNK):
                e = min(b, c + _CHUNK)
                if int((offsets[c:e] + sizes[c:e]).max()) > int(self._shard_bytes[i]):
                    raise ManifestError(f"{self.where}: shard {i}: sample extents exceed the shard's "
                                        f"{int(self._shard_bytes[i])} bytes")

    @property
    def keys(self) -> Strings:
        return self.table.strings(KEY)

    @property
    def labels(self) -> np.ndarray:
        return self.table.array(LABEL)

    @property
    def offsets(self) -> np.ndarray:
        return self.table.array(OFFSET)

    @property
    def sizes(self) -> np.ndarray:
        return self.table.array(SIZE)

    def extra(self) -> Mapping[str, np.ndarray | Ragged]:
        """The extra columns (everything but the core four), by name."""
        return {n: c for n, c in self.table.columns.items() if n not in CORE}
