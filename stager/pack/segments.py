"""``pack --workers N`` for formats written in fragments (tar, hdf5): one shard in parallel segments.

Each shard's samples are cut into segments of at most :data:`SEG_SAMPLES` samples /
:data:`SEG_BYTES` source bytes, so even a pack of one shard keeps every worker busy. A worker loads,
checks and formats its segment in memory (a fragment: ``Format.open_fragment``; it does not depend
on where it lands), then waits until the previous segment of the shard has published its end offset
in a shared array (:class:`Slots`; a futex wakes the waiter), publishes its own end, and writes
its bytes there (``pwritev``) into the shard's ``.partial`` file. The wait is short: a segment's end is known as
soon as its bytes are built, before they are written. Only rows (keys, labels, extents) and the
format's per-sample extras travel back; image bytes never cross processes.

The parent (:class:`SegmentRun`) does the serial part while the workers write: it hashes each
shard's bytes as soon as they are final, in order (:class:`_ShardHash`: tar's are final as
written, so a shard is hashed segment by segment as they land; an HDF5 shard only once its
metadata is written around them), and finishes each shard whose segments are all in
(``Format.finish_fragments``: tar's end marker, HDF5's metadata), then fsyncs and renames it and
writes its done-record on a thread, so that finishing overlaps the next shard's segments. A shard's
bytes are its samples' fragments in order whatever the cut, so the output does not depend on
``workers``.

Failures: the first failing segment poisons its successor's offset slot, the parent poisons every
open slot, waits for the pool to drain and re-raises the first real error in plan order; the
caller removes the ``.partial`` files. An interrupt (Ctrl-C, SIGTERM, SIGHUP in the parent) does not
wait for the segments in flight, which may be blocked reading a FIFO or a hung file: ``stop_workers()``
ends the workers first.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
import uuid
from collections import deque
from concurrent.futures import FIRST_COMPLETED, BrokenExecutor, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

from stager.checksum import new_hasher
from stager.errors import StagerError
from stager.formats import get_format
from stager.formats.base import FragmentsDone, write_parts
from stager.fs.atomic import partial_path, space_error
from stager.fs.kernel import futex_wait, futex_wake
from stager.fs.writeback import start_writeback
from stager.manifest import AuxFile
from stager.pack.plan import cut_shards
from stager.pack.shard import SampleRows, ShardJob, finish_done, fsync_and_hash, fsync_file, write_samples
from stager.pack.sources.columns import sizes_of

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from stager.checksum import Hasher
    from stager.pack.shard import FragmentFormat
    from stager.pack.sources.base import SampleRef, Source
    from stager.pack.state import ShardDone
    from stager.progress import Progress

SEG_SAMPLES = 512  # at most this many samples per segment ...
SEG_BYTES = 4 << 20  # ... and about this many source bytes (a few ms of work: small vs. task overhead)
_UNKNOWN = -1  # offset slot not yet published
_POISON = -2  # an earlier segment (or the parent) gave up: stop


class SegmentAbortedError(Exception):
    """A segment stopped because an earlier one failed (never the error reported to the user)."""


def plan_segments(job: ShardJob) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of ``job``'s planned samples, one per segment."""
    return cut_shards(sizes_of(job.shard.refs), samples_per_shard=SEG_SAMPLES, shard_size=SEG_BYTES)


class Slots:
    """Shared int64 offset slots in a memory-mapped file (works across fork and spawn, and for
    workers started before the array existed).

    :meth:`publish` stores a slot and wakes the processes in :meth:`wait` on it (a futex on the shared
    mapping where the kernel has them: a waiting worker resumes within microseconds of its
    predecessor's publish, instead of at its next poll; elsewhere :meth:`wait` polls).
    """

    WAIT_S = 0.005  # a futex sleep's bound: the slot is re-read at least this often (never needed for wake-up)

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
        self._cells = (ctypes.c_int64 * len(self.offsets)).from_buffer(self._mm)  # the slots' addresses

    def _addr(self, i: int) -> int:
        # A slot's first 32-bit word: -1 (unknown) has both words 0xFFFFFFFF whatever the byte order.
        return ctypes.addressof(self._cells) + 8 * i

    def publish(self, i: int, value: int) -> None:
        """Set slot ``i`` to ``value`` and wake whoever waits on it."""
        self.offsets[i] = value
        futex_wake(self._addr(i))

    def wait(self, i: int) -> int:
        """Slot ``i``'s value once published (:class:`SegmentAbortedError` if it was poisoned)."""
        delay = 1e-5
        while (v := int(self.offsets[i])) == _UNKNOWN:
            # A published value whose first word happens to be 0xFFFFFFFF only costs one WAIT_S sleep.
            if not futex_wait(self._addr(i), _UNKNOWN, self.WAIT_S):
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
        if v == _POISON:
            raise SegmentAbortedError(f"segment slot {i}: an earlier segment failed")
        return v

    def close(self) -> None:
        del self._cells
        self.offsets.release()
        self._mm.close()


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


class SegmentDone(NamedTuple):
    """A written segment, as a worker reports it: its rows (offsets relative to ``start``), where it
    lies in the shard file, and the format's ``extra()`` of its samples."""

    job: int  # index of its job
    start: int  # offset of its first byte in the shard file
    size: int
    rows: SampleRows
    extra: Any
    worker: tuple[int, float]  # the worker's pid and the CPU seconds it has used so far (a run's profile)


def run_segment(task: SegmentTask, job: ShardJob, refs: Sequence[SampleRef], source: Source,
                slots: Slots) -> SegmentDone:
    """In a worker: build one segment of ``job`` (``refs``, its samples), publish its end offset,
    ``pwritev`` it."""
    fmt = cast("FragmentFormat", get_format(job.options.format))  # segments exist for these only
    rows = SampleRows()
    published = False
    slot = task.slot
    try:
        w = fmt.open_fragment(
            shard_name=job.shard.name,
            classes=list(job.classes),
            keys_checked=job.keys_checked,
            json_member=job.options.tar_json,
            fields=job.fields,
        )
        write_samples(w, refs, source, job, rows, progress=None)
        parts = w.take()
        size = sum(map(len, parts))
        start = slots.wait(slot)
        slots.publish(slot + 1, start + size)
        published = True
        fd = os.open(task.path, os.O_WRONLY)
        try:
            write_parts(fd, parts, start)
            start_writeback(fd, start, size)
        finally:
            os.close(fd)
    except BaseException as exc:
        if not published:
            slots.publish(slot + 1, _POISON)
        if isinstance(exc, OSError) and not isinstance(exc, StagerError):
            err = space_error(exc, Path(job.out) / job.shard.name)
            if err is not None:
                raise err from exc
        raise
    return SegmentDone(task.job, start, size, rows, w.extra(), (os.getpid(), time.process_time()))


class _ShardHash:
    """A shard's hash, fed the file's bytes in order as they become final (read back through a
    read-only map: no copy out of the page cache; a mapping's pages come 16 at a time)."""

    def __init__(self, path: Path, algo: str) -> None:
        self.path = path
        self.hasher: Hasher = new_hasher(algo)
        self.upto = 0  # bytes hashed

    def feed(self, end: int) -> None:
        """Hash the file's bytes ``[upto, end)``."""
        if end <= self.upto:
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            at = self.upto - self.upto % mmap.ALLOCATIONGRANULARITY
            with mmap.mmap(fd, end - at, offset=at, access=mmap.ACCESS_READ) as mm, memoryview(mm) as v:
                self.hasher.update(v[self.upto - at :])
        finally:
            os.close(fd)
        self.upto = end


class _Shard:
    """The parent's record of one shard being written in segments."""

    def __init__(self, job: ShardJob, fmt: FragmentFormat, segments: int) -> None:
        self.job = job
        self.tmp = partial_path(Path(job.out) / job.shard.name)
        with open(self.tmp, "wb"):
            pass
        self.segments = segments
        self.done: list[SegmentDone] = []
        self.ends: dict[int, int] = {}  # start -> end of each segment written
        # A format whose fragments start at byte 0 has its shard's bytes final as they are written
        # (tar): hashed as they land. Otherwise the bytes before them come last (HDF5's metadata).
        self.progressive = fmt.fragment_base() == 0
        self.hash = _ShardHash(self.tmp, job.options.hash_algo)

    def add(self, seg: SegmentDone) -> bool:
        """Record ``seg``; hash what became final; whether every segment is in."""
        self.done.append(seg)
        self.ends[seg.start] = seg.start + seg.size
        if self.progressive:
            end = self.hash.upto
            while end in self.ends:
                end = self.ends.pop(end)
            self.hash.feed(end)
        return len(self.done) == self.segments


class SegmentRun:
    """The parent's side of one segment-parallel write: the offset slots, the segment queue, the
    tasks in flight, the shards' hashes and their finishing.

    Slot layout: job ``i`` owns slots ``bases[i] .. bases[i + 1] - 1``, one more than its segments;
    its first slot holds the format's ``fragment_base()`` and segment ``k`` publishes its end into
    slot ``bases[i] + k + 1``, so the last slot ends up holding where the fragments end.
    ``submit(task)`` runs :func:`run_segment` for a task on the pool.
    """

    def __init__(self, submit: Callable[[SegmentTask], Future[SegmentDone]], jobs: list[ShardJob], jobs_file: str,
                 state_dir: Path, *, in_flight: int, workers_cpu: dict[int, float],
                 ready: Callable[[], None] = lambda: None) -> None:
        self.submit = submit
        self.ready = ready  # waited for before a shard is renamed into place
        self.workers_cpu = workers_cpu  # pid -> CPU seconds, as the latest segment of each worker said
        self.in_flight = in_flight
        self.jobs = jobs
        self.fmt = cast("FragmentFormat", get_format(jobs[0].options.format))
        segs = [plan_segments(j) for j in jobs]
        self.bases = np.cumsum([0] + [len(s) + 1 for s in segs]).tolist()  # each job's first slot
        self.slots = Slots(str(state_dir / f"slots-{uuid.uuid4().hex[:12]}.bin"), int(self.bases[-1]))
        self.shards: list[_Shard] = []
        self.queue: deque[SegmentTask] = deque()
        for ji, (job, runs) in enumerate(zip(jobs, segs, strict=True)):
            shard = _Shard(job, self.fmt, len(runs))
            self.shards.append(shard)
            first = self.bases[ji]
            self.slots.offsets[first] = self.fmt.fragment_base()
            self.queue.extend(
                SegmentTask(jobs_file, self.slots.path, ji, a, b, first + k, str(shard.tmp))
                for k, (a, b) in enumerate(runs)
            )
        self.segments: set[Future[SegmentDone]] = set()
        # Finishing threads: fsync, rename and done-record of each shard (fsync waits for the disk).
        self.finisher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="stager-pack-finish")
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
                res = f.result()  # re-raises the worker's (or finisher's) exception
                del self.submitted[f]
                if not isinstance(res, SegmentDone):
                    out.append(res)
                    continue
                progress.update(len(res.rows.keys), res.rows.payload)
                pid, cpu = res.worker
                self.workers_cpu[pid] = max(cpu, self.workers_cpu.get(pid, 0.0))
                if self.shards[res.job].add(res):
                    self._finish(res.job)
            self._refill()
        return out

    def _pending(self) -> set[Future[Any]]:
        return {*self.segments, *self.finishing}

    def _refill(self) -> None:
        # Segments are submitted a few at a time, in plan order, so that a shard is finished soon
        # after its last segment instead of after every queued segment.
        while self.queue and len(self.segments) < self.in_flight:
            f = self.submit(self.queue.popleft())
            self.segments.add(f)
            self.submitted[f] = None

    def _finish(self, ji: int) -> None:
        """Every segment of job ``ji`` is written: finish the shard (here: the format's finish and the
        rest of the hash; then fsync, rename and done-record on a thread)."""
        shard = self.shards[ji]
        job = shard.job
        end = int(self.slots.offsets[self.bases[ji + 1] - 1])
        rows = SampleRows()
        extras = []
        for seg in sorted(shard.done, key=lambda s: s.start):
            rows.extend(seg.rows, seg.start)
            extras.append(seg.extra)
        shard.done = []
        final = Path(job.out) / job.shard.name
        try:
            done = FragmentsDone(job.shard.name, job.classes, rows.keys, rows.labels, rows.sizes, extras)
            companions = self.fmt.finish_fragments(str(shard.tmp), end, done)
            shard.hash.feed(os.stat(shard.tmp).st_size)
        except OSError as exc:
            err = space_error(exc, final)
            if err is not None:
                raise err from exc
            raise
        g = self.finisher.submit(_publish, job, shard.tmp, companions, rows, shard.hash, self.ready)
        self.finishing.add(g)
        self.submitted[g] = None

    def abort(self, exc: BaseException, stop_workers: Callable[[], None] = lambda: None) -> None:
        """Stop after ``exc``: release every waiting segment, drain the pool, and raise instead the
        first real failure (in plan order) when ``exc`` only says an earlier segment failed. After an
        interrupt, or once the pool broke (a worker died), ``stop_workers()`` ends the workers instead, and
        the segments they held end with their pool's BrokenProcessPool (not cancelled: Python 3.11's pool,
        finding a cancelled future when it breaks, fails on it and never settles the rest)."""
        offsets = self.slots.offsets
        for i in range(len(offsets)):
            if offsets[i] == _UNKNOWN:
                self.slots.publish(i, _POISON)
        # A worker died (the pool broke): the rest are ended too, before the caller removes their partials.
        interrupted = isinstance(exc, (KeyboardInterrupt, BrokenExecutor))
        if interrupted:
            stop_workers()
        for f in (self.finishing if interrupted else self._pending()):
            f.cancel()
        wait(self._pending())
        if isinstance(exc, SegmentAbortedError):
            for f in self.submitted:
                e = f.exception() if f.done() and not f.cancelled() else None
                if e is not None and not isinstance(e, SegmentAbortedError):
                    raise e from None

    def close(self) -> None:
        self.finisher.shutdown(wait=True)
        self.slots.close()


def _publish(job: ShardJob, tmp: Path, companions: list[tuple[str, str]], rows: SampleRows,  # noqa: PLR0917
             shard_hash: _ShardHash, ready: Callable[[], None]) -> ShardDone:
    """On a finishing thread: fsync the finished shard (and its companions), rename them into place,
    companions first, once ``ready()``, and write its done-record (as
    :func:`stager.pack.shard.write_shard` does)."""
    final = Path(job.out) / job.shard.name
    try:
        aux = [AuxFile(cname, *fsync_and_hash(ctmp, job.options.hash_algo)) for cname, ctmp in companions]
        nbytes = fsync_file(tmp)
        ready()
        for cname, ctmp in companions:
            os.replace(ctmp, Path(job.out) / cname)
        os.replace(tmp, final)  # durable with the manifest's directory fsync, as in write_shard
    except OSError as exc:
        err = space_error(exc, final)
        if err is not None:
            raise err from exc
        raise
    return finish_done(job, [c for c, _ in companions], rows, nbytes=nbytes, digest=shard_hash.hasher.hexdigest(),
                       aux=aux)


def run_segments(submit: Callable[[SegmentTask], Future[SegmentDone]], workers: int, jobs: list[ShardJob],
                 jobs_file: str, *, progress: Progress, state_dir: Path,
                 workers_cpu: dict[int, float] | None = None, ready: Callable[[], None] = lambda: None,
                 stop_workers: Callable[[], None] = lambda: None) -> list[ShardDone]:
    """Write ``jobs`` in segments (``submit(task)`` runs :func:`run_segment` on the pool); return their
    :class:`ShardDone` (in completion order). ``workers_cpu`` gets each worker's CPU seconds by pid;
    ``ready()`` is waited for before a shard is renamed into place; ``stop_workers()`` ends the pool's
    workers at once (on an interrupt, before the segments in flight are waited for)."""
    run = SegmentRun(submit, jobs, jobs_file, state_dir, in_flight=2 * workers,
                     workers_cpu=workers_cpu if workers_cpu is not None else {}, ready=ready)
    try:
        return run.run(progress)
    except BaseException as exc:
        run.abort(exc, stop_workers)
        raise
    finally:
        run.close()

