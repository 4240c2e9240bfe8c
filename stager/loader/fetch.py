"""A worker's payloads, read when its read schedule (:mod:`stager.order.reads`) says.

The worker loop (:class:`~stager.loader.ShardedDataset`) asks for its batches in turn:
``fetcher.batch(step, positions)`` first issues the reads the schedule assigns to loading worker
batch ``step``, in schedule order, then returns the payloads at ``positions`` (stream positions in
emission order) and the payload bytes read for it. Two ways to hold a read's samples until the
shuffle buffer emits them:

* :class:`MappedFetcher` (local shard files of encoded formats): a read maps the shard (or takes the
  mapping held, :class:`~stager.order.reads.HeldFiles`) and advises the kernel to read its needed
  byte span ahead (``MADV_WILLNEED``), so a cold shard is read in runs, ahead of the page faults.
  The read keeps its mapping until its last sample is emitted (``WorkerReads.last_step``), and
  payloads are zero-copy slices of it: the shards a worker opens are exactly the schedule's opens,
  and the shuffle buffer holds positions, not bytes.
* :class:`PreadFetcher` (other formats, remote data, ``use_mmap=False``): a read is one ``pread`` (or
  ranged GET) per coalesced span of its needed samples; the payloads wait in a dict by stream
  position, copied out of the read buffer when the shuffle buffer holds more than one sample (a
  view would pin the whole run: the bound is ``K`` samples per worker, not ``K`` runs).
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from stager.errors import CorruptSampleError
from stager.order.epoch import WorkerPlan
from stager.order.reads import WorkerReads

if TYPE_CHECKING:
    from stager.loader.shard_access import ShardAccess


WINDOW = 32  # batches whose offsets, ends and reads MappedFetcher looks up at once (given the bounds)


class Fetcher(Protocol):
    def batch(self, step: int, positions: np.ndarray) -> tuple[list[Any], int]:
        """Issue worker batch ``step``'s reads, then ``(payloads at positions, payload bytes read)``."""
        ...


class MappedFetcher:
    """Payloads as slices of mapped shard files (see the module docstring)."""

    def __init__(self, reads: WorkerReads, wp: WorkerPlan, access: ShardAccess) -> None:
        idx = access.index
        self.access = access
        self.stream = wp.stream
        # Batch ``step`` emits ``wp.emit[bounds[step]:bounds[step + 1]]`` (the ``positions`` its caller
        # passes). Offsets, ends and reads are looked up WINDOW batches at a time: a batch's fixed numpy
        # cost (4 gathers, 3 conversions) is paid once a window, which matters where a batch's items come
        # in several small parts (a mix's streams: one fetcher each).
        self.emit = wp.emit
        self.bounds: list[int] = np.concatenate([[0], np.cumsum(wp.sizes)]).astype(np.int64).tolist()
        self._win: tuple[int, int, int] = (0, 0, 0)  # steps [lo, hi) held; their first position
        self._o: list[int] = []
        self._e: list[int] = []
        self._r: list[int] = []
        # Offsets and ends per stream position are needed here only, transiently: batches look them
        # up again for their own positions (two arrays of the worker's share, ~20 MB per million
        # samples, would otherwise stay on every worker's heap for the whole epoch).
        offs = idx.offsets[wp.stream]
        ends = offs + idx.sizes[wp.stream]
        steps, n = len(wp.batches), len(wp.stream)
        self.load_bounds = reads.step_bounds(steps).tolist()
        self.shards = reads.shard.tolist()
        self.views: list[memoryview | None] = [None] * len(reads)
        # Each read's needed byte span, [min offset, max end) of its needed samples. reduceat runs
        # from one read's start to the next one's: positions between them are not needed (masked).
        self.span_lo: list[int] = []
        self.span_hi: list[int] = []
        # Per stream position, the read holding it (positions of no read are never emitted).
        self.read_of = (np.searchsorted(reads.lo, np.arange(n), side="right") - 1).astype(np.int32)
        self.single_read: list[int] = [-1] * steps  # per worker batch: its one read, or -1 (several)
        self.step_bytes: list[int] = [0] * steps
        if len(reads):
            big = np.iinfo(np.int64).max
            self.span_lo = np.minimum.reduceat(np.where(reads.needed, offs, big), reads.lo).tolist()
            self.span_hi = np.maximum.reduceat(np.where(reads.needed, ends, 0), reads.lo).tolist()
        if steps:
            first = np.concatenate([[0], np.cumsum(wp.sizes)[:-1]]).astype(np.int64)
            by_emission = self.read_of[wp.emit]
            lo_read = np.minimum.reduceat(by_emission, first)
            self.single_read = np.where(lo_read == np.maximum.reduceat(by_emission, first), lo_read, -1).tolist()
            self.step_bytes = np.add.reduceat((ends - offs)[wp.emit], first).tolist()
        # Reads whose last sample worker batch b emits: release[release_bounds[b]:release_bounds[b + 1]].
        order = np.argsort(reads.last_step, kind="stable")
        self.release = order.tolist()
        self.release_bounds = np.searchsorted(reads.last_step[order], np.arange(steps + 1)).tolist()

    def batch(self, step: int, positions: np.ndarray) -> tuple[list[Any], int]:
        access, views = self.access, self.views
        for i in range(self.load_bounds[step], self.load_bounds[step + 1]):
            shard = self.shards[i]
            views[i] = access.mapping(shard)
            access.advise(shard, self.span_lo[i], self.span_hi[i])
        lo, hi, base = self._win
        if not lo <= step < hi:
            lo, hi = step, min(step + WINDOW, len(self.bounds) - 1)
            base = self.bounds[lo]
            self._o, self._e, self._r = self._lookup(self.emit[base : self.bounds[hi]])
            self._win = (lo, hi, base)
        first, end = self.bounds[step] - base, self.bounds[step + 1] - base
        assert end - first == len(positions), "positions are the plan's emission of this step"
        o, e, rs = self._o[first:end], self._e[first:end], self._r[first:end]
        one = self.single_read[step]
        if one >= 0:
            m = views[one]
            assert m is not None
            out = [m[a:z] for a, z in zip(o, e, strict=True)]
        else:
            held = cast("list[memoryview]", views)  # a read is loaded before any of its samples is emitted
            out = [held[r][a:z] for r, a, z in zip(rs, o, e, strict=True)]
        for i in self.release[self.release_bounds[step] : self.release_bounds[step + 1]]:
            views[i] = None  # the slices handed out keep their mapping alive as long as they live
        return out, self.step_bytes[step]

    def _lookup(self, positions: np.ndarray) -> tuple[list[int], list[int], list[int]]:
        """Per stream position: its payload's offset and end in its shard, and the read holding it."""
        idx = self.access.index
        ids = self.stream[positions]
        offs = idx.offsets[ids]
        return offs.tolist(), (offs + idx.sizes[ids]).tolist(), self.read_of[positions].tolist()


class PreadFetcher:
    """Payloads from reads of runs into private buffers, held until emitted (see the module docstring)."""

    def __init__(
        self, reads: WorkerReads, wp: WorkerPlan, access: ShardAccess, *, on_error: str, owned: bool
    ) -> None:
        self.reads, self.wp, self.access = reads, wp, access
        self.on_error, self.owned = on_error, owned
        self.load_bounds = reads.step_bounds(len(wp.batches)).tolist()
        self.waiting: dict[int, Any] = {}  # stream position -> payload, until emitted
        # A window plan's frames (stager.order.windows) may be emitted several times: such a
        # payload waits until the last batch that emits it (per worker batch, positions to drop).
        self.drop: list[list[int]] | None = None
        if len(wp.emit) != len(wp.stream):
            steps = len(wp.batches)
            last = np.full(len(wp.stream), -1, dtype=np.int64)
            np.maximum.at(last, wp.emit, np.repeat(np.arange(steps, dtype=np.int64), wp.sizes))
            order = np.argsort(last, kind="stable")
            bounds = np.searchsorted(last[order], np.arange(steps + 1)).tolist()
            self.drop = [order[bounds[b] : bounds[b + 1]].tolist() for b in range(steps)]

    def batch(self, step: int, positions: np.ndarray) -> tuple[list[Any], int]:
        r, starts = self.reads, self.access.index.starts
        nbytes = 0
        for i in range(self.load_bounds[step], self.load_bounds[step + 1]):
            lo, hi, shard = int(r.lo[i]), int(r.hi[i]), int(r.shard[i])
            want = np.flatnonzero(r.needed[lo:hi]) + lo
            payloads, nb = read_isolating(self.access, shard, self.wp.stream[want] - starts[shard], self.on_error)
            if self.owned:
                payloads = [owned_copy(x) for x in payloads]
            nbytes += nb
            self.waiting.update(zip(want.tolist(), payloads, strict=True))
        if self.drop is None:
            return [self.waiting.pop(p) for p in positions.tolist()], nbytes
        out = [self.waiting[p] for p in positions.tolist()]
        for p in self.drop[step]:
            self.waiting.pop(p, None)
        return out, nbytes


def read_isolating(access: ShardAccess, shard: int, positions: np.ndarray, on_error: str) -> tuple[list[Any], int]:
    """Read a run; on a damaged run, isolate the bad samples (None payloads) or name the key (``on_error``)."""
    try:
        return access.read(shard, positions)
    except CorruptSampleError:
        if len(positions) == 1 and on_error == "raise":
            idx = access.index
            key = idx.keys[int(idx.starts[shard] + positions[0])]
            raise CorruptSampleError(
                f"{access.res.shard_path(shard)}: sample {key!r} is damaged; run `stager verify --deep` "
                "or pass on_error='skip'"
            ) from None
        if len(positions) == 1:
            return [None], 0
    out: list[Any] = []
    total = 0
    for p in positions.tolist():
        got, nb = read_isolating(access, shard, np.array([p], dtype=np.int64), on_error)
        out += got
        total += nb
    return out, total


def owned_copy(x: Any) -> Any:
    """A payload that owns its memory (bytes for views, a copy for array views), so it pins no read buffer.
    A slice of a file's mapping (a format reader's zero-copy payload: squashfs) stays as it is: it pins
    only address space, never a private buffer."""
    if isinstance(x, memoryview):
        return x if isinstance(x.obj, mmap.mmap) else x.tobytes()
    if isinstance(x, np.ndarray) and x.base is not None:
        return x.copy()
    return x
