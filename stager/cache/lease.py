"""Leases: who uses which objects now, so eviction never removes an object a live job needs.

A lease is a small JSON file in the cache's ``leases/`` naming object keys. Two kinds:

* **process** (:class:`Lease`): held by a running ``stager stage`` or loader for as long as it runs.
  Its file is ``flock``\\ ed for the holder's lifetime (forked loader workers share the lock), so a
  holder that dies, however it dies, releases it: the kernel drops the lock, and eviction sees a
  lease nobody holds as dead. The file is written under a partial name, locked, then renamed, so
  no reader ever sees an unlocked or half-written live lease.
  A filler's process lease also names the bytes it is about to add (``reserve``: object key -> size),
  so concurrent fillers count each other's copies in flight against the quota
  (:func:`reserved_bytes`): only the cache owner's leases reserve (a site cache's readers cannot
  block its fills by reserving).
* **destination** (:func:`write_dest_lease`): written by a stage that left symbolic links to objects
  in a job's destination. It lives as long as that destination does: eviction ``lstat``\\ s the
  destination, else its parent, else its grandparent (the first one it may look at; a job's
  directory is private), and the lease is dead once that directory is gone, is another directory,
  or is not the lease writer's. One that cannot be checked at all expires after ``max_age`` days. Hard links need no
  lease: an object linked into a destination has a link count above one and is never evicted.

Liveness is judged by :func:`read_leases`. In a site cache ``leases/`` is the one directory its
readers may write (sticky, world-writable): every lease there is untrusted input. It is opened
without following links and must be a small regular file; it can only ever *keep* objects (and be
removed itself when dead), never make anything else happen, and nothing in it can make a reader of
it fail: whatever is not a lease (a directory, a FIFO, a link, broken JSON, numbers that are not
finite, a path with a NUL) is *junk*, protects nothing, and is reported (:func:`junk_line`: one
line) and removed when it is a file (a directory of another user's stays, and stays reported). Each
user other than the cache's owner has their entries read up to a budget (:data:`LEASE_ENTRIES_PER_USER`,
:data:`LEASE_BYTES_PER_USER` together): past it they are not opened, and count as junk.

What a lease keeps is bounded, whoever wrote it (:func:`protected_keys`):

* only objects its writer could read (an object's mode and group against the writer's uid and
  groups, :mod:`stager.fs.asuser`): a lease cannot pin a licensed dataset its writer is not
  licensed for;
* a lease of anyone but the cache's owner is dead :attr:`~stager.cache.store.Cache.lease_max_s`
  after its file last changed (its ``ctime``, which nobody can set back; the site configuration's
  ``STAGER_CACHE_LEASE_DAYS``, default 7), whatever its ``expires`` says, and a process lease also
  dies with its holder, a destination lease with its destination;
* a lease's time counts as a use of its objects (the LRU clock) only up to its file's ``ctime``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import socket
import stat
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from stager.cache.config import DEFAULT_DEST_LEASE_DAYS
from stager.cache.layout import LEASE_SUFFIX, is_object_name
from stager.errors import UnsafePathError
from stager.fs.asuser import Reader
from stager.fs.atomic import partial_base, partial_path
from stager.fs.kernel import boot_id
from stager.fs.safe import O_CLOEXEC, O_DIRECTORY, O_NOFOLLOW, create_exclusive, kind_of, open_regular, owner_name
from stager.redact import printable, redact_text

if TYPE_CHECKING:
    from stager.cache.store import Cache, ObjectInfo

LEASE_SCHEMA = "stager.cache.lease/1"
LEASE_MAX_BYTES = 16 << 20
# What one user other than the cache's owner may have judged in leases/, all their entries together:
# beyond it their entries are not opened (nor kept one by one), so nobody can make every fill and gc
# read gigabytes of leases (a 16 MiB lease of valid keys costs ~40 MiB of memory to hold). A user's
# real leases are one per running stage or loader and per DEST (a 100,000-shard dataset's is ~5 MiB).
LEASE_ENTRIES_PER_USER = 1024
LEASE_BYTES_PER_USER = 64 << 20
DEST_CHAIN = 3  # the destination and two directories above it


def public_what(cache: Cache, what: str) -> str:
    """What a lease says it is for: in a site cache, whose ``leases/`` every user of the node reads, only
    the words before the first location (``stage --cache-only``, not the dataset's path: a licensed
    dataset's record is its group's only, and its leases must not name it to everyone)."""
    if cache.kind != "site":
        return what
    words = []
    for w in what.split():
        if "/" in w:
            break
        words.append(w)
    return " ".join(words)


def _lease_body(kind: str, keys: Iterable[str], what: str, **extra: Any) -> bytes:
    body = {"schema": LEASE_SCHEMA, "kind": kind, "what": redact_text(what), "pid": os.getpid(), "uid": os.geteuid(),
            "host": socket.gethostname(), "boot_id": boot_id(), "time": time.time(), "keys": sorted(set(keys)),
            **extra}
    return (json.dumps(body) + "\n").encode()


def _create(dirpath: Path, data: bytes, *, lock: bool) -> tuple[Path, int]:
    """Write ``data`` to a partial file in ``dirpath``, ``flock`` it (with ``lock``), rename it to a
    fresh ``<id>.lease``; return its path and the open fd."""
    final = dirpath / f"{uuid.uuid4().hex}{LEASE_SUFFIX}"
    tmp = partial_path(final)
    fd = create_exclusive(tmp, 0o644, os.O_RDWR)
    try:
        os.fchmod(fd, 0o644)  # past the umask: a site cache's eviction (another uid) must read it
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if lock:
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(tmp, final)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return final, fd


class Lease:
    """A process lease on ``keys`` in ``cache`` (module docstring): ``with Lease(cache, keys, "stage"):``.

    :meth:`extend` adds keys and :meth:`reserve` the bytes of objects being filled (each rewrites the file
    under a new name, the old one released after)."""

    def __init__(self, cache: Cache, keys: Iterable[str], what: str) -> None:
        self.cache = cache
        self.keys = set(keys)
        self.what = what
        self.reserved: dict[str, int] = {}
        self.path: Path | None = None
        self.fd: int | None = None
        self.pid = os.getpid()

    def acquire(self) -> Lease:
        extra = {"reserve": dict(sorted(self.reserved.items()))} if self.reserved else {}
        self.path, self.fd = _create(self.cache.leases_dir,
                                     _lease_body("process", self.keys, public_what(self.cache, self.what), **extra),
                                     lock=True)
        return self

    def reserve(self, sizes: dict[str, int]) -> None:
        """Count ``sizes`` (object key -> bytes, objects this process is about to fill) against the quota
        for as long as the lease lives; an object counts as its file once it is in the cache."""
        if not sizes or all(self.reserved.get(k) == n for k, n in sizes.items()):
            return
        self.reserved.update(sizes)
        self.keys |= set(sizes)
        self._rewrite()

    def extend(self, keys: Iterable[str]) -> None:
        new = set(keys) - self.keys
        if not new:
            return
        self.keys |= new
        self._rewrite()

    def _rewrite(self) -> None:
        old_path, old_fd = self.path, self.fd
        self.acquire()  # the new file is locked before the old one goes: no moment without a lease
        if old_fd is not None and old_path is not None:
            _drop(old_path, old_fd)

    def release(self) -> None:
        """Remove the lease (in the process that took it; a forked child only closes its copy of the
        descriptor: the lock stays while the parent holds it)."""
        if self.fd is not None and self.path is not None:
            if os.getpid() == self.pid:
                _drop(self.path, self.fd)
            else:
                os.close(self.fd)
        self.path = self.fd = None

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def _drop(path: Path, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)


def write_dest_lease(cache: Cache, keys: Iterable[str], dest: Path, *,
                     max_age_days: float = DEFAULT_DEST_LEASE_DAYS) -> Path:
    """Lease ``keys`` for as long as ``dest`` exists (module docstring); return the lease's path."""
    chain = []
    p = dest
    for _ in range(DEST_CHAIN):
        with contextlib.suppress(OSError):
            st = os.lstat(p)
            chain.append([str(p), st.st_dev, st.st_ino])
        if p.parent == p:
            break
        p = p.parent
    body = _lease_body("dest", keys, public_what(cache, f"links in {dest}"), dest=chain,
                       expires=time.time() + max_age_days * 86400)
    path, fd = _create(cache.leases_dir, body, lock=False)
    os.close(fd)
    return path


@dataclass
class LeaseInfo:
    """A lease as eviction judged it: ``live`` or not and ``why``; ``keys`` it protects while live.

    ``junk``: not a lease at all (see the module docstring); ``removable``: a regular file or a link,
    which eviction may remove once dead (a directory is left to its owner); ``changed``: its file's
    ``ctime``."""

    name: str
    kind: str
    live: bool
    why: str
    keys: set[str] = field(default_factory=set)
    time: float = 0.0
    uid: int = -1
    what: str = ""
    pid: int = 0
    host: str = ""
    reserve: dict[str, int] = field(default_factory=dict)
    junk: bool = False
    removable: bool = True
    changed: float = 0.0
    count: int = 1  # entries this stands for (those of one user past :data:`LEASE_ENTRIES_PER_USER`: many)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "live": self.live, "why": self.why, "objects": len(self.keys),
                "time": self.time, "uid": self.uid, "what": self.what, "pid": self.pid, "host": self.host,
                "reserved_bytes": sum(self.reserve.values()), "junk": self.junk}


def read_leases(cache: Cache, now: float | None = None) -> list[LeaseInfo]:
    """Every entry of ``cache``'s ``leases/``, judged live, dead or junk (module docstring); never raises
    for what an entry holds. Partial files of a lease being written count as live while their writer
    holds them, so nothing they will protect is evicted."""
    now = time.time() if now is None else now
    max_age = cache.lease_max_s
    out: list[LeaseInfo] = []
    try:
        dfd = os.open(cache.leases_dir, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
    except OSError:
        return out
    budget = _Budget(cache.owner)
    try:
        with os.scandir(dfd) as entries:  # an iterator: a million names are never one list
            for entry in entries:
                name = entry.name
                if not budget.admits(_lstat_at(dfd, name)):
                    continue
                try:
                    info = _judge(dfd, name, now)
                except (OSError, ValueError, TypeError, OverflowError, RecursionError) as exc:
                    info = LeaseInfo(name, "?", False, f"unreadable ({type(exc).__name__}): protects nothing",
                                     junk=True)
                if info.live and info.uid != cache.owner and now - info.changed > max_age:
                    info.live = False
                    info.why = f"older than {max_age / 86400:g} days (the longest a lease of another user's lasts)"
                out.append(info)
    finally:
        os.close(dfd)
    return out + budget.past()


class _Budget:
    """Counts each user's entries of ``leases/`` (the cache's owner's excepted) against
    :data:`LEASE_ENTRIES_PER_USER` and :data:`LEASE_BYTES_PER_USER`, in directory order."""

    def __init__(self, owner: int) -> None:
        self.owner = owner
        self.spent: dict[int, tuple[int, int]] = {}
        self.over: dict[int, int] = {}

    def admits(self, st: os.stat_result | None) -> bool:
        if st is None or st.st_uid == self.owner:
            return True
        n, size = self.spent.get(st.st_uid, (0, 0))
        if n >= LEASE_ENTRIES_PER_USER or size + st.st_size > LEASE_BYTES_PER_USER:
            self.over[st.st_uid] = self.over.get(st.st_uid, 0) + 1
            return False
        self.spent[st.st_uid] = (n + 1, size + st.st_size)
        return True

    def past(self) -> list[LeaseInfo]:
        """One entry per user past the budget, standing for all of theirs that were not read."""
        return [LeaseInfo(f"{n} more entries of {owner_name(uid)}", "?", False,
                          f"past what one user's leases may hold together ({LEASE_ENTRIES_PER_USER} entries, "
                          f"{LEASE_BYTES_PER_USER >> 20} MiB): not read, protect nothing", uid=uid, junk=True,
                          removable=False, count=n) for uid, n in sorted(self.over.items())]


def _judge(dfd: int, name: str, now: float) -> LeaseInfo:
    """One entry of ``leases/`` (open as ``dfd``), judged."""
    base = partial_base(name)
    kind = "partial" if base is not None else "?"
    try:
        fd = open_regular(name, dir_fd=dfd, follow=False)  # never through a link, never blocked by a FIFO
    except FileNotFoundError:
        return LeaseInfo(name, kind, False, "gone meanwhile", removable=False)
    except (UnsafePathError, OSError) as exc:
        st = _lstat_at(dfd, name)
        return LeaseInfo(name, kind, False, f"{_found(st, exc)}, not a lease: protects nothing", junk=True,
                         uid=st.st_uid if st else -1, removable=st is not None and not stat.S_ISDIR(st.st_mode))
    try:
        st = os.fstat(fd)
        if st.st_size > LEASE_MAX_BYTES:
            return LeaseInfo(name, kind, False, "too large: protects nothing", uid=st.st_uid, junk=True,
                             changed=st.st_ctime)
        held = _flock_held(fd)
        if base is not None:
            # Being written: its keys are not readable yet; it is live while its writer holds it.
            return LeaseInfo(name, kind, held, "being written" if held else "a dead writer's partial file",
                             uid=st.st_uid, changed=st.st_ctime)
        data = _read_bounded(fd)
    finally:
        os.close(fd)
    return _parse(name, data, st, held, now)


def _parse(name: str, data: bytes, st: os.stat_result, held: bool, now: float) -> LeaseInfo:
    """A lease file's content, judged: anything but the schema's shapes is junk."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        body = None
    if not isinstance(body, dict) or body.get("schema") != LEASE_SCHEMA or not isinstance(body.get("keys"), list):
        return LeaseInfo(name, "?", False, "malformed: protects nothing", uid=st.st_uid, junk=True,
                         changed=st.st_ctime)
    keys = {k for k in body["keys"] if isinstance(k, str) and is_object_name(k)}
    pid = _num(body.get("pid"))
    info = LeaseInfo(name, _text(body.get("kind"), 20), False, "", keys, min(_num(body.get("time")), st.st_ctime),
                     st.st_uid, _text(body.get("what"), 200), int(pid) if 0 <= pid < 1 << 31 else 0,
                     _text(body.get("host"), 100), changed=st.st_ctime)
    reserve = body.get("reserve")
    if isinstance(reserve, dict):
        info.reserve = {k: v for k, v in reserve.items() if isinstance(k, str) and is_object_name(k)
                        and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62}
    if info.kind == "process":
        info.live = held
        info.why = "its holder is running" if held else "its holder exited (no lock held)"
    elif info.kind == "dest":
        info.live, info.why = _dest_alive(body, now, st.st_uid)
        info.junk = info.why.startswith("malformed")
    else:
        info.why = f"unknown kind {info.kind!r}: protects nothing"
        info.junk = True
    return info


def _read_bounded(fd: int) -> bytes:
    chunks = []
    total = 0
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
        total += len(chunk)
        if total > LEASE_MAX_BYTES:
            raise ValueError("grew past the size a lease may have")
    return b"".join(chunks)


def _lstat_at(dfd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None


def _found(st: os.stat_result | None, exc: BaseException) -> str:
    if st is None:
        return f"unreadable ({type(exc).__name__})"
    if stat.S_ISREG(st.st_mode):
        return f"a regular file of {owner_name(st.st_uid)} that cannot be read ({getattr(exc, 'strerror', exc)})"
    return f"a {kind_of(st)} of {owner_name(st.st_uid)}"


def _text(v: Any, limit: int) -> str:
    """A free-text field of a lease, for listings: a string, cut, control characters escaped."""
    return printable(v[:limit]) if isinstance(v, str) else ""


def protected_keys(cache: Cache, leases: Iterable[LeaseInfo], objects: Mapping[str, ObjectInfo]) -> set[str]:
    """Keys of ``objects`` that the live ``leases`` keep from eviction: every key a lease of the cache's
    owner names; of a lease of anyone else only objects its writer could read (module docstring)."""
    out: set[str] = set()
    for le in leases:
        if not le.live or not le.keys:
            continue
        if le.uid == cache.owner:
            out |= le.keys & objects.keys()
            continue
        reader = Reader.of_uid(le.uid)
        out |= {k for k in le.keys if k in objects
                and reader.allows(objects[k].mode, objects[k].uid, objects[k].gid)}
    return out


def junk_line(leases: Iterable[LeaseInfo], where: Path) -> str | None:
    """One line about the entries of ``leases/`` that are not leases (None when there are none)."""
    junk = [le for le in leases if le.junk]
    if not junk:
        return None
    first = junk[0]
    n = sum(le.count for le in junk)
    return (f"{where}: {n} entr{'y is' if n == 1 else 'ies are'} not a lease and protect nothing "
            f"(first: {printable(first.name)}: {first.why}); removed when a file, else left to its owner")


def reserved_bytes(cache: Cache, leases: Iterable[LeaseInfo], present: set[str], *, mine: Path | None = None) -> int:
    """Bytes that live fillers have reserved for objects not in the cache yet (``present``: the keys it
    holds), ``mine`` (this process's own lease file) left out. Only the cache owner's process leases
    count: in a site cache anyone may write a lease, and a reservation must not let them block fills."""
    total = 0
    for info in leases:
        if not info.live or info.kind != "process" or info.uid != cache.owner or not info.reserve:
            continue
        if mine is not None and info.name == mine.name:
            continue
        total += sum(n for k, n in info.reserve.items() if k not in present)
    return total


def _num(v: Any) -> float:
    """A lease's number, or 0.0 when it is not a finite one (JSON's ``Infinity`` and ``NaN`` included)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0


def _flock_held(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _dest_alive(body: dict[str, Any], now: float, writer: int) -> tuple[bool, str]:
    """A destination lease is live while the first directory of its chain that can be looked at is
    the same directory and belongs to whoever wrote the lease (a job's destination and its job
    directory are the user's: a lease naming a directory of someone else's, ``/`` say, keeps nothing)."""
    expires = body.get("expires")
    if not (isinstance(expires, (int, float)) and not isinstance(expires, bool) and math.isfinite(expires)):
        return False, "malformed: no finite expiry: protects nothing"
    if expires < now:
        return False, "expired"
    chain = body.get("dest")
    if not isinstance(chain, list):
        return False, "malformed: protects nothing"
    for i, entry in enumerate(chain[:DEST_CHAIN]):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and "\0" not in entry[0]
                and all(isinstance(x, int) and not isinstance(x, bool) for x in entry[1:])):
            return False, "malformed: protects nothing"
        path, dev, ino = entry
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False, f"{printable(path)} is gone"
        except OSError:
            continue  # not ours to look at: try the directory above
        if (st.st_dev, st.st_ino) != (dev, ino):
            return False, f"{printable(path)} is another directory now"
        if st.st_uid != writer:
            return False, f"{printable(path)} is not the lease writer's (uid {writer}): protects nothing"
        if i == 0:
            return True, f"{printable(path)} exists"
        return True, f"{printable(path)} (above the destination) exists"
    return True, "cannot be checked: kept until it expires"
