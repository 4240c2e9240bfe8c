"""Crash-safe file writes: nothing ever appears under its final name half-written.

Every file stager creates is written as ``<name>.<uuid>.partial`` in the destination directory,
fsynced, renamed with :func:`os.replace` and the directory fsynced. On any exception the partial
file is removed. A crash (kill -9, node reboot) can leave ``*.partial`` files, never a torn final
file; :func:`remove_stale_partials` clears them on the next run.

The one exception is ``stager stage --no-fsync`` (the cp/dcp trade: renamed without fsync, so the
data may still be in the page cache when the command returns). What it writes is marked with
:func:`boot_id`; after a reboot such marks no longer match and the files are not trusted again.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from stager.errors import OutOfSpaceError

PARTIAL_SUFFIX = ".partial"
_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


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


def syncfs(path: str | os.PathLike[str]) -> None:
    """Flush the file system holding ``path`` once (Linux ``syncfs``); fall back to ``os.sync``."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    os.sync()


def partial_path(final: str | os.PathLike[str]) -> Path:
    """The temporary sibling ``<name>.<uuid>.partial`` for ``final``."""
    final = Path(final)
    return final.with_name(f"{final.name}.{uuid.uuid4().hex[:12]}{PARTIAL_SUFFIX}")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it survives a crash (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def space_error(exc: OSError, path: str | os.PathLike[str]) -> OutOfSpaceError | None:
    """Translate ENOSPC/EDQUOT/EFBIG into a one-line :class:`OutOfSpaceError`, else None."""
    if exc.errno in _SPACE_ERRNOS:
        what = {errno.ENOSPC: "disk full", errno.EDQUOT: "quota exceeded", errno.EFBIG: "file size limit"}
        return OutOfSpaceError(
            f"{path}: write failed ({what.get(exc.errno or 0, 'no space')}: {exc.strerror}); "
            "free space or choose another destination, then rerun (completed files are kept)"
        )
    return None


def commit_partial(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Rename an already-fsynced partial file to its final name and fsync the directory."""
    os.replace(tmp, final)
    fsync_dir(Path(final).parent)


@contextlib.contextmanager
def atomic_write(final: str | os.PathLike[str], mode: int | None = None) -> Iterator[BinaryIO]:
    """Open a partial sibling of ``final`` for binary writing; publish it atomically on success.

    ``mode`` (e.g. ``0o640``) is applied before the rename. Disk-full style errors are re-raised as
    :class:`OutOfSpaceError`; the partial file is removed on any failure.
    """
    final = Path(final)
    tmp = partial_path(final)
    f = open(tmp, "xb")  # noqa: SIM115 - closed below on every path
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        if mode is not None:
            os.chmod(tmp, mode)
        commit_partial(tmp, final)
    except OSError as exc:
        f.close()
        _unlink_quiet(tmp)
        err = space_error(exc, final)
        if err is not None:
            raise err from exc
        raise
    except BaseException:
        f.close()
        _unlink_quiet(tmp)
        raise


def atomic_write_bytes(final: str | os.PathLike[str], data: bytes, mode: int | None = None) -> None:
    with atomic_write(final, mode) as f:
        f.write(data)


def remove_stale_partials(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete ``*.partial`` files left by a crashed run in ``directory``; return what was removed."""
    removed: list[Path] = []
    d = Path(directory)
    if not d.is_dir():
        return removed
    for p in d.iterdir():
        if p.name.endswith(PARTIAL_SUFFIX) and p.is_file():
            _unlink_quiet(p)
            removed.append(p)
    return removed


def _unlink_quiet(p: str | os.PathLike[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(p)
