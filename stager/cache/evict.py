"""Eviction that never hurts: least recently used first, never what a live job uses, always explained.

:func:`collect` brings a cache down to a target (its quota, ``stager cache gc --max-bytes N``, or the
room a stage needs for new files). An object is a candidate only if

* no live lease keeps it (:mod:`stager.cache.lease`: a running stage or loader, a destination that
  still holds symbolic links to it; a lease of another user's keeps only what they could read, and
  for a bounded time: :func:`~stager.cache.lease.protected_keys`),
* in a user's cache, its link count is 1 (a hard link in a destination that still exists is a job's
  copy: evicting the cache's name would free nothing). A site cache links only symbolically, so a
  hard link to one of its objects is someone else's doing and keeps nothing,
* no pinned dataset (``stager cache pin``) needs it.

Candidates go oldest use first (an object's access time is its last use: stages, loaders and the
leases they leave set it; its modification time stays when its bytes were written,
:mod:`stager.cache.seal`). The cache holds copies only: eviction removes files under ``objects/``
that the cache itself wrote, never a source, never a destination's file.

**No race with a new user of an object.** A user takes its lease *before* it checks that an object is
there, and eviction moves each victim aside (renamed to a partial name, so nobody finds it) *before*
it reads the leases a second time, then puts back those a new lease names and deletes the rest. So
an object is deleted only if every lease that names it was published after it had already vanished
from its name, and such a user sees it missing and copies it again.

Every run takes ``locks/.gc`` (one eviction at a time), folds the leases' use times into the LRU
clock, removes dead leases and the partial files of dead fillers, and reports every eviction (key,
bytes, last use, the datasets it belonged to, why) in its result and in ``log.jsonl``. What users
put into ``leases/`` never makes it fail: entries that are not leases are skipped, counted and
reported in one line (``junk``), and removed when they are files.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stager.cache.layout import GC_LOCK, LEASES
from stager.cache.lease import LeaseInfo, junk_line, protected_keys, read_leases
from stager.cache.locks import FillLock, lock_held
from stager.cache.store import Cache, ObjectInfo, now_iso, record_files
from stager.errors import StagerTimeoutError, UnsafePathError
from stager.fs.atomic import partial_base, partial_path

BATCH = 64  # victims moved aside before the leases are read again
PRUNE_AT = 256  # dead leases are cleared by a fill once leases/ holds more entries than this


@dataclass
class Eviction:
    key: str
    algo: str
    bytes: int
    last_used: str
    datasets: list[str]
    reason: str


@dataclass
class Kept:
    objects: int = 0
    bytes: int = 0

    def add(self, o: ObjectInfo) -> None:
        self.objects += 1
        self.bytes += o.bytes


@dataclass
class GcReport:
    """What :func:`collect` did (printed by ``stager cache gc --json``)."""

    dir: str
    target_bytes: int
    why: str
    before_bytes: int = 0
    after_bytes: int = 0
    freed_bytes: int = 0
    evicted: list[Eviction] = field(default_factory=list)
    in_use: Kept = field(default_factory=Kept)
    linked: Kept = field(default_factory=Kept)
    pinned: Kept = field(default_factory=Kept)
    shortfall_bytes: int = 0
    live_leases: int = 0
    dead_leases_removed: int = 0
    junk_leases: int = 0
    junk: str | None = None  # one line about them
    partials_removed: int = 0
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = True
        return d

    def summary(self) -> str:
        head = (f"{self.dir}: {'would evict' if self.dry_run else 'evicted'} {len(self.evicted)} objects, "
                f"{self.freed_bytes / 1e9:.3f} GB freed ({self.before_bytes / 1e9:.3f} -> {self.after_bytes / 1e9:.3f} "
                f"GB, target {self.target_bytes / 1e9:.3f} GB: {self.why})")
        lines = [head]
        for e in self.evicted[:20]:
            lines.append(f"  {e.algo}/{e.key[:24]}  {e.bytes / 1e6:9.1f} MB  last used {e.last_used}  "
                         f"[{', '.join(e.datasets) or 'no dataset'}]")
        if len(self.evicted) > 20:
            lines.append(f"  ... and {len(self.evicted) - 20} more")
        kept = [f"{k.objects} in use by live jobs ({k.bytes / 1e9:.3f} GB)" if n == "in_use" else
                f"{k.objects} {n} ({k.bytes / 1e9:.3f} GB)"
                for n, k in (("in_use", self.in_use), ("hard-linked into destinations", self.linked),
                             ("pinned", self.pinned)) if k.objects]
        if kept:
            lines.append("  kept: " + "; ".join(kept))
        if self.shortfall_bytes:
            lines.append(f"  still {self.shortfall_bytes / 1e9:.3f} GB over the target: everything else is in use "
                         "or pinned")
        if self.junk:
            lines.append(f"  {self.junk}")
        return "\n".join(lines)


def collect(cache: Cache, *, target_bytes: int | None = None, need_bytes: int = 0, why: str = "",
            dry_run: bool = False, timeout: float | None = None) -> GcReport:
    """Evict least recently used objects until the cache holds at most ``target_bytes`` (default: its
    quota) minus ``need_bytes`` (room for files about to be added). See the module docstring."""
    assert cache.writable, "only the cache's owner evicts"
    quota = cache.quota_bytes
    if quota is None:
        quota = cache.quota.resolve(cache.disk_bytes, str(cache.root))
    target = max(0, (quota if target_bytes is None else target_bytes) - need_bytes)
    if not why:
        why = (f"room for {need_bytes / 1e9:.3f} GB of new files under the quota {cache.quota.text}" if need_bytes
               else f"quota {cache.quota.text}" if target_bytes is None else f"--max-bytes {target_bytes}")
    report = GcReport(dir=str(cache.root), target_bytes=target, why=why, dry_run=dry_run)
    gc_lock = FillLock(cache.locks_dir, GC_LOCK)
    if not gc_lock.acquire(timeout):
        raise StagerTimeoutError(f"{cache.locks_dir / GC_LOCK}: another eviction still runs after {timeout:g}s; "
                                 "wait for it or rerun")
    try:
        _run(cache, report, target, dry_run)
    finally:
        gc_lock.release()
    return report


def _run(cache: Cache, report: GcReport, target: int, dry_run: bool) -> None:
    now = time.time()
    leases = read_leases(cache, now)
    report.junk_leases = sum(le.count for le in leases if le.junk)
    report.junk = junk_line(leases, cache.leases_dir)
    if not dry_run:
        _fold_use_times(cache, leases)
        report.dead_leases_removed = _remove_dead(cache, leases)
        report.partials_removed = _remove_dead_partials(cache)
    objects = list(cache.scan())
    total = sum(o.bytes for o in objects)
    report.before_bytes = total
    report.live_leases = sum(1 for le in leases if le.live)
    leased = protected_keys(cache, leases, {o.key: o for o in objects})
    pinned = _pinned_keys(cache)
    hard_links_count = cache.kind == "user"
    candidates = []
    for o in objects:
        if o.key in leased:
            report.in_use.add(o)
        elif o.nlink > 1 and hard_links_count:
            report.linked.add(o)
        elif o.key in pinned:
            report.pinned.add(o)
        else:
            candidates.append(o)
    candidates.sort(key=lambda o: (o.used, o.key))
    datasets = _datasets_of(cache)
    batch: list[tuple[ObjectInfo, Path]] = []
    for o in candidates:
        if total <= target:
            break
        reason = (f"least recently used (last used {now_iso(o.used)}): the cache held {total / 1e9:.3f} GB, over its "
                  f"target {target / 1e9:.3f} GB ({report.why})")
        ev = Eviction(o.key, o.algo, o.bytes, now_iso(o.used), datasets.get(o.key, []), reason)
        if dry_run:
            report.evicted.append(ev)
            total -= o.bytes
            continue
        aside = _move_aside(o)
        if aside is None:
            continue  # gone meanwhile
        batch.append((o, aside))
        report.evicted.append(ev)
        total -= o.bytes
        if len(batch) >= BATCH:
            total += _settle(cache, batch, report)
            batch = []
    if batch:
        total += _settle(cache, batch, report)
    report.after_bytes = total
    report.freed_bytes = report.before_bytes - total
    report.shortfall_bytes = max(0, total - target)
    if not dry_run:
        cache.log([{"time": now_iso(), "event": "evict", **asdict(e)} for e in report.evicted])


def _move_aside(o: ObjectInfo) -> Path | None:
    aside = partial_path(o.path)
    try:
        os.rename(o.path, aside)
    except FileNotFoundError:
        return None
    return aside


def _settle(cache: Cache, batch: list[tuple[ObjectInfo, Path]], report: GcReport) -> int:
    """Read the leases again: put back the victims a new lease names, delete the rest; return the bytes
    put back (the module docstring's race)."""
    leased = protected_keys(cache, read_leases(cache), {o.key: o for o, _ in batch})
    restored = 0
    for o, aside in batch:
        if o.key in leased:
            with contextlib.suppress(FileNotFoundError):
                if os.path.lexists(o.path):
                    os.unlink(aside)  # filled again meanwhile
                else:
                    os.rename(aside, o.path)
            restored += o.bytes
            report.evicted = [e for e in report.evicted if e.key != o.key]
            report.in_use.add(o)
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)
        lock = FillLock(cache.locks_dir, o.key)
        with contextlib.suppress(OSError, UnsafePathError):  # a lock file that is not one stays, reported by verify
            if lock.try_acquire():
                lock.release(remove=True)
    return restored


def prune_leases(cache: Cache, threshold: int = PRUNE_AT) -> int:
    """Fold the use times of dead leases into the LRU clock and remove them, once ``leases/`` holds more
    than ``threshold`` entries (destination leases of finished jobs pile up in a cache that never
    reaches its quota); return how many were removed. The owner's fills call it."""
    try:
        if len(os.listdir(cache.root / LEASES)) <= threshold:
            return 0
    except OSError:
        return 0
    leases = read_leases(cache)
    _fold_use_times(cache, [le for le in leases if not le.live])
    return _remove_dead(cache, leases)


def _fold_use_times(cache: Cache, leases: list[LeaseInfo]) -> None:
    """A lease's time (never later than its file's ``ctime``) is a use of the objects its writer could
    read (readers of a site cache cannot set an object's time themselves)."""
    objects = {o.key: o for o in cache.scan()}
    latest: dict[str, float] = {}
    for le in leases:
        if le.junk or not le.keys:
            continue
        for k in protected_keys(cache, [_as_live(le)], objects):
            latest[k] = max(latest.get(k, 0.0), le.time)
    for k, t in latest.items():
        o = objects[k]
        if t > o.used:
            cache.touch([o.path], min(t, time.time()))


def _as_live(le: LeaseInfo) -> LeaseInfo:
    """``le`` judged live (a dead lease's time still counts as a use)."""
    return LeaseInfo(le.name, le.kind, True, le.why, le.keys, le.time, le.uid)


def _remove_dead(cache: Cache, leases: list[LeaseInfo]) -> int:
    """Remove dead leases and junk files (never a directory: that is left to its owner); return how many
    went. What cannot be removed (another user's, in the sticky ``leases/``) stays, judged again next time."""
    n = 0
    d = cache.root / LEASES
    for le in leases:
        if le.live or not le.removable:
            continue
        if le.kind == "partial" and lock_held(d / le.name):
            continue
        with contextlib.suppress(OSError, ValueError):
            os.unlink(d / le.name)
            n += 1
    return n


def _remove_dead_partials(cache: Cache) -> int:
    """Partial files under ``objects/`` whose filler is gone (its fill lock not held), and objects a
    killed eviction had moved aside."""
    n = 0
    for p in cache.partial_files():
        key = partial_base(p.name) or ""
        if lock_held(cache.locks_dir / key):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
            n += 1
    return n


def _pinned_keys(cache: Cache) -> set[str]:
    out: set[str] = set()
    for rec in cache.records():
        if rec.get("pinned") is True:
            out.update(f[2] for f in record_files(rec))
    return out


def _datasets_of(cache: Cache) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for rec in cache.records():
        for f in record_files(rec):
            out.setdefault(f[2], []).append(str(rec.get("dataset_id", "?")))
    return out
