"""``stager pack --workers N``: write planned shards on N processes, byte-identical to one process.

Two granularities:

* **Segments** (formats whose entry declares ``fragments``: tar, hdf5 without fields): each shard is
  written in parallel segments, and the parent hashes and finishes it while the workers go on
  (:mod:`stager.pack.segments`), so even a pack of one shard keeps every worker busy. The parent
  only lists (through the pool), plans, schedules, hashes, finishes and writes the manifest.
* **Shards** (other formats): one process writes one whole shard (:func:`stager.pack.shard.write_shard`).

The jobs reach the workers through one pickle file (:class:`JobsFile`: the jobs and each one's
samples as positions in the listing), the listing through memory-mapped column files
(:mod:`stager.pack.sources.columns`) and the segment offsets through a shared memory-mapped file
(:class:`~stager.pack.segments.Slots`), all in ``.stager-pack/``, so that a pool started before the
plan existed (to list an ImageFolder) serves the writing as well. A worker reads its samples as a
view of the mapped listing (:class:`~stager.pack.plan.ShardRefs`), in file-system order where the
listing is in path order, as one process does (:mod:`stager.pack.read_order`).

Segmentation depends on ``workers`` only through scheduling: a shard's bytes are its samples'
fragments in order whatever the cut, so the output does not depend on ``workers``.
"""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing as mp
import pickle
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from stager.formats import get_format
from stager.fs.kernel import keep_freed_heap
from stager.fs.pool import end_with_parent, ended_workers, kill_workers, lost_worker_error, signals_held
from stager.pack.plan import ShardRefs
from stager.pack.segments import SEG_BYTES, SEG_SAMPLES, SegmentDone, SegmentTask, Slots, run_segment, run_segments
from stager.pack.shard import ShardJob, fragmentable, write_shard
from stager.pack.sources.columns import Columns, ListingRefs
from stager.pack.state import ShardDone

if TYPE_CHECKING:
    from multiprocessing.context import BaseContext

    from stager.errors import WorkerLostError
    from stager.pack.sources.base import Source
    from stager.progress import Progress

T = TypeVar("T")
R = TypeVar("R")
__all__ = ["SEG_BYTES", "SEG_SAMPLES", "JobsFile", "PackPool"]  # the segment sizes live in stager.pack.segments


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
    _listing: ListingRefs | None = field(default=None, repr=False, compare=False)

    def listing_refs(self) -> ListingRefs:
        """The mapped listing, as a lazy sequence of refs."""
        if self._listing is None:
            self._listing = ListingRefs(Columns.open(self.listing))
        return self._listing

    def job(self, ji: int, a: int = 0, b: int | None = None) -> tuple[ShardJob, ShardRefs]:
        """Job ``ji`` and its samples ``[a, b)`` as a view of the listing (refs built when read)."""
        return self.jobs[ji], ShardRefs(self.listing_refs(), self.positions[ji][a:b])

    def whole_job(self, ji: int) -> ShardJob:
        """Job ``ji`` with all its samples."""
        job, refs = self.job(ji)
        return dataclasses.replace(job, shard=dataclasses.replace(job.shard, refs=refs, positions=refs.positions))


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
    # Ctrl-C, SIGTERM and SIGHUP end a worker at once and quietly (no KeyboardInterrupt traceback from an
    # idle one); stager, which the same Ctrl-C or Slurm signal reaches, ends the rest (PackPool.kill) and
    # removes what they half-wrote. A signal the user's shell set to be ignored (nohup) stays so.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    end_with_parent()  # stager killed (kill -9, the OOM killer): its workers go too, not orphans for ever
    keep_freed_heap()  # a worker reads segment after segment: reuse their memory, do not fault it in again
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
        # CPU seconds each worker (by pid) had used at its last segment: how evenly the work was shared.
        self.workers_cpu: dict[int, float] = {}
        self.ended: dict[int, int] = {}  # {pid: exit code} of the workers that had ended when the pool was killed

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
        with signals_held():  # map submits every item now, starting the workers: a signal inside fork would be lost
            results = self._executor().map(fn, items, chunksize=chunk)
        return self._lost_as_error(results)

    def _lost_as_error(self, results: Iterator[R]) -> Iterator[R]:
        try:
            yield from results
        except BrokenProcessPool as exc:
            self.kill()
            raise self.lost(exc) from None

    def run(self, jobs: list[ShardJob], source: Source, progress: Progress, state_dir: Path, *,
            ready: Callable[[], None] = lambda: None) -> list[ShardDone]:
        """Write ``jobs`` (segments where the format allows, else whole shards); see the module doc.
        ``ready()`` returns once shards may be renamed into place (their ``plan.json`` is durable)."""
        inherited = self._ex is None  # started now, with the loaded source
        if inherited:
            ready()  # its writing thread ends before a fork (fork copies only the forking thread)
        ex = self._executor(source)
        jobs_file = _publish_jobs(state_dir, jobs, source, ship_source=not inherited)
        try:
            if fragmentable(get_format(jobs[0].options.format), jobs[0].fields):
                def submit(task: SegmentTask) -> Future[SegmentDone]:
                    with signals_held():  # submit may start a worker: a signal inside fork would be lost
                        return ex.submit(_run_segment, task)

                return run_segments(submit, self.workers, jobs, jobs_file, progress=progress, state_dir=state_dir,
                                    workers_cpu=self.workers_cpu, ready=ready, stop_workers=self.kill)
            ready()  # whole shards are renamed by the workers
            return _run_shards(ex, jobs, jobs_file, progress, stop_workers=self.kill)
        except BrokenProcessPool as exc:  # the workers are gone (stop_workers): the caller removes their partials
            raise self.lost(exc) from None

    def kill(self) -> None:
        """End the workers at once (SIGKILL) and wait until they are gone (:func:`stager.fs.pool.kill_workers`):
        on an interrupt, or after one of them died. Those that had ended already are noted first
        (:attr:`ended`, for :meth:`lost`). Their ``.partial`` files are the caller's to remove (it does, after this)."""
        if self._ex is not None:
            self.ended.update(ended_workers(self._ex))
            kill_workers(self._ex)

    def lost(self, exc: BrokenProcessPool) -> WorkerLostError:
        """The one-line error for ``exc``: the pool broke because a worker ended on its own (the OOM killer)."""
        if not self.ended and self._ex is not None:
            self.ended.update(ended_workers(self._ex))
        return lost_worker_error(self.ended, "pack", "rerun with fewer --workers; the pack resumes where it stopped")

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True, cancel_futures=True)
            self._ex = None

    def __enter__(self) -> PackPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            self.kill()  # an interrupt while listing on the pool: nothing to wait for
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


def _run_shards(ex: ProcessPoolExecutor, jobs: list[ShardJob], jobs_file: str, progress: Progress, *,
                stop_workers: Callable[[], None]) -> list[ShardDone]:
    """Write ``jobs`` as whole shards on ``ex``; progress counts each shard's samples as soon as it is done
    (the first failure cancels what has not started and is raised; an interrupt first ends the workers,
    ``stop_workers()``, instead of waiting for the shards in flight)."""
    out: list[ShardDone] = []
    try:
        with signals_held():  # the first submit starts the workers: a signal inside fork would be lost
            pending: set[Future[ShardDone]] = {ex.submit(_run_job, jobs_file, ji) for ji in range(len(jobs))}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                d = f.result()  # re-raises the worker's exception
                out.append(d)
                progress.update(d.info.samples, d.payload_bytes)
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, BrokenProcessPool)):  # an interrupt, or a worker died: end the rest
            stop_workers()  # their futures end with BrokenProcessPool (cancelled, see SegmentRun.abort, never)
        else:
            for f in pending:
                f.cancel()
        wait(pending)
        raise
    return out


# ---- segments ---------------------------------------------------------------------------------------


def _run_segment(task: SegmentTask) -> SegmentDone:
    """In a worker: build, publish and write one segment (:func:`stager.pack.segments.run_segment`)."""
    jf = _WORKER.jobs_file(task.jobs_file)
    job, refs = jf.job(task.job, task.start, task.stop)
    return run_segment(task, job, refs, _WORKER.source_for(jf), _WORKER.slots_at(task.slots_file))
