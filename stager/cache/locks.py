"""Fill locks: one writer per object, and one eviction at a time (``DIR/locks/<key>``, ``locks/.gc``).

A lock is an ``flock`` on a small file the cache owner creates in ``locks/`` (never through a link:
``O_NOFOLLOW``, a regular file of the caller's). The kernel drops an ``flock`` when its holder dies,
so a filler killed mid-copy never blocks the next one: whoever takes the lock next removes the
dead filler's partial file and copies again. Lock files are removed only by eviction, with the lock
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

from stager.errors import UnsafePathError
from stager.fs.safe import O_CLOEXEC, O_NOFOLLOW, O_NONBLOCK, require


class FillLock:
    """``flock`` on ``locks_dir/name``: :meth:`try_acquire` (never waits), :meth:`acquire` (waits up to
    ``timeout`` seconds; None: forever), :meth:`release`. Also a context manager (waits forever)."""

    def __init__(self, locks_dir: Path, name: str) -> None:
        self.path = locks_dir / name
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        fix = "the cache's lock files are its own: its owner runs `stager cache verify` on the cache"
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0o600)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise UnsafePathError(f"{self.path}: fill lock is a symlink (links are not followed); "
                                          f"{fix}") from exc
                raise
            try:
                st = os.fstat(fd)
                require(st, self.path, "fill lock", fix, expect="file", owners=frozenset({os.geteuid()}),
                        single_link=True)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        os.close(fd)
                        return False
                    raise
                try:
                    same = os.lstat(self.path).st_ino == st.st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    self.fd = fd
                    return True
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            os.close(fd)  # removed (evicted) while we waited: take the new file

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
