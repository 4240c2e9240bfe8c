"""Crash-safe file writes: nothing ever appears under its final name half-written.

Every file stager creates is written as ``<name>.<12 hex>.partial`` in the destination directory,
fsynced, renamed with :func:`os.replace` and the directory fsynced. On any exception the partial
file is removed. A crash (kill -9, node reboot) can leave ``*.partial`` files, never a torn final
file; :func:`remove_partials` clears them on the next run.

The one exception is ``stager stage --no-fsync`` (the cp/dcp trade: renamed without fsync, so the
data may still be in the page cache when the command returns). What it writes is marked with
:func:`stager.fs.kernel.boot_id`; after a reboot such marks no longer match and the files are not trusted again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import BinaryIO

from stager.errors import OutOfSpaceError
from stager.fs.safe import open_exclusive

PARTIAL_SUFFIX = ".partial"
# ``<final name>.<12 hex digits>.partial``: the one spelling of a partial file (see partial_path).
PARTIAL_RE = re.compile(r"^(?P<base>.+)\.[0-9a-f]{12}\.partial$")
_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def partial_path(final: str | os.PathLike[str]) -> Path:
    """The temporary sibling ``<name>.<12 random hex digits>.partial`` for ``final``."""
    final = Path(final)
    return final.with_name(f"{final.name}.{os.urandom(6).hex()}{PARTIAL_SUFFIX}")


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
    f = open_exclusive(tmp)  # closed below on every path
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        if mode is not None:
            os.chmod(tmp, mode)
        commit_partial(tmp, final)
    except OSError as exc:
        with contextlib.suppress(OSError):  # a close that flushes what the failed write left fails the same way
            f.close()
        _unlink_quiet(tmp)
        err = space_error(exc, final)
        if err is not None:
            raise err from exc
        raise
    except BaseException:
        with contextlib.suppress(OSError):
            f.close()
        _unlink_quiet(tmp)
        raise


def atomic_write_bytes(final: str | os.PathLike[str], data: bytes, mode: int | None = None) -> None:
    with atomic_write(final, mode) as f:
        f.write(data)


def partial_base(name: str) -> str | None:
    """The final name a partial file ``<base>.<12 hex>.partial`` stands for, or None if ``name`` is not one."""
    m = PARTIAL_RE.match(name)
    return m.group("base") if m else None


def remove_partials(directory: str | os.PathLike[str], bases: Collection[str] | None = None) -> list[str]:
    """Delete the partial files a crashed run left in ``directory``; return the names removed.

    Only regular files named ``<base>.<12 hex>.partial`` (what :func:`partial_path` makes) are
    removed, and with ``bases`` only those whose ``<base>`` is in it: a shared directory (a BeeOND
    DEST) may hold another writer's live partials of other files.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        base = partial_base(entry.name)
        if base is None or (bases is not None and base not in bases):
            continue
        if entry.is_file(follow_symlinks=False) or entry.is_symlink():
            _unlink_quiet(entry.path)
            removed.append(entry.name)
    return removed


def _unlink_quiet(p: str | os.PathLike[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(p)
