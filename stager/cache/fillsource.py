"""What a site cache's fill may read: sources as the job's user would, never with the service account's rights.

The prolog's fill runs as the site cache's service account, which owns every object in the cache,
for a job's user (:envvar:`STAGER_CACHE_FILL_UID`, set by tools/slurm/stager-prolog; else the
caller's own uid), with that user's gid and groups. Its reading rights are not the user's: it may
read any object, and files whose owner class is its own. So a fill takes a source only when
(:class:`FillGate`, :func:`stager.fs.asuser.open_for`):

* the job's user may read it: every directory of its real path searchable and the file readable by
  the user's uid and groups, judged on the descriptors it then reads (no ACL: a wrong "no" costs a
  copy, a wrong "yes" a licence);
* it is a regular file reached without a symbolic link at its name, not the service account's own
  (unless that is root, whose files every dataset tree holds: a site cache of root's is the admin's
  choice) and not under the cache (a link or a hard link to an object is how the service account's
  rights would be borrowed);
* its copy can have the source's access: some group or others may read it (a site cache shares
  nothing owner-only), and where only its group may, the service account can give the copy that
  group (it holds the user's groups: a group the user is not in cannot be given, and a copy is never
  placed with another group's read bit);
* it is a local file (an object-store source's readers' credentials are not the cache's to share).

A source refused is left to the job's own stage, which copies it as the user into the job's
directory (the plain per-job copy): never wrong, only uncached. The reason is one line.

The fill then reads the very descriptor it checked, through ``/proc/self/fd/<fd>`` (the path any
copy routine takes; Linux reopens the same inode), so nothing can be swapped in between.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stager.errors import UnsafePathError
from stager.fs.asuser import DirCache, Reader, open_for
from stager.fs.open import is_url

if TYPE_CHECKING:
    from stager.cache.store import Cache

FILL_UID_ENV = "STAGER_CACHE_FILL_UID"
PROC_FD = "/proc/self/fd"


def fill_reader(env: dict[str, str] | None = None) -> Reader:
    """Whom a site cache's fill reads for: :envvar:`STAGER_CACHE_FILL_UID` (the prolog sets the job's
    uid), else the caller; with this process's groups (the prolog gives the fill the user's)."""
    env = dict(os.environ) if env is None else env
    given = env.get(FILL_UID_ENV, "")
    return Reader.with_my_groups(int(given) if given.isdigit() else os.getuid())


@dataclass
class FillGate:
    """The checks of the module docstring for one fill of a site cache; :meth:`open` each source,
    :meth:`close` at the end. ``refused``: one line per source left to the plain copy."""

    cache: Cache
    reader: Reader
    refused: list[str] = field(default_factory=list)
    _dirs: DirCache | None = None
    _gids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        self._dirs = DirCache(self.reader, "source")
        self._gids = frozenset({os.getegid(), *os.getgroups()})

    def open(self, src_path: str, what: str = "source") -> tuple[int, os.stat_result] | None:
        """The checked, open source (``(fd, stat)``; the caller closes the fd), or None when it is
        refused (the reason added to :attr:`refused`). A missing file is FileNotFoundError."""
        if is_url(src_path):
            self.refused.append(f"{src_path}: an object-store {what}: its readers' credentials are not the site "
                                "cache's to share")
            return None
        if not os.path.isdir(PROC_FD):
            self.refused.append(f"{src_path}: no {PROC_FD} here to read the checked {what} through")
            return None
        try:
            fd, st, _real = open_for(src_path, self.reader, what=what, refuse=self._refuse, dirs=self._dirs)
        except UnsafePathError as exc:
            self.refused.append(str(exc))
            return None
        except PermissionError as exc:
            self.refused.append(f"{src_path}: the service account may not open it ({exc.strerror})")
            return None
        return fd, st

    def _refuse(self, real: str, st: os.stat_result) -> str | None:
        mode = stat.S_IMODE(st.st_mode)
        root = os.fspath(self.cache.root)
        if st.st_uid == self.cache.owner and self.cache.owner != 0:  # root's files are everyday data
            return "belongs to the site cache's service account"
        if real == root or real.startswith(root.rstrip("/") + "/"):
            return "lies under the site cache"
        if not mode & 0o044:
            return "is readable by its owner only: a site cache shares nothing private"
        if mode & 0o040 and not mode & 0o004 and st.st_gid not in self._gids:
            return (f"is readable by its group {st.st_gid} only, which the service account cannot give the copy "
                    "(a copy is never placed with another group's read bit)")
        return None

    def close(self) -> None:
        if self._dirs is not None:
            self._dirs.close()

    def summary(self) -> str | None:
        """One line about the sources left to the plain copy (None when none was)."""
        if not self.refused:
            return None
        n = len(self.refused)
        return (f"{n} source file{'s' if n != 1 else ''} not copied into the site cache, the job's stage copies "
                f"{'them' if n != 1 else 'it'} as its user (first: {self.refused[0]})")


def via_fd(fd: int) -> str:
    """The path that reads the open file ``fd`` (the very inode checked)."""
    return f"{PROC_FD}/{fd}"


__all__ = ["FILL_UID_ENV", "FillGate", "fill_reader", "via_fd"]
