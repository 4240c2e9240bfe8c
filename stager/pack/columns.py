"""A source's listing as memory-mapped columns: how ``pack --workers N`` hands the samples over.

The pack workers need every planned sample's five :class:`~stager.pack.sources.base.SampleRef`
fields. Pickled as Python objects, 1.28M samples took ~4 s to build and pickle in the parent and
~300 MB of heap in every worker. Here the parent writes the listing once, in the source's own order,
as flat files in ``.stager-pack/`` (:meth:`Columns.save`): keys and locators as one UTF-8 blob each
plus int64 end offsets, labels/sizes/mtimes as int64 arrays. Workers map them read-only
(:meth:`Columns.open`), so the pages are the page cache's, shared by all workers, and a segment
rebuilds only its own samples' refs (:meth:`Columns.refs`, by position in the listing).

Files of a listing saved at ``<stem>``: ``<stem>.keys``, ``<stem>.keys.ends``, ``<stem>.locators``,
``<stem>.locators.ends``, ``<stem>.labels``, ``<stem>.sizes``, ``<stem>.mtimes`` (raw little-endian
int64 for the arrays; ``ends[i]`` is the end of string ``i`` in its blob).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from itertools import repeat
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from stager.pack.sources.base import SampleRef

_INT_COLUMNS = ("labels", "sizes", "mtimes")  # SampleRef fields 1, 3, 4
_STR_COLUMNS = ("keys", "locators")  # SampleRef fields 0, 2


class StrColumn(NamedTuple):
    """Strings as one UTF-8 ``blob`` (bytes or a read-only map) and their int64 ``ends``."""

    blob: bytes | mmap.mmap
    ends: np.ndarray

    @classmethod
    def of(cls, texts: Sequence[str]) -> StrColumn:
        parts = [t.encode() for t in texts]
        return cls(b"".join(parts), np.cumsum(np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))))

    def take(self, positions: np.ndarray) -> list[str]:
        """The strings at ``positions`` (int64), in that order."""
        ends = self.ends
        starts = np.where(positions > 0, ends[np.maximum(positions - 1, 0)], 0).tolist()
        blob = self.blob
        return [blob[a:b].decode() for a, b in zip(starts, ends[positions].tolist(), strict=True)]


class Columns(NamedTuple):
    """A listing's five SampleRef columns, in listing order."""

    keys: StrColumn
    labels: np.ndarray
    locators: StrColumn
    sizes: np.ndarray
    mtimes: np.ndarray

    @classmethod
    def of(cls, refs: Sequence[SampleRef]) -> Columns:
        """The columns of ``refs``, taken in their order (``itemgetter`` at C speed, not ``zip(*refs)``)."""
        n = len(refs)
        keys, locs = (list(map(itemgetter(k), refs)) for k in (0, 2))
        labels, sizes, mtimes = (np.fromiter(map(itemgetter(k), refs), dtype=np.int64, count=n) for k in (1, 3, 4))
        return cls(StrColumn.of(keys), labels, StrColumn.of(locs), sizes, mtimes)

    def save(self, stem: str) -> None:
        """Write the column files at ``stem`` (see the module docstring)."""
        for name in _STR_COLUMNS:
            col: StrColumn = getattr(self, name)
            _write(f"{stem}.{name}", col.blob)
            _write(f"{stem}.{name}.ends", col.ends.astype("<i8").tobytes())
        for name in _INT_COLUMNS:
            _write(f"{stem}.{name}", getattr(self, name).astype("<i8").tobytes())

    @classmethod
    def open(cls, stem: str) -> Columns:
        """Map the column files at ``stem`` read-only."""
        strs = {name: StrColumn(_map(f"{stem}.{name}"), _ints(f"{stem}.{name}.ends")) for name in _STR_COLUMNS}
        ints = {name: _ints(f"{stem}.{name}") for name in _INT_COLUMNS}
        return cls(strs["keys"], ints["labels"], strs["locators"], ints["sizes"], ints["mtimes"])

    def refs(self, positions: np.ndarray) -> tuple[SampleRef, ...]:
        """The SampleRefs at ``positions`` (int64 indices into the listing), in that order."""
        cols = (
            self.keys.take(positions),
            self.labels[positions].tolist(),
            self.locators.take(positions),
            self.sizes[positions].tolist(),
            self.mtimes[positions].tolist(),
        )
        return tuple(map(tuple.__new__, repeat(SampleRef), zip(*cols, strict=True)))


def _write(path: str, data: bytes | mmap.mmap) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _map(path: str) -> bytes | mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size == 0:  # an empty file cannot be mapped
            return b""
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def _ints(path: str) -> np.ndarray:
    blob = _map(path)
    return np.frombuffer(blob, dtype="<i8") if len(blob) else np.zeros(0, dtype=np.int64)
