"""What another user may read: the kernel's permission check by mode bits, for a uid and its groups.

A site cache's service account acts for the node's users: its fill copies a job user's sources, and
its eviction honours leases that users wrote. Both must know what *that user* may read, which the
kernel cannot be asked from another uid (``access(2)`` and ``faccessat`` answer for the caller's own
ids; ``setfsuid`` needs a privilege the service account must not have). So the answer is computed
from what is held, as the kernel's ``generic_permission`` does for mode bits:

* the owner class when the file's uid is the reader's, else the group class when its gid is one of
  the reader's groups, else the others class (a class that matches decides, even if it grants less
  than the next one would: ``0604`` denies its own group);
* root reads everything (as the kernel lets it);
* a file or directory that carries a POSIX access ACL (``system.posix_acl_access``) is judged
  unreadable: its mode bits do not tell the whole answer, and a wrong "no" only costs a copy
  (:func:`has_acl`); LSMs and network file systems' own checks are not modelled either, and the
  caller's real ``open`` still applies its own ids on top.

:func:`open_for` opens a file only along a walk in which every directory was searchable and the
file readable for the reader, deciding each step on a descriptor it holds (``openat`` with
``O_NOFOLLOW``), so a component swapped for a link between check and use is refused, never
followed (docs/security.md).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from stager.errors import UnsafePathError
from stager.fs.safe import O_CLOEXEC, O_DIRECTORY, O_NOFOLLOW, O_NONBLOCK, describe

READ, WRITE, SEARCH = 4, 2, 1
ACL_XATTR = "system.posix_acl_access"
_MAX_LINKS = 40  # as the kernel's ELOOP limit


@dataclass(frozen=True)
class Reader:
    """A uid and the gids it reads with (its primary group included)."""

    uid: int
    gids: frozenset[int]

    @classmethod
    def of_uid(cls, uid: int) -> Reader:
        """``uid`` with its groups from the password and group databases; a uid without an account
        reads with no group at all (only the owner and others classes can let it in)."""
        return cls(uid, _account_groups(uid))

    @classmethod
    def with_my_groups(cls, uid: int) -> Reader:
        """``uid`` with this process's groups: the prolog runs the service account's fill with the job
        user's gid and supplementary groups, so those are the user's."""
        return cls(uid, frozenset({os.getegid(), *os.getgroups()}))

    def allows(self, mode: int, uid: int, gid: int, want: int = READ) -> bool:
        """Whether a file of ``uid``:``gid`` with ``mode`` grants ``want`` (``READ``, ``SEARCH``; or'ed)
        to this reader by its mode bits (root: always, as the kernel lets it read and search)."""
        if self.uid == 0:
            return True
        if uid == self.uid:
            bits = (mode >> 6) & 7
        elif gid in self.gids:
            bits = (mode >> 3) & 7
        else:
            bits = mode & 7
        return bits & want == want

    def may(self, st: os.stat_result, want: int = READ) -> bool:
        """:meth:`allows` for what ``st`` describes."""
        return self.allows(stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, want)


@functools.lru_cache(maxsize=256)
def _account_groups(uid: int) -> frozenset[int]:
    import pwd  # noqa: PLC0415 (only a site cache's eviction and fill judge for other users)

    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return frozenset()
    try:
        return frozenset(os.getgrouplist(pw.pw_name, pw.pw_gid))
    except OSError:
        return frozenset({pw.pw_gid})


def has_acl(fd: int) -> bool:
    """Whether the file open as ``fd`` carries a POSIX access ACL (False where xattrs are unsupported)."""
    try:
        return ACL_XATTR in os.listxattr(fd)
    except OSError:
        return False


def open_for(path: str | os.PathLike[str], reader: Reader, *, what: str = "source",
             refuse: Callable[[str, os.stat_result], str | None] | None = None,
             dirs: DirCache | None = None) -> tuple[int, os.stat_result, str]:
    """Open the regular file ``path`` only if ``reader`` may read it there; return ``(fd, stat, real path)``.

    The directory part is resolved (``realpath``) and then walked from ``/`` one component at a time,
    each opened with ``O_NOFOLLOW|O_DIRECTORY`` relative to the last and checked on the descriptor:
    searchable for the reader, no ACL. The file is opened the same way (``O_NONBLOCK``: a FIFO never
    blocks) and must be a regular file the reader may read, without an ACL. ``refuse(real path,
    stat)`` may veto what was found (a reason, or None). ``dirs`` keeps checked directory handles
    between calls (a dataset's files share their directory). Any refusal is one line,
    :class:`~stager.errors.UnsafePathError`; a missing file is FileNotFoundError. The descriptor is
    blocking when returned, and the caller closes it.
    """
    p = os.path.abspath(os.fspath(path))
    real_dir = os.path.realpath(os.path.dirname(p))
    name = os.path.basename(p)
    real = os.path.join(real_dir, name)
    cache = dirs if dirs is not None else DirCache(reader, what)
    try:
        fd = os.open(name, os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, dir_fd=cache.get(real_dir))
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise UnsafePathError(f"{p}: {what} is a symbolic link in {real_dir}; the site cache copies only real "
                                  "files the job's user may read (the plain copy will read it as the user)") from exc
        raise
    finally:
        if dirs is None:
            cache.close()
    try:
        st = os.fstat(fd)
        why = None
        if not stat.S_ISREG(st.st_mode):
            why = f"is {describe(st)}, not a regular file"
        elif not reader.may(st, READ):
            why = f"is {describe(st)}, which uid {reader.uid} may not read"
        elif has_acl(fd):
            why = "carries an ACL, whose answer the site cache does not compute"
        elif refuse is not None:
            why = refuse(real, st)
        if why is not None:
            raise UnsafePathError(f"{p}: {what} {why}; not copied into the site cache (the plain copy reads it as "
                                  "the job's user)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st, real


class DirCache:
    """Directory handles checked for one reader (:func:`open_for`), by real path; close when done."""

    def __init__(self, reader: Reader, what: str = "source") -> None:
        self.reader = reader
        self.what = what
        self._fds: dict[str, int] = {}

    def get(self, real_dir: str) -> int:
        """A handle on ``real_dir`` reached from ``/`` through directories the reader may search."""
        fd = self._fds.get(real_dir)
        if fd is not None:
            return fd
        parent = os.path.dirname(real_dir)
        if parent == real_dir:  # "/"
            fd = os.open("/", os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        else:
            pfd = self.get(parent)
            try:
                fd = os.open(os.path.basename(real_dir), os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC,
                             dir_fd=pfd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    raise UnsafePathError(f"{real_dir}: changed into a symbolic link while the {self.what} was "
                                          "opened; rerun") from exc
                raise
        try:
            st = os.fstat(fd)
            if not self.reader.may(st, SEARCH) or has_acl(fd):
                raise UnsafePathError(f"{real_dir}: is {describe(st)}, which uid {self.reader.uid} may not search; "
                                      f"its {self.what}s are not copied into the site cache")
        except BaseException:
            os.close(fd)
            raise
        self._fds[real_dir] = fd
        return fd

    def close(self) -> None:
        fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> DirCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ACL_XATTR", "READ", "SEARCH", "DirCache", "Reader", "has_acl", "open_for"]
