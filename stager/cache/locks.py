"""Fill locks: one writer per object, and one eviction at a time (``DIR/locks/<key>``, ``locks/.gc``).

A lock is an ``flock`` on a small file the cache owner creates in ``locks/`` (never through a link:
:func:`stager.fs.safe.open_trusted`, a regular file of the caller's). The kernel drops an ``flock``
when its holder dies, so a filler killed mid-copy never blocks the next one: whoever takes the lock
next removes the dead filler's partial file and copies again. Lock files are removed only by eviction, with the lock
held; a waiter that opened the removed file notices (its inode is no longer the path's) and retries.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

from stager.fs.safe import O_CLOEXEC, O_NOFOLLOW, O_NONBLOCK, open_trusted


def _flock_current(fd: int, st: os.stat_result, path: Path) -> bool | None:
    """``flock`` the lock file open as ``fd`` without waiting: True when held and still the file at
    ``path``, False when someone else holds it, None when it was removed meanwhile (lock the new one)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    try:
        return True if os.lstat(path).st_ino == st.st_ino else None
    except FileNotFoundError:
        return None


class FillLock:
    """``flock`` on ``locks_dir/name``: :meth:`try_acquire` (never waits), :meth:`acquire` (waits up to
    ``timeout`` seconds; None: forever), :meth:`release`. Also a context manager (waits forever)."""

    def __init__(self, locks_dir: Path, name: str) -> None:
        self.path = locks_dir / name
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        fix = "the cache's lock files are its own: its owner runs `stager cache verify` on the cache"
        while True:
            # Made if missing, never through a link; a regular file of the caller's, not hard-linked.
            fd, st = open_trusted(self.path, os.O_RDWR | os.O_CREAT, what="fill lock", fix=fix,
                                  owners=frozenset({os.geteuid()}), single_link=True, mode=0o600)
            try:
                held = _flock_current(fd, st, self.path)
            except BaseException:
                os.close(fd)
                raise
            if held:
                self.fd = fd
                return True
            os.close(fd)
            if held is False:
                return False
            # None: removed (evicted) while we waited: take the new file

    def acquire(self, timeout: float | None = None, poll: float = 0.05) -> bool:
        start = time.monotonic()
        while not self.try_acquire():
            if timeout is not None and time.monotonic() - start >= timeout:
                return False
            time.sleep(poll)
        return True

    def release(self, *, remove: bool = False) -> None:
        """Drop the lock; with ``remove`` also delete the lock file first (eviction of its object)."""
        if self.fd is None:
            return
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> FillLock:
        self.acquire()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def lock_held(path: Path) -> bool:
    """True when someone holds an ``flock`` on ``path`` now (a live filler); False when nobody does or
    the file is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)
    return False
