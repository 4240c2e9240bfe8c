"""Clairvoyant prefetch for datasets larger than a node's local disk (NoPFS-style).

The loader's order is a pure function of (seed, epoch, world size, rank, workers, ...), so the
shards this node's ranks will read next are known in advance. :class:`Prefetcher` keeps, within a
byte ``budget``, the shards with the soonest next use on local disk (Belady's MIN policy, exact
here because the future is known): it fetches the next-needed shards ahead of training and evicts
shards whose next use is furthest away or that are not needed again.

Loader integration needs no loader change: DEST is a packed directory (``manifest.json`` copied
verbatim) in which every shard name is either a verified local file (a *hit*) or a symlink to the
file in SRC (a *miss*: the loader reads through to the shared file system). Fetching replaces the
symlink with the local copy atomically (``<name>.<uuid>.partial`` -> hash check -> rename);
evicting replaces the file with the symlink again. File descriptors the loader already holds stay
valid either way (same bytes). Point the loader at DEST with ``staged=False``.

The schedule is the loader's own: one :class:`stager.loader.ShardedDataset` per rank of this node,
built with the arguments the training script passes to ``make_loader``
(:meth:`~stager.loader.LoaderOptions.from_kwargs`), and its ``read_schedule(epoch)``: the one
:func:`stager.order.reads.read_schedule` the loader's workers also follow, so the reads are
identical by construction. A worker reads a segment (a run of consecutive samples in one shard)
while loading the first of its batches that reaches it, and keeps its most recently read shard
files open for the epoch (:class:`stager.order.reads.HeldFiles`, ``MAX_OPEN_FILES``), reading a
held file whatever DEST holds meanwhile; so only the reads that *open* a file need it local
(:attr:`Read.opens`), and the next use of a shard is its next open.

Shapes: :class:`EpochReads` holds the node's reads of one epoch as parallel arrays of shape
(reads,), rank after rank (index into :attr:`Prefetcher.ranks`), each rank's in schedule order;
:meth:`Prefetcher.next_uses` returns int64 (shards,) global batch numbers (``epoch *
batches_per_epoch + batch``), :data:`NEVER` for none.

Progress: in one process the training loop calls :meth:`Prefetcher.advance` with (epoch, batches
done). Beside training, ``stager stage --follow`` (:mod:`stager.prefetch.follow`) runs the
prefetcher in its own process and learns the progress from files the ranks write with
:class:`ProgressReporter` (``DEST/.stager-progress/rank<r>.json``: position, pid, and the loader's
plan arguments, so the follower plans exactly what the ranks read). Each rank has its own
position. The hit rate counts the payload bytes of reads whose open found the shard local when
the batch began (per rank, from its first known position; reported by :meth:`Prefetcher.stats`).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stager.errors import UsageError
from stager.fs.access import source_access
from stager.fs.atomic import atomic_write, atomic_write_bytes, fsync_dir, partial_path, remove_partials
from stager.fs.safe import private_dir
from stager.manifest import (
    MANIFEST_NAME,
    Manifest,
    bytes_for_copy,
    dataset_root,
    load_manifest,
    manifest_path,
    shard_root,
)
from stager.order.reads import MAX_OPEN_FILES, ReadSchedule
from stager.prefetch.reports import (
    loader_config,
)
from stager.stage.collective.io import IoCounters, ShareReader, StreamSink, copy_share
from stager.stage.collective.plan import StreamLayout, files_of_shards

if TYPE_CHECKING:
    from stager.loader import ShardedDataset
    from stager.loader.shard_access import Resolved

__all__ = ["NEVER", "EpochReads", "PrefetchStats", "Prefetcher", "Read", "own_dest", "prepare_dest", "rank_reads",
           "remove_fetch_partials"]


@dataclass(frozen=True)
class Read:
    """One shard read of this node at (epoch, rank-level batch): ``bytes`` of payload from ``shard``.

    ``worker``: the rank's DataLoader worker stream that reads it. ``opens``: the worker opens (or
    maps) the shard's file here; False when it still holds the file from an earlier read this
    epoch, and then reads whatever file that was (a local copy, or SRC through the symlink) even if
    DEST changed since.
    """

    batch: int
    shard: int
    bytes: int
    worker: int = 0
    opens: bool = True


def rank_reads(ds: ShardedDataset, epoch: int, open_files: int | None = None) -> list[Read]:
    """The shard reads of one rank's epoch as :class:`Read` records, from the loader's own schedule.

    ``ds.read_schedule(epoch)`` (:func:`stager.order.reads.read_schedule`, what the loader's workers
    do); ``opens`` under a set of ``open_files`` held files per worker (default the loader's
    ``MAX_OPEN_FILES``).
    """
    sched = ds.read_schedule(epoch)
    opens = sched.opens(MAX_OPEN_FILES if open_files is None else open_files)
    return [
        Read(b, s, n, w, o)
        for b, s, n, w, o in zip(
            sched.batch.tolist(),
            sched.shard.tolist(),
            sched.nbytes.tolist(),
            sched.worker.tolist(),
            opens.tolist(),
            strict=True,
        )
    ]


@dataclass
class PrefetchStats:
    """``hit_bytes``/``miss_bytes``: payload bytes the node's ranks read from local copies / SRC."""

    fetched_shards: int = 0
    fetched_bytes: int = 0
    evicted_shards: int = 0
    hit_bytes: int = 0
    miss_bytes: int = 0
    hit_reads: int = 0
    miss_reads: int = 0
    peak_local_bytes: int = 0
    budget: int = 0
    per_epoch: dict[int, dict[str, int]] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        total = self.hit_bytes + self.miss_bytes
        return self.hit_bytes / total if total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "hit_rate": round(self.hit_rate, 4),
            "hit_bytes": self.hit_bytes,
            "miss_bytes": self.miss_bytes,
            "hit_reads": self.hit_reads,
            "miss_reads": self.miss_reads,
            "fetched_shards": self.fetched_shards,
            "fetched_bytes": self.fetched_bytes,
            "evicted_shards": self.evicted_shards,
            "peak_local_bytes": self.peak_local_bytes,
            "budget": self.budget,
            "per_epoch": self.per_epoch,
        }


def prepare_dest(src: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Manifest:
    """Make DEST a packed directory of symlinks into SRC (local copies already there are kept).

    A regular file in DEST counts as local only if it has the manifest's size; otherwise it is
    replaced by the symlink (the prefetcher fetches and verifies it again when needed).
    """
    src_s = os.fspath(src)
    if "://" in src_s:
        raise UsageError(f"{src_s}: prefetch needs SRC as a mounted path (the loader reads misses through symlinks)")
    m = load_manifest(src_s)
    root = Path(os.path.abspath(shard_root(src_s, m)))  # an index's shards may live elsewhere
    d = Path(dest)
    own_dest(d)
    mode = source_access(manifest_path(src_s))[0]  # the source's access less the umask, as stage gives
    mbytes = bytes_for_copy(m, Path(manifest_path(src_s)).read_bytes())
    mpath = d / MANIFEST_NAME
    if m.index is not None:  # a local copy of the sample index, before the manifest that names it
        ipath = d / m.index.name
        if not ipath.is_file() or ipath.is_symlink() or ipath.stat().st_size != m.index.bytes:
            with atomic_write(ipath, mode=mode) as out, open(Path(dataset_root(src_s)) / m.index.name, "rb") as inp:
                shutil.copyfileobj(inp, out, 1 << 20)
    if not mpath.exists() or mpath.read_bytes() != mbytes:
        atomic_write_bytes(mpath, mbytes, mode=mode)
    for f in files_of_shards(m, range(len(m.shards))):
        p = d / f.name
        if p.is_symlink() and _links_to(p, root / f.name):
            continue
        if p.is_file() and not p.is_symlink() and p.stat().st_size == f.bytes:
            continue
        _link(root / f.name, p)
    fsync_dir(d)
    return m


def _links_to(p: Path, target: Path) -> bool:
    """``p`` is a symlink to ``target`` (any spelling of it: ranks and the follower may name SRC
    differently; replacing such a link could race with a fetch renaming a local copy into place)."""
    try:
        return os.readlink(p) == str(target) or os.path.samefile(p, target)
    except OSError:
        return False


def _link(target: Path, at: Path) -> None:
    tmp = partial_path(at)
    os.symlink(target, tmp)
    os.replace(tmp, at)


def own_dest(dest: Path) -> None:
    """Create the prefetch DEST exclusively, or accept an existing directory only when it is the
    user's (docs/security.md; :func:`stager.fs.safe.private_dir`): exit 2 otherwise."""
    handle, _ = private_dir(dest.parent, dest.name, 0o755, what="prefetch destination",
                            fix="choose another DEST (if it is yours: chmod go-w it, or remove it)")
    handle.close()


def remove_fetch_partials(dest: str | os.PathLike[str], manifest: Manifest) -> list[str]:
    """Delete the partial copies and links a killed fetcher left in DEST (holder of the lock only)."""
    return remove_partials(dest, {f.name for f in files_of_shards(manifest, range(len(manifest.shards)))})


class _StoppedError(Exception):
    """The prefetcher was asked to stop in the middle of a fetch (the partial file is removed)."""


class _StoppableReader(ShareReader):
    """A :class:`ShareReader` that gives up between chunks once ``stop`` is set."""

    def __init__(self, *args: Any, stop: threading.Event, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stop_event = stop

    def fill(self, view: memoryview) -> int:
        if self._stop_event.is_set():
            raise _StoppedError
        return super().fill(view)


@dataclass(frozen=True)
class EpochReads:
    """The node's shard reads of one epoch as parallel arrays of shape (reads,).

    ``rank``: index into :attr:`Prefetcher.ranks`; ``batch``: the rank's batch whose loading
    makes the read; ``shard``; ``nbytes``: payload bytes read; ``opens`` (bool): the worker opens
    the shard's file at this read; ``opener``: index of the read whose open this read uses (itself
    when it opens). ``open_hit``/``open_known`` (bool, mutable): whether that open found a local
    copy, once accounted.
    """

    rank: np.ndarray
    batch: np.ndarray
    shard: np.ndarray
    nbytes: np.ndarray
    opens: np.ndarray
    opener: np.ndarray
    open_hit: np.ndarray
    open_known: np.ndarray
    rank_start: np.ndarray  # reads of rank i are [rank_start[i], rank_start[i + 1])

    @classmethod
    def of(cls, schedules: Sequence[ReadSchedule], open_files: int = MAX_OPEN_FILES) -> EpochReads:
        """The node's reads from each rank's :class:`~stager.order.reads.ReadSchedule` (rank order)."""
        counts = [len(s.shard) for s in schedules]
        rank = np.repeat(np.arange(len(schedules), dtype=np.int64), counts)
        worker = _cat([s.worker for s in schedules], np.int64)
        shard = _cat([s.shard for s in schedules], np.int64)
        opens = _cat([s.opens(open_files) for s in schedules], bool)
        return cls(
            rank=rank,
            batch=_cat([s.batch for s in schedules], np.int64),
            shard=shard,
            nbytes=_cat([s.nbytes for s in schedules], np.int64),
            opens=opens,
            opener=_openers(rank, worker, shard, opens),
            open_hit=np.zeros(len(shard), dtype=bool),
            open_known=np.zeros(len(shard), dtype=bool),
            rank_start=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        )


def _cat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)


def _openers(rank: np.ndarray, worker: np.ndarray, shard: np.ndarray, opens: np.ndarray) -> np.ndarray:
    """Per read, the index of the read whose open it uses: the last open of the same (rank, worker,
    shard) at or before it (a worker's first read of a shard in an epoch always opens)."""
    n = len(shard)
    order = np.lexsort((np.arange(n), shard, worker, rank))
    sorted_keys = np.stack([rank[order], worker[order], shard[order]])
    first_of_key = np.ones(n, dtype=bool)
    first_of_key[1:] = (sorted_keys[:, 1:] != sorted_keys[:, :-1]).any(axis=0)
    marks = np.where(opens[order] | first_of_key, np.arange(n), 0)
    opener = np.empty(n, dtype=np.int64)
    opener[order] = order[np.maximum.accumulate(marks)] if n else order
    return opener


NEVER = np.iinfo(np.int64).max


class Prefetcher:
    """Keeps the shards this node needs soonest on local disk, within ``budget`` bytes.

    ``loader_kwargs``: what the training script passes to ``make_loader`` besides path and rank
    (batch_size, world_size, num_workers, seed, shuffle, drop_last, run_bytes, ...), or a rank's
    :func:`~stager.prefetch.loader_config` (which adds ``deal_batches`` after Accelerate's ``prepare()``). ``ranks``:
    the global ranks running on this node. Use as a context manager (starts/stops the thread), call
    :meth:`advance` after every batch, read :meth:`stats` at the end.

    Each rank has its own position (epoch, batches done): a shard's next use is the earliest read
    of any rank at or after that rank's position, within ``lookahead_epochs`` epochs past it.
    Hits and misses are counted per rank from its first known position (``baseline=True``: from
    (0, 0) at construction, as for a training loop in this process; ``False``: from the ``start``
    given with the rank's first :meth:`advance`, else that call's position, as for a follower that
    may start after training did).
    """

    def __init__(
        self,
        src: str | os.PathLike[str],
        dest: str | os.PathLike[str],
        *,
        budget: int,
        ranks: Sequence[int],
        loader_kwargs: dict[str, Any],
        lookahead_epochs: int = 1,
        poll: float = 0.02,
        chunk_bytes: int = 8 << 20,
        baseline: bool = True,
    ) -> None:
        if budget <= 0:
            raise UsageError(f"prefetch budget must be > 0 bytes, got {budget}")
        self.dest = Path(dest)
        self.budget = budget
        self.ranks = list(ranks)
        self.manifest = prepare_dest(src, dest)
        self.src = Path(os.path.abspath(shard_root(os.fspath(src), self.manifest)))
        self._access = source_access(manifest_path(os.fspath(src)))  # what stage gives its copies
        self.loader_kwargs = dict(loader_kwargs)
        self._datasets = self._make_datasets(self.ranks, self.loader_kwargs)
        self.batches_per_epoch = len(self._datasets[0])
        self.lookahead_epochs = lookahead_epochs
        self.poll = poll
        self.chunk_bytes = chunk_bytes
        m = self.manifest
        self._size = m.shard_bytes
        self._local = np.array([self._is_local(i) for i in range(len(m.shards))], dtype=bool)
        self._stats = PrefetchStats(budget=budget)
        self._reads: dict[int, EpochReads] = {}
        # Per rank (index into self.ranks): position (epoch, batches done) that the schedule starts
        # from, whether hits are counted from it yet, and which shards were local when the batch at
        # that position began loading (its opens are judged by it).
        self._positions = [(0, 0)] * len(self.ranks)
        self._counted = [baseline] * len(self.ranks)
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stats.peak_local_bytes = int(self._size[self._local].sum())
        self._plan_lock = threading.Lock()
        self._local_at_load = [self._local.copy() for _ in self.ranks]

    # ---- schedule -------------------------------------------------------------------------------
    def _make_datasets(
        self, ranks: Sequence[int], loader_kwargs: dict[str, Any], resolved: Resolved | None = None
    ) -> list[ShardedDataset]:
        """One dataset per rank, reading DEST as the ranks do (``staged=False``), over one shared index."""
        from stager.loader import LoaderOptions, ShardedDataset  # noqa: PLC0415 (the loader imports torch)

        if not ranks:
            raise UsageError("prefetch needs at least one rank of this node to plan for")
        kwargs = dict(loader_kwargs)
        dealt = bool(kwargs.pop("deal_batches", False))  # loader_config's: set by prepare(), not a loader argument
        out: list[ShardedDataset] = []
        for r in ranks:
            # One index for all ranks of the node (it is the manifest's columns: large for big datasets).
            opts = LoaderOptions.from_kwargs(kwargs, rank=r, staged=False)
            ds = ShardedDataset(str(self.dest), opts, resolved=resolved or (out[0].resolved if out else None))
            if dealt and not ds.deal_batches_in_turn():
                raise UsageError("deal_batches needs shuffle='none' over the whole world (as prepare() deals "
                                 f"batches only then); got shuffle={ds.mode!r}")
            out.append(ds)
        return out

    def config(self) -> dict[str, Any]:
        """The plan arguments this prefetcher schedules for (:func:`loader_config` of its datasets)."""
        return loader_config(self._datasets[0])

    def config_for(self, loader_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The plan arguments ``loader_kwargs`` come to on DEST ("auto" settings resolved as the loader does)."""
        return loader_config(self._make_datasets(self.ranks[:1], loader_kwargs, self._datasets[0].resolved)[0])

    def replan(self, ranks: Sequence[int], loader_kwargs: dict[str, Any]) -> None:
        """Schedule for other ranks or loader arguments from now on (stops and restarts the thread).

        Ranks kept keep their positions and counts; a new rank is scheduled from the slowest known
        position and counted from its first :meth:`advance`. Local copies stay; the next pass of
        the thread evicts what the new schedule does not want.
        """
        datasets = self._make_datasets(ranks, loader_kwargs)  # may raise: keep the old plan then
        running = self._thread is not None and self._thread.is_alive()
        if running:
            self._halt()
        with self._cv, self._plan_lock:  # the order advance() and ready() take them in
            old = {r: i for i, r in enumerate(self.ranks)}
            slowest = min(self._positions) if self._positions else (0, 0)
            self._positions = [self._positions[old[r]] if r in old else slowest for r in ranks]
            self._counted = [self._counted[old[r]] if r in old else False for r in ranks]
            self._local_at_load = [self._local_at_load[old[r]] if r in old else self._local.copy() for r in ranks]
            self.ranks = list(ranks)
            self.loader_kwargs = dict(loader_kwargs)
            self._datasets = datasets
            self.batches_per_epoch = len(datasets[0])
            self._reads.clear()
        if running:
            self.start()

    def _epoch_reads(self, epoch: int) -> EpochReads:
        with self._plan_lock:
            got = self._reads.get(epoch)
            if got is None:
                got = EpochReads.of([ds.read_schedule(epoch) for ds in self._datasets])
                self._reads[epoch] = got
                lo = min(e for e, _ in self._positions) if self._positions else epoch
                for old in [e for e in self._reads if e < lo]:
                    del self._reads[old]
            return got

    def next_uses(self, positions: Sequence[tuple[int, int]] | None = None) -> np.ndarray:
        """Per shard, the global batch (epoch * batches + batch) of its next open, or ``NEVER``.

        ``positions``: per rank (epoch, batches done); default: the ranks' current positions.
        """
        pos = list(self._positions) if positions is None else list(positions)
        bpe = self.batches_per_epoch
        nxt = np.full(len(self.manifest.shards), NEVER, dtype=np.int64)
        start = np.array([e * bpe + d for e, d in pos], dtype=np.int64)
        stop = np.array([(e + 1 + self.lookahead_epochs) * bpe for e, _ in pos], dtype=np.int64)
        for e in range(min(e for e, _ in pos), max(e for e, _ in pos) + 1 + self.lookahead_epochs):
            er = self._epoch_reads(e)
            t = e * bpe + er.batch
            # Only opens need the local file: a read through a file the worker holds gets that file.
            ok = er.opens & (t >= start[er.rank]) & (t < stop[er.rank])
            np.minimum.at(nxt, er.shard[ok], t[ok])
        return nxt

    def wanted(self, positions: Sequence[tuple[int, int]] | None = None) -> np.ndarray:
        """Shards to hold now: soonest next use first, as many as fit the budget (Belady's MIN)."""
        return self._wanted(self.next_uses(positions))

    def _wanted(self, nxt: np.ndarray) -> np.ndarray:
        order = np.argsort(nxt, kind="stable")
        keep = np.zeros(len(nxt), dtype=bool)
        used = 0
        for i in order.tolist():
            if nxt[i] == NEVER:
                break
            if used + int(self._size[i]) > self.budget:
                break  # strictly by next use: nothing later may jump the queue
            keep[i] = True
            used += int(self._size[i])
        return keep

    # ---- files ----------------------------------------------------------------------------------
    def _is_local(self, shard: int) -> bool:
        p = self.dest / self.manifest.shards[shard].name
        return p.is_file() and not p.is_symlink()

    def _fetch(self, shard: int) -> None:
        """Copy one shard (and its companion files) from SRC, hashing while copying, then rename.

        Raises :class:`_StoppedError` between chunks once :meth:`close` was called; ``copy_share``
        then deletes the ``.partial`` file, so nothing half-written stays in DEST.
        """
        files = tuple(files_of_shards(self.manifest, [shard]))
        lay = StreamLayout(0, files)
        c = IoCounters()
        have: set[str] = set()
        copy_share(_StoppableReader(str(self.src), self.dest, lay, counters=c, stop=self._stop),
                   StreamSink(self.dest, lay, algo=self.manifest.hash_algo, counters=c, have=have, access=self._access),
                   self.chunk_bytes)
        with self._cv:
            self._local[shard] = True
            self._stats.fetched_shards += 1
            self._stats.fetched_bytes += c.src_bytes
            self._stats.peak_local_bytes = max(self._stats.peak_local_bytes, int(self._size[self._local].sum()))

    def _evict(self, shard: int) -> None:
        with self._cv:
            self._local[shard] = False
            self._stats.evicted_shards += 1
        for f in files_of_shards(self.manifest, [shard]):
            _link(self.src / f.name, self.dest / f.name)

    # ---- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cv:
                    pos = list(self._positions)
                nxt = self.next_uses(pos)
                keep = self._wanted(nxt)
                for i in np.flatnonzero(self._local & ~keep).tolist():
                    self._evict(i)
                todo = [i for i in np.argsort(nxt, kind="stable").tolist() if keep[i] and not self._local[i]]
                if todo:
                    self._fetch(todo[0])  # one at a time, then re-plan: progress may have moved
                    continue
                with self._cv:
                    if self._positions == pos and not self._stop.is_set():
                        self._cv.wait(self.poll)
        except _StoppedError:
            pass
        except BaseException as exc:
            self._error = exc

    def start(self) -> Prefetcher:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="stager-prefetch", daemon=True)
        self._thread.start()
        return self

    def _halt(self) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop the thread; a fetch in progress is abandoned between chunks and its partial file deleted."""
        self._halt()
        if self._error is not None:
            raise self._error

    @property
    def error(self) -> BaseException | None:
        """What stopped the thread, if it failed (a fetch that could not be verified, a full disk)."""
        return self._error

    def __enter__(self) -> Prefetcher:
        return self.start()

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        self.close()

    # ---- progress and accounting ----------------------------------------------------------------
    def advance(
        self, epoch: int, batches_done: int, rank: int | None = None, *, start: tuple[int, int] | None = None
    ) -> None:
        """``rank`` (default: every rank of the node) finished ``batches_done`` batches of ``epoch``.

        Call after each batch. Counts the reads of the batches just finished as hits or misses by
        the local state at the rank's previous call (when they began; conservative for a shard
        fetched mid-batch), then lets the thread re-plan. Positions never move backwards.

        ``start``: where the rank began reading in this run (its report's ``start``). At a rank's
        first call (``baseline=False``), the reads from ``start`` up to this position were made
        before this prefetcher saw the rank; they are counted by DEST's state when it began
        planning for the rank (nothing was fetched for the rank before), so every read of the run
        is accounted however late the follower started.
        """
        new = self._normalized(epoch, batches_done)
        with self._cv:
            idx = range(len(self.ranks)) if rank is None else [self.ranks.index(rank)]
            moved = False
            for i in idx:
                if not self._counted[i]:
                    self._counted[i] = True
                    if start is not None and self._normalized(*start) < new:
                        self._account(i, self._normalized(*start), new)
                elif new <= self._positions[i]:
                    continue
                else:
                    self._account(i, self._positions[i], new)
                self._positions[i] = new
                self._local_at_load[i] = self._local.copy()
                moved = True
            if moved:
                self._cv.notify_all()

    def _normalized(self, epoch: int, batches_done: int) -> tuple[int, int]:
        """The end of an epoch is the start of the next: ``(e, batches)`` -> ``(e + 1, 0)``."""
        if batches_done >= self.batches_per_epoch:
            return epoch + 1, 0
        return epoch, batches_done

    def refresh(self, rank: int) -> None:
        """``rank`` has not begun loading the batch at its position yet: judge that batch by DEST now."""
        with self._cv:
            i = self.ranks.index(rank)
            if self._counted[i]:
                self._local_at_load[i] = self._local.copy()

    def _account(self, i: int, frm: tuple[int, int], to: tuple[int, int]) -> None:
        local_at_load = self._local_at_load[i]
        st = self._stats
        for e in range(frm[0], to[0] + 1):
            lo = frm[1] if e == frm[0] else 0
            hi = to[1] if e == to[0] else self.batches_per_epoch
            if lo >= hi:
                continue
            er = self._epoch_reads(e)
            a, z = int(er.rank_start[i]), int(er.rank_start[i + 1])
            k = a + np.flatnonzero((er.batch[a:z] >= lo) & (er.batch[a:z] < hi))
            # An open finds what DEST held when its batch began; a later read of the same held
            # file gets that file (an open the follower did not see: judged like an open now).
            ko = k[er.opens[k] | ~er.open_known[er.opener[k]]]
            ko = np.union1d(ko, er.opener[ko])
            er.open_hit[ko] = local_at_load[er.shard[ko]]
            er.open_known[ko] = True
            hit = er.open_hit[er.opener[k]]
            nb = er.nbytes[k]
            hb, mb = int(nb[hit].sum()), int(nb[~hit].sum())
            st.hit_bytes += hb
            st.miss_bytes += mb
            st.hit_reads += int(hit.sum())
            st.miss_reads += int((~hit).sum())
            pe = st.per_epoch.setdefault(e, {"hit_bytes": 0, "miss_bytes": 0})
            pe["hit_bytes"] += hb
            pe["miss_bytes"] += mb

    def ready(self, epoch: int, batch: int) -> bool:
        """True when every shard that batch ``batch`` of ``epoch`` opens on this node is local.

        For a rank about to run that batch (its position is ``(epoch, batch)``), hits are judged
        from now on: the caller waited for it, so its reads come after this.
        """
        er = self._epoch_reads(epoch)
        with self._cv:
            ok = bool(self._local[er.shard[(er.batch == batch) & er.opens]].all())
            if ok:
                for i, p in enumerate(self._positions):
                    if p == (epoch, batch):
                        self._local_at_load[i] = self._local.copy()
            return ok

    def wait_ready(self, epoch: int, batch: int, timeout: float) -> bool:
        """Block until :meth:`ready` (or ``timeout`` seconds); a training loop's compute time stand-in."""
        deadline = time.monotonic() + timeout
        while not self.ready(epoch, batch):
            if self._error is not None:
                raise self._error
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.poll)
        return True

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, batches done) of the slowest rank of the node."""
        with self._cv:
            return min(self._positions)

    def local_bytes(self) -> int:
        with self._cv:
            return int(self._size[self._local].sum())

    def stats(self) -> PrefetchStats:
        return self._stats
