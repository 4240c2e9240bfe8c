"""A node-local lock in the staging destination, robust to holders that died.

Several processes on one node (every rank of a job, or ``srun`` steps) may call ``stager stage``
at once; exactly one must copy. The lock is a file ``DEST/<name>`` holding ``{"pid", "host",
"boot_id", "time"}``:

* Acquire: write the holder record into a private ``<name>.<uuid>.partial`` file (created with
  ``O_EXCL``), take ``fcntl.flock`` on it, and publish it with ``os.link`` to the lock name, which
  fails with EEXIST if the lock exists (the classic atomic-create that, unlike a bare ``O_EXCL`` on
  the final name, never shows a half-written record).
* A live holder always holds the ``flock``; the kernel drops it when the holder dies. So when a
  waiter can ``flock`` the existing file (still the same inode as the path), the holder is dead and
  the waiter takes the lock over in place. Where ``flock`` is not supported, the record decides:
  same host and (different boot id or no such pid) means dead.
* Release: unlink the path, then close (dropping the flock). A waiter that opened the old inode
  notices that the path no longer points to it and retries.

Safety (:mod:`stager.fs.safe`): every step is relative to a handle on the lock's directory; the
partial is created with ``O_EXCL|O_NOFOLLOW`` and published with ``link``, the existing lock is
opened with ``O_NOFOLLOW|O_NONBLOCK`` and must be a regular file owned by us or root and not
writable by others (else :class:`~stager.errors.UnsafePathError`, exit 2): a symlink planted at the
lock's name is never written through, a FIFO never blocks, a file of another user is never taken
over. The lock file is ``0600``: nobody else can open it, so nobody else can hold its ``flock``.
A waiter is told who holds the lock once it has waited ``notice`` seconds (``on_wait``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from stager.errors import StagerTimeoutError
from stager.fs.atomic import partial_path
from stager.fs.kernel import boot_id
from stager.fs.safe import SafeDir


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_is_dead(record: dict[str, Any]) -> bool:
    """Judge a holder record from this host: dead if another boot or its pid is gone."""
    if record.get("host") != os.uname().nodename:
        return False  # another host's process: we cannot see it, so never assume it is dead
    if record.get("boot_id") and record.get("boot_id") != boot_id():
        return True
    try:
        pid = int(record.get("pid", -1))
    except (TypeError, ValueError):
        return False  # an unreadable record: never assume its holder is dead
    return not pid_alive(pid)


class NodeLock:
    """``with NodeLock(path, timeout=...) as lock:`` - exclusive among processes on this node.

    ``waited`` (seconds spent waiting), ``took_over`` (the previous holder record when a dead
    holder's lock was taken over) are set after entry. ``timeout`` None waits forever; on expiry
    :class:`StagerTimeoutError` names the holder. ``on_wait(holder record)`` is called once when
    the lock is still held by another process after ``notice`` seconds. ``directory``: an already
    checked handle on the lock's directory (else the directory is created if missing and opened,
    not following a symlink at its last component).
    """

    def __init__(self, path: str | os.PathLike[str], timeout: float | None = None, poll: float = 0.05, *,
                 directory: SafeDir | None = None, on_wait: Callable[[dict[str, Any]], None] | None = None,
                 notice: float = 5.0) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self.poll = poll
        self.on_wait = on_wait
        self.notice = notice
        self.fd: int | None = None
        self.waited = 0.0
        self.took_over: dict[str, Any] | None = None
        self._given_dir = directory
        self._dir: SafeDir | None = None

    @property
    def name(self) -> str:
        return self.path.name

    def _record(self) -> bytes:
        rec = {"pid": os.getpid(), "host": os.uname().nodename, "boot_id": boot_id(), "time": time.time()}
        return (json.dumps(rec) + "\n").encode()

    def _try_create(self, d: SafeDir) -> bool:
        tmp = partial_path(self.path).name
        fd = d.create_file(tmp, 0o600, os.O_RDWR)
        try:
            os.write(fd, self._record())
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                d.link(tmp, self.name)
            except FileExistsError:
                os.close(fd)
                return False
            self.fd = fd
            return True
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        finally:
            d.unlink(tmp)

    def _try_takeover(self, d: SafeDir) -> bool:
        try:
            fd, st = d.open_file(self.name, os.O_RDWR, what="stage lock",
                                 fix="remove it (only the user who runs stage should own it) and rerun")
        except FileNotFoundError:
            return False
        keep = False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                flocked = True
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return False  # a live holder
                flocked = False  # no flock support here: fall back to the record
            now = d.lstat(self.name)
            if now is None or now.st_ino != st.st_ino or now.st_dev != st.st_dev:
                return False  # released and replaced meanwhile
            try:
                record = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except (ValueError, RecursionError):
                record = {}
            if not isinstance(record, dict):
                record = {}
            if not flocked and not holder_is_dead(record):
                return False
            data = self._record()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fchmod(fd, 0o600)
            self.took_over = record
            self.fd = fd
            keep = True
            return True
        finally:
            if not keep:
                os.close(fd)

    def holder(self) -> dict[str, Any]:
        """The holder record (``pid``, ``host``, ``boot_id``, ``time``), or {} when unreadable."""
        try:
            data = (self._dir.read_bytes(self.name, what="stage lock", limit=4096) if self._dir is not None
                    else None)
            rec = json.loads(data or b"{}")
        except (OSError, ValueError, RecursionError):
            return {}
        return rec if isinstance(rec, dict) else {}

    def _open_dir(self) -> SafeDir:
        if self._given_dir is not None:
            return self._given_dir
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return SafeDir.open(self.path.parent, check=False)

    def acquire(self) -> NodeLock:
        start = time.monotonic()
        d = self._dir = self._open_dir()
        told = self.on_wait is None
        try:
            while True:
                if self._try_create(d) or self._try_takeover(d):
                    self.waited = time.monotonic() - start
                    return self
                waited = time.monotonic() - start
                if not told and waited >= self.notice and self.on_wait is not None:
                    told = True
                    self.on_wait(self.holder())
                if self.timeout is not None and waited >= self.timeout:
                    h = self.holder()
                    raise StagerTimeoutError(
                        f"{self.path}: still locked after {self.timeout:g}s by pid {h.get('pid', '?')} on "
                        f"{h.get('host', '?')}; wait longer (--timeout) or, if that process is gone, rerun"
                    )
                time.sleep(self.poll)
        except BaseException:
            self._close_dir()
            raise

    def release(self) -> None:
        if self.fd is None:
            return
        if self._dir is not None:
            self._dir.unlink(self.name)
        os.close(self.fd)
        self.fd = None
        self._close_dir()

    def _close_dir(self) -> None:
        if self._dir is not None and self._dir is not self._given_dir:
            self._dir.close()
        self._dir = None

    def __enter__(self) -> NodeLock:
        return self.acquire()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


__all__ = ["NodeLock", "holder_is_dead", "pid_alive"]
