"""Staging through a node-local shard cache: ``stager stage SRC DEST --cache DIR`` (:mod:`stager.cache`).

:func:`place` runs inside a plain stage, with DEST's node lock held, on the files the journal does
not already hold, before the plain copy:

1. **Lease** every object the plan needs (:class:`~stager.cache.lease.Lease`: held until the run
   ends, so no eviction removes what this run is about to link), then look each one up
   (:meth:`~stager.cache.store.Cache.find`: the key comes from this run's own manifest and SRC), and
   check that it is still what was verified (:class:`~stager.cache.seal.HitCheck`: its seal, else a
   re-hash; ``--verify-cache`` re-hashes every hit): a changed object is never linked.
2. **Link hits** into DEST: a hard link when the cache is the caller's own and on DEST's file system
   (the file in DEST *is* the object; its link count keeps it from eviction while DEST exists), a
   symbolic link otherwise (a site cache, another file system), then leased for as long as DEST
   exists (:func:`~stager.cache.lease.write_dest_lease`). Nothing is copied.
3. **Fill misses** (the cache's owner only): make room under the quota (:func:`~stager.cache.evict.collect`,
   least recently used first), then copy each missing file once from SRC into the cache, hashed
   while copied (the plain stage's copy streams, :class:`~stager.stage.copier.Copier`, placing into
   the cache: read-only, SRC's group, fsynced), and link it into DEST. Each object is filled under
   its fill lock (:class:`~stager.cache.locks.FillLock`), claimed a batch at a time without waiting:
   when another stage on the node fills the same dataset, each copies what it claimed and links what
   the other finished, so SRC serves every byte once; a stage that finds nothing left to claim
   waits for the next object it needs to arrive. A filler that dies leaves a partial file and no
   lock: the next one removes the partial and copies again.
4. What the cache cannot take (a site cache the caller may only read, the quota, a file another
   user's group may not share) is returned to the plain copy into DEST: a partly cached dataset
   copies only the rest, once. A site cache's fill reads a source only as the job's user would
   (:class:`~stager.cache.fillsource.FillGate`: the service account never lends its rights), through
   the descriptor it checked; what it refuses is left to the job's own stage.

:func:`fill_only` is the same without a DEST (``--cache-only``: the prolog's service account filling
a site cache). Collective staging links hits before its exchange (:func:`link_hits`) and adds what it
received afterwards (:func:`adopt`), so a collective stage fills the cache too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from stager.cache.config import site_config
from stager.cache.evict import collect, prune_leases
from stager.cache.fillsource import FillGate, fill_reader, via_fd
from stager.cache.layout import ROOM_LOCK, object_key
from stager.cache.lease import Lease, read_leases, reserved_bytes, write_dest_lease
from stager.cache.locks import FillLock
from stager.cache.seal import HitCheck, iso, seals_of
from stager.cache.store import Cache, fsync_dirs
from stager.errors import DestinationError, StagerTimeoutError, UnsafePathError
from stager.fs.access import size_or_missing
from stager.fs.atomic import fsync_dir, partial_path
from stager.fs.verified import Expected, copy_verified
from stager.manifest import manifest_path
from stager.progress import Progress
from stager.redact import redact
from stager.stage.copier import Copier
from stager.stage.dest import check_free_space
from stager.stage.journal import Journal
from stager.stage.options import StageOptions
from stager.stage.plan import DEFAULT_BLOCK, FileTask, StagePlan, order_for_streams
from stager.stage.result import StageResult

CLAIM_BATCH = 32  # objects claimed per round (each claim holds a lock file open)


@dataclass
class CacheStats:
    """What the cache did for one stage (``StageResult.cache``; job scripts read these names)."""

    dir: str
    kind: str
    links: str = ""  # "hard", "symbolic" or "mixed": how DEST refers to the objects
    files_hit: int = 0
    bytes_hit: int = 0
    files_filled: int = 0  # copied from SRC into the cache by this run
    bytes_filled: int = 0
    files_from_peer: int = 0  # filled meanwhile by another stage on this node, then linked
    bytes_from_peer: int = 0
    files_uncached: int = 0  # left to the plain copy into DEST
    bytes_uncached: int = 0
    waited_s: float = 0.0
    evicted_files: int = 0
    evicted_bytes: int = 0
    eviction: dict[str, Any] | None = None
    files_rehashed: int = 0  # hits whose seal did not match (or --verify-cache): hashed again
    files_damaged: int = 0  # hits whose bytes were not their name's: never linked
    verified: dict[str, str] = field(default_factory=dict)  # file -> "copied" or "cached, verified <time>"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": round(self.hit_rate, 4)}

    @property
    def hit_rate(self) -> float:
        """Bytes this stage found in the cache / bytes it needed from it or SRC (1.0 when it needed none)."""
        total = self.bytes_hit + self.bytes_filled + self.bytes_from_peer + self.bytes_uncached
        return self.bytes_hit / total if total else 1.0


class _Linker:
    """Links objects into DEST under their manifest names (hard while allowed, else symbolic)."""

    def __init__(self, cache: Cache, dest: Path) -> None:
        self.dest = dest
        self.hard = cache.kind == "user" and cache.writable
        self.kinds: set[str] = set()
        self.symbolic_keys: set[str] = set()
        self._lock = threading.Lock()

    def link(self, name: str, obj: Path, key: str) -> None:
        final = self.dest / name
        tmp = partial_path(final)
        kind = "symbolic"
        if self.hard:
            try:
                os.link(obj, tmp)
                kind = "hard"
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES, errno.ENOTSUP):
                    raise
                self.hard = False  # another file system (or mount), or links not allowed: symbolic from now on
        if kind == "symbolic":
            os.symlink(obj, tmp)
        try:
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        with self._lock:
            self.kinds.add(kind)
            if kind == "symbolic":
                self.symbolic_keys.add(key)

    @property
    def mode(self) -> str:
        return "mixed" if len(self.kinds) > 1 else next(iter(self.kinds), "")


class _Fill:
    """The :class:`~stager.stage.copier.Placement` of a fill: copies go to their objects; each placed
    object is linked into DEST (when there is one) and its fill lock released."""

    def __init__(self, cache: Cache, algo: str, keys: dict[str, str], linker: _Linker | None,
                 stats: CacheStats) -> None:
        self.cache, self.algo, self.keys, self.linker, self.stats = cache, algo, keys, linker, stats
        self.locks: dict[str, FillLock] = {}
        self.placed_paths: list[Path] = []
        self.placed_keys: list[tuple[str, Path]] = []  # (key, object) filled and verified by this run
        self.sources: dict[str, tuple[int, int]] = {}  # a gated fill's checked sources: name -> (fd, gid)
        self._lock = threading.Lock()

    def final(self, task: FileTask) -> Path:
        return self.cache.object_path(self.algo, self.keys[task.name])

    def mode(self, source_mode: int | None) -> int:
        return self.cache.object_mode(source_mode)

    def placed(self, task: FileTask) -> None:
        obj = self.final(task)
        source = self.sources.get(task.name)
        if source is not None:
            _require_group(obj, source[1])
        if self.linker is not None:
            self.linker.link(task.name, obj, self.keys[task.name])
        with self._lock:
            lock = self.locks.pop(task.name, None)
            self.stats.files_filled += 1
            self.stats.bytes_filled += task.bytes
            self.stats.verified[task.name] = "copied"
            self.placed_paths.append(obj)
            self.placed_keys.append((self.keys[task.name], obj))
        if lock is not None:
            lock.release()

    def release_all(self) -> None:
        with self._lock:
            locks, self.locks = list(self.locks.values()), {}
            sources, self.sources = list(self.sources.values()), {}
        for lock in locks:
            lock.release()
        for fd, _gid in sources:
            with contextlib.suppress(OSError):
                os.close(fd)


def _require_group(obj: Path, gid: int) -> None:
    """A site cache's object whose group only may read it must have its source's group: if the group
    could not be given after all (changed meanwhile), the object goes, never placed with another
    group's read bit (:mod:`stager.cache.fillsource`)."""
    st = os.lstat(obj)
    if st.st_mode & 0o040 and not st.st_mode & 0o004 and st.st_gid != gid:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(obj)
        raise UnsafePathError(f"{obj}: could not be given its source's group {gid}: removed, the job's stage copies "
                              "it as its user")


# ---- the phases ---------------------------------------------------------------------------------
def open_cache(options: StageOptions) -> Cache:
    """The cache of ``options`` (made when missing: a site cache when the caller is the site's cache
    service account, :mod:`stager.cache.config`, else the caller's own)."""
    assert options.cache is not None
    site = site_config()
    kind = "site" if site.service_uid is not None and site.service_uid == os.geteuid() else "user"
    return Cache.open(options.cache.dir, create=True, kind=kind, quota=options.cache.quota, site=site)


def keys_for(plan: StagePlan, tasks: list[FileTask]) -> dict[str, str]:
    algo = plan.manifest.hash_algo
    return {t.name: object_key(algo, t.hash, t.src_path) for t in tasks}


@dataclass
class _Run:
    """One stage's work with the cache: what it needs (``keys``), where links go (``linker``, None
    without a DEST), the journal of DEST (None without one), and what happened (``stats``)."""

    cache: Cache
    plan: StagePlan
    options: StageOptions
    warnings: list[str]
    keys: dict[str, str]
    linker: _Linker | None
    journal: Journal | None
    stats: CacheStats
    lease: Lease | None = None  # this stage's process lease: what it fills is reserved in it
    gate: FillGate | None = None  # a site cache's fill: sources as the job's user would read them
    access: tuple[int, int] | None = None  # a site cache's dataset record: the manifest's (mode, gid)
    hits: HitCheck | None = None  # each hit checked against its seal before it is linked

    def __post_init__(self) -> None:
        m = self.plan.manifest
        rec = self.cache.read_record(m.digest or m.compute_digest())
        everything = self.options.cache is not None and self.options.cache.verify
        self.hits = HitCheck(self.algo, seals_of(rec), everything=everything, owner=self.cache.writable)

    @property
    def algo(self) -> str:
        return self.plan.manifest.hash_algo

    def link(self, t: FileTask, obj: Path) -> None:
        if self.linker is None:
            return
        self.linker.link(t.name, obj, self.keys[t.name])
        if self.journal is not None and t is not self.plan.index_task:
            self.journal.add_file(t.name, t.bytes)

    def link_hits(self, tasks: list[FileTask]) -> list[FileTask]:
        """Link every cached file that is still what was verified into DEST (journaled); return the
        misses (a changed object is one: its owner removed it, a reader leaves it)."""
        misses, used = [], []
        assert self.hits is not None
        for t in tasks:
            obj = self.cache.find(self.algo, self.keys[t.name], t.bytes)
            when = self.hits.check(self.keys[t.name], obj, t.bytes) if obj is not None else None
            if obj is None or when is None:
                misses.append(t)
                continue
            self.stats.verified[t.name] = f"cached, verified {iso(when)}"
            self.link(t, obj)
            self.stats.files_hit += 1
            self.stats.bytes_hit += t.bytes
            used.append(obj)
        self.cache.touch(used)
        return misses

    def fill(self, misses: list[FileTask]) -> list[FileTask]:
        """Copy ``misses`` into the cache (room made first) and link them; return what it cannot take."""
        cache, options, warnings = self.cache, self.options, self.warnings
        if not cache.writable or not misses:
            return misses
        if not options.fsync:
            warnings.append("--no-fsync ignored for the cache: its copies outlive the job (and a reboot)")
        prune_leases(cache)
        if cache.kind == "site" and not self.open_gate():
            return misses
        fillable, uncached = self.make_room(misses)
        if uncached:
            warnings.append(
                f"{len(uncached)} files ({sum(t.bytes for t in uncached) / 1e9:.2f} GB) staged without caching: the "
                f"cache quota ({cache.quota.text}) cannot hold them next to what live jobs use and what is pinned")
        if not fillable:
            return uncached
        check_free_space(cache.root, sum(t.bytes for t in fillable))
        placement = _Fill(cache, self.algo, self.keys, self.linker, self.stats)
        block = (options.tuning and options.tuning.block) or DEFAULT_BLOCK
        pending = order_for_streams(fillable, None, block)[0]
        progress = Progress("stage (cache)", total_items=len(pending), total_bytes=sum(t.bytes for t in pending),
                            unit="files", quiet=options.quiet)
        try:
            while pending:
                claimed, rest = self.claim(pending, placement, uncached)
                if claimed:
                    copier = Copier(self.plan, block=block, workers=options.copy_streams, journal=self.journal,
                                    progress=progress, warnings=warnings, tuning=options.tuning, fsync=True,
                                    placement=placement)
                    try:
                        copier.run(claimed)
                    finally:
                        placement.release_all()
                        for key, obj in placement.placed_keys:
                            assert self.hits is not None
                            self.hits.filled(key, obj)
                    fsync_dirs(placement.placed_paths)
                elif rest:
                    self.wait_for(self.keys[rest[0].name])
                pending = rest
        finally:
            placement.release_all()
            progress.close()
            self.close_gate()
        return uncached

    def open_gate(self) -> bool:
        """A site cache's fill: check the manifest as the job's user would read it (its access becomes
        the dataset record's); False (a warning said why) when the user may not, and nothing is filled."""
        self.gate = FillGate(self.cache, fill_reader())
        if not self.gate_manifest(self.gate):
            self.close_gate()
            return False
        return True

    def gate_manifest(self, gate: FillGate) -> bool:
        """Set :attr:`access` from the manifest opened through ``gate``; False (and its warning) when refused."""
        opened = gate.open(manifest_path(self.plan.src), "manifest")
        if opened is None:
            line = gate.summary() or ""
            if line not in self.warnings:
                self.warnings.append(line)
            return False
        os.close(opened[0])
        self.access = (self.cache.object_mode(opened[1].st_mode), opened[1].st_gid)
        return True

    def may_record(self) -> bool:
        """Whether this stage may write the dataset's record: always in a user's cache; in a site cache only
        with the access of a manifest the job's user may read (a record says what a dataset holds, and
        one written for a manifest the fill refused, or never opened because every file was a hit, would
        be world-readable)."""
        if self.cache.kind != "site" or self.access is not None:
            return True
        gate = FillGate(self.cache, fill_reader())
        try:
            return self.gate_manifest(gate)
        finally:
            gate.close()

    def close_gate(self) -> None:
        if self.gate is not None:
            line = self.gate.summary()
            if line is not None and line not in self.warnings:
                self.warnings.append(line)
            self.gate.close()
            self.gate = None

    def claim(self, pending: list[FileTask], placement: _Fill, uncached: list[FileTask]
              ) -> tuple[list[FileTask], list[FileTask]]:
        """One round: claim up to :data:`CLAIM_BATCH` unclaimed objects (link those another stage filled
        meanwhile); return ``(claimed, still pending)``. A site cache's fill claims a source only once
        its gate opened it (the claimed task then reads that descriptor); refused ones join ``uncached``."""
        claimed: list[FileTask] = []
        rest: list[FileTask] = []
        for t in pending:
            if len(claimed) >= CLAIM_BATCH:
                rest.append(t)
                continue
            key = self.keys[t.name]
            lock = FillLock(self.cache.locks_dir, key)
            if not lock.try_acquire():
                rest.append(t)  # another stage is copying it: link it once it is there
                continue
            obj = self.cache.find(self.algo, key, t.bytes)
            if obj is not None:
                lock.release()
                assert self.hits is not None
                self.hits.filled(key, obj)  # filled (and hashed) by the stage whose lock we waited for
                self.stats.verified[t.name] = "copied (by another stage on this node)"
                self.link(t, obj)
                self.stats.files_from_peer += 1
                self.stats.bytes_from_peer += t.bytes
                continue
            if self.gate is not None:
                opened = self.gate.open(t.src_path)
                if opened is None:
                    lock.release()
                    uncached.append(t)
                    continue
                placement.sources[t.name] = (opened[0], opened[1].st_gid)
                t = replace(t, src_path=via_fd(opened[0]))
            self.cache.remove_partials(self.algo, key)  # a dead filler's
            self.cache.partial_for(self.algo, key)  # makes its directories
            placement.locks[t.name] = lock
            claimed.append(t)
        return claimed, rest

    def wait_for(self, key: str) -> None:
        """Wait until whoever fills ``key`` is done (or died: the kernel then drops its lock)."""
        t = time.perf_counter()
        lock = FillLock(self.cache.locks_dir, key)
        timeout = self.options.timeout
        if not lock.acquire(timeout):
            raise StagerTimeoutError(f"{self.cache.root}: another stage on this node is still copying {key[:16]}... "
                                     f"into the cache after {timeout:g}s; wait longer (--timeout) or rerun")
        lock.release()
        self.stats.waited_s += time.perf_counter() - t

    def make_room(self, misses: list[FileTask]) -> tuple[list[FileTask], list[FileTask]]:
        """Evict (LRU) to fit ``misses`` under the quota; ``(what fits, the rest)``, largest first.

        Under the cache's room lock: what concurrent fillers have reserved and not yet added counts as used,
        and what fits is reserved in this stage's lease before the lock is let go, so two stages that fill
        at the same time never overshoot the quota between them."""
        cache, stats = self.cache, self.stats
        assert cache.quota_bytes is not None
        room_lock = FillLock(cache.locks_dir, ROOM_LOCK)
        if not room_lock.acquire(self.options.timeout):
            raise StagerTimeoutError(f"{cache.locks_dir / ROOM_LOCK}: another stage still measures the cache's room "
                                     f"after {self.options.timeout:g}s; wait longer (--timeout) or rerun")
        try:
            need = sum(t.bytes for t in misses)
            objects = list(cache.scan())
            used = sum(o.bytes for o in objects)
            reserved = reserved_bytes(cache, read_leases(cache), {o.key for o in objects},
                                      mine=self.lease.path if self.lease is not None else None)
            if used + reserved + need > cache.quota_bytes:
                rep = collect(cache, need_bytes=need + reserved, timeout=self.options.timeout)
                stats.evicted_files += len(rep.evicted)
                stats.evicted_bytes += rep.freed_bytes
                stats.eviction = {"why": rep.why, "freed_bytes": rep.freed_bytes, "evicted": len(rep.evicted),
                                  "in_use_bytes": rep.in_use.bytes, "linked_bytes": rep.linked.bytes,
                                  "pinned_bytes": rep.pinned.bytes, "reserved_bytes": reserved,
                                  "junk_leases": rep.junk_leases}
                if rep.junk:
                    self.warnings.append(rep.junk)
                used = rep.after_bytes
            room = cache.quota_bytes - used - reserved
            fits, rest = [], []
            for t in sorted(misses, key=lambda t: -t.bytes):
                if t.bytes <= room:
                    fits.append(t)
                    room -= t.bytes
                else:
                    rest.append(t)
            if self.lease is not None:
                self.lease.reserve({self.keys[t.name]: t.bytes for t in fits})
        finally:
            room_lock.release()
        return fits, rest

    def note(self, tasks: list[FileTask]) -> None:
        if not self.cache.writable or not self.may_record():
            return
        m = self.plan.manifest
        files = [(t.name, m.hash_algo, self.keys[t.name], t.bytes) for t in tasks]
        seals = {k: s.to_json() for k, s in self.hits.new.items()} if self.hits is not None else None
        self.cache.note_stage(digest=m.digest or m.compute_digest(), dataset_id=m.dataset_id,
                              source=redact(self.plan.src),
                              algo=m.hash_algo, files=files, hit_bytes=self.stats.bytes_hit,
                              filled_bytes=self.stats.bytes_filled + self.stats.bytes_from_peer, access=self.access,
                              seals=seals)

    def finish(self, uncached: list[FileTask]) -> dict[str, Any]:
        """The stats as ``result.cache``."""
        stats = self.stats
        stats.links = self.linker.mode if self.linker is not None else ""
        stats.files_uncached += len(uncached)
        stats.bytes_uncached += sum(t.bytes for t in uncached)
        stats.waited_s = round(stats.waited_s, 3)
        if self.hits is not None:
            stats.files_rehashed, stats.files_damaged = self.hits.rehashed, len(self.hits.damaged)
            line = self.hits.summary()
            if line is not None:
                self.warnings.append(line)
        return stats.to_json()


def place(plan: StagePlan, options: StageOptions, journal: Journal, todo: list[FileTask],
          result: StageResult) -> list[FileTask]:
    """Link what the cache holds into DEST, fill what it lacks and link that; return the tasks left to
    the plain copy (module docstring). The sample index counts as one of the files."""
    cache = open_cache(options)
    result.warnings += cache.warnings
    tasks = list(todo)
    ix = plan.index_task
    if ix is not None and size_or_missing(plan.dest / ix.name) != ix.bytes:
        tasks.append(ix)
    keys = keys_for(plan, tasks)
    linker = _Linker(cache, plan.dest)
    run = _Run(cache, plan, options, result.warnings, keys, linker, journal,
               CacheStats(dir=str(cache.root), kind=cache.kind))
    with Lease(cache, keys.values(), f"stage {plan.src} -> {plan.dest}") as run.lease:
        uncached = run.fill(run.link_hits(tasks))
        fsync_dir(plan.dest)
        if linker.symbolic_keys:
            write_dest_lease(cache, linker.symbolic_keys, plan.dest)
        run.note(tasks)
    result.cache = run.finish(uncached)
    result.files_copied += run.stats.files_filled
    result.bytes_copied += run.stats.bytes_filled
    return [t for t in uncached if t is not ix]


def fill_only(plan: StagePlan, options: StageOptions, result: StageResult) -> None:
    """``--cache-only``: copy into the cache whatever it lacks of the plan (no DEST, no links)."""
    cache = open_cache(options)
    result.warnings += cache.warnings
    if not cache.writable:
        raise DestinationError(f"{cache.root}: --cache-only fills a cache, and this one is owned by uid "
                               f"{cache.owner}: run it as the cache's owner")
    tasks = list(plan.tasks) + ([plan.index_task] if plan.index_task is not None else [])
    keys = keys_for(plan, tasks)
    run = _Run(cache, plan, options, result.warnings, keys, None, None,
               CacheStats(dir=str(cache.root), kind=cache.kind))
    with Lease(cache, keys.values(), f"stage --cache-only {plan.src}") as run.lease:
        uncached = run.fill(run.link_hits(tasks))
        run.note(tasks)
    result.cache = run.finish(uncached)
    result.files_copied, result.bytes_copied = run.stats.files_filled, run.stats.bytes_filled


# ---- collective staging ---------------------------------------------------------------------------
def link_hits(plan: StagePlan, options: StageOptions, journal: Journal, warnings: list[str]
              ) -> tuple[_Run, Lease]:
    """Before a collective exchange: link what the cache holds into DEST and journal it (so the
    exchange counts it as held); return the run and its lease (release it after :func:`adopt`)."""
    cache = open_cache(options)
    warnings += cache.warnings
    tasks = [t for t in plan.tasks if journal.files.get(t.name) != t.bytes]
    if plan.index_task is not None and size_or_missing(plan.dest / plan.index_task.name) != plan.index_task.bytes:
        tasks.append(plan.index_task)
    keys = keys_for(plan, list(plan.tasks) + ([plan.index_task] if plan.index_task else []))
    run = _Run(cache, plan, options, warnings, keys, _Linker(cache, plan.dest), journal,
               CacheStats(dir=str(cache.root), kind=cache.kind))
    lease = Lease(cache, keys.values(), f"stage --collective {plan.src} -> {plan.dest}").acquire()
    run.lease = lease
    try:
        run.link_hits(tasks)
        assert run.linker is not None
        if run.linker.symbolic_keys:
            write_dest_lease(cache, run.linker.symbolic_keys, plan.dest)
    except BaseException:
        lease.release()
        raise
    return run, lease


def adopt(run: _Run) -> dict[str, Any]:
    """After a collective exchange: add DEST's verified files the cache lacks (a hard link on the same
    file system, else a copy hashed again while written); return the stats (``result.cache``)."""
    cache, plan, stats = run.cache, run.plan, run.stats
    tasks = list(plan.tasks) + ([plan.index_task] if plan.index_task is not None else [])
    if cache.writable:
        misses = [t for t in tasks if cache.find(run.algo, run.keys[t.name], t.bytes) is None
                  and size_or_missing(plan.dest / t.name) == t.bytes]
        fits, _rest = run.make_room(misses)
        placed = []
        for t in fits:
            key = run.keys[t.name]
            lock = FillLock(cache.locks_dir, key)
            if not lock.try_acquire():
                continue  # another stage is filling it
            try:
                if cache.find(run.algo, key, t.bytes) is None:
                    cache.remove_partials(run.algo, key)
                    placed.append(_adopt_one(cache, run.algo, key, plan.dest / t.name, t))
                    if run.hits is not None:
                        run.hits.filled(key, placed[-1])  # DEST's verified file (or a re-hashed copy of it)
                    stats.files_filled += 1
                    stats.bytes_filled += t.bytes
            finally:
                lock.release()
        fsync_dirs(placed)
        run.note(tasks)
    return run.finish([])


def _adopt_one(cache: Cache, algo: str, key: str, src: Path, task: FileTask) -> Path:
    tmp = cache.partial_for(algo, key)
    final = cache.object_path(algo, key)
    mode = cache.object_mode(os.lstat(src).st_mode)
    try:
        os.link(src, tmp)  # the verified file itself: no copy
        os.chmod(tmp, mode)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # linked, but not ours to chmod: copy it instead
        # A copy, hashed again while written: DEST's file may have changed since it was verified.
        copy_verified(src, final, Expected(task.name, task.bytes, task.hash, algo), context=f" copying {src}",
                      fix="it changed since it was verified: stage again").publish(mode)
        return final
    os.replace(tmp, final)
    return final
