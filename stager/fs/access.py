"""Who may read what stager writes: the one rule for modes and groups of copies.

A copy never grants more than its source: owner read/write always, group and others at most the
read/write bits the source grants (never execute), and the source's group where we may set it. So a
group-only (licensed) dataset never becomes world-readable on node-local disk, and a world-readable
one stays readable for the job's other users. Directories get the source directory's read and
search bits for group and others (``0o055``), the owner everything. Never write: a copy is never
writable by group or others, which is what :mod:`stager.fs.safe` requires of a file it trusts.

The group is the source's, compared with the group each new file actually has (never assumed to
be the process's: in a setgid directory, a project tree say, a new file takes the directory's
group), and where it cannot be given the group class gets only what others get
(:func:`give_group`), so no copy grants a group its source did not.

The umask applies on top, everywhere (shards, manifest, index, receipt, DEST, unpacked files):
it can only take group and other bits away (``umask 077`` makes every copy private), never the
owner's. A copy of an object-store file (which has no POSIX modes) is private: ``0600``.
"""

from __future__ import annotations

import os
import stat

URL_FILE_MODE = 0o600  # what a copy of an object-store file gets: the store has no POSIX modes


def current_umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status``; elsewhere the
    set-and-restore dance, which is not thread-safe but is only the fallback)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def copy_mode(source_mode: int, umask: int | None = None) -> int:
    """The mode for a copy of a file with ``source_mode`` (``st_mode``): see the module docstring."""
    mask = current_umask() if umask is None else umask
    return (stat.S_IMODE(source_mode) & 0o644 & ~mask) | 0o600


def dir_mode(source_mode: int, umask: int | None = None) -> int:
    """The mode for a directory made for a copy of a directory with ``source_mode`` (less the umask)."""
    mask = current_umask() if umask is None else umask
    return 0o700 | (stat.S_IMODE(source_mode) & 0o055 & ~mask)


def source_access(source: str | os.PathLike[str]) -> tuple[int, int | None]:
    """``(mode, gid)`` for a file written about ``source`` (a copy, the receipt, unpacked images).

    URLs give ``(0o600, None)``; an unreadable path ``(0o600, None)``. The umask applies.
    """
    if "://" in os.fspath(source):
        return URL_FILE_MODE, None
    try:
        st = os.stat(source)
    except OSError:
        return 0o600, None
    return copy_mode(st.st_mode), st.st_gid


def give_group(fd: int, gid: int | None, mode: int | None = None) -> bool:
    """Give the open file or directory ``fd`` the group ``gid`` (its source's), then ``mode`` (when given).

    The group is compared with the one the file has, never assumed to be ours: in a setgid directory
    (a project tree) a new file takes the directory's group, and a copy must not grant that group
    the read bits its source grants its own. Where ``gid`` cannot be given (EPERM: a group we are not
    in), the group class gets what others get (``0640`` becomes ``0600``, ``0644`` stays), so no other
    group reads more than everyone may. Returns False then.
    ``gid=None`` (an object-store source, no group to keep) leaves the group alone."""
    ok = True
    if gid is not None and os.fstat(fd).st_gid != gid:
        try:
            os.fchown(fd, -1, gid)
        except PermissionError:
            ok = False
            mode = _group_as_others(stat.S_IMODE(os.fstat(fd).st_mode) if mode is None else mode)
    if mode is not None:
        os.fchmod(fd, mode)
    return ok


def _group_as_others(mode: int) -> int:
    return (mode & ~0o070) | ((mode & 0o007) << 3)


def chgrp_quiet(path: str | os.PathLike[str], gid: int | None) -> None:
    """:func:`give_group` for ``path`` (never through a link; a path that cannot be opened is skipped)."""
    if gid is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        give_group(fd, gid)
    finally:
        os.close(fd)


def size_or_missing(path: str | os.PathLike[str]) -> int:
    """``path``'s size in bytes, or -1 if it cannot be stat'ed (missing, no permission)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return -1
