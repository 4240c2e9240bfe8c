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
removed itself when dead), never make anything else happen. A lease that cannot be read protects
nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from stager.cache.config import DEFAULT_DEST_LEASE_DAYS
from stager.cache.layout import LEASE_SUFFIX, is_object_name
from stager.errors import UnsafePathError
from stager.fs.atomic import partial_base, partial_path
from stager.fs.kernel import boot_id
from stager.fs.safe import O_CLOEXEC, O_NOFOLLOW, open_regular
from stager.redact import redact_text

if TYPE_CHECKING:
    from stager.cache.store import Cache

LEASE_SCHEMA = "stager.cache.lease/1"
LEASE_MAX_BYTES = 16 << 20
DEST_CHAIN = 3  # the destination and two directories above it


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
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o644)
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
        self.path, self.fd = _create(self.cache.leases_dir, _lease_body("process", self.keys, self.what, **extra),
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
    body = _lease_body("dest", keys, f"links in {dest}", dest=chain, expires=time.time() + max_age_days * 86400)
    path, fd = _create(cache.leases_dir, body, lock=False)
    os.close(fd)
    return path


@dataclass
class LeaseInfo:
    """A lease as eviction judged it: ``live`` or not and ``why``; ``keys`` it protects while live."""

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

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "live": self.live, "why": self.why, "objects": len(self.keys),
                "time": self.time, "uid": self.uid, "what": self.what, "pid": self.pid, "host": self.host,
                "reserved_bytes": sum(self.reserve.values())}


def read_leases(cache: Cache, now: float | None = None) -> list[LeaseInfo]:
    """Every lease in ``cache``, judged live or dead (module docstring). Partial files of a lease being
    written count as live while their writer holds them, so nothing they will protect is evicted."""
    now = time.time() if now is None else now
    out = []
    with contextlib.suppress(FileNotFoundError), os.scandir(cache.leases_dir) as it:
        entries = list(it)
    for e in entries:
        out.append(_judge(Path(e.path), now))
    return out


def _judge(path: Path, now: float) -> LeaseInfo:
    name = path.name
    base = partial_base(name)
    kind = "partial" if base is not None else "?"
    try:
        fd = open_regular(path, follow=False)  # never through a link, never blocked by a FIFO
    except UnsafePathError:
        return LeaseInfo(name, kind, False, "not a regular file: protects nothing")
    except OSError as exc:
        return LeaseInfo(name, kind, False, f"cannot be opened ({exc.strerror}): protects nothing")
    try:
        st = os.fstat(fd)
        if st.st_size > LEASE_MAX_BYTES:
            return LeaseInfo(name, kind, False, "too large: protects nothing", uid=st.st_uid)
        held = _flock_held(fd)
        if base is not None:
            # Being written: its keys are not readable yet; it is live while its writer holds it.
            return LeaseInfo(name, kind, held, "being written" if held else "a dead writer's partial file",
                             uid=st.st_uid)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):
        body = None
    if not isinstance(body, dict) or body.get("schema") != LEASE_SCHEMA or not isinstance(body.get("keys"), list):
        return LeaseInfo(name, kind, False, "malformed: protects nothing", uid=st.st_uid)
    keys = {k for k in body["keys"] if isinstance(k, str) and is_object_name(k)}
    info = LeaseInfo(name, str(body.get("kind")), False, "", keys, _num(body.get("time")), st.st_uid,
                     str(body.get("what", ""))[:200], int(_num(body.get("pid"))), str(body.get("host", ""))[:100])
    reserve = body.get("reserve")
    if isinstance(reserve, dict):
        info.reserve = {k: int(v) for k, v in reserve.items() if isinstance(k, str) and is_object_name(k)
                        and isinstance(v, int) and not isinstance(v, bool) and v >= 0}
    if info.kind == "process":
        info.live = held
        info.why = "its holder is running" if held else "its holder exited (no lock held)"
    elif info.kind == "dest":
        info.live, info.why = _dest_alive(body, now, st.st_uid)
    else:
        info.why = f"unknown kind {info.kind!r}: protects nothing"
    return info


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
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


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
    if _num(body.get("expires")) < now:
        return False, "expired"
    chain = body.get("dest")
    if not isinstance(chain, list):
        return False, "malformed: protects nothing"
    for i, entry in enumerate(chain[:DEST_CHAIN]):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
            return False, "malformed: protects nothing"
        path, dev, ino = entry
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False, f"{path} is gone"
        except OSError:
            continue  # not ours to look at: try the directory above
        if (st.st_dev, st.st_ino) != (dev, ino):
            return False, f"{path} is another directory now"
        if st.st_uid != writer:
            return False, f"{path} is not the lease writer's (uid {writer}): protects nothing"
        if i == 0:
            return True, f"{path} exists"
        return True, f"{path} (above the destination) exists"
    return True, "cannot be checked: kept until it expires"
