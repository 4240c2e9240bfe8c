"""A shard cache directory, opened and checked: :class:`Cache` (layout in :mod:`stager.cache.layout`).

Opening decides what the caller may do, before anything is read or written:

* **the owner** (the directory is the caller's): fill, link, evict, pin. A missing or empty directory
  becomes a new cache (a user's: 0700; ``kind="site"``: 0755 with a sticky, world-writable
  ``leases/``). A directory that holds other files and no marker is refused: ``stager cache`` deletes
  only what it can tell is its own.
* **a reader** of a site cache (owned by root or the site's service account, from the site
  configuration): objects are used, never written; the reader's leases go into ``leases/``.
* anyone else: refused, one line, exit 2: a cache owned by another user, one that others may write
  (``chmod go-w``), a symbolic link, a marker of another owner.

An object is trusted (:meth:`Cache.find`) only when it is a regular file of the cache's owner under
the key the reader computed from its own manifest, read-only (no write bit at all: the owner, too,
never changes an object in place), with the manifest's size, in directories only the owner may
write. Its bytes were hashed while they were written; nothing else is needed to trust them.

A cache on a shared file system (Lustre, NFS, BeeGFS...) works but is warned about: it is meant to
be node-local. The quota (:class:`~stager.cache.config.Quota`) is resolved against the cache's
file system; more than the disk is refused.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import functools
import json
import os
import socket
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stager.cache.config import (
    DEFAULT_DEST_LEASE_DAYS,
    DEFAULT_QUOTA,
    Quota,
    SiteConfig,
    disk_size,
    quota_from_env,
    site_config,
)
from stager.cache.layout import (
    DATASETS,
    HASH_ALGOS,
    KINDS,
    LEASES,
    LOCKS,
    LOG,
    MARKER,
    OBJECTS,
    SCHEMA,
    foreign_entries,
    is_object_name,
    object_relpath,
    record_name,
)
from stager.errors import ManifestError, UnsafePathError, UsageError
from stager.fs.access import current_umask, give_group
from stager.fs.atomic import atomic_write_bytes, fsync_dir, partial_base, partial_path, remove_partials
from stager.fs.info import detect_fs
from stager.fs.safe import check_chain, create_exclusive, owner_name, problem, read_trusted, require, trusted_uids

RECORD_SCHEMA = "stager.cache.dataset/1"
LOG_MAX_BYTES = 1 << 20  # log.jsonl is halved when it grows past this
RECORD_STAGES_KEPT = 32  # stage times kept per dataset (stager hints: staged again within a day)


def record_files(rec: dict[str, Any]) -> list[tuple[str, str, str, int]]:
    """A dataset record's files as ``(name, algo, key, bytes)``, every entry checked: one that is not a
    well-formed list (a damaged record, or one an older stager wrote) is skipped, never fatal."""
    out = []
    files = rec.get("files")
    for f in files if isinstance(files, list) else ():
        if (isinstance(f, list) and len(f) == 4 and isinstance(f[0], str) and f[1] in HASH_ALGOS
                and isinstance(f[2], str) and is_object_name(f[2]) and isinstance(f[3], int)
                and not isinstance(f[3], bool) and f[3] >= 0):
            out.append((f[0], f[1], f[2], f[3]))
    return out


def record_int(rec: dict[str, Any], key: str) -> int:
    """A count of a dataset record (``uses``, ``hit_bytes``...), 0 when it is not a non-negative integer."""
    v = rec.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def now_iso(t: float | None = None) -> str:
    return _dt.datetime.fromtimestamp(time.time() if t is None else t, _dt.timezone.utc).isoformat(
        timespec="seconds")


@dataclass(frozen=True)
class ObjectInfo:
    """One object file as a scan found it: ``used`` is its last use (the LRU clock: its access time,
    which :meth:`Cache.touch` sets, or when it was written if later), ``nlink`` > 1 means it is
    hard-linked into a destination that still exists (in a user's cache: a site cache links only
    symbolically, so there a hard link is someone else's and means nothing)."""

    algo: str
    key: str
    path: Path
    bytes: int
    used: float
    nlink: int
    mode: int
    uid: int
    gid: int = -1


@dataclass
class Cache:
    """An opened cache (see the module docstring). ``writable``: the caller owns it; ``quota_bytes``:
    the resolved quota (None when opened only to read); ``warnings``: to print; ``lease_max_s``: the
    longest a lease of anyone but the owner keeps objects (:mod:`stager.cache.lease`)."""

    root: Path
    kind: str
    owner: int
    writable: bool
    quota: Quota
    quota_bytes: int | None
    disk_bytes: int
    fstype: str
    warnings: list[str] = field(default_factory=list)
    lease_max_s: float = DEFAULT_DEST_LEASE_DAYS * 86400
    _dirs_ok: set[Path] = field(default_factory=set, repr=False)

    # ---- opening --------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str], *, create: bool = False, kind: str = "user",
             quota: Quota | None = None, site: SiteConfig | None = None, read_only: bool = False) -> Cache:
        """Open (and with ``create``, make) the cache at ``path``; raise a one-line error when the caller
        may not use it (module docstring). ``read_only`` skips resolving the quota (the loader)."""
        if kind not in KINDS:
            raise UsageError(f"cache kind must be one of {', '.join(KINDS)}, got {kind!r}")
        site = site if site is not None else site_config()
        allowed = trusted_uids() | site.trusted_owners
        fix = "use a cache directory of your own (--cache DIR) or the site cache"
        # Nobody else may rename or replace the cache or a directory above it (fs/safe.py, rule 5): then
        # paths under it are as good as handles, for the copy streams and the loader's maps.
        root = Path(check_chain(os.path.abspath(os.fspath(path)), owners=allowed, what="shard cache", fix=fix))
        if quota is not None:  # before anything is made or recorded: a refused quota never reaches the marker
            quota.check_fits(root, f"cache {root}")
        st = _lstat(root)
        if st is None:
            if not create:
                raise UsageError(f"{root}: no such cache; stage with --cache {root} to create it")
            _make_root(root, kind)
            st = os.lstat(root)
        require(st, root, "shard cache", fix, expect="dir", owners=allowed)
        me = os.geteuid()
        mine = st.st_uid == me
        if not mine and st.st_uid not in site.trusted_owners:
            require(st, root, "shard cache", fix, expect="dir", owners=frozenset({me}))  # root and a user's cache
        marker = _read_marker(root, st.st_uid)
        if marker is None:
            if not mine:
                raise UsageError(f"{root}: not a stager cache (no {MARKER}); give a cache directory")
            marker = _init(root, kind, quota)
        cache_kind = marker.get("kind")
        if cache_kind not in KINDS:
            raise ManifestError(f"{root}/{MARKER}: unknown cache kind {cache_kind!r}; not a cache of this stager")
        if not mine and cache_kind != "site":
            raise UnsafePathError(f"{root}: a user's shard cache of {owner_name(st.st_uid)}, not yours; only a site "
                                  f"cache is shared; {fix}")
        own = _marker_quota(root, marker)
        disk = disk_size(root)
        warnings = list(site.warnings)
        chosen = quota or quota_from_env() or own or _site_quota(site, disk, warnings) or Quota.parse(DEFAULT_QUOTA)
        cache = cls(root=root, kind=cache_kind, owner=st.st_uid, writable=mine, quota=chosen, quota_bytes=None,
                    disk_bytes=disk, fstype="", warnings=warnings, lease_max_s=site.lease_days * 86400)
        cache._check_dirs(create=mine)
        if not read_only and mine:  # a reader never evicts: the owner's quota is not its to refuse
            fix = (f"record one that fits: `stager cache init --quota {DEFAULT_QUOTA} {root}`" if chosen is own
                   else "give at most the disk's size or a fraction (0.5)")
            cache.quota_bytes = chosen.resolve(disk, f"cache {root}", fix)
        fs = detect_fs(root)
        cache.fstype = fs.fstype
        if fs.is_shared:
            cache.warnings.append(
                f"{root}: the cache is on {fs.fstype} (a file system shared by nodes), where a node-local disk was "
                "expected: every read of it crosses the network; put the cache on the node's local disk")
        return cache

    def _check_dirs(self, *, create: bool) -> None:
        """The four sub-directories: the owner's, not writable by others (``leases/`` of a site cache:
        sticky and world-writable, so readers can hold leases)."""
        for name in (OBJECTS, DATASETS, LOCKS, LEASES):
            p = self.root / name
            st = _lstat(p)
            if st is None and create:
                _mkdir(p, self._dir_mode(name), self.kind)
                st = os.lstat(p)
            if st is None:
                if name == LOCKS:
                    continue  # a reader never takes fill locks
                raise UsageError(f"{p}: missing; the cache is damaged: its owner runs `stager cache verify "
                                 f"{self.root}`")
            require(st, p, "cache directory", f"the cache was tampered with: its owner runs `stager cache verify "
                    f"{self.root}` or removes it", expect="dir", owners=frozenset({self.owner}),
                    sticky_ok=name == LEASES and self.kind == "site")

    def _dir_mode(self, name: str = "") -> int:
        if self.kind == "site":
            return 0o1777 if name == LEASES else (0o700 if name == LOCKS else 0o755)
        return 0o700

    # ---- names ----------------------------------------------------------------------------------
    def object_path(self, algo: str, key: str) -> Path:
        return self.root / object_relpath(algo, key)

    @property
    def locks_dir(self) -> Path:
        return self.root / LOCKS

    @property
    def leases_dir(self) -> Path:
        return self.root / LEASES

    # ---- objects --------------------------------------------------------------------------------
    def find(self, algo: str, key: str, nbytes: int) -> Path | None:
        """The trusted object for ``key`` with ``nbytes`` bytes that the caller can read, or None (module
        docstring). A file that is there but fails a check is left alone (``stager cache verify``
        reports it) and counts as absent."""
        p = self.object_path(algo, key)
        st = _lstat(p)
        if st is None or problem(st, expect="file", owners=frozenset({self.owner})) or st.st_mode & 0o222:
            return None
        if st.st_size != nbytes or not self._parents_ok(p):
            return None
        if not os.access(p, os.R_OK, effective_ids=os.access in os.supports_effective_ids):
            return None  # a group-only object of a group the caller is not in
        return p

    def _parents_ok(self, p: Path) -> bool:
        """``objects/<algo>/<kk>`` are the owner's and nobody else may write them (checked once each)."""
        for d in (p.parent, p.parent.parent):
            if d in self._dirs_ok:
                continue
            st = _lstat(d)
            if st is None or problem(st, expect="dir", owners=frozenset({self.owner})):
                return False
            self._dirs_ok.add(d)
        return True

    def partial_for(self, algo: str, key: str) -> Path:
        """A fresh ``<key>.<12 hex>.partial`` beside the object's final name (its directories made)."""
        final = self.object_path(algo, key)
        for d in (final.parent.parent, final.parent):
            if _lstat(d) is None:
                _mkdir(d, self._dir_mode(), self.kind)
        return partial_path(final)

    def remove_partials(self, algo: str, key: str) -> list[str]:
        """Remove partial files of ``key`` (a dead filler's; call with its fill lock held)."""
        d = self.object_path(algo, key).parent
        removed = []
        with contextlib.suppress(FileNotFoundError), os.scandir(d) as it:
            for e in it:
                if partial_base(e.name) == key and e.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)
                    removed.append(e.name)
        return removed

    def object_mode(self, source_mode: int | None) -> int:
        """An object's mode: the read bits its source grants (owner read always), no write or execute
        bit: so a group-only (licensed) dataset stays group-only in a site cache. In a user's cache
        the umask applies too, as to every copy of theirs (its hard links are their DEST's files); a
        site cache's modes are its contract with its readers, not its service account's umask. A
        source without POSIX modes (an object store, ``None``) gives an owner-only object: its
        readers' credentials are not the cache's to share."""
        if source_mode is None:
            return 0o400
        mode = stat.S_IMODE(source_mode) & 0o444
        if self.kind == "user":
            mode &= ~self._umask
        return mode | 0o400

    @functools.cached_property
    def _umask(self) -> int:
        return current_umask()

    def scan(self) -> Iterator[ObjectInfo]:
        """Every object file (not partial files), in directory order."""
        for algo in HASH_ALGOS:
            base = self.root / OBJECTS / algo
            try:
                subs = sorted(e.name for e in os.scandir(base) if e.is_dir(follow_symlinks=False))
            except FileNotFoundError:
                continue
            for sub in subs:
                with contextlib.suppress(FileNotFoundError), os.scandir(base / sub) as it:
                    for e in it:
                        if partial_base(e.name) is not None:
                            continue
                        try:
                            st = e.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if stat.S_ISREG(st.st_mode):
                            yield ObjectInfo(algo, e.name, Path(e.path), st.st_size, max(st.st_atime, st.st_mtime),
                                             st.st_nlink, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)

    def partial_files(self) -> Iterator[Path]:
        """Partial files under ``objects/`` (a filler's in progress, or a dead one's)."""
        for algo in HASH_ALGOS:
            base = self.root / OBJECTS / algo
            with contextlib.suppress(FileNotFoundError):
                for sub in os.scandir(base):
                    with contextlib.suppress(FileNotFoundError), os.scandir(sub.path) as it:
                        for e in it:
                            if partial_base(e.name) is not None:
                                yield Path(e.path)

    def touch(self, paths: Iterable[Path], when: float | None = None) -> None:
        """Record a use of these objects; only the owner can. The LRU clock is an object's access time:
        its modification time is never moved, so that it keeps telling whether its bytes changed since
        they were verified (:mod:`stager.cache.seal`)."""
        if not self.writable:
            return
        t_ns = time.time_ns() if when is None else int(when * 1e9)
        for p in paths:
            with contextlib.suppress(OSError):
                st = os.lstat(p)
                if st.st_atime_ns < t_ns and stat.S_ISREG(st.st_mode):
                    os.utime(p, ns=(t_ns, st.st_mtime_ns), follow_symlinks=False)

    def used_bytes(self) -> int:
        return sum(o.bytes for o in self.scan())

    def foreign(self) -> list[str]:
        return foreign_entries(self.root)

    def require_own_files(self) -> None:
        """``stager cache``'s guard: refuse a cache that holds anything but its own files."""
        bad = self.foreign()
        if bad:
            raise UsageError(
                f"{self.root}: holds files that are not the cache's own (first: {bad[0]}); a cache holds only its "
                "own files and `stager cache` deletes only those: move them out, or give the right directory")

    # ---- dataset records ------------------------------------------------------------------------
    def record_path(self, digest: str) -> Path:
        return self.root / DATASETS / record_name(digest)

    def read_record(self, digest: str) -> dict[str, Any] | None:
        return _read_json(self.record_path(digest), self.owner)

    def records(self) -> list[dict[str, Any]]:
        out = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root / DATASETS) as it:
            for e in sorted(it, key=lambda e: e.name):
                if partial_base(e.name) is None and e.name.endswith(".json"):
                    rec = _read_json(Path(e.path), self.owner)
                    if rec is not None and rec.get("schema") == RECORD_SCHEMA:
                        out.append(rec)
        return out

    def write_record(self, rec: dict[str, Any]) -> None:
        """Replace a dataset's record (atomically; not fsynced: a record is what ``ls`` and pins read,
        the objects are the cache, and a record a crash lost is written again by the next stage;
        a pin is fsynced, :func:`set_pinned`). A user's cache's records are 0600; a site cache's
        have the access of the dataset's manifest (``access``: ``[mode, gid]``, its read bits and
        group, as the objects do: a licensed dataset's record is its group's only), else 0644."""
        if not self.writable:
            return
        final = self.record_path(rec["digest"])
        tmp = partial_path(final)
        mode, gid = (0o600, None) if self.kind == "user" else _record_access(rec.get("access"))
        fd = create_exclusive(tmp, 0o600)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
            give_group(fd, gid, mode)  # never another group's read bit (nor a setgid directory's group)
            if rec.get("pinned"):
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)

    def note_stage(self, *, digest: str, dataset_id: str, source: str, algo: str,
                   files: list[tuple[str, str, str, int]], hit_bytes: int, filled_bytes: int,
                   access: tuple[int, int] | None = None, seals: dict[str, list[Any]] | None = None) -> None:
        """Update the dataset's record after a stage: its files (name, algo, key, bytes), a use, the
        bytes found and copied; ``access``: the ``(mode, gid)`` a site cache's record gets; ``seals``:
        objects verified by this stage (key -> seal, :mod:`stager.cache.seal`), over the record's."""
        if not self.writable:
            return
        rec = self.read_record(digest) or {"schema": RECORD_SCHEMA, "digest": digest, "dataset_id": dataset_id,
                                           "first_cached": now_iso(), "uses": 0, "pinned": False, "stages": [],
                                           "hit_bytes": 0, "filled_bytes": 0}
        known = {f[0]: f for f in record_files(rec)}
        known.update({f[0]: f for f in files})
        rec.update(source=source, algo=algo, files=sorted(list(f) for f in known.values()),
                   bytes=sum(f[3] for f in known.values()), last_used=now_iso())
        rec["uses"] = record_int(rec, "uses") + 1
        rec["hit_bytes"] = record_int(rec, "hit_bytes") + hit_bytes
        rec["filled_bytes"] = record_int(rec, "filled_bytes") + filled_bytes
        stages = rec.get("stages")
        stages = [t for t in stages if isinstance(t, (int, float)) and not isinstance(t, bool)] \
            if isinstance(stages, list) else []
        rec["stages"] = [*stages, time.time()][-RECORD_STAGES_KEPT:]
        if access is not None:
            rec["access"] = list(access)
        old_seals = rec.get("seals")
        kept = {k: v for k, v in old_seals.items() if k in {f[2] for f in known.values()}} \
            if isinstance(old_seals, dict) else {}
        rec["seals"] = {**kept, **(seals or {})}
        self.write_record(rec)

    # ---- the log --------------------------------------------------------------------------------
    def log(self, events: list[dict[str, Any]]) -> None:
        """Append eviction events to ``log.jsonl`` (halved, oldest dropped, past :data:`LOG_MAX_BYTES`)."""
        if not self.writable or not events:
            return
        path = self.root / LOG
        data = "".join(json.dumps(e) + "\n" for e in events).encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size > LOG_MAX_BYTES:
            lines = path.read_bytes().splitlines(keepends=True)
            atomic_write_bytes(path, b"".join(lines[len(lines) // 2:]), mode=0o600)

    def read_log(self, last: int = 20) -> list[dict[str, Any]]:
        """The last eviction events (lines that are not JSON objects skipped)."""
        try:
            data = read_trusted(self.root / LOG, what="cache log", limit=4 * LOG_MAX_BYTES,
                                owners=frozenset({self.owner}))
        except (OSError, UnsafePathError):
            return []
        out = []
        for ln in (data or b"").splitlines()[-last:]:
            with contextlib.suppress(ValueError, RecursionError):
                e = json.loads(ln)
                if isinstance(e, dict):
                    out.append(e)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"dir": str(self.root), "kind": self.kind, "owner": self.owner, "writable": self.writable,
                "quota": self.quota.text, "quota_bytes": self.quota_bytes, "disk_bytes": self.disk_bytes,
                "fstype": self.fstype}


# ---- helpers -----------------------------------------------------------------------------------
def _record_access(acc: Any) -> tuple[int, int | None]:
    """A site cache record's ``(mode, gid)`` from its ``access`` entry: read bits only (owner read
    always); 0644 when there is none (a record written before records had one)."""
    if (isinstance(acc, list) and len(acc) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in acc)
            and acc[1] >= 0):
        return (acc[0] & 0o444) | 0o400, acc[1]
    return 0o644, None



def _site_quota(site: SiteConfig, disk: int, warnings: list[str]) -> Quota | None:
    """The site configuration's quota when it fits this node's disk; else None and a warning (one
    prolog.conf serves nodes with different disks: a quota another node's disk holds is not this
    node's users' failure)."""
    if site.quota is None:
        return None
    try:
        site.quota.resolve(disk, f"{site.path}: STAGER_CACHE_QUOTA")
    except UsageError as exc:
        warnings.append(f"{exc}; using {DEFAULT_QUOTA} on this node")
        return None
    return site.quota


def _lstat(p: Path) -> os.stat_result | None:
    try:
        return os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _mkdir(p: Path, mode: int, kind: str) -> None:
    """Make a directory of the cache. A user's: ``mode`` less the umask (0700). A site cache's modes
    are its contract with every reader (0755, a sticky 1777 ``leases/``), set past the service
    account's umask."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(p, mode & 0o777)
    if kind == "site":
        os.chmod(p, mode, follow_symlinks=False)


def _make_root(root: Path, kind: str) -> None:
    root.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):  # made meanwhile by a concurrent stage: checked as usual
        _mkdir(root, 0o755 if kind == "site" else 0o700, kind)


def _init(root: Path, kind: str, quota: Quota | None) -> dict[str, Any]:
    """Make ``root`` (empty, the caller's) a cache: write its marker (first: the sub-directories are
    made on every open by the owner, so a crash here leaves an empty directory or a cache). Holds an
    ``flock`` on the directory, so concurrent first stages agree on one marker."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        got = _read_marker(root, os.geteuid())
        if got is not None:
            return got  # made meanwhile by a concurrent stage
        others = sorted(n for n in os.listdir(root) if partial_base(n) != MARKER)
        if others:
            raise UsageError(
                f"{root}: not a stager cache: it holds other files (first: {others[0]}) and no {MARKER}; a cache "
                "holds only its own files: give an empty or new directory")
        remove_partials(root, {MARKER})
        marker = {"schema": SCHEMA, "kind": kind, "owner": os.geteuid(), "created": now_iso(),
                  "host": socket.gethostname(), "quota": quota.text if quota else None}
        atomic_write_bytes(root / MARKER, (json.dumps(marker) + "\n").encode(),
                           mode=0o644 if kind == "site" else 0o600)
        return marker
    finally:
        os.close(fd)


def _read_marker(root: Path, owner: int) -> dict[str, Any] | None:
    m = _read_json(root / MARKER, owner)
    if m is None:
        return None
    if m.get("schema") != SCHEMA:
        raise ManifestError(f"{root / MARKER}: unknown cache schema {m.get('schema')!r}; not a cache of this stager")
    return m


def _marker_quota(root: Path, marker: dict[str, Any]) -> Quota | None:
    text = marker.get("quota")
    return Quota.parse(text, f"{root / MARKER}: quota") if isinstance(text, str) and text else None


def set_marker_quota(cache: Cache, quota: Quota) -> None:
    """Record ``quota`` as the cache's own (``stager cache init --quota``)."""
    marker = _read_marker(cache.root, cache.owner) or {}
    marker["quota"] = quota.text
    atomic_write_bytes(cache.root / MARKER, (json.dumps(marker) + "\n").encode(),
                       mode=0o644 if cache.kind == "site" else 0o600)


def _read_json(p: Path, owner: int, limit: int = 64 << 20) -> dict[str, Any] | None:
    """A JSON object from a regular file of ``owner`` that nobody else may write (never through a
    link); None if absent or unreadable."""
    try:
        data = read_trusted(p, what="cache file", limit=limit, owners=frozenset({owner}))
    except (OSError, UnsafePathError):
        return None
    if data is None:
        return None
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def fsync_dirs(paths: Iterable[Path]) -> None:
    """One directory fsync per distinct parent of ``paths`` (after renames into them)."""
    for d in sorted({p.parent for p in paths}):
        fsync_dir(d)
