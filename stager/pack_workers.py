"""``stager pack --workers N``: write planned shards on N processes, byte-identical to one process.

Two granularities:

* **Segments** (formats with ``open_fragment``: tar). Each shard's samples are cut into segments
  of at most :data:`SEG_SAMPLES` samples / :data:`SEG_BYTES` source bytes, so even a pack of one
  shard keeps every worker busy. A worker loads, checks and formats its segment in memory (tar
  members do not record their position, so this needs no offset), then waits until the previous
  segment of the shard has published its end offset in a shared array, publishes its own end, and
  ``pwrite`` s its bytes at its offset into the shard's ``.partial`` file. The wait is short: a
  segment's end is known as soon as its bytes are built, before they are written. Only extents
  (keys, labels, offsets, sizes) travel back to the parent; image bytes never cross processes. When
  all segments of a shard are in, a worker writes the end-of-archive marker, hashes and fsyncs the
  file, renames it and writes its done-record, exactly as for a single-process shard. The parent
  only lists (through the pool), plans, schedules and writes the manifest.
* **Shards** (other formats): one process writes one whole shard (:func:`stager.pack.write_shard`).

Segmentation depends on ``workers`` only through scheduling: a shard's bytes are the concatenation
of its samples' members whatever the cut, so the output does not depend on ``workers``.
Failures: the first failing segment poisons its successor's offset slot, the parent poisons every
open slot, waits for the pool to drain and re-raises the first real error in plan order; the
caller removes the ``.partial`` files.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np

from .atomicio import commit_partial, partial_path, space_error
from .errors import StagerError
from .formats import get_format
from .pack import (
    SampleRows,
    ShardDone,
    ShardJob,
    cut_shards,
    fsync_and_hash,
    record_done,
    write_samples,
    write_shard,
)
from .progress import Progress
from .sources import Source

SEG_SAMPLES = 512  # at most this many samples per segment ...
SEG_BYTES = 4 << 20  # ... and about this many source bytes (a few ms of work: small vs. task overhead)
_UNKNOWN = -1  # offset slot not yet published
_POISON = -2  # an earlier segment (or the parent) gave up: stop


class SegmentAbortedError(Exception):
    """A segment stopped because an earlier one failed (never the error reported to the user)."""


# Worker-process state, set once per worker by the pool initializer (inherited, not pickled, on fork).
_STATE: dict[str, Any] = {}


def _init_worker(source: Source, jobs: list[ShardJob] | None = None, slots: Any = None) -> None:
    _STATE.update(source=source, jobs=jobs, slots=slots)


def _run_job(job: ShardJob) -> ShardDone:
    return write_shard(job, _STATE["source"])


def _mp_context() -> Any:
    # fork is cheapest (no re-import, the source and plan are inherited) but unsafe once threads
    # exist (zarr/h5py may start some); fall back to spawn then.
    if "fork" in mp.get_all_start_methods() and threading.active_count() == 1:
        return mp.get_context("fork")
    return mp.get_context("spawn")


class ListingPool:
    """A ``map`` that starts ``workers`` processes on first use (listing an ImageFolder's class
    folders in parallel) and stops them on exit; sources that never call it start nothing."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._ex: ProcessPoolExecutor | None = None

    def map(self, fn: Any, items: list[Any]) -> list[Any]:
        if len(items) < 2:
            return list(map(fn, items))
        if self._ex is None:
            self._ex = ProcessPoolExecutor(max_workers=min(self.workers, len(items)), mp_context=_mp_context())
        # Several folders per task (fewer round trips), yet enough tasks to balance uneven folders.
        return list(self._ex.map(fn, items, chunksize=max(1, len(items) // (self.workers * 4))))

    def __enter__(self) -> ListingPool:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True, cancel_futures=True)
            self._ex = None


def fragmentable(format_name: str) -> bool:
    """Whether ``format_name`` shards can be written in parallel segments."""
    return hasattr(get_format(format_name), "open_fragment")


def run_pool(jobs: list[ShardJob], source: Source, workers: int, progress: Progress) -> list[ShardDone]:
    """Write ``jobs`` on ``workers`` processes (segments where the format allows); see the module doc."""
    if fragmentable(jobs[0].format):
        return _run_segments(jobs, source, workers, progress)
    return _run_shards(jobs, source, workers, progress)


def _run_shards(jobs: list[ShardJob], source: Source, workers: int, progress: Progress) -> list[ShardDone]:
    out: list[ShardDone] = []
    ex = ProcessPoolExecutor(
        max_workers=min(workers, len(jobs)), mp_context=_mp_context(), initializer=_init_worker, initargs=(source,)
    )
    try:
        pending: set[Future[ShardDone]] = {ex.submit(_run_job, j) for j in jobs}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for f in finished:
                d = f.result()  # re-raises the worker's exception
                out.append(d)
                progress.update(d.info.samples, d.payload_bytes)
    except BaseException:
        ex.shutdown(wait=True, cancel_futures=True)
        raise
    ex.shutdown(wait=True)
    return out


def plan_segments(job: ShardJob) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of ``job``'s planned samples, one per segment."""
    sizes = np.asarray([r[3] for r in job.shard.refs], dtype=np.int64)  # r[3] is r.size
    return cut_shards(sizes, samples_per_shard=SEG_SAMPLES, shard_size=SEG_BYTES)


def _wait_slot(slots: Any, i: int) -> int:
    delay = 1e-5
    while (v := int(slots[i])) == _UNKNOWN:
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
    if v == _POISON:
        raise SegmentAbortedError(f"segment slot {i}: an earlier segment failed")
    return v


def _run_segment(task: tuple[int, int, int, int, str]) -> tuple[int, int, SampleRows]:
    """Build one segment, publish its end offset, pwrite it; return (job index, start, rows)."""
    ji, a, b, slot, path = task
    job: ShardJob = _STATE["jobs"][ji]
    slots = _STATE["slots"]
    fmt: Any = get_format(job.format)
    rows = SampleRows()
    published = False
    try:
        w = fmt.open_fragment(shard_name=job.shard.name, classes=list(job.classes), keys_checked=job.keys_checked)
        write_samples(w, job.shard.refs[a:b], _STATE["source"], job, rows, progress=None)
        buf = w.take()
        start = _wait_slot(slots, slot)
        slots[slot + 1] = start + len(buf)
        published = True
        fd = os.open(path, os.O_WRONLY)
        try:
            view = memoryview(buf)
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], start + done)
        finally:
            os.close(fd)
    except BaseException as exc:
        if not published:
            slots[slot + 1] = _POISON
        if isinstance(exc, OSError) and not isinstance(exc, StagerError):
            err = space_error(exc, Path(job.out) / job.shard.name)
            if err is not None:
                raise err from exc
        raise
    return ji, start, rows


def _run_segments(jobs: list[ShardJob], source: Source, workers: int, progress: Progress) -> list[ShardDone]:
    ctx = _mp_context()
    segs = [plan_segments(j) for j in jobs]
    bases = np.cumsum([0] + [len(s) + 1 for s in segs]).tolist()  # slot of each shard's first segment
    slots = ctx.RawArray("q", int(bases[-1]))
    slots[:] = [_UNKNOWN] * len(slots)
    tmps: list[Path] = []
    queue: deque[tuple[int, int, int, int, str]] = deque()
    for ji, (job, runs) in enumerate(zip(jobs, segs, strict=True)):
        tmp = partial_path(Path(job.out) / job.shard.name)
        with open(tmp, "wb"):
            pass
        tmps.append(tmp)
        slots[bases[ji]] = 0
        queue.extend((ji, a, b, bases[ji] + k, str(tmp)) for k, (a, b) in enumerate(runs))
    parts: list[list[tuple[int, SampleRows]]] = [[] for _ in jobs]
    out: list[ShardDone] = []
    ex = ProcessPoolExecutor(
        max_workers=min(workers, len(queue)),
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(source, jobs, slots),
    )
    # Segments are submitted a few at a time, in plan order, so that a shard's finishing task (end
    # marker, hash, fsync, rename, done-record: run by a worker, not here) starts soon after its last
    # segment instead of after every queued segment.
    in_flight = 2 * workers
    pending: dict[Future[Any], bool] = {}  # future -> is a segment
    every: list[Future[Any]] = []

    def refill() -> None:
        while queue and sum(pending.values()) < in_flight:
            f = ex.submit(_run_segment, queue.popleft())
            pending[f] = True
            every.append(f)

    try:
        refill()
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                is_segment = pending.pop(f)
                res = f.result()  # re-raises the worker's exception
                if not is_segment:
                    out.append(res)
                    continue
                ji, start, r = res
                parts[ji].append((start, r))
                progress.update(len(r.keys), r.payload)
                if len(parts[ji]) == len(segs[ji]):
                    end = int(slots[bases[ji + 1] - 1])
                    g = ex.submit(_finish_shard, ji, str(tmps[ji]), end, parts[ji])
                    pending[g] = False
                    every.append(g)
            refill()
    except BaseException as exc:
        for i in range(len(slots)):  # release every waiting segment
            if slots[i] == _UNKNOWN:
                slots[i] = _POISON
        ex.shutdown(wait=True, cancel_futures=True)
        if isinstance(exc, SegmentAbortedError):  # report the failure that caused it, in plan order
            for f in every:
                e = f.exception() if f.done() and not f.cancelled() else None
                if e is not None and not isinstance(e, SegmentAbortedError):
                    raise e from None
        raise
    ex.shutdown(wait=True)
    return out


def _finish_shard(ji: int, tmp: str, end: int, parts: list[tuple[int, SampleRows]]) -> ShardDone:
    """In a worker: end marker, hash + fsync, rename and done-record of a shard whose segments are
    all written (``end`` is where the last one stopped)."""
    job: ShardJob = _STATE["jobs"][ji]
    fmt: Any = get_format(job.format)
    final = Path(job.out) / job.shard.name
    try:
        fd = os.open(tmp, os.O_WRONLY)
        try:
            os.pwrite(fd, fmt.END_MARKER, end)
        finally:
            os.close(fd)
        nbytes, digest = fsync_and_hash(tmp, job.hash_algo)
        commit_partial(tmp, final)
    except OSError as exc:
        err = space_error(exc, final)
        if err is not None:
            raise err from exc
        raise
    rows = SampleRows()
    for start, r in sorted(parts, key=lambda p: p[0]):
        rows.extend(r, start)
    return record_done(Path(job.out), job.shard, rows, nbytes=nbytes, digest=digest, aux=[])
