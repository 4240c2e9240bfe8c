"""The verified copy of one file: read, hash and write in one pass, with write-back overlapped.

:func:`copy_hashed` is the inner loop of ``stager stage``. Per block it does exactly three things:
``readinto`` a buffer the stream allocated once (no ``bytes`` object per block), ``hasher.update``
on a memoryview of it (xxh3-128 runs at ~20 GB/s per core: a few percent of the copy), and
``os.write`` of the same memoryview (no slice copies). The source is read once; the hash is of the
bytes written.

Durability without a stall at the end: the copy is fsynced before it is renamed (the project rule),
and an fsync of a freshly written 64 MiB file has to push all of it to the disk. :class:`WriteBehind`
starts write-back of each block as soon as it is written (``sync_file_range(SYNC_FILE_RANGE_WRITE)``,
Linux; it returns once the I/O is queued), so the disk works while the stream copies the next blocks
and the final fsync finds little left. It also waits for the block ``window`` bytes behind, which
bounds the dirty pages each stream holds (they would otherwise pile up to ``vm.dirty_ratio`` and
then stall every writer on the node at once). Where ``sync_file_range`` does not exist (not Linux)
or is refused (some file systems), it does nothing and the fsync does all the work, as before.

Measured effects and the block/stream sweep: docs/bench/stage.md.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .checksum import Hasher

# <linux/fs.h>
SYNC_FILE_RANGE_WAIT_BEFORE = 1
SYNC_FILE_RANGE_WRITE = 2
SYNC_FILE_RANGE_WAIT_AFTER = 4
DEFAULT_WINDOW = 64 << 20  # dirty bytes one stream may hold before it waits for its oldest write-back


@dataclass(frozen=True)
class CopyTuning:
    """Knobs of the copy engine (defaults measured in docs/bench/stage.md).

    ``block``: bytes per read (None: the caller's choice, 8 MiB or a multiple of the Lustre stripe
    size); ``window``: write-behind window per stream (see :class:`WriteBehind`; 0: start write-back
    but never wait, -1: off, the fsync does everything); ``sync_threads``: threads that fsync and
    rename verified copies while the streams go on (0: each stream does it itself).
    """

    block: int | None = None
    window: int = DEFAULT_WINDOW
    sync_threads: int = 2


class Readable(Protocol):
    def readinto(self, buf: memoryview, /) -> int | None: ...


@functools.lru_cache(maxsize=1)
def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (``int(int fd, off64_t off, off64_t n, unsigned flags)``) or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the libc already loaded into this process
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> bool:
    """Call ``sync_file_range(2)``; False where it is unavailable or unsupported (nothing done).

    Errors other than "not supported" (EIO, ENOSPC) raise OSError: they would fail the fsync too.
    """
    fn = _sync_file_range()
    if fn is None:
        return False
    if fn(fd, offset, nbytes, flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err))


class WriteBehind:
    """Start write-back of each written range at once; keep at most ``window`` bytes in flight.

    ``wrote(offset, n)`` after every write; the caller still fsyncs at the end (this only moves the
    disk work earlier, it promises nothing about durability). ``window=0`` starts write-back but
    never waits.
    """

    def __init__(self, fd: int, window: int = DEFAULT_WINDOW) -> None:
        self.fd = fd
        self.window = window
        self.enabled = _sync_file_range() is not None
        self._waited_to = 0  # everything before this offset has been written back

    def wrote(self, offset: int, nbytes: int) -> None:
        if not self.enabled or nbytes <= 0:
            return
        if not sync_file_range(self.fd, offset, nbytes, SYNC_FILE_RANGE_WRITE):
            self.enabled = False
            return
        behind = offset + nbytes - self.window
        if self.window > 0 and behind > self._waited_to:
            # WAIT_BEFORE|WRITE|WAIT_AFTER on an already-started range: wait for it to reach the disk.
            sync_file_range(self.fd, self._waited_to, behind - self._waited_to,
                            SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER)
            self._waited_to = behind


def write_all(fd: int, view: memoryview) -> None:
    """``os.write`` until all of ``view`` is written (a short write continues where it stopped)."""
    while view:
        n = os.write(fd, view)
        view = view[n:]


def copy_hashed(
    src: Readable,
    fd: int,
    buf: memoryview,
    hasher: Hasher,
    *,
    limit: int,
    write_behind: WriteBehind | None = None,
    on_block: Callable[[int], None] | None = None,
) -> int:
    """Copy ``src`` to ``fd`` from their current positions through ``buf``, hashing what is written.

    Reads ``len(buf)`` bytes at a time until EOF, or until more than ``limit`` bytes were read (the
    source is larger than expected: the caller fails the copy without reading the rest). Returns the
    bytes copied (> ``limit`` in that case). ``on_block(n)`` runs after each block (progress,
    cancellation: raise to stop).
    """
    total = 0
    while True:
        n = src.readinto(buf)
        if not n:
            return total
        chunk = buf[:n]
        hasher.update(chunk)
        write_all(fd, chunk)
        if write_behind is not None:
            write_behind.wrote(total, n)
        total += n
        if on_block is not None:
            on_block(n)
        if total > limit:
            return total


__all__ = ["CopyTuning", "WriteBehind", "copy_hashed", "sync_file_range", "write_all"]
