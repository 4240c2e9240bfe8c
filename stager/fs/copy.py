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

Direct I/O (``stage --direct``, where the destination file system takes it): :func:`open_partial` opens
the copy with ``O_DIRECT`` and :func:`copy_hashed_direct` writes whole aligned blocks straight from
the stream's page-aligned buffer to the device. The kernel then never copies the data into new
page-cache pages (``copy_folio_from_iter_atomic`` was two thirds of the buffered copy's system time),
no dirty pages pile up to throttle other jobs on the node, and the final fsync only has the
metadata and the sub-block tail left. On this project's VM disk both paths run at the disk's
~2 GB/s write ceiling, O_DIRECT at half the CPU (0.15-0.23 vs 0.33-0.45 s/GB); its use is staging
beside a running job. The cost: the staged copy is not left in the page cache (the loader's first
epoch reads it from the SSD, sequentially).
File systems that refuse ``O_DIRECT`` (tmpfs before Linux 6.6, some FUSE) fall back to the
buffered path, at open or at the first write.

Measured effects and the block/stream sweep: docs/bench/stage.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from stager.checksum import Hasher
from stager.fs.safe import create_exclusive
from stager.fs.writeback import DEFAULT_WINDOW, WriteBehind

# O_DIRECT alignment of buffer address, length and file offset: 4 KiB covers 512 B and 4 KiB sector devices.
DIRECT_ALIGN = 4096
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class CopyTuning:
    """Knobs of the copy engine (defaults measured in docs/bench/stage.md).

    ``block``: bytes per read (None: the caller's choice, 8 MiB or a multiple of the Lustre stripe
    size); ``window``: write-behind window per stream (see :class:`WriteBehind`; 0: start write-back
    but never wait, -1: off, the fsync does everything); ``sync_threads``: threads that fsync and
    rename verified copies while the streams go on (0: each stream does it itself); ``direct``:
    write with ``O_DIRECT`` where the destination takes it (False: always through the page cache).
    """

    block: int | None = None
    window: int = DEFAULT_WINDOW
    sync_threads: int = 2
    direct: bool = False


class Readable(Protocol):
    def readinto(self, buf: memoryview, /) -> int | None: ...


def aligned_buffer(nbytes: int) -> memoryview:
    """A writable ``nbytes`` buffer whose address is page-aligned (anonymous mmap): O_DIRECT-safe."""
    return memoryview(mmap.mmap(-1, nbytes))


def open_partial(path: os.PathLike[str] | str, *, direct: bool, mode: int = 0o600, dir_fd: int | None = None
                 ) -> tuple[int, bool]:
    """Create ``path`` (relative to ``dir_fd`` when given) exclusively for writing
    (:func:`stager.fs.safe.create_exclusive`: no link followed); ``(fd, True)`` when it is open with
    ``O_DIRECT``. The verified copy's create (:mod:`stager.fs.verified`).

    ``direct=False``, no ``O_DIRECT`` on this platform, or a file system that refuses it at open
    (EINVAL): an ordinary fd and False.
    """
    if direct and O_DIRECT:
        try:
            return create_exclusive(path, mode, os.O_WRONLY | O_DIRECT, dir_fd=dir_fd), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # Some kernels create the file before refusing O_DIRECT; the name is ours (unique partial).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path, dir_fd=dir_fd)
    return create_exclusive(path, mode, dir_fd=dir_fd), False


def set_direct(fd: int, on: bool) -> None:
    """Switch ``O_DIRECT`` on or off for an open fd (Linux allows it through F_SETFL)."""
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, (fl | O_DIRECT) if on else (fl & ~O_DIRECT))


def fill(src: Readable, buf: memoryview) -> int:
    """``readinto`` until ``buf`` is full or the source is at EOF; the bytes read.

    A short read before EOF (network file systems, fsspec) would otherwise shift every later
    O_DIRECT write off its alignment.
    """
    n = 0
    size = len(buf)
    while n < size:
        got = src.readinto(buf[n:])
        if not got:
            break
        n += got
    return n


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


def copy_hashed_direct(
    src: Readable,
    fd: int,
    buf: memoryview,
    hasher: Hasher,
    *,
    limit: int,
    on_block: Callable[[int], None] | None = None,
) -> int:
    """:func:`copy_hashed` for an fd opened with ``O_DIRECT`` (:func:`open_partial`).

    ``buf`` must come from :func:`aligned_buffer` with a length that is a multiple of
    :data:`DIRECT_ALIGN`. Every full block is written directly; the last block's unaligned tail is
    written after switching the fd back to buffered I/O (the caller's fsync covers it). A file
    system that accepted the open but refuses a direct write (EINVAL) gets the rest buffered.
    Same return value and ``limit`` / ``on_block`` contract as :func:`copy_hashed`.
    """
    if len(buf) % DIRECT_ALIGN:
        raise ValueError(f"direct copy buffer of {len(buf)} bytes is not a multiple of {DIRECT_ALIGN}")
    total = 0
    direct = True
    while True:
        n = fill(src, buf)
        if not n:
            return total
        hasher.update(buf[:n])
        head = n - n % DIRECT_ALIGN if direct else 0
        if head:
            try:
                _pwrite_all(fd, buf[:head], total)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                head = 0  # nothing of this block was accepted: write it all buffered below
        if head < n:
            if direct:
                set_direct(fd, False)
                direct = False
            _pwrite_all(fd, buf[head:n], total + head)
        total += n
        if on_block is not None:
            on_block(n)
        if total > limit or n < len(buf):
            return total


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


__all__ = ["DIRECT_ALIGN", "CopyTuning", "aligned_buffer", "copy_hashed", "copy_hashed_direct",
           "fill", "open_partial", "set_direct", "write_all"]
