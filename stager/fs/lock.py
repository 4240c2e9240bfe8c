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
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from stager.errors import StagerTimeoutError
from stager.fs.atomic import partial_path
from stager.fs.kernel import boot_id


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
    if record.get("host") != socket.gethostname():
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
    :class:`StagerTimeoutError` names the holder.
    """

    def __init__(self, path: str | os.PathLike[str], timeout: float | None = None, poll: float = 0.05) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self.poll = poll
        self.fd: int | None = None
        self.waited = 0.0
        self.took_over: dict[str, Any] | None = None

    def _record(self) -> bytes:
        rec = {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": boot_id(), "time": time.time()}
        return (json.dumps(rec) + "\n").encode()

    def _try_create(self) -> bool:
        tmp = partial_path(self.path)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, self._record())
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                os.link(tmp, self.path)
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
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _try_takeover(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDWR)
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
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
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
            self.took_over = record
            self.fd = fd
            keep = True
            return True
        finally:
            if not keep:
                os.close(fd)

    def holder(self) -> dict[str, Any]:
        try:
            rec = json.loads(self.path.read_bytes() or b"{}")
        except (OSError, ValueError, RecursionError):
            return {}
        return rec if isinstance(rec, dict) else {}

    def acquire(self) -> NodeLock:
        start = time.monotonic()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            if self._try_create() or self._try_takeover():
                self.waited = time.monotonic() - start
                return self
            if self.timeout is not None and time.monotonic() - start >= self.timeout:
                h = self.holder()
                raise StagerTimeoutError(
                    f"{self.path}: still locked after {self.timeout:g}s by pid {h.get('pid', '?')} on "
                    f"{h.get('host', '?')}; wait longer (--timeout) or, if that process is gone, rerun"
                )
            time.sleep(self.poll)

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> NodeLock:
        return self.acquire()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
