"""The copy streams of one stage run: verified copies of the plan's files into DEST.

:class:`Copier` runs ``workers`` threads; each takes the next file and copies it with the one
verified copy (:func:`stager.fs.verified.copy_verified`: into ``<name>.<uuid>.partial``, hashed while
copied with write-behind or O_DIRECT, size and hash compared with the manifest at EOF, no second
read). Finisher threads then publish the verified copy with the source file's access
(:func:`~stager.fs.access.copy_mode` and group): fsync (unless ``--no-fsync``), rename, journal,
while the stream goes on with its next file.

Contract: a file is journaled only after its rename, so the journal never lists a file that is not
in DEST with the manifest's size and hash; a failed or cancelled copy never leaves its partial file
behind (:meth:`~stager.fs.verified.PartialCopy.fail`); the first error cancels the other streams and
is re-raised from :meth:`Copier.run` (disk-full errors as one-line
:class:`~stager.errors.OutOfSpaceError`). Every open of SRC goes through :func:`open_src_file`,
with the plan's storage options.

``$STAGER_TEST_THROTTLE_BPS`` (test-only) limits each stream to that many bytes/s so that tests can
kill a run mid-copy.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from stager.errors import ShardMissingError
from stager.fs.access import copy_mode, current_umask
from stager.fs.copy import CopyTuning, aligned_buffer
from stager.fs.open import is_url, open_read
from stager.fs.verified import Expected, PartialCopy, copy_verified
from stager.progress import Progress
from stager.stage.journal import Journal
from stager.stage.plan import FileTask, StagePlan

THROTTLE_ENV = "STAGER_TEST_THROTTLE_BPS"
SRC_FIX = "the source shard is damaged or changed after packing: restore it or re-pack (no copy kept)"


class Placement(Protocol):
    """Where verified copies go instead of DEST (a shard cache, :mod:`stager.stage.cached`): ``final``
    names the file a copy is renamed to, ``mode`` gives the placed file's mode from the source file's
    ``st_mode`` (None for an object store), and ``placed`` runs once the copy is renamed (before its
    journal line). Called from the copy and finisher threads."""

    def final(self, task: FileTask) -> Path: ...
    def mode(self, source_mode: int | None) -> int: ...
    def placed(self, task: FileTask) -> None: ...


@dataclass(frozen=True)
class _Verified:
    """A copy whose size and hash matched, still open under its partial name, and its access."""

    task: FileTask
    part: PartialCopy
    mode: int
    gid: int | None


class Copier:
    """Runs the copy streams; the first error cancels the others and is re-raised.

    ``workers`` threads each take the next file and copy it with
    :func:`~stager.fs.verified.copy_verified` (one reused buffer per stream, write-back started per
    block). A verified copy is then handed to one of ``tuning.sync_threads`` finisher threads
    (fchmod, fchown, fsync, rename, journal), so a stream goes on with its next file while the disk
    absorbs the last one; 0 finishes inline.
    """

    def __init__(self, plan: StagePlan, *, block: int, workers: int, journal: Journal | None, progress: Progress,
                 warnings: list[str], tuning: CopyTuning | None = None, fsync: bool = True,
                 placement: Placement | None = None) -> None:
        self.plan = plan
        self.placement = placement
        self.umask = current_umask()  # read once per run (a /proc read), applied to every copy's mode
        self.fsync = fsync
        self.tuning = tuning or CopyTuning()
        self.block = block
        self.workers = workers
        self.journal = journal
        self.progress = progress
        self.warnings = warnings
        self.cancel = threading.Event()
        self.errors: list[BaseException] = []
        self.copied = 0
        self.bytes = 0
        self.direct_files = 0  # copies written with O_DIRECT (the rest went through the page cache)
        self._lock = threading.Lock()
        self._next = 0
        self._warned_group = False
        self._finishers: _Finishers | None = None
        # Bounds the verified copies waiting for a finisher (each holds an open fd).
        self._pending = threading.BoundedSemaphore(max(1, self.tuning.sync_threads) + workers)

    def run(self, tasks: list[FileTask], meanwhile: Callable[[], None] | None = None) -> None:
        """Copy ``tasks``; ``meanwhile()`` runs on the calling thread while the streams copy."""
        self._tasks = tasks
        if self.tuning.sync_threads > 0:
            self._finishers = _Finishers(self.tuning.sync_threads, self._finish_async)
        threads = [threading.Thread(target=self._worker, name=f"stage-{i}", daemon=True)
                   for i in range(min(self.workers, len(tasks)))]
        try:
            for t in threads:
                t.start()
            if meanwhile is not None:
                try:
                    meanwhile()
                except BaseException as exc:
                    self._fail(exc)
            for t in threads:
                t.join()
        finally:
            if self._finishers is not None:
                self._finishers.close()
        if self.errors:
            raise self.errors[0]

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self.errors.append(exc)
        self.cancel.set()

    def _worker(self) -> None:
        buf = aligned_buffer(self.block)  # page-aligned: usable for O_DIRECT writes
        while not self.cancel.is_set():
            with self._lock:
                if self._next >= len(self._tasks):
                    return
                task = self._tasks[self._next]
                self._next += 1
            try:
                self._copy(task, buf)
            except BaseException as exc:
                self._fail(exc)
                return

    def _copy_access(self, task: FileTask, src: Any) -> tuple[int, int | None]:
        """``(mode, gid or None)`` for the copy of ``task`` from its open source file ``src``: the
        source's, by the one copy-mode rule (an object-store file has no owner or mode: 0600)."""
        if is_url(task.src_path):
            return 0o600, None
        st = os.fstat(src.fileno())  # of the file opened: a missing one already failed, naming it
        return copy_mode(st.st_mode, self.umask), st.st_gid

    def _on_block(self) -> Callable[[int], None]:
        """The copy engine's per-block callback for one file: stops the copy once another stream
        failed, counts progress, and throttles to ``$STAGER_TEST_THROTTLE_BPS`` (tests)."""
        throttle = Throttle()

        def on_block(n: int) -> None:
            if self.cancel.is_set():
                raise _CancelledError()
            self.progress.update(0, n)
            throttle.passed(n)
        return on_block

    def _copy(self, task: FileTask, buf: memoryview) -> None:
        """Copy and verify ``task`` into a partial file, then finish it (inline or on a finisher)."""
        final = self.placement.final(task) if self.placement is not None else self.plan.dest / task.name
        expect = Expected(task.name, task.bytes, task.hash, self.plan.manifest.hash_algo)
        part: PartialCopy | None = None
        try:
            with open_src_file(task.src_path, self.plan.storage_options) as f:
                mode, gid = self._copy_access(task, f)
                if self.placement is not None:
                    mode = self.placement.mode(None if is_url(task.src_path) else os.fstat(f.fileno()).st_mode)
                # Write-behind waits for the disk: only worth it when the fsync would wait anyway.
                part = copy_verified(f, final, expect, context=f" copying {task.src_path}", fix=SRC_FIX, buf=buf,
                                     direct=self.tuning.direct, window=self.tuning.window if self.fsync else -1,
                                     on_block=self._on_block())
        except BaseException as exc:
            if part is not None:  # verified, but closing the source failed: keep nothing
                part.fail(exc)
            raise
        if part.direct:
            with self._lock:
                self.direct_files += 1
        done = _Verified(task, part, mode, gid)
        if self._finishers is None:
            self._finish(done)
            return
        self._pending.acquire()
        try:
            self._finishers.submit(done)
        except BaseException as exc:
            self._pending.release()
            part.fail(exc)

    def _finish_async(self, done: _Verified) -> None:
        try:
            self._finish(done)
        except BaseException as exc:
            self._fail(exc)
        finally:
            self._pending.release()

    def _finish(self, done: _Verified) -> None:
        """Permissions, group, fsync, rename, journal line (the partial file is removed on error)."""
        task, part, gid = done.task, done.part, done.gid
        if self.cancel.is_set():
            part.fail(_CancelledError())
        if not part.publish(done.mode, gid, fsync=self.fsync):
            with self._lock:
                if not self._warned_group:
                    self._warned_group = True
                    self.warnings.append(group_warning(gid))
        if self.placement is not None:
            self.placement.placed(task)
        if self.journal is not None:
            self.journal.add_file(task.name, task.bytes)
        with self._lock:
            self.copied += 1
            self.bytes += task.bytes
        self.progress.update(1, 0)


class Throttle:
    """``$STAGER_TEST_THROTTLE_BPS`` (test-only): at most that many bytes/s through one copy, so that a
    test can kill a run mid-copy (every copy of a shard calls :meth:`passed`; without the variable it
    does nothing)."""

    def __init__(self) -> None:
        self.rate = float(os.environ.get(THROTTLE_ENV) or 0)
        self._start = time.perf_counter()
        self._bytes = 0

    def passed(self, nbytes: int) -> None:
        if self.rate > 0:
            self._bytes += nbytes
            lag = self._bytes / self.rate - (time.perf_counter() - self._start)
            if lag > 0:
                time.sleep(lag)


class _Finishers:
    """Up to ``n`` threads that run ``finish`` on each item handed over, started as items arrive (one
    file starts one). A queue and threads, not ``concurrent.futures``, whose import (with ``logging``)
    costs a small stage more than its finisher does. :meth:`close` waits for every item handed over."""

    def __init__(self, n: int, finish: Callable[[_Verified], None]) -> None:
        self._n = n
        self._finish = finish
        self._items: queue.SimpleQueue[_Verified | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, item: _Verified) -> None:
        with self._lock:
            start = self._idle == 0 and len(self._threads) < self._n
            if start:
                t = threading.Thread(target=self._loop, name=f"stage-sync-{len(self._threads)}", daemon=True)
                self._threads.append(t)
            else:
                self._idle -= 1
        self._items.put(item)
        if start:
            t.start()

    def _loop(self) -> None:
        while (item := self._items.get()) is not None:
            self._finish(item)
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._items.put(None)
        for t in threads:
            t.join()


class _CancelledError(Exception):
    """Another stream failed; this one stops quietly."""


def group_warning(gid: int | None) -> str:
    """The run's one warning when a staged copy could not be given the source's group."""
    return (f"cannot give staged files the source's group {gid} (EPERM): their group may read only what "
            "others may")


def open_src_file(src_path: str, storage_options: dict[str, Any] | None = None) -> Any:
    """Open a file the manifest lists in SRC (path or URL, with the plan's storage options) for
    streaming reads; a missing one is a :class:`~stager.errors.ShardMissingError` naming it."""
    try:
        return open_read(src_path, storage_options)
    except FileNotFoundError as exc:
        raise ShardMissingError(f"{src_path}: shard listed in the manifest is missing; restore it or re-pack") from exc
