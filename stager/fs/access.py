"""Who may read what stager writes: the one rule for modes and groups of copies.

A copy never grants more than its source: owner read/write always, group and others at most the
read/write bits the source grants (never execute), and the source's group where we may set it. So a
group-only (licensed) dataset never becomes world-readable on node-local disk, and a world-readable
one stays readable for the job's other users. Directories get the source directory's read and
search bits for group and others (``0o055``), the owner everything.
"""

from __future__ import annotations

import contextlib
import os
import stat

URL_FILE_MODE = 0o644  # what a copy of an object-store file gets: the store has no POSIX modes


def copy_mode(source_mode: int) -> int:
    """The mode for a copy of a file with ``source_mode`` (``st_mode``): see the module docstring."""
    return (stat.S_IMODE(source_mode) & 0o644) | 0o600


def dir_mode(source_mode: int) -> int:
    """The mode for a directory made for a copy of a directory with ``source_mode``."""
    return 0o700 | (stat.S_IMODE(source_mode) & 0o055)


def source_access(source: str | os.PathLike[str]) -> tuple[int, int | None]:
    """``(mode, gid)`` for a file written about ``source`` (a copy, the receipt, unpacked images).

    URLs give ``(0o644, None)``; an unreadable path ``(0o600, None)``.
    """
    if "://" in os.fspath(source):
        return URL_FILE_MODE, None
    try:
        st = os.stat(source)
    except OSError:
        return 0o600, None
    return copy_mode(st.st_mode), st.st_gid


def chgrp_quiet(path: str | os.PathLike[str], gid: int | None) -> None:
    """Give ``path`` group ``gid`` when it differs from ours; skipped where we may not (EPERM)."""
    if gid is not None and gid != os.getegid():
        with contextlib.suppress(PermissionError):
            os.chown(path, -1, gid)


def size_or_missing(path: str | os.PathLike[str]) -> int:
    """``path``'s size in bytes, or -1 if it cannot be stat'ed (missing, no permission)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return -1
