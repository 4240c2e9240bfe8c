"""What the kernel offers beyond :mod:`os`, in one place: ``sync_file_range``, ``syncfs``, ``statfs``
(through the libc already mapped into this process) and the boot id.

Each call degrades to "not available" (None/False, or ``os.sync``) off Linux or where the file system
refuses it; callers treat them as hints or fast paths, never as their only route to correctness.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys
import time

# <linux/fs.h>
SYNC_FILE_RANGE_WAIT_BEFORE = 1
SYNC_FILE_RANGE_WRITE = 2
SYNC_FILE_RANGE_WAIT_AFTER = 4


@functools.lru_cache(maxsize=1)
def libc() -> ctypes.CDLL:
    """The libc already mapped into this process (``find_library("c")`` would run ldconfig: ~25 ms)."""
    return ctypes.CDLL(None, use_errno=True)


@functools.lru_cache(maxsize=1)
def _sync_file_range_fn() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``sync_file_range`` (``int(int fd, off64_t off, off64_t n, unsigned flags)``) or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = libc().sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def has_sync_file_range() -> bool:
    return _sync_file_range_fn() is not None


def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> bool:
    """Call ``sync_file_range(2)``; False where it is unavailable or unsupported (nothing done).

    Errors other than "not supported" (EIO, ENOSPC) raise OSError: they would fail the fsync too.
    """
    fn = _sync_file_range_fn()
    if fn is None:
        return False
    if fn(fd, offset, nbytes, flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err))


def syncfs(path: str | os.PathLike[str]) -> None:
    """Flush the file system holding ``path`` once (Linux ``syncfs``); fall back to ``os.sync``."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if libc().syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    os.sync()


class _Statfs(ctypes.Structure):
    # Only f_type is read; the rest of struct statfs is padding large enough for every Linux ABI.
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 256)]


def statfs_magic(path: str | os.PathLike[str]) -> int | None:
    """``statfs(path).f_type`` as an unsigned 32-bit number, or None (no such path, not Linux)."""
    try:
        buf = _Statfs()
        if libc().statfs(os.fsencode(os.fspath(path)), ctypes.byref(buf)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return int(buf.f_type) & 0xFFFFFFFF


@functools.lru_cache(maxsize=1)
def boot_id() -> str:
    """An identifier of the running boot: Linux's ``/proc/sys/kernel/random/boot_id``; elsewhere the
    boot time to 10 s (a rounding edge can only make a later run distrust and redo work, never trust
    more). Unsynced writes from another boot may be lost or torn, so they are never trusted."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"boot@{round(time.time() - time.monotonic(), -1):.0f}"


_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3


def keep_freed_heap(nbytes: int = 256 << 20) -> None:
    """Make this process keep up to ``nbytes`` of freed heap instead of handing it back to the kernel
    at once (glibc ``mallopt``: trim and mmap thresholds; a no-op elsewhere).

    For processes that allocate and free the same few MB over and over, such as a pack worker
    reading one segment of files after another: with glibc's defaults each segment's buffers are
    returned when freed and the next segment's page-fault in again, which cost a pack worker as much
    CPU as the copies themselves. For processes stager owns only: the setting outlives the call (it
    also ends glibc's dynamic threshold), so a library function must not change it in its caller.
    """
    try:
        mallopt = libc().mallopt
    except AttributeError:
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(_M_TRIM_THRESHOLD, nbytes)
    mallopt(_M_MMAP_THRESHOLD, min(nbytes, 32 << 20))  # glibc's ceiling for it on 64-bit


def release_free_heap() -> None:
    """Hand freed heap pages back to the kernel (glibc ``malloc_trim(0)``; a no-op elsewhere).

    glibc raises its mmap threshold after the first large ``free``, so the next large numpy arrays
    (an epoch plan: a few int64 arrays of the rank's share) come from the heap and stay resident
    after they are freed: ~50 MB per million samples on every loader worker. Called once a plan's
    temporaries are gone.
    """
    try:
        trim = libc().malloc_trim
    except AttributeError:
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)



# <linux/futex.h>: shared (not FUTEX_PRIVATE) operations, so that processes mapping the same file meet.
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "ppc64": 221, "s390x": 238}


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.lru_cache(maxsize=1)
def _futex_nr() -> int | None:
    """The ``futex`` system call's number on this machine, or None (not Linux, unknown machine)."""
    if not sys.platform.startswith("linux"):
        return None
    return _SYS_FUTEX.get(os.uname().machine)


def futex_wait(addr: int, expected: int, timeout_s: float) -> bool:
    """Sleep while the 32-bit int at address ``addr`` (in memory shared with other processes: a
    ``MAP_SHARED`` file mapping) holds ``expected``, until :func:`futex_wake` on it or ``timeout_s``.

    Returns False when futexes are unavailable (not Linux, unknown machine, refused): the caller
    polls instead. Otherwise True, however it woke (woken, timed out, interrupted, or the value
    was not ``expected`` to begin with): the caller re-reads the value, as futex callers must.
    """
    nr = _futex_nr()
    if nr is None:
        return False
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    r = libc().syscall(ctypes.c_long(nr), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
                       ctypes.c_int(expected), ctypes.byref(ts), None, ctypes.c_int(0))
    return r == 0 or ctypes.get_errno() not in (errno.ENOSYS, errno.EPERM, errno.EFAULT, errno.EINVAL)


def futex_wake(addr: int) -> None:
    """Wake every process sleeping in :func:`futex_wait` on ``addr`` (a no-op where there are no futexes)."""
    nr = _futex_nr()
    if nr is not None:
        libc().syscall(ctypes.c_long(nr), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
                       ctypes.c_int(0x7FFFFFFF), None, None, ctypes.c_int(0))
