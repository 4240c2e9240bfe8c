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
* **Shards** (other formats): one process writes one whole shard (:func:`stager.pack.shard.write_shard`).

The jobs reach the workers through one pickle file (:class:`JobsFile`: the jobs and each one's
samples as positions in the listing), the listing through memory-mapped column files
(:mod:`stager.pack.sources.columns`) and the offsets through a shared memory-mapped file (:class:`Slots`), all
in ``.stager-pack/``, so that a pool started before the plan existed (to list an ImageFolder) serves
the writing as well.

Segmentation depends on ``workers`` only through scheduling: a shard's bytes are the concatenation
of its samples' members whatever the cut, so the output does not depend on ``workers``.
Failures: the first failing segment poisons its successor's offset slot, the parent poisons every
open slot, waits for the pool to drain and re-raises the first real error in plan order; the
caller removes the ``.partial`` files.
"""

from __future__ import annotations

import copy
import dataclasses
import mmap
import multiprocessing as mp
import os
import pickle
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import numpy as np

from stager.errors import StagerError
from stager.formats import get_format
from stager.formats.base import write_parts
from stager.fs.atomic import partial_path, space_error
from stager.fs.writeback import start_writeback
from stager.pack.plan import cut_shards
from stager.pack.shard import (
    SampleRows,
    ShardJob,
    finish_done,
    fragmentable,
    fsync_and_hash,
    write_samples,
    write_shard,
)
from stager.pack.sources.base import SampleRef
from stager.pack.sources.columns import Columns, sizes_of
from stager.pack.state import ShardDone

if TYPE_CHECKING:
    from multiprocessing.context import BaseContext

    from stager.pack.shard import FragmentFormat
    from stager.pack.sources.base import Source
    from stager.progress import Progress

T = TypeVar("T")
R = TypeVar("R")

SEG_SAMPLES = 512  # at most this many samples per segment ...
SEG_BYTES = 4 << 20  # ... and about this many source bytes (a few ms of work: small vs. task overhead)
_UNKNOWN = -1  # offset slot not yet published
_POISON = -2  # an earlier segment (or the parent) gave up: stop


class SegmentAbortedError(Exception):
    """A segment stopped because an earlier one failed (never the error reported to the user)."""


@dataclass
class JobsFile:
    """The jobs as the workers see them, pickled once into ``.stager-pack/workers-<id>.pkl``.

    ``jobs`` have no samples (``shard.refs == ()``); ``listing`` is the stem of the listing's column
    files (:mod:`stager.pack.sources.columns`: every sample once, in the source's order, memory-mapped by the
    workers) and ``positions[i]`` job ``i``'s samples in write order, as indices into it. ``source``
    (without its listing) is there for workers started before the source existed, else None.
    """

    jobs: list[ShardJob]
    listing: str
    positions: list[np.ndarray]
    source: Source | None
    _columns: Columns | None = field(default=None, repr=False, compare=False)

    def columns(self) -> Columns:
        if self._columns is None:
            self._columns = Columns.open(self.listing)
        return self._columns

    def job(self, ji: int, a: int = 0, b: int | None = None) -> tuple[ShardJob, tuple[SampleRef, ...]]:
        """Job ``ji`` and the SampleRefs of its samples ``[a, b)``, rebuilt from the columns."""
        return self.jobs[ji], self.columns().refs(self.positions[ji][a:b])

    def whole_job(self, ji: int) -> ShardJob:
        """Job ``ji`` with all its samples."""
        job, refs = self.job(ji)
        return dataclasses.replace(job, shard=dataclasses.replace(job.shard, refs=refs))


@dataclass
class _WorkerState:
    """What a worker process keeps between tasks.

    ``source`` when the pool was started after the source was opened (fork inherits it, spawn
    pickles it once per worker); jobs files and offset slots published later arrive as paths named
    in each task, loaded once per worker and then cached by path.
    """

    source: Source | None = None
    jobs_files: dict[str, JobsFile] = field(default_factory=dict)
    slots: dict[str, Slots] = field(default_factory=dict)

    def jobs_file(self, path: str) -> JobsFile:
        got = self.jobs_files.get(path)
        if got is None:
            with open(path, "rb") as f:
                got = self.jobs_files[path] = pickle.load(f)
        return got

    def source_for(self, jobs_file: JobsFile) -> Source:
        src = self.source or jobs_file.source
        assert src is not None, "a worker started before the source has it in the jobs file"
        return src

    def slots_at(self, path: str) -> Slots:
        got = self.slots.get(path)
        if got is None:
            got = self.slots[path] = Slots(path)
        return got


_WORKER = _WorkerState()  # in each worker process (unused in the parent)


def _init_worker(source: Source | None = None) -> None:
    _WORKER.source = source
    _WORKER.jobs_files.clear()
    _WORKER.slots.clear()


def _mp_context() -> BaseContext:
    # fork is cheapest (no re-import, the source is inherited) but unsafe once threads exist
    # (zarr/h5py may start some); fall back to spawn then.
    if "fork" in mp.get_all_start_methods() and threading.active_count() == 1:
        return mp.get_context("fork")
    return mp.get_context("spawn")


class PackPool:
    """The worker processes of one ``pack --workers N``, started on first use and reused throughout.

    An ImageFolder source is listed through :meth:`map` (the pool starts then, before the plan
    exists); :meth:`run` then writes the planned shards on the same processes, handing them the plan
    through a pickle file and the segment offsets through a shared memory-mapped file, so no process
    is forked twice (a fork costs ~5-15 ms here). Sources that never call :meth:`map` (CIFAR batches,
    packs, lists) start the pool in :meth:`run`, after the source is loaded, and fork inherits it.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._ex: ProcessPoolExecutor | None = None

    def _executor(self, source: Source | None = None) -> ProcessPoolExecutor:
        if self._ex is None:
            self._ex = ProcessPoolExecutor(
                max_workers=self.workers, mp_context=_mp_context(), initializer=_init_worker, initargs=(source,)
            )
        return self._ex

    def map(self, fn: Callable[[T], R], items: list[T]) -> Iterator[R]:
        """``map(fn, items)`` on the workers: results in order, each held only until consumed."""
        if len(items) < 2:
            return map(fn, items)
        # Several items per task (fewer round trips), yet enough tasks to balance uneven ones.
        # At most 16: a task's results arrive as one message, and the caller holds them until taken.
        chunk = max(1, min(16, len(items) // (self.workers * 4)))
        return self._executor().map(fn, items, chunksize=chunk)

    def run(self, jobs: list[ShardJob], source: Source, progress: Progress, state_dir: Path) -> list[ShardDone]:
        """Write ``jobs`` (segments where the format allows, else whole shards); see the module doc."""
        inherited = self._ex is None  # started now, with the loaded source
        ex = self._executor(source)
        jobs_file = _publish_jobs(state_dir, jobs, source, ship_source=not inherited)
        if fragmentable(get_format(jobs[0].options.format)):
            return _run_segments(ex, self.workers, jobs, jobs_file, progress=progress, state_dir=state_dir)
        return _run_shards(ex, jobs, jobs_file, progress)

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True, cancel_futures=True)
            self._ex = None

    def __enter__(self) -> PackPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the jobs, as the workers see them -------------------------------------------------------------


def _publish_jobs(state_dir: Path, jobs: list[ShardJob], source: Source, *, ship_source: bool) -> str:
    """Write the :class:`JobsFile` of ``jobs`` (with ``source`` when ``ship_source``, for workers that
    did not inherit it); return its path."""
    light = [dataclasses.replace(j, shard=dataclasses.replace(j.shard, refs=(), positions=None)) for j in jobs]
    planned = [j.shard.positions for j in jobs]
    stem = None
    if all(p is not None and len(p) == len(j.shard.refs) for p, j in zip(planned, jobs, strict=True)):
        columns = Columns.of(source.refs)
        stem = getattr(source.refs, "stem", None)  # a spilled ListingRefs is on disk already
        positions = [np.asarray(p, dtype=np.int64) for p in planned]
    else:  # shards planned elsewhere: their own samples, concatenated, are the listing
        columns = Columns.of([r for j in jobs for r in j.shard.refs])
        ends = np.cumsum([len(j.shard.refs) for j in jobs]).tolist()
        positions = [np.arange(e - len(j.shard.refs), e, dtype=np.int64) for j, e in zip(jobs, ends, strict=True)]
    if stem is None:
        stem = str(state_dir / f"listing-{uuid.uuid4().hex[:12]}")
        columns.save(stem)
    src = None
    if ship_source:
        src = copy.copy(source)
        src.refs = []
    path = state_dir / f"workers-{uuid.uuid4().hex[:12]}.pkl"
    path.write_bytes(pickle.dumps(JobsFile(light, stem, positions, src), protocol=pickle.HIGHEST_PROTOCOL))
    return str(path)


def _run_job(jobs_file: str, ji: int) -> ShardDone:
    """In a worker: write job ``ji`` of ``jobs_file`` as one whole shard."""
    jf = _WORKER.jobs_file(jobs_file)
    return write_shard(jf.whole_job(ji), _WORKER.source_for(jf))


def _run_shards(ex: ProcessPoolExecutor, jobs: list[ShardJob], jobs_file: str, progress: Progress) -> list[ShardDone]:
    """Write ``jobs`` as whole shards on ``ex``; progress counts each shard's samples as soon as it is done
    (the first failure cancels what has not started and is raised)."""
    out: list[ShardDone] = []
    try:
        pending: set[Future[ShardDone]] = {ex.submit(_run_job, jobs_file, ji) for ji in range(len(jobs))}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                d = f.result()  # re-raises the worker's exception
                out.append(d)
                progress.update(d.info.samples, d.payload_bytes)
    except BaseException:
        for f in pending:
            f.cancel()
        wait(pending)
        raise
    return out


# ---- segments --------------------------------------------------------------------------------------


def plan_segments(job: ShardJob) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of ``job``'s planned samples, one per segment."""
    return cut_shards(sizes_of(job.shard.refs), samples_per_shard=SEG_SAMPLES, shard_size=SEG_BYTES)


class Slots:
    """Shared int64 offset slots in a memory-mapped file (works across fork and spawn, and for
    workers started before the array existed)."""

    def __init__(self, path: str, n: int | None = None) -> None:
        self.path = path
        if n is not None:
            with open(path, "wb") as f:
                f.write(np.full(max(n, 1), _UNKNOWN, dtype=np.int64).tobytes())
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.offsets = memoryview(self._mm).cast("q")  # aligned 8-byte stores: atomic on every platform we run

    def close(self) -> None:
        self.offsets.release()
        self._mm.close()


def _wait_slot(slots: memoryview, i: int) -> int:
    delay = 1e-5
    while (v := int(slots[i])) == _UNKNOWN:
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
    if v == _POISON:
        raise SegmentAbortedError(f"segment slot {i}: an earlier segment failed")
    return v


class SegmentTask(NamedTuple):
    """One segment to write: samples ``[start, stop)`` of job ``job``, whose own start offset is
    published in slot ``slot`` (it publishes its end in ``slot + 1``), into the file at ``path``."""

    jobs_file: str
    slots_file: str
    job: int
    start: int
    stop: int
    slot: int
    path: str


def _run_segment(task: SegmentTask) -> SegmentDone:
    """In a worker: build one segment, publish its end offset, pwrite it."""
    jobs_file, slots_file, ji, a, b, slot, path = task
    jf = _WORKER.jobs_file(jobs_file)
    job, refs = jf.job(ji, a, b)
    slots = _WORKER.slots_at(slots_file).offsets
    fmt = cast("FragmentFormat", get_format(job.options.format))  # segments exist for these only
    rows = SampleRows()
    published = False
    try:
        w = fmt.open_fragment(
            shard_name=job.shard.name,
            classes=list(job.classes),
            keys_checked=job.keys_checked,
            json_member=job.options.tar_json,
            fields=job.fields,
        )
        write_samples(w, refs, _WORKER.source_for(jf), job, rows, progress=None)
        parts = w.take()
        size = sum(map(len, parts))
        start = _wait_slot(slots, slot)
        slots[slot + 1] = start + size
        published = True
        fd = os.open(path, os.O_WRONLY)
        try:
            write_parts(fd, parts, start)
            start_writeback(fd, start, size)
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
    return SegmentDone(ji, start, rows)


class SegmentDone(NamedTuple):
    """A written segment, as a worker reports it: its rows, with offsets relative to ``start``."""

    job: int  # index of its job
    start: int  # offset of its first byte in the shard
    rows: SampleRows


def _run_segments(
    ex: ProcessPoolExecutor, workers: int, jobs: list[ShardJob], jobs_file: str, *, progress: Progress, state_dir: Path
) -> list[ShardDone]:
    """Write ``jobs`` in segments on ``ex``; return their :class:`ShardDone` (in completion order)."""
    run = _SegmentRun(ex, jobs, jobs_file, state_dir, in_flight=2 * workers)
    try:
        return run.run(progress)
    except BaseException as exc:
        run.abort(exc)
        raise
    finally:
        run.slots.close()


class _SegmentRun:
    """The parent's side of one segment-parallel write: the offset slots, the segment queue and
    the tasks in flight.

    Slot layout: job ``i`` owns slots ``bases[i] .. bases[i + 1] - 1``, one more than its segments;
    its first slot holds 0 and segment ``k`` publishes its end into slot ``bases[i] + k + 1``, so
    the last slot ends up holding where the end-of-archive marker goes.
    """

    def __init__(
        self, ex: ProcessPoolExecutor, jobs: list[ShardJob], jobs_file: str, state_dir: Path, *, in_flight: int
    ) -> None:
        self.ex = ex
        self.jobs_file = jobs_file
        self.in_flight = in_flight
        self.segs = [plan_segments(j) for j in jobs]
        self.bases = np.cumsum([0] + [len(s) + 1 for s in self.segs]).tolist()  # each job's first slot
        self.slots = Slots(str(state_dir / f"slots-{uuid.uuid4().hex[:12]}.bin"), int(self.bases[-1]))
        self.tmps: list[Path] = []
        self.queue: deque[SegmentTask] = deque()
        for ji, (job, runs) in enumerate(zip(jobs, self.segs, strict=True)):
            tmp = partial_path(Path(job.out) / job.shard.name)
            with open(tmp, "wb"):
                pass
            self.tmps.append(tmp)
            first = self.bases[ji]
            self.slots.offsets[first] = 0
            self.queue.extend(
                SegmentTask(jobs_file, self.slots.path, ji, a, b, first + k, str(tmp)) for k, (a, b) in enumerate(runs)
            )
        self.parts: list[list[tuple[int, SampleRows]]] = [[] for _ in jobs]
        self.segments: set[Future[SegmentDone]] = set()
        self.finishing: set[Future[ShardDone]] = set()
        # Tasks not yet done with, in submission order, to report errors in plan order; a task whose
        # result was taken leaves it, so that its rows (Python objects per sample) are not kept.
        self.submitted: dict[Future[Any], None] = {}

    def run(self, progress: Progress) -> list[ShardDone]:
        out: list[ShardDone] = []
        self._refill()
        while self.segments or self.finishing:
            finished, _ = wait(self._pending(), return_when=FIRST_COMPLETED)
            self.segments -= finished
            self.finishing -= finished
            for f in finished:
                res = f.result()  # re-raises the worker's exception
                del self.submitted[f]
                if isinstance(res, ShardDone):
                    out.append(res)
                    continue
                self.parts[res.job].append((res.start, res.rows))
                progress.update(len(res.rows.keys), res.rows.payload)
                if len(self.parts[res.job]) == len(self.segs[res.job]):
                    self._finish(res.job)
            self._refill()
        return out

    def _pending(self) -> set[Future[Any]]:
        return {*self.segments, *self.finishing}

    def _refill(self) -> None:
        # Segments are submitted a few at a time, in plan order, so that a shard's finishing task (end
        # marker, hash, fsync, rename, done-record: run by a worker, not here) starts soon after its
        # last segment instead of after every queued segment.
        while self.queue and len(self.segments) < self.in_flight:
            f = self.ex.submit(_run_segment, self.queue.popleft())
            self.segments.add(f)
            self.submitted[f] = None

    def _finish(self, ji: int) -> None:
        end = int(self.slots.offsets[self.bases[ji + 1] - 1])
        g = self.ex.submit(_finish_shard, self.jobs_file, ji, str(self.tmps[ji]), end, self.parts[ji])
        self.parts[ji] = []  # rebound, not cleared: the task still holds its list until it is sent
        self.finishing.add(g)
        self.submitted[g] = None

    def abort(self, exc: BaseException) -> None:
        """Stop after ``exc``: release every waiting segment, drain the pool, and raise instead the
        first real failure (in plan order) when ``exc`` only says an earlier segment failed."""
        offsets = self.slots.offsets
        for i in range(len(offsets)):
            if offsets[i] == _UNKNOWN:
                offsets[i] = _POISON
        pending = self._pending()
        for f in pending:
            f.cancel()
        wait(pending)
        if isinstance(exc, SegmentAbortedError):
            for f in self.submitted:
                e = f.exception() if f.done() and not f.cancelled() else None
                if e is not None and not isinstance(e, SegmentAbortedError):
                    raise e from None


def _finish_shard(jobs_file: str, ji: int, tmp: str, end: int, parts: list[tuple[int, SampleRows]]) -> ShardDone:
    """In a worker: end marker, hash + fsync, rename and done-record of a shard whose segments are
    all written (``end`` is where the last one stopped)."""
    job = _WORKER.jobs_file(jobs_file).jobs[ji]
    fmt = cast("FragmentFormat", get_format(job.options.format))
    final = Path(job.out) / job.shard.name
    try:
        fd = os.open(tmp, os.O_WRONLY)
        try:
            os.pwrite(fd, fmt.END_MARKER, end)
        finally:
            os.close(fd)
        nbytes, digest = fsync_and_hash(tmp, job.options.hash_algo)
        os.replace(tmp, final)  # durable with the manifest's directory fsync, as in write_shard
    except OSError as exc:
        err = space_error(exc, final)
        if err is not None:
            raise err from exc
        raise
    rows = SampleRows()
    for start, r in sorted(parts, key=lambda p: p[0]):
        rows.extend(r, start)
    return finish_done(job, [], rows, nbytes=nbytes, digest=digest, aux=[])
