"""The read schedule: which shard segments each worker stream reads, while loading which batch.

A worker (one :class:`~stager.order.epoch.WorkerPlan`) reads its stream front to back in
**segments**: maximal stretches of consecutive sample ids inside one shard (:func:`segment_bounds`),
one read each. It reads only when a batch needs it: before emitting its ``b``-th batch it reads
every segment that starts below the highest stream position emitted so far plus one. So segment
``k`` is read while loading the first worker batch whose running maximum of ``max(positions) + 1``
exceeds the segment's start. The read samples then wait (as copied bytes, or as positions in a
mapped file) until the shuffle buffer emits them.

A pass that starts mid-epoch (a resumed loader, ``start_batch`` > 0) emits only the positions of
the worker's batches from there on (``needed``); reads of segments holding none of them are left
out, the others fetch only their needed samples.

Open files: a worker holds the files of the :data:`MAX_OPEN_FILES` shards it read most recently
(:class:`HeldFiles`: least recently read closed first; a new set every epoch). A read of a held
shard uses the file already open (whatever DEST holds under that name meanwhile); any other read
opens it. The loader's :class:`~stager.loader.shard_access.ShardAccess` keeps its file handles by this
class and the schedule's :meth:`WorkerReads.opens` replays it, so the prefetcher
(:mod:`stager.prefetch`) knows which reads need a local copy.

One copy, two consumers: the loader's worker loop (:mod:`stager.loader.fetch`) issues exactly the
reads of :func:`worker_reads`, and the prefetcher schedules from :func:`read_schedule`
(tests/test_prefetch.py checks the files the loader opens against it). Pure numpy, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from stager.order.epoch import RankPlan, WorkerPlan

# Shard files (or mappings) a worker keeps open; the loader's ShardAccess and the schedule share it.
MAX_OPEN_FILES = 64


class HeldFiles:
    """The open-file rule: a worker holds the files of its ``capacity`` most recently read shards.

    :meth:`read` records a read and says whether it opens the file and which held file it closes.
    Used by the loader's file handles and by :meth:`WorkerReads.opens` alike.
    """

    def __init__(self, capacity: int = MAX_OPEN_FILES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, shard: int) -> bool:
        return shard in self._lru

    def read(self, shard: int) -> tuple[bool, int | None]:
        """Record a read of ``shard``: ``(opens, closed)``, ``closed`` the shard whose file to close, or None."""
        if shard in self._lru:
            self._lru.move_to_end(shard)
            return False, None
        self._lru[shard] = None
        if len(self._lru) > self.capacity:
            return True, self._lru.popitem(last=False)[0]
        return True, None

    def clear(self) -> None:
        self._lru.clear()


def segment_bounds(stream: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut a stream into maximal reads: ``(lo, hi, shard)``, int64 arrays of shape (segments,).

    Segment ``k`` is stream positions ``[lo[k], hi[k])``: consecutive sample ids inside shard
    ``shard[k]`` (``starts``: shape (shards + 1,), each shard's first global id, then N). Segments
    are in stream order and tile ``[0, len(stream))``.
    """
    n = len(stream)
    if n == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty.copy(), empty.copy()
    shard = np.searchsorted(starts, stream, side="right") - 1
    brk = np.flatnonzero((np.diff(stream) != 1) | (np.diff(shard) != 0)) + 1
    lo = np.concatenate([[0], brk]).astype(np.int64)
    hi = np.concatenate([brk, [n]]).astype(np.int64)
    return lo, hi, shard[lo].astype(np.int64)


@dataclass(frozen=True)
class WorkerReads:
    """One worker stream's reads of an epoch, in the order it issues them: arrays of shape (reads,).

    Read ``i`` covers stream positions ``[lo[i], hi[i])`` of the worker's plan (consecutive sample
    ids of shard ``shard[i]``) and fetches the ``needed`` positions among them, ``nbytes[i]`` payload
    bytes. The worker issues it while loading its batch ``load_step[i]`` (an index into
    ``WorkerPlan.batches``; the rank-level batch is ``batch[i]``) and emits the last of its samples
    with its batch ``last_step[i]``. ``needed`` (bool, shape (stream,)): the positions this pass
    emits, from worker batch ``first_step`` on (all of them for a pass from the epoch's start).
    """

    worker: int
    first_step: int
    lo: np.ndarray
    hi: np.ndarray
    shard: np.ndarray
    load_step: np.ndarray
    last_step: np.ndarray
    batch: np.ndarray
    nbytes: np.ndarray
    needed: np.ndarray

    def __len__(self) -> int:
        return len(self.lo)

    def step_bounds(self, steps: int) -> np.ndarray:
        """Reads issued while loading worker batch ``b`` are ``[bounds[b], bounds[b + 1])`` (shape (steps + 1,))."""
        return np.searchsorted(self.load_step, np.arange(steps + 1), side="left").astype(np.int64)

    def opens(self, open_files: int = MAX_OPEN_FILES) -> np.ndarray:
        """Per read (bool): it opens its shard's file under the :class:`HeldFiles` rule (new each epoch)."""
        held = HeldFiles(open_files)
        return np.array([held.read(s)[0] for s in self.shard.tolist()], dtype=bool)


def worker_reads(wp: WorkerPlan, starts: np.ndarray, sizes: np.ndarray, *, start_batch: int = 0) -> WorkerReads:
    """The reads worker ``wp`` makes in a pass that starts at the rank's batch ``start_batch``.

    ``starts``: shape (shards + 1,), global id of each shard's first sample, then N; ``sizes``:
    shape (N,), each sample's payload bytes.
    """
    steps = len(wp.batches)
    first = int(np.searchsorted(wp.batches, start_batch))
    n = len(wp.stream)
    cum = np.concatenate([[0], np.cumsum(wp.sizes)]).astype(np.int64)
    needed = np.zeros(n, dtype=bool)
    needed[wp.emit[cum[first] :]] = True
    lo, hi, shard = segment_bounds(wp.stream, starts)
    if first >= steps or len(lo) == 0:
        empty = np.zeros(0, np.int64)
        return WorkerReads(wp.worker, first, empty, empty, empty, empty, empty, empty, empty, needed)
    # Worker batch b needs the stream loaded up to max(its positions) + 1; loading is monotone.
    reach = np.maximum.reduceat(wp.emit, cum[:-1]) + 1
    loaded = np.maximum.accumulate(reach[first:])
    load_step = first + np.searchsorted(loaded, lo, side="right")
    step_of_pos = np.full(n, -1, dtype=np.int64)
    emitted_at = np.repeat(np.arange(steps, dtype=np.int64), wp.sizes)
    if len(wp.emit) == n:
        step_of_pos[wp.emit] = emitted_at
    else:  # a window plan's frames (stager.order.windows): a position may be emitted more than once
        np.maximum.at(step_of_pos, wp.emit, emitted_at)
    last_step = np.maximum.reduceat(np.where(needed, step_of_pos, -1), lo)
    nbytes = np.add.reduceat(np.where(needed, sizes[wp.stream], 0), lo).astype(np.int64)
    keep = np.add.reduceat(needed.astype(np.int64), lo) > 0
    load_step = load_step[keep]
    return WorkerReads(
        worker=wp.worker,
        first_step=first,
        lo=lo[keep],
        hi=hi[keep],
        shard=shard[keep],
        load_step=load_step,
        last_step=last_step[keep],
        batch=wp.batches[load_step].astype(np.int64),
        nbytes=nbytes[keep],
        needed=needed,
    )


@dataclass(frozen=True)
class ReadSchedule:
    """One rank's reads of an epoch: one :class:`WorkerReads` per worker stream.

    The flat views (:attr:`worker`, :attr:`batch`, :attr:`shard`, :attr:`nbytes`, :meth:`opens`)
    concatenate the workers' reads, worker after worker, each in issue order.
    """

    rank: int
    epoch: int
    workers: tuple[WorkerReads, ...]

    def _cat(self, arrays: list[np.ndarray], dtype: type) -> np.ndarray:
        return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)

    @property
    def worker(self) -> np.ndarray:
        return self._cat([np.full(len(w), w.worker, dtype=np.int64) for w in self.workers], np.int64)

    @property
    def batch(self) -> np.ndarray:
        return self._cat([w.batch for w in self.workers], np.int64)

    @property
    def shard(self) -> np.ndarray:
        return self._cat([w.shard for w in self.workers], np.int64)

    @property
    def nbytes(self) -> np.ndarray:
        return self._cat([w.nbytes for w in self.workers], np.int64)

    def opens(self, open_files: int = MAX_OPEN_FILES) -> np.ndarray:
        return self._cat([w.opens(open_files) for w in self.workers], bool)


def read_schedule(plan: RankPlan, starts: np.ndarray, sizes: np.ndarray, *, start_batch: int = 0) -> ReadSchedule:
    """Every worker's reads of ``plan``'s epoch from the rank's batch ``start_batch`` (see :func:`worker_reads`)."""
    workers = tuple(worker_reads(wp, starts, sizes, start_batch=start_batch) for wp in plan.workers)
    return ReadSchedule(plan.rank, plan.epoch, workers)
