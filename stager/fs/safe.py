"""Safety in one place: every open, create, lock, rename and remove of a path someone else could have planted.

Who is trusted (docs/security.md): the effective user and root. Anyone else who can write a directory
(another user on the node in a shared ``/tmp`` or ``$TMPDIR``; the job's user, seen from root-run
code) may have put anything at any name in it beforehand, and may change it between our check and
our use: a symlink to a file of ours, a hard link, a FIFO that blocks ``open``, a directory where a
file is expected, files of their own. The rules, each enforced here and nowhere else:

1. **Never follow a link at the last component.** Names are opened with ``O_NOFOLLOW`` (and a
   directory with ``O_DIRECTORY``); files for reading also with ``O_NONBLOCK``, so a FIFO or a
   device never blocks. The type, owner and mode are then read with ``fstat`` from the descriptor:
   what we decide about is what we hold, not what a path named a moment earlier.
2. **Owner and mode.** A directory we write into or trust the content of, and a file we trust or
   write into, is owned by a trusted uid (:func:`trusted_uids`: ours, or root) and not writable by
   group or others (group write is fine when the group is the user's private group, the convention
   under which sites set ``umask 002``: :func:`private_group`). Refusals are
   :class:`~stager.errors.UnsafePathError` (exit 2): one line naming the path, the owner and mode
   found, what was expected and what to do (:func:`require`).
3. **Work relative to a directory handle.** Once a directory is opened and checked (:class:`SafeDir`),
   every name inside it is reached with ``*at()`` calls on its descriptor, never by a path string again,
   so swapping a path component for a symlink after the check changes nothing.
4. **Create exclusively.** Files with ``O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC`` (:func:`create_exclusive`,
   :func:`open_exclusive`, :meth:`SafeDir.create_file`: the only spelling of ``O_EXCL`` in stager,
   ``tests/test_one_mechanism.py`` scans for others), directories with ``mkdir`` (neither follows a planted
   name); published with ``rename``/``link`` inside the same handle (:meth:`SafeDir.write_atomic`).
5. **A stable path.** Path-based code (the copy streams, libraries that take a file name) may use a
   path under a directory only when every ancestor of it is trusted or sticky (:func:`check_chain`):
   then nobody else can rename or replace any component of it, and the checks above stay true.

Callers in ``stage/``, ``loader/``, ``commands/``, the receipt and the node lock use these functions
instead of re-checking. ``shutil.rmtree``'s fd-based walk and ``tarfile``'s extraction filters show
the shape: one vetted mechanism, many callers.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
from collections.abc import Callable, Iterator
from typing import BinaryIO, Final

from stager.errors import UnsafePathError

O_NOFOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY: Final = getattr(os, "O_DIRECTORY", 0)
O_CLOEXEC: Final = getattr(os, "O_CLOEXEC", 0)
O_NONBLOCK: Final = getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS: Final = os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC
WRITABLE_BY_OTHERS: Final = 0o022  # group or others may write
MAX_SMALL_FILE: Final = 64 << 20  # receipts, journals, lock records: refuse absurd sizes before reading


# ---- who is trusted ------------------------------------------------------------------------------
def trusted_uids() -> frozenset[int]:
    """The uids whose files and directories we trust: the effective user's, and root's."""
    return frozenset((os.geteuid(), 0))


def owner_name(uid: int) -> str:
    """``uid 1001 (alice)`` for messages (just the number where the name is unknown)."""
    try:
        import pwd  # noqa: PLC0415 (only for an error message)

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def kind_of(st: os.stat_result) -> str:
    """``directory``, ``regular file``, ``symlink``, ``FIFO``, ``socket``, ``device`` for messages."""
    m = st.st_mode
    if stat.S_ISDIR(m):
        return "directory"
    if stat.S_ISREG(m):
        return "regular file"
    if stat.S_ISLNK(m):
        return "symlink"
    if stat.S_ISFIFO(m):
        return "FIFO"
    if stat.S_ISSOCK(m):
        return "socket"
    return "device"


def describe(st: os.stat_result) -> str:
    """What was found, for messages: ``a FIFO owned by uid 1001 (bob), mode 0666``."""
    return f"a {kind_of(st)} owned by {owner_name(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}"


@functools.lru_cache(maxsize=16)
def private_group(gid: int) -> bool:
    """Whether ``gid`` is the effective user's private group: the user's primary group, named like the
    user, with no other members (the user-private-group convention; RHEL's profile sets ``umask 002``
    exactly then). Its group write bit lets nobody else in."""
    if gid != os.getegid():
        return False
    try:
        import grp  # noqa: PLC0415 (only when a group-writable path is met)
        import pwd  # noqa: PLC0415

        g, u = grp.getgrgid(gid), pwd.getpwuid(os.geteuid())
    except (ImportError, KeyError):
        return False
    return g.gr_name == u.pw_name and set(g.gr_mem) <= {u.pw_name}


# ---- checks on what is held -------------------------------------------------------------------------
def problem(st: os.stat_result, *, expect: str = "file", owners: frozenset[int] | None = None,
            sticky_ok: bool = False, single_link: bool = False) -> str | None:
    """Why ``st`` may not be trusted, or None when it may.

    ``expect``: ``"file"`` (a regular file) or ``"dir"``. ``owners``: trusted uids (default
    :func:`trusted_uids`). ``sticky_ok``: a directory writable by others is fine when sticky (``/tmp``:
    nobody can rename or remove what is not theirs). ``single_link``: a file with more than one hard
    link is refused (for files we write into: a hard link could make the write land elsewhere).
    """
    owners = trusted_uids() if owners is None else owners
    want_dir = expect == "dir"
    if (stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)) is False:
        return f"{kind_of(st)}, expected a {'directory' if want_dir else 'regular file'}"
    if st.st_uid not in owners:
        return f"owned by {owner_name(st.st_uid)}"
    writable = st.st_mode & WRITABLE_BY_OTHERS
    if writable == 0o020 and private_group(st.st_gid):
        writable = 0  # the user's private group: nobody else is in it
    if writable and not (sticky_ok and want_dir and st.st_mode & stat.S_ISVTX):
        return f"writable by {'others' if st.st_mode & 0o002 else 'its group'} (mode {stat.S_IMODE(st.st_mode):04o})"
    if single_link and not want_dir and st.st_nlink != 1:
        return f"a file with {st.st_nlink} hard links"
    return None


def expected(owners: frozenset[int] | None = None) -> str:
    """The rule in words: ``owned by you (uid 1000) or root, not writable by group or others``."""
    owners = trusted_uids() if owners is None else owners
    me = os.geteuid()
    who = [f"you ({owner_name(me)})" if u == me else ("root" if u == 0 else owner_name(u))
           for u in sorted(owners, key=lambda u: (u != me, u))]
    return f"owned by {' or '.join(who)}, not writable by group or others"


def require(st: os.stat_result, path: str | os.PathLike[str], what: str, fix: str, *, expect: str = "file",
            owners: frozenset[int] | None = None, sticky_ok: bool = False, single_link: bool = False) -> None:
    """Raise :class:`UnsafePathError` (one line) when :func:`problem` finds ``st`` untrustworthy.

    ``what`` names the role (``"staging destination"``), ``fix`` says what to do; the keywords are
    :func:`problem`'s. The message: ``PATH: WHAT is <found> (<why>); expected <rule>; FIX``.
    """
    why = problem(st, expect=expect, owners=owners, sticky_ok=sticky_ok, single_link=single_link)
    if why is not None:
        raise UnsafePathError(f"{os.fspath(path)}: {what} is {describe(st)} ({why}); "
                              f"expected {expected(owners)}; {fix}")


def check_chain(path: str | os.PathLike[str], *, owners: frozenset[int] | None = None,
                what: str = "directory", fix: str = "choose a path whose directories only you or root can change"
                ) -> str:
    """Check that nobody untrusted can rename or replace ``path`` or any directory above it, or any
    link on the way to it; return its real path (no symlinks: use that from then on).

    ``path`` is walked from ``/`` one component at a time, as the kernel resolves it. Every existing
    directory met must be owned by a trusted uid and not writable by others, or be sticky (``/tmp``).
    A symbolic link is followed only when nobody untrusted can have put it there or change it: its
    directory is not writable by others, or (a sticky directory others may write) the link is a
    trusted uid's. That is the kernel's ``fs.protected_symlinks`` rule, which stager does not rely
    on: in a shared ``/tmp`` another user's ``/tmp/x -> /home/you/dir`` is refused, since they could
    point it elsewhere at any moment. Components that do not exist yet are not checked (the caller
    creates them with :meth:`SafeDir.mkdir`). Raises :class:`UnsafePathError` naming the first
    offending directory or link.
    """
    owners = trusted_uids() if owners is None else owners
    shown = os.path.abspath(os.fspath(path))
    todo = [c for c in shown.split("/") if c][::-1]  # the next component last
    cur, cur_st = "/", os.lstat("/")
    where = (shown, owners, what, fix)
    _check_dir(where, cur, cur_st)
    links = 0
    while todo:
        comp = todo.pop()
        if comp == ".":
            continue
        if comp == "..":
            cur = os.path.dirname(cur)
            cur_st = os.lstat(cur)  # checked on the way down already
            continue
        nxt = os.path.join(cur, comp)
        try:
            st = os.lstat(nxt)
        except (FileNotFoundError, NotADirectoryError):
            return os.path.join(nxt, *reversed(todo))  # the rest is created (and checked) by the caller
        if stat.S_ISLNK(st.st_mode):
            _check_link(where, nxt, st, cur, cur_st)
            links += 1
            if links > _MAX_LINKS:
                raise UnsafePathError(f"{shown}: {what}: more than {_MAX_LINKS} symbolic links on the way; {fix}")
            target = os.readlink(nxt)
            if target.startswith("/"):
                cur, cur_st = "/", os.lstat("/")
            todo.extend(c for c in reversed(target.split("/")) if c)
            continue
        if not stat.S_ISDIR(st.st_mode):
            return os.path.join(nxt, *reversed(todo))  # the caller's open or mkdir reports it
        _check_dir(where, nxt, st)
        cur, cur_st = nxt, st
    return cur


_MAX_LINKS: Final = 40  # the kernel's ELOOP limit


_Where = tuple[str, "frozenset[int] | None", str, str]  # check_chain's path as given, owners, what, fix


def _check_dir(where: _Where, d: str, st: os.stat_result) -> None:
    shown, owners, what, fix = where
    why = problem(st, expect="dir", owners=owners, sticky_ok=True)
    if why is not None:
        raise UnsafePathError(f"{shown}: {what} lies in {d}, which is {describe(st)} ({why}); {fix}")


def _check_link(where: _Where, link: str, st: os.stat_result, d: str, dst: os.stat_result) -> None:
    """A link in the (checked) directory ``d`` may be followed when nobody untrusted can replace it."""
    shown, owners, what, fix = where
    if problem(dst, expect="dir", owners=owners) is None:
        return  # only trusted uids may create, rename or remove names in d
    if st.st_uid in (trusted_uids() if owners is None else owners):
        return  # a sticky directory: only the link's owner (trusted) or d's owner (trusted) can replace it
    raise UnsafePathError(f"{shown}: {what} is reached through the symbolic link {link}, owned by "
                          f"{owner_name(st.st_uid)} in {d}, which others may write (mode "
                          f"{stat.S_IMODE(dst.st_mode):04o}): they could point it elsewhere at any moment; give the "
                          f"real path, or {fix}")


def trusted_size(path: str | os.PathLike[str], *, owners: frozenset[int] | None = None) -> int:
    """The size of ``path`` when it is a regular file we may trust (``lstat``: not a symlink, owned
    by a trusted uid, not writable by group or others), else -1 (absent, or untrustworthy). The cheap
    check of a file a journal or a receipt vouches for."""
    try:
        st = os.lstat(path)
    except OSError:
        return -1
    return st.st_size if problem(st, owners=owners) is None else -1


# ---- creating -------------------------------------------------------------------------------------
CREATE_FLAGS: Final = os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC


def create_exclusive(path: str | os.PathLike[str], mode: int = 0o600, flags: int = os.O_WRONLY, *,
                     dir_fd: int | None = None) -> int:
    """Create ``path`` (relative to ``dir_fd`` when given) exclusively and return its descriptor.

    ``flags`` is the access (``O_WRONLY``, ``O_RDWR``, plus extras such as ``O_DIRECT``);
    ``O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC`` are always added: FileExistsError when any entry (a
    planted symlink included) is there already, and nothing outside is ever opened through it.
    ``mode`` less the umask, as ``open`` gives: leases, partial files, cache records, the
    files an unpack writes.
    """
    return os.open(path, flags | CREATE_FLAGS, mode, dir_fd=dir_fd)


def open_exclusive(path: str | os.PathLike[str], mode: int = 0o666) -> BinaryIO:
    """:func:`create_exclusive` as a binary file object for writing (``open(path, "xb")``, whose
    mode is ``0o666`` less the umask: the same here, for the atomic writers that ``chmod`` later)."""
    fd = create_exclusive(path, mode)
    try:
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


# ---- opening --------------------------------------------------------------------------------------
def open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY, *, dir_fd: int | None = None,
                 follow: bool = True) -> int:
    """Open an existing regular file without blocking on a FIFO or a device; return the descriptor.

    For data someone else wrote (a dataset's shards on shared storage): the owner is not checked
    (the user's permissions decide what can be read), but anything other than a regular file is
    :class:`UnsafePathError` naming what it is (a directory: IsADirectoryError, as ``open`` says).
    ``follow=False`` also refuses a symlink. The descriptor is blocking again when returned.
    """
    def regular(fd: int, st: os.stat_result) -> None:
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{os.fspath(path)}: is {describe(st)}, expected a regular file; "
                                  "replace it with the file the manifest lists")
        os.set_blocking(fd, True)

    fd = os.open(path, flags | O_NONBLOCK | O_CLOEXEC | (0 if follow else O_NOFOLLOW), dir_fd=dir_fd)
    _hold(fd, regular)
    return fd


def _hold(fd: int, check: Callable[[int, os.stat_result], None]) -> os.stat_result:
    """``fstat`` the open ``fd`` and ``check(fd, stat)`` what is held; ``fd`` is closed if anything
    fails. Every open here decides about what it holds, never about what a path named."""
    try:
        st = os.fstat(fd)
        check(fd, st)
    except BaseException:
        os.close(fd)
        raise
    return st


def _no_follow_error(exc: OSError, display: str, name: str, dir_fd: int | None, *, what: str, fix: str,
                     want: str) -> UnsafePathError | None:
    """ELOOP/ENOTDIR from an ``O_NOFOLLOW`` open: a symlink (or a non-directory) where ``what`` goes."""
    if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):
        try:
            found = describe(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
        except OSError:
            found = "a symlink"
        return UnsafePathError(f"{display}: {what} is {found}, expected a {want} (links are not followed); {fix}")
    return None


def _open_held(p: str, flags: int, *, dir_fd: int | None, shown: str, what: str, fix: str, want: str,
               check: Callable[[int, os.stat_result], None], mode: int = 0o600) -> tuple[int, os.stat_result]:
    """Open ``p`` with ``flags`` (which carry ``O_NOFOLLOW``: a link there is
    :class:`UnsafePathError` naming what was found; with ``O_CREAT`` a new file gets ``mode`` less
    the umask), then ``check(fd, fstat)`` what is held; the descriptor is closed if anything fails.
    Returns ``(fd, stat)``."""
    try:
        fd = os.open(p, flags, mode, dir_fd=dir_fd)
    except OSError as exc:
        err = _no_follow_error(exc, shown, p, dir_fd, what=what, fix=fix, want=want)
        if err is not None:
            raise err from exc
        raise
    return fd, _hold(fd, check)


def open_trusted(path: str | os.PathLike[str], flags: int = os.O_RDONLY, *, what: str = "file",
                 fix: str = "remove it and rerun", dir_fd: int | None = None, display: str | None = None,
                 single_link: bool = False, owners: frozenset[int] | None = None, mode: int = 0o600
                 ) -> tuple[int, os.stat_result]:
    """Open an existing file we must trust (a receipt, a journal, a lock) and check what we hold.

    ``O_NOFOLLOW|O_NONBLOCK``; then ``fstat``: a regular file, owned by a trusted uid, not writable
    by group or others (and, with ``single_link``, not hard-linked). ``path`` is relative to
    ``dir_fd`` when given (``display`` then names it in messages). With ``O_CREAT`` in ``flags`` a
    missing file is made with ``mode`` less the umask (a lock file: whoever comes first makes it).
    Returns ``(fd, stat)``; raises FileNotFoundError when absent and :class:`UnsafePathError` otherwise.
    """
    p = os.fspath(path)
    shown = display or p

    def check(fd: int, st: os.stat_result) -> None:
        require(st, shown, what, fix, expect="file", owners=owners, single_link=single_link)
        os.set_blocking(fd, True)

    return _open_held(p, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, dir_fd=dir_fd, shown=shown, what=what, fix=fix,
                      want="regular file", check=check, mode=mode)


def read_trusted(path: str | os.PathLike[str], *, what: str = "file", limit: int = MAX_SMALL_FILE,
                 fix: str = "remove it and rerun", dir_fd: int | None = None, display: str | None = None,
                 owners: frozenset[int] | None = None) -> bytes | None:
    """The bytes of a small file we must trust (:func:`open_trusted`), or None when it is absent.

    More than ``limit`` bytes is :class:`UnsafePathError`.
    """
    shown = display or os.fspath(path)
    try:
        fd, st = open_trusted(path, what=what, fix=fix, dir_fd=dir_fd, display=shown, owners=owners)
    except FileNotFoundError:
        return None
    try:
        return _read_bounded(fd, st.st_size, limit, shown, what)
    finally:
        os.close(fd)


def read_regular(path: str | os.PathLike[str], *, limit: int = MAX_SMALL_FILE, dir_fd: int | None = None
                 ) -> bytes | None:
    """The bytes of a small regular file whatever its owner (to look at before deciding to trust it),
    or None when absent: a symlink is not followed, a FIFO never blocks, more than ``limit`` bytes
    is :class:`UnsafePathError`."""
    try:
        fd = open_regular(path, dir_fd=dir_fd, follow=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise UnsafePathError(f"{os.fspath(path)}: is a symlink, expected a regular file") from exc
        raise
    try:
        return _read_bounded(fd, os.fstat(fd).st_size, limit, os.fspath(path), "file")
    finally:
        os.close(fd)


def _read_bounded(fd: int, size: int, limit: int, shown: str, what: str) -> bytes:
    """All of ``fd`` (``size`` by ``fstat``), refusing more than ``limit`` bytes (also if it grows)."""
    if size > limit:
        raise UnsafePathError(f"{shown}: {what} is {size} bytes, more than {limit}; remove it")
    chunks: list[bytes] = []
    total = 0
    while True:
        b = os.read(fd, max(size - total, 0) + 1 if total <= size else 1 << 16)
        if not b:
            return b"".join(chunks)
        chunks.append(b)
        total += len(b)
        if total > limit:
            raise UnsafePathError(f"{shown}: {what} grew past {limit} bytes while read; remove it")


# ---- a checked directory handle ------------------------------------------------------------------
class SafeDir:
    """An open, checked directory; every name inside it is reached relative to its descriptor.

    Open one with :meth:`open` (an existing directory) or :meth:`create` (exclusively, or reuse one
    that passes the checks). ``path`` is for messages and for path-based code (valid while
    :func:`check_chain` holds for it); ``fd`` is the handle. Names passed to the methods are single
    components (no ``/``): :class:`ValueError` otherwise. Use as a context manager, or :meth:`close`.
    """

    def __init__(self, fd: int, path: str, st: os.stat_result) -> None:
        self.fd = fd
        self.path = path
        self.st = st

    # -- opening -----------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str], *, what: str = "directory", fix: str = "choose another directory",
             check: bool = True, owners: frozenset[int] | None = None, sticky_ok: bool = False,
             dir_fd: int | None = None, display: str | None = None) -> SafeDir:
        """Open the existing directory ``path`` (``O_NOFOLLOW``: a symlink there is refused) and, with
        ``check``, require it trusted (:func:`problem` with ``sticky_ok``). FileNotFoundError if absent.
        ``path`` is relative to ``dir_fd`` when given; ``display`` is the path the handle reports."""
        p = os.fspath(path)
        shown = display or p

        def trusted(fd: int, st: os.stat_result) -> None:
            if check:
                require(st, shown, what, fix, expect="dir", owners=owners, sticky_ok=sticky_ok)

        fd, st = _open_held(p, _DIR_FLAGS, dir_fd=dir_fd, shown=shown, what=what, fix=fix, want="directory",
                            check=trusted)
        return cls(fd, shown, st)

    @classmethod
    def create(cls, path: str | os.PathLike[str], mode: int = 0o700, *, what: str = "directory",
               fix: str = "choose another directory", exist_ok: bool = True, owners: frozenset[int] | None = None
               ) -> tuple[SafeDir, bool]:
        """Create ``path`` with ``mode`` (less the umask) exclusively, or, with ``exist_ok``, open an
        existing one that passes the checks. Returns ``(handle, created)``. The parent is not checked
        here (see :func:`check_chain`); ``mkdir`` never follows a name planted at ``path``."""
        p = os.fspath(path)
        created = True
        try:
            os.mkdir(p, mode)
        except FileExistsError:
            if not exist_ok:
                raise
            created = False
        return cls.open(p, what=what, fix=fix, owners=owners), created

    # -- names inside --------------------------------------------------------------------------------
    @staticmethod
    def _name(name: str) -> str:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"{name!r}: expected one file name inside the directory")
        return name

    def join(self, name: str) -> str:
        """``path/name``, for messages (and for path-based code under :func:`check_chain`)."""
        return os.path.join(self.path, self._name(name))

    def lstat(self, name: str) -> os.stat_result | None:
        """``lstat`` of ``name`` (a symlink itself, never its target), or None when absent."""
        try:
            return os.stat(self._name(name), dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def entries(self) -> Iterator[tuple[str, os.stat_result]]:
        """Every name in the directory with its ``lstat`` (names that vanish meanwhile are skipped)."""
        for name in os.listdir(self.fd):
            st = self.lstat(name)
            if st is not None:
                yield name, st

    def check(self, name: str, *, expect: str = "file", what: str = "file", fix: str = "remove it and rerun",
              owners: frozenset[int] | None = None, single_link: bool = False) -> os.stat_result | None:
        """``lstat`` ``name`` and :func:`require` it trusted; None when absent (nothing to refuse)."""
        st = self.lstat(name)
        if st is not None:
            require(st, self.join(name), what, fix, expect=expect, owners=owners, single_link=single_link)
        return st

    def subdir(self, name: str, *, what: str = "directory", fix: str = "remove it and rerun",
               check: bool = True, owners: frozenset[int] | None = None) -> SafeDir:
        """Open the existing subdirectory ``name`` (no symlink), checked like :meth:`open`."""
        return SafeDir.open(self._name(name), what=what, fix=fix, check=check, owners=owners, dir_fd=self.fd,
                            display=self.join(name))

    def mkdir(self, name: str, mode: int = 0o700, *, exist_ok: bool = True, what: str = "directory",
              fix: str = "remove it and rerun", owners: frozenset[int] | None = None) -> tuple[SafeDir, bool]:
        """:meth:`create` for ``name`` inside this directory; returns ``(handle, created)``."""
        created = True
        try:
            os.mkdir(self._name(name), mode, dir_fd=self.fd)
        except FileExistsError:
            if not exist_ok:
                raise
            created = False
        return self.subdir(name, what=what, fix=fix, owners=owners), created

    def open_file(self, name: str, flags: int = os.O_RDONLY, *, what: str = "file", fix: str = "remove it and rerun",
                  single_link: bool = False, owners: frozenset[int] | None = None) -> tuple[int, os.stat_result]:
        """:func:`open_trusted` of ``name`` inside this directory."""
        return open_trusted(self._name(name), flags, what=what, fix=fix, dir_fd=self.fd, display=self.join(name),
                            single_link=single_link, owners=owners)

    def create_file(self, name: str, mode: int = 0o600, flags: int = os.O_WRONLY) -> int:
        """Create ``name`` exclusively (``O_CREAT|O_EXCL|O_NOFOLLOW``) with ``mode`` less the umask;
        FileExistsError when any entry (a symlink included) is there already."""
        return create_exclusive(self._name(name), mode, flags, dir_fd=self.fd)

    def read_bytes(self, name: str, *, what: str = "file", limit: int = MAX_SMALL_FILE,
                   owners: frozenset[int] | None = None) -> bytes | None:
        """:func:`read_trusted` of ``name`` inside this directory (None when absent)."""
        return read_trusted(self._name(name), what=what, limit=limit, dir_fd=self.fd, display=self.join(name),
                            owners=owners)

    def write_atomic(self, name: str, data: bytes, mode: int = 0o600, *, fsync: bool = True) -> None:
        """Write ``data`` to ``<name>.<12 hex>.partial`` (created exclusively), fsync, ``fchmod`` to
        ``mode``, rename over ``name`` inside this handle, fsync the directory. On failure the
        partial file is removed and ``name`` is untouched. Renaming replaces whatever entry ``name``
        was (a planted symlink is replaced, never followed)."""
        tmp = f"{self._name(name)}.{os.urandom(6).hex()}.partial"
        fd = self.create_file(tmp, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
            if fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            self.unlink(tmp)
            raise
        if fsync:
            self.fsync()

    def replace(self, src: str, dst: str) -> None:
        """Rename ``src`` over ``dst``, both inside this directory."""
        os.rename(self._name(src), self._name(dst), src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def link(self, src: str, dst: str) -> None:
        """Hard-link ``src`` to the new name ``dst`` (FileExistsError when taken): an atomic publish."""
        os.link(self._name(src), self._name(dst), src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)

    def unlink(self, name: str, *, missing_ok: bool = True) -> bool:
        """Remove the entry ``name`` (a symlink itself, never its target); True if it was there."""
        try:
            os.unlink(self._name(name), dir_fd=self.fd)
        except FileNotFoundError:
            if not missing_ok:
                raise
            return False
        return True

    def rmdir(self, name: str) -> bool:
        """Remove the empty subdirectory ``name``; False when absent or not empty."""
        try:
            os.rmdir(self._name(name), dir_fd=self.fd)
        except OSError:
            return False
        return True

    def remove(self, name: str, *, keep: Callable[[str], bool] | None = None, dry_run: bool = False
               ) -> tuple[int, int]:
        """Remove ``name`` without following links: a file or symlink is unlinked; a directory is
        walked through descriptors (``O_NOFOLLOW``, the same device) and emptied, then removed.

        ``keep(relative path)``: files for which it returns True stay, with the directories that hold
        them (``stager clean`` keeps what a user added to an unpacked tree). ``dry_run``: remove
        nothing, count what would go. Returns ``(entries removed, bytes of files removed)``. Entries
        that vanish meanwhile are skipped.
        """
        st = self.lstat(name)
        if st is None:
            return 0, 0
        if not stat.S_ISDIR(st.st_mode):
            return (1, st.st_size) if dry_run or self.unlink(name) else (0, 0)
        try:
            sub = self.subdir(name, check=False)
        except (FileNotFoundError, UnsafePathError):
            return 0, 0  # replaced by something else meanwhile: leave it
        with sub:
            if (sub.st.st_dev, sub.st.st_ino) != (st.st_dev, st.st_ino) or sub.st.st_dev != self.st.st_dev:
                return 0, 0  # swapped meanwhile, or a mount point: never cross it
            n, freed, kept = sub._empty("", keep, dry_run)
        if not kept and (dry_run or self.rmdir(name)):
            n += 1
        return n, freed

    def _empty(self, prefix: str, keep: Callable[[str], bool] | None, dry_run: bool) -> tuple[int, int, bool]:
        """Remove what is inside (see :meth:`remove`); ``(removed, bytes, anything kept)``."""
        n = freed = 0
        kept = False
        for name, st in list(self.entries()):
            rel = f"{prefix}{name}"
            if stat.S_ISDIR(st.st_mode):
                try:
                    sub = self.subdir(name, check=False)
                except (FileNotFoundError, UnsafePathError):
                    kept = True
                    continue
                with sub:
                    if (sub.st.st_dev, sub.st.st_ino) != (st.st_dev, st.st_ino) or sub.st.st_dev != self.st.st_dev:
                        kept = True
                        continue
                    dn, df, dk = sub._empty(rel + "/", keep, dry_run)
                n, freed = n + dn, freed + df
                if not dk and (dry_run or self.rmdir(name)):
                    n += 1
                else:
                    kept = True
            elif keep is not None and keep(rel):
                kept = True
            elif dry_run or self.unlink(name):
                n, freed = n + 1, freed + st.st_size
        return n, freed, kept

    def via_handle(self, name: str = "") -> str:
        """A path that reaches ``name`` (or the directory itself) through this handle, for libraries
        that only take a path: ``/proc/self/fd/<fd>/<name>`` on Linux (immune to a renamed or swapped
        component), else :meth:`join`."""
        if os.path.isdir(f"/proc/self/fd/{self.fd}"):
            base = f"/proc/self/fd/{self.fd}"
            return base if not name else os.path.join(base, self._name(name))
        return self.path if not name else self.join(name)

    def fsync(self) -> None:
        """fsync the directory (renames inside it survive a crash); ignored where unsupported."""
        with contextlib.suppress(OSError):
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SafeDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafeDir({self.path!r}, fd={self.fd})"


def private_dir(parent: str | os.PathLike[str], name: str, mode: int = 0o700, *, what: str = "directory",
                fix: str = "choose another directory") -> tuple[SafeDir, bool]:
    """A directory ``parent/name`` that is ours: created exclusively (``mode`` less the umask), or an
    existing one that is trusted, after :func:`check_chain` of ``parent`` (created with ``mode`` when
    missing, one level at a time). Returns ``(handle, created)``; the handle's ``path`` is real (no
    symlinks). Raises :class:`UnsafePathError` for a ``name`` or an ancestor someone else controls."""
    real_parent = check_chain(parent, what=what, fix=fix)
    missing = []
    cur = real_parent
    while not os.path.lexists(cur):
        missing.append(cur)
        cur = os.path.dirname(cur)
    made: list[str] = []
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d, mode)
                made.append(d)
            except FileExistsError:
                pass
            SafeDir.open(d, what=what, fix=fix, sticky_ok=True).close()
        return SafeDir.create(os.path.join(real_parent, name), mode, what=what, fix=fix)
    except BaseException:
        for d in reversed(made):  # nothing half-made: a path too long or deep leaves no trail of directories
            with contextlib.suppress(OSError):
                os.rmdir(d)
        raise


__all__ = [
    "CREATE_FLAGS",
    "MAX_SMALL_FILE",
    "O_CLOEXEC",
    "O_DIRECTORY",
    "O_NOFOLLOW",
    "O_NONBLOCK",
    "SafeDir",
    "check_chain",
    "create_exclusive",
    "describe",
    "expected",
    "kind_of",
    "open_exclusive",
    "open_regular",
    "open_trusted",
    "owner_name",
    "private_dir",
    "private_group",
    "problem",
    "read_regular",
    "read_trusted",
    "require",
    "trusted_size",
    "trusted_uids",
]
