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
int64 for the arrays; ``ends[i]`` is the end of string ``i`` in its blob) and ``<stem>.prefix``
(UTF-8, prepended to every locator).

A source may also keep its listing in this form from the start (:class:`ListingRefs`, a lazy
``Sequence[SampleRef]``): ImageFolder does, so that 1.28M samples cost ~70 bytes each (their
strings' bytes and five numbers) instead of ~500 bytes of Python objects.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from itertools import repeat
from operator import itemgetter
from typing import NamedTuple, overload

import numpy as np

from stager.formats.base import Lines
from stager.fs.kernel import release_free_heap
from stager.pack.sources.base import SampleRef

_INT_COLUMNS = ("labels", "sizes", "mtimes")  # SampleRef fields 1, 3, 4
_STR_COLUMNS = ("keys", "locators")  # SampleRef fields 0, 2


class StrColumn(NamedTuple):
    """Strings as one UTF-8 ``blob`` (bytes or a read-only map) and their int64 ``ends``."""

    blob: bytes | bytearray | mmap.mmap
    ends: np.ndarray

    @classmethod
    def of(cls, texts: Sequence[str]) -> StrColumn:
        # surrogateescape: a file name that is not UTF-8 round-trips (os.scandir gives it that way).
        parts = [t.encode("utf-8", "surrogateescape") for t in texts]
        return cls(b"".join(parts), np.cumsum(np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))))

    def at(self, i: int) -> str:
        """String ``i``."""
        a = int(self.ends[i - 1]) if i > 0 else 0
        return self.blob[a : int(self.ends[i])].decode("utf-8", "surrogateescape")

    def lengths(self) -> np.ndarray:
        """Each string's length in bytes (int64)."""
        return np.diff(self.ends, prepend=0)

    def joined(self, positions: np.ndarray | None = None, sep: int = 0x0A) -> bytes:
        """The strings at ``positions`` (all, in order, for None) joined by the byte ``sep``, gathered
        from the blob by numpy (no Python object per string)."""
        blob = np.frombuffer(self.blob, dtype=np.uint8) if len(self.blob) else np.zeros(0, np.uint8)
        if positions is None:
            return np.insert(blob, self.ends[:-1], sep).tobytes()
        if len(positions) == 0:
            return b""
        stops = self.ends[positions]
        starts = np.where(positions > 0, self.ends[np.maximum(positions - 1, 0)], 0)
        take = stops - starts + 1  # each string and a separator after it
        firsts = np.cumsum(take) - take  # where each one starts in the result
        idx_type = np.int32 if len(blob) < (1 << 31) - 1 and int(firsts[-1] + take[-1]) < (1 << 31) else np.int64
        # Result byte j is blob byte (start of its string) + (j - where its string starts); the
        # separators read one byte past the blob, where ``sep`` is.
        total = int(firsts[-1] + take[-1])
        idx = np.repeat((starts - firsts).astype(idx_type), take) + np.arange(total, dtype=idx_type)
        idx[firsts[1:] - 1] = len(blob)
        return np.append(blob, np.uint8(sep))[idx[:-1]].tobytes()

    def all_end_with(self, suffix: bytes) -> bool:
        """Whether every string ends with ``suffix`` (one numpy comparison over the blob's bytes)."""
        lengths = self.lengths()
        if not len(lengths) or int(lengths.min()) < len(suffix):
            return len(lengths) == 0
        blob = np.frombuffer(self.blob, dtype=np.uint8)
        tails = blob[(self.ends - len(suffix))[:, None] + np.arange(len(suffix))]
        return bool((tails == np.frombuffer(suffix, dtype=np.uint8)).all())

    def lines(self, positions: np.ndarray | None = None, *, unique: bool = False) -> Sequence[str]:
        """The strings at ``positions`` (all for None) as :class:`~stager.formats.base.Lines`, decoded in
        one go; as a list where a string holds a newline (a file name may), which only the per-string
        checks then refuse. ``unique``: the caller knows that they hold no repeat."""
        text = self.joined(positions).decode("utf-8", "surrogateescape")
        lengths = self.lengths() if positions is None else self.lengths()[positions]
        if text.count("\n") != max(len(lengths) - 1, 0):
            return self.take(np.arange(len(self.ends), dtype=np.int64) if positions is None else positions)
        return Lines(text, lengths, unique=unique)

    def take(self, positions: np.ndarray) -> list[str]:
        """The strings at ``positions`` (int64), in that order."""
        ends = self.ends
        starts = np.where(positions > 0, ends[np.maximum(positions - 1, 0)], 0).tolist()
        blob = self.blob
        stops = ends[positions].tolist()
        return [blob[a:b].decode("utf-8", "surrogateescape") for a, b in zip(starts, stops, strict=True)]


class Columns(NamedTuple):
    """A listing's five SampleRef columns, in listing order; a locator is ``prefix`` + its string."""

    keys: StrColumn
    labels: np.ndarray
    locators: StrColumn
    sizes: np.ndarray
    mtimes: np.ndarray
    prefix: str = ""

    @classmethod
    def of(cls, refs: Sequence[SampleRef]) -> Columns:
        """The columns of ``refs``, taken in their order (``itemgetter`` at C speed, not ``zip(*refs)``)."""
        if isinstance(refs, ListingRefs):
            return refs.columns
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
        _write(f"{stem}.prefix", self.prefix.encode("utf-8", "surrogateescape"))

    @classmethod
    def open(cls, stem: str) -> Columns:
        """Map the column files at ``stem`` read-only."""
        strs = {name: StrColumn(_map(f"{stem}.{name}"), _ints(f"{stem}.{name}.ends")) for name in _STR_COLUMNS}
        ints = {name: _ints(f"{stem}.{name}") for name in _INT_COLUMNS}
        with open(f"{stem}.prefix", "rb") as f:
            prefix = f.read().decode("utf-8", "surrogateescape")
        return cls(strs["keys"], ints["labels"], strs["locators"], ints["sizes"], ints["mtimes"], prefix)

    def refs(self, positions: np.ndarray) -> tuple[SampleRef, ...]:
        """The SampleRefs at ``positions`` (int64 indices into the listing), in that order."""
        locators = self.locators.take(positions)
        if self.prefix:
            locators = list(map(self.prefix.__add__, locators))
        cols = (
            self.keys.take(positions),
            self.labels[positions].tolist(),
            locators,
            self.sizes[positions].tolist(),
            self.mtimes[positions].tolist(),
        )
        return tuple(map(tuple.__new__, repeat(SampleRef), zip(*cols, strict=True)))


def sizes_of(refs: Sequence[SampleRef]) -> np.ndarray:
    """Each ref's ``size`` (int64), from a columnar view's ``sizes`` without building its refs."""
    sizes = getattr(refs, "sizes", None)
    if isinstance(sizes, np.ndarray):
        return sizes
    return np.fromiter((r[3] for r in refs), dtype=np.int64, count=len(refs))  # r[3] is r.size


_CHUNK = 4096  # refs built per step when iterating a ListingRefs (vectorised, yet bounded memory)
CHUNK_LINES = 1 << 18  # strings decoded at once as Lines (~7 MB of text for ImageNet's keys)


class ListingRefs(Sequence[SampleRef]):
    """A source's listing kept as :class:`Columns`: a read-only ``Sequence[SampleRef]`` whose refs
    are built only when asked for (an index builds one, a slice or :meth:`take` a tuple of them at
    once, iteration a few thousand at a time). ``columns`` are the listing itself: the planner and
    the pack workers use them directly."""

    __slots__ = ("columns", "stem")

    def __init__(self, columns: Columns) -> None:
        self.columns = columns
        self.stem: str | None = None  # where the columns are saved and mapped from, once spilled

    def spill(self, stem: str) -> None:
        """Save the columns at ``stem`` and map them from there: their pages become the page cache's
        (shared, reclaimable) instead of this process's heap; the freed heap goes back to the kernel."""
        self.columns.save(stem)
        self.columns = Columns.open(stem)
        self.stem = stem
        release_free_heap()

    @property
    def sizes(self) -> np.ndarray:
        return self.columns.sizes

    def __len__(self) -> int:
        return len(self.columns.sizes)

    @overload
    def __getitem__(self, i: int) -> SampleRef: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[SampleRef, ...]: ...
    def __getitem__(self, i: int | slice) -> SampleRef | tuple[SampleRef, ...]:
        if isinstance(i, slice):
            return self.take(np.arange(len(self), dtype=np.int64)[i])
        c = self.columns
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        i %= n
        loc = c.prefix + c.locators.at(i)
        return SampleRef(c.keys.at(i), int(c.labels[i]), loc, int(c.sizes[i]), int(c.mtimes[i]))

    def key_chunks(self, step: int | None = None) -> Iterator[Sequence[str]]:
        """The keys in listing order, ``step`` (default :data:`CHUNK_LINES`) at a time, each chunk
        decoded at once as :class:`~stager.formats.base.Lines` (``unique``: a listing's keys are, by
        the source contract, across chunks too): never a Python string per key, and a bounded text at
        a time."""
        n = len(self)
        step = step or CHUNK_LINES
        for a in range(0, n, step):
            pos = None if a == 0 and n <= step else np.arange(a, min(a + step, n), dtype=np.int64)
            yield self.columns.keys.lines(pos, unique=True)

    def take(self, positions: np.ndarray) -> tuple[SampleRef, ...]:
        """The refs at ``positions`` (int64 indices), in that order."""
        return self.columns.refs(np.asarray(positions, dtype=np.int64))

    def __iter__(self) -> Iterator[SampleRef]:
        for a in range(0, len(self), _CHUNK):
            yield from self.take(np.arange(a, min(a + _CHUNK, len(self)), dtype=np.int64))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable-looking sequence semantics, like a list


def _write(path: str, data: bytes | bytearray | mmap.mmap) -> None:
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
