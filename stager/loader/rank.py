"""``RankDataset``: one rank's batches of an epoch, planned, read, decoded and assembled without torch.

Worker stream ``k`` of ``W`` produces the rank's batches ``k, k + W, ...`` (a transport that takes
them from its workers in turn then hands out batches ``0, 1, 2, ...``): its
:class:`~stager.order.epoch.WorkerPlan` says which samples in which order, its
:class:`~stager.order.reads.WorkerReads` which shard segments it reads while loading which batch
(one read each, front to back), and a :mod:`stager.loader.fetch` fetcher makes those reads and
hands out the payloads the shuffle buffer emits.

Two transports drive it: torch's DataLoader (:class:`~stager.loader.sharded.ShardedDataset`, the
subclass that is a torch ``IterableDataset``; :class:`~stager.loader.Loader`) and plain
multiprocessing (:class:`~stager.loader.numpy_loader.NumpyLoader`, for TensorFlow, Keras and JAX).
This module imports no torch.

Construction, in phases: resolve the path (a staged copy? :func:`~stager.loader.shard_access.resolve`),
the topology (:class:`~stager.world.World`), the run layout (:func:`run_size`), the ranks this rank
plans with (:class:`PlanGroup`: everyone, or the node's ranks on a node-partitioned staged copy),
then a size check of the shards it will read.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from stager.errors import CorruptSampleError, UsageError
from stager.formats import format_spec, get_format
from stager.fs.info import detect_fs
from stager.fs.kernel import release_free_heap
from stager.fs.open import local_path_of
from stager.loader.assemble import pack_raw_numpy, stack_nhwc
from stager.loader.clipfields import ClipFieldsFn
from stager.loader.clips import ClipFn, clip_meta, item_shard_groups, item_space
from stager.loader.dataset_index import index_from_manifest
from stager.loader.fetch import Fetcher, MappedFetcher, PreadFetcher
from stager.loader.fields import FieldsSampleFn, assemble_fields, select_fields
from stager.loader.options import BoxFilter, LoaderOptions
from stager.loader.shard_access import Resolved, ShardAccess, check_shards, resolve, validate_partition
from stager.loader.state import LoaderState
from stager.loader.transforms import make_sample_fn
from stager.manifest import Strings
from stager.manifest.fields import FieldSpec, sample_fields
from stager.order import streams
from stager.order.epoch import (
    PlanConfig,
    RankPlan,
    WorkerPlan,
    batch_padding,
    batch_sizes,
    epoch_sequence,
    plan_rank,
    plan_worker,
    run_lengths,
    unconsumed,
)
from stager.order.epoch import samples_per_rank as equal_samples_per_rank
from stager.order.items import ItemSpace
from stager.order.partition import partition_samples_per_rank
from stager.order.reads import ReadSchedule, WorkerReads, worker_reads
from stager.redact import redact
from stager.world import World, process_group_world

# Run size by storage (run_bytes="auto"): on a shared/network file system (Lustre, GPFS, BeeGFS,
# NFS, fsspec URLs) reads should be whole stripes (1 MiB+); on node-local NVMe/tmpfs (a staged copy)
# 256 KiB reads already run at full device speed, and shorter runs shuffle better for the same
# buffer memory (docs/loader.md, "Shuffle quality").
SHARED_RUN_BYTES, SHARED_MIN_RUN = 1 << 20, 4
LOCAL_RUN_BYTES, LOCAL_MIN_RUN = 256 << 10, 2
MAX_BUFFER_SAMPLES = 1 << 16

log = logging.getLogger("stager.loader")


@dataclass(frozen=True)
class PlanGroup:
    """The ranks this rank's epoch plan is cut for: rank ``rank`` of ``world_size``.

    Normally the whole job. On a node-partitioned staged copy, the node's ranks: they plan over the
    node's shards only (``sample_mask``, bool of shape (N,)), with ``samples_per_rank`` the count
    every node derives alike (:func:`~stager.order.partition.partition_samples_per_rank`).
    """

    rank: int
    world_size: int
    samples_per_rank: int | None = None
    sample_mask: np.ndarray | None = None

    @property
    def node_partitioned(self) -> bool:
        return self.sample_mask is not None


@dataclass(frozen=True)
class EpochPosition:
    """Where a pass over the dataset starts: rank-level batch ``start_batch`` of ``epoch``.

    ``remaining``: after an elastic resume, the epoch's samples not yet consumed, in the order of
    the plan they were left from (int64); None: the plain plan.
    """

    epoch: int
    start_batch: int = 0
    remaining: np.ndarray | None = None


def run_size(options: LoaderOptions, res: Resolved) -> tuple[int, int]:
    """``(run_bytes, min_run)`` for ``options`` on ``res``'s storage (``"auto"``: by file system)."""
    run_bytes, min_run = options.run_bytes, options.min_run
    if run_bytes != "auto":
        assert isinstance(run_bytes, int)
        return run_bytes, SHARED_MIN_RUN if min_run is None else min_run
    shared = True
    if res.is_local:
        try:
            shared = detect_fs(res.root.removeprefix("file://")).is_shared
        except OSError:
            shared = True
    if shared:
        return SHARED_RUN_BYTES, SHARED_MIN_RUN if min_run is None else min_run
    return LOCAL_RUN_BYTES, LOCAL_MIN_RUN if min_run is None else min_run


def plan_group(
    res: Resolved, rank: int, world_size: int, drop_last: bool, items: ItemSpace | None = None
) -> PlanGroup:
    """The :class:`PlanGroup` of ``rank``: the whole world, or its node's ranks on a partitioned copy.

    ``items``: what the plan deals out (default: the samples); on a partitioned copy the group plans
    over the items whose samples are all local (a clip pack's windows: sequences continued across
    shards were staged on one node, so each window is local to exactly one node).
    """
    if res.local_shards is None:
        return PlanGroup(rank, world_size)
    items = items or item_space(res.index)
    _node, rpn, local_rank = validate_partition(res, rank, world_size)
    part = res.partition or {}
    m = res.index.manifest
    assert m is not None
    per_rank = partition_samples_per_rank(
        m.shard_bytes,
        np.diff(items.starts),
        num_nodes=int(part["num_nodes"]),
        seed=int(part.get("seed", 0)),
        ranks_per_node=rpn,
        drop_last=drop_last,
        groups=item_shard_groups(res.index),
    )
    mask = np.zeros(res.index.num_samples, dtype=bool)
    starts = res.index.starts
    for s in res.local_shards.tolist():
        mask[starts[s] : starts[s + 1]] = True
    return PlanGroup(local_rank, rpn, per_rank, items.item_mask(mask))


def _options_of(options: LoaderOptions | int, settings: dict[str, Any]) -> LoaderOptions:
    if isinstance(options, LoaderOptions):
        if settings:
            raise TypeError(f"ShardedDataset takes LoaderOptions or keyword settings, not both ({sorted(settings)})")
        return options
    return LoaderOptions.from_kwargs(settings, batch_size=options)


_WARM_SHARDS = 8  # shards whose readers' first needs (their compressors) are loaded before workers fork


def _first_local_paths(res: Resolved) -> list[str]:
    """The local files of the first :data:`_WARM_SHARDS` shards this node reads (none when remote)."""
    shards = res.local_shards if res.local_shards is not None else np.arange(res.index.num_shards)
    paths = (local_path_of(res.shard_path(int(s))) for s in shards[:_WARM_SHARDS])
    return [p for p in paths if p is not None]


class RankDataset:
    """One rank's shuffled, padded share of a packed dataset (or ImageFolder tree), as batches: no torch.

    :class:`~stager.loader.sharded.ShardedDataset` is this plus torch's ``IterableDataset`` and its
    shared-memory batches; :class:`~stager.loader.numpy_loader.NumpyLoader` drives it in its own
    worker processes. Both call :meth:`worker_batches`, so both give the same batches in the same order.

    ``ShardedDataset(path, LoaderOptions(...))``, or ``ShardedDataset(path, batch_size, **settings)``
    with :func:`~stager.loader.make_loader`'s keyword arguments. ``resolved``: an already resolved
    dataset to share (the prefetcher plans several ranks over one index).

    Batches are dicts: ``key`` (list[str]), ``label`` (int64 array (B,)), ``index`` (int64 array
    (B,), global sample ids in manifest order), and ``image`` (uint8 array (B, H, W, C)) for
    ``decode="uint8"``, ``data``/``offsets`` (one uint8 array + int64 (B + 1,)) for ``"raw"`` in
    workers (in-process: ``image`` = list of ``memoryview``), or ``image`` (list of PIL images) for
    ``"pil"``. ``_w`` carries the worker's timing figures (consumed by the loaders). The torch
    subclass overrides the image and raw fields (:meth:`_image_fields`, :meth:`_raw_fields`).

    ``num_workers=None`` takes the worker count from the running transport at iteration time
    (:meth:`_runtime_workers`; the order depends on it, so the loaders pass it explicitly).

    Between epochs the owner moves it with :meth:`set_epoch`, :meth:`resume` (an explicit order
    after an elastic resume), ``start_batch`` (where the next pass starts) or :meth:`seek` (all
    three at once, as persistent workers receive it); ``shm_channel`` (set inside a worker) makes
    it send batches through reused shared-memory rings over that channel (:mod:`stager.loader.shm`).

    ``deal_batches`` (False: each rank a contiguous slice of the epoch): the ranks take the epoch's
    batches in turn, as Accelerate's own DataLoader deals them (:meth:`deal_batches_in_turn`).
    """

    deal_batches = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        options: LoaderOptions | int,
        *,
        resolved: Resolved | None = None,
        **settings: Any,
    ) -> None:
        self.options = opts = _options_of(options, settings)
        self.resolved = resolved or resolve(
            path, storage_options=opts.storage_options, staged=opts.staged, staging_roots=opts.staging_roots
        )
        res = self.resolved
        if opts.mode == "random" and not res.is_local:
            raise UsageError(
                f"{res.root}: shuffle='random' reads one sample per request and is meant for local copies; "
                "use the default shuffle='runs' for remote storage"
            )
        world = World.detect(opts.rank, opts.world_size)
        self.rank, self.world_size = world.rank, world.world_size
        self.world_source = world.source  # "explicit", "torch.distributed", a launcher's name, or "default"
        self.field_fn, self.field_specs = self._fields_kind(opts)
        res = self.resolved
        self.index = res.index
        # What the plan deals out: samples, or a clip pack's windows (stager.loader.clips).
        self.items = item_space(self.index)
        sample_fn = make_sample_fn(opts.decode, opts.transform, opts.image_size, self.index.kind)
        self.sample_fn: Any = ClipFn(sample_fn) if self.items.per_item > 1 else sample_fn
        # A clip pack with fields: each window's frames with their fields, one geometry per clip.
        self.clip_field_fn = ClipFieldsFn(self.field_fn) if self.field_fn and self.items.per_item > 1 else None
        payload = self.items.shard_bytes(self.index.sizes)
        self.run_bytes, self.min_run = run_size(opts, res)
        self.run_len = run_lengths(np.diff(self.items.starts), payload, self.run_bytes, self.min_run)
        self._mean_sample = float(payload.sum()) / max(1, self.items.count)
        self.group = plan_group(res, self.rank, self.world_size, opts.drop_last, self.items)
        check_shards(res, res.local_shards if res.local_shards is not None else np.arange(self.index.num_shards))
        m = self.index.manifest
        if m is not None and any(s.extents != "bytes" for s in m.shards):
            # Shards read through their format's reader (squashfs inodes, parquet rows): its module, and
            # what its readers load first (a decompressor), are loaded here, once, so forked workers
            # inherit them instead of each loading them before its first sample.
            get_format(m.format).warm_readers(_first_local_paths(res))
        self.epoch = 0
        self.start_batch = 0
        self._remaining: np.ndarray | None = None
        self.shm_channel: Any = None  # a worker's stager.loader.shm.Channel (set in the worker only)
        # The worker's ring, kept across the epochs a persistent worker serves under one token.
        self._ring: Any = None
        self._keys: np.ndarray | None = None

    def _fields_kind(self, opts: LoaderOptions) -> tuple[FieldsSampleFn | None, list[FieldSpec]]:
        """On a dataset with fields (docs/fields.md) and ``decode="uint8"``: the fields sample function
        and the fields read. The index is swapped for one whose extents span image + those fields, so
        reads, staging and streaming carry them unchanged (:mod:`stager.loader.fields`)."""
        m = self.resolved.index.manifest
        has = m is not None and bool(sample_fields(m.fields))
        if m is None or not has or opts.fields == () or (opts.decode != "uint8" and opts.fields is None):
            if opts.fields:
                raise UsageError(f"{self.resolved.root}: fields {list(opts.fields)} requested, but this dataset has "
                                 "no fields" if not has else "fields are read with decode='uint8'")
            return None, []
        if opts.decode != "uint8":
            raise UsageError("fields are read with decode='uint8'")
        specs = select_fields(m, opts.fields)
        names = tuple(s.name for s in specs if not s.ragged)
        # Where byte fields sit beside their image (tar, record: the format's fields "span"), one span
        # reads them all; elsewhere (hdf5, parquet: a dataset or column per field) each field is one more
        # read at its extent (FieldsSampleFn.access).
        span = format_spec(m.format).fields == "span"
        if names and span:
            self.resolved = dataclasses.replace(self.resolved, index=index_from_manifest(m, names))
        idx = self.resolved.index
        fn = FieldsSampleFn(m, specs, idx.offsets, transform=opts.transform, size=opts.image_size, kind=idx.kind,
                            side=bool(names) and not span, starts=idx.starts,
                            box_filter=BoxFilter.of(opts.box_filter))
        return fn, specs

    def _runtime_workers(self) -> int:
        """The worker count of the transport running this dataset (no transport here: 0)."""
        return 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_keys": None, "_ring": None, "shm_channel": None}  # rebuilt where needed

    # ---- the plan's arguments -------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.options.batch_size

    @property
    def num_workers(self) -> int | None:
        return self.options.num_workers

    @property
    def seed(self) -> int:
        return self.options.seed

    @property
    def mode(self) -> str:
        return self.options.mode

    @property
    def drop_last(self) -> bool:
        return self.options.drop_last

    # ---- the world -------------------------------------------------------------------------------
    def rebind_world(self) -> bool:
        """Follow the initialised process group when the world was detected (not passed) and no longer matches it.

        A dataset built before ``init_process_group``, or pickled into processes that a framework spawned
        (Lightning's ``ddp_spawn`` pickles a DataModule built in the parent), would otherwise read the
        parent's world: every rank the whole dataset. Returns True when the rank or world size changed (the
        plan group is rebuilt; an elastic resume's order is dropped: its state must be loaded again).
        """
        if self.world_source == "explicit":
            return False
        now = process_group_world()
        if now is None or now == (self.rank, self.world_size):
            return False
        world = World.detect()
        log.info("stager.loader: rank %d of %d became rank %d of %d (the initialised process group): re-planned",
                 self.rank, self.world_size, world.rank, world.world_size)
        self.rank, self.world_size, self.world_source = world.rank, world.world_size, world.source
        self.group = plan_group(self.resolved, self.rank, self.world_size, self.options.drop_last, self.items)
        self._remaining = None
        self.start_batch = 0
        return True

    # ---- position -------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch (an explicit order is kept only for the same epoch)."""
        if epoch != self.epoch:
            self._remaining = None
        self.epoch = epoch
        self.start_batch = 0

    def resume(self, epoch: int, remaining: np.ndarray | None) -> None:
        """Continue ``epoch`` over ``remaining`` (an elastic resume's samples left, in the old order) or,
        with None, over the plain plan; the next pass starts at its first batch."""
        self.epoch, self.start_batch, self._remaining = epoch, 0, remaining

    @property
    def remaining(self) -> np.ndarray | None:
        """The explicit order of the current epoch after an elastic resume (None: the plain plan)."""
        return self._remaining

    @property
    def position(self) -> EpochPosition:
        return EpochPosition(self.epoch, self.start_batch, self._remaining)

    def seek(self, position: EpochPosition) -> None:
        self.epoch, self.start_batch, self._remaining = position.epoch, position.start_batch, position.remaining

    # ---- planning -------------------------------------------------------------------------------
    def streams(self) -> int:
        nw = self.num_workers
        if nw is None:
            nw = self._runtime_workers()
        return max(1, nw)

    def buffer_samples(self, streams: int | None = None) -> int:
        """Per-worker shuffle buffer ``K`` (samples): ``shuffle_buffer`` or the byte budget per rank / workers."""
        if self.options.shuffle_buffer is not None:
            return int(self.options.shuffle_buffer)
        per_worker = self.options.shuffle_buffer_bytes / (streams or self.streams())
        return int(max(1, min(MAX_BUFFER_SAMPLES, per_worker // max(self._mean_sample, 1.0))))

    def config(self) -> PlanConfig:
        return PlanConfig(
            batch_size=self.batch_size,
            world_size=self.group.world_size,
            num_workers=self.streams() if self.num_workers is None else self.num_workers,
            seed=self.seed,
            mode=self.mode,
            drop_last=self.drop_last,
            buffer_samples=self.buffer_samples(),
            samples_per_rank=self.group.samples_per_rank,
            deal_batches=self.deal_batches,
        )

    def deal_batches_in_turn(self) -> bool:
        """Deal an unshuffled epoch's batches to the ranks in turn (rank ``r``: batches ``r, r + R, ...``), as
        Accelerate's own DataLoader does, so that gathering each step's batches over the ranks gives the
        dataset's order and the padding repeats end the last step (``accelerator.prepare`` asks it).
        Only for ``shuffle=False`` over the whole world (not a node's partition of a staged copy; a shuffled
        order has no order to keep). Returns whether the plan changed."""
        if self.deal_batches or self.mode != "none" or self.group.node_partitioned:
            return False
        self.deal_batches = True
        return True

    def epoch_sequence(self, epoch: int) -> np.ndarray:
        """The epoch's order of the samples this rank's group plans over (all, or this node's)."""
        seq = epoch_sequence(self.items.starts, self.run_len, self.config(), epoch)
        if self.group.sample_mask is not None:
            seq = seq[self.group.sample_mask[seq]]
        return seq

    def plan(self, epoch: int | None = None, *, rank: int | None = None) -> RankPlan:
        """This rank's plan of ``epoch`` (default: the current one, over its explicit order if any);
        ``rank``: another rank of the plan group instead."""
        e = self.epoch if epoch is None else epoch
        r = self.group.rank if rank is None else rank
        return plan_rank(self.items.starts, self.run_len, self.config(), r, epoch=e, seq=self._sequence(e))

    def worker_plan(self, worker: int) -> WorkerPlan:
        """Worker stream ``worker``'s plan of the current epoch: ``plan().workers[worker]``, without
        simulating the other streams' shuffle buffers (a worker process needs only its own)."""
        e = self.epoch
        return plan_worker(self.items.starts, self.run_len, self.config(), self.group.rank, worker, epoch=e,
                           seq=self._sequence(e))

    def _sequence(self, epoch: int) -> np.ndarray:
        """The order ``epoch`` is planned over: the explicit one (an elastic resume's) for the current epoch, or
        the epoch sequence."""
        if self._remaining is not None and epoch == self.epoch:
            return self._remaining
        return self.epoch_sequence(epoch)

    def read_schedule(self, epoch: int | None = None, *, start_batch: int = 0) -> ReadSchedule:
        """The shard reads of :meth:`plan` ``(epoch)`` from ``start_batch`` on (:mod:`stager.order.reads`;
        over the samples the plan's items read, :meth:`~stager.order.items.ItemSpace.reading_plan`)."""
        plan, idx = self.plan(epoch), self.index
        workers = tuple(
            worker_reads(self.items.reading_plan(wp), idx.starts, idx.sizes, start_batch=start_batch)
            for wp in plan.workers
        )
        return ReadSchedule(plan.rank, plan.epoch, workers)

    def samples_in_epoch(self) -> int:
        """How many samples the group plans over this epoch: an explicit order's, the node's, or all."""
        if self._remaining is not None:
            return len(self._remaining)
        if self.group.sample_mask is not None:
            return int(self.group.sample_mask.sum())
        return self.items.count

    def batch_sizes(self) -> np.ndarray:
        """This rank's batch sizes for the current epoch (cheap: no shuffling)."""
        per = self.group.samples_per_rank
        if per is None:
            per = equal_samples_per_rank(self.samples_in_epoch(), self.group.world_size, self.drop_last)
        return batch_sizes(per, self.batch_size, self.drop_last)

    def __len__(self) -> int:
        """Batches per rank in the current epoch (the same on every rank)."""
        return len(self.batch_sizes())

    # ---- what the loaders ask besides batches (LoaderBase; a mix answers for all its streams) ------
    @property
    def dataset_id(self) -> str:
        """The dataset's identity in the resume state (the manifest digest)."""
        return self.index.dataset_id

    def plan_key(self) -> str:
        """A fingerprint of the run layout and the per-rank count: part of the order a state must match."""
        h = xxhash.xxh3_64()
        h.update(np.ascontiguousarray(self.run_len).tobytes())
        h.update(f"{self.group.samples_per_rank}".encode())
        if self.deal_batches:
            h.update(b"batches dealt in turn")
        return h.hexdigest()

    def origin(self) -> dict[str, Any]:
        """Where the batches come from, for ``stats()``: source, the directory read, staged or not."""
        res = self.resolved
        return {"source": redact(res.source), "reading_from": redact(res.root), "staged": res.staged,
                "staged_mode": res.staged_mode}

    def batch_fields(self) -> tuple[str, ...]:
        """The keys every batch has (raw batches from workers add ``data``/``offsets``)."""
        return ("image", "index", "key", "label")

    def batch_padding(self) -> np.ndarray:
        """Per batch of the current epoch: how many of its samples are padding repeats (int64 (batches,))."""
        # Which positions are padding depends on the layout alone: no epoch order, and only the
        # shuffle buffers of workers that hold padding (the main process asks this before its workers start).
        return batch_padding(self.samples_in_epoch(), self.config(), self.group.rank, epoch=self.epoch)

    def unconsumed(self, state: LoaderState, seq: np.ndarray | None) -> np.ndarray:
        """``state``'s epoch minus what every rank of its world consumed, in the old order (int64): what an
        elastic resume re-plans. ``seq``: the order that epoch was planned over (a parent state's
        remaining samples), or None for the plain epoch sequence."""
        if seq is None:
            seq = self.epoch_sequence(state.epoch)
        cfg = PlanConfig(batch_size=state.batch_size, world_size=state.world_size, num_workers=state.num_workers,
                         seed=state.seed, mode=state.mode, drop_last=state.drop_last,
                         buffer_samples=state.buffer_samples, deal_batches=self.deal_batches)
        return unconsumed(seq, self.items.starts, self.run_len, cfg, epoch=state.epoch,
                          batches_done=state.batches_done)

    # ---- iteration ------------------------------------------------------------------------------
    def worker_batches(self, worker: int, *, in_worker: bool) -> Iterator[dict[str, Any]]:
        """Worker stream ``worker``'s batches from ``start_batch`` on (rank batches ``start_batch + worker,
        + W, ...``): what transport worker ``worker`` yields. ``in_worker``: the batches leave this
        process (raw payloads are copied into one buffer; the cv2 thread pool is cut to one thread)."""
        streams = self.config().streams
        logical = (worker + self.start_batch) % streams
        wp = self.worker_plan(logical)
        access = ShardAccess(self.resolved, use_mmap=self.options.use_mmap)
        try:
            yield from self._worker_batches(wp, access, in_worker=in_worker, trim=True)
        finally:
            access.close()

    def _worker_batches(self, wp: WorkerPlan, access: ShardAccess, *, in_worker: bool,
                        trim: bool = False) -> Iterator[dict[str, Any]]:
        """Worker ``wp``'s batches from ``start_batch`` on: read as scheduled, decode, assemble.
        ``trim``: return the plan's freed temporaries to the kernel once the fetcher is built.

        ``wp`` is over items; its reads are over the samples they hold (``rp``, the reading plan: the
        same plan for samples, the frames of the windows for a clip pack)."""
        rp = self.items.reading_plan(wp)
        reads = worker_reads(rp, self.index.starts, self.index.sizes, start_batch=self.start_batch)
        ring = self._worker_ring() if in_worker else None
        if in_worker:
            single_threaded_cv2()
        access.check_pid()
        if self.field_fn is not None:
            self.field_fn.access = access  # byte fields outside the payload (hdf5, parquet) are read through it
        fetcher = self._fetcher(reads, rp, access)
        if trim:
            release_free_heap()
        cum = np.concatenate([[0], np.cumsum(wp.sizes)]).astype(np.int64)
        rcum = cum * self.items.per_item
        for b in range(reads.first_step, len(wp.batches)):
            pos = rp.emit[rcum[b] : rcum[b + 1]]
            t = time.perf_counter()
            payloads, nbytes = fetcher.batch(b, pos)
            io_s = time.perf_counter() - t
            j = int(wp.batches[b])
            t = time.perf_counter()
            ids = wp.stream[wp.emit[cum[b] : cum[b + 1]]]
            batch = self._assemble(payloads, ids, j, in_worker=in_worker, ring=ring)
            batch["_w"]["bytes"], batch["_w"]["io_s"] = nbytes, io_s
            batch["_w"]["decode_s"] = time.perf_counter() - t
            yield batch

    def _worker_ring(self) -> Any:
        """The worker's shared-memory batch ring (the torch transport's; here none)."""
        return None

    def _fetcher(self, reads: WorkerReads, wp: WorkerPlan, access: ShardAccess) -> Fetcher:
        if access.mapped:
            return MappedFetcher(reads, wp, access)
        # A payload is a view of its run's read buffer; a sample waiting in the shuffle buffer would
        # pin that whole run. Copying out keeps the bound at K samples (not K runs) per worker.
        owned = self.config().buffer_samples > 1 and self.mode in ("runs", "shards")
        return PreadFetcher(reads, wp, access, on_error=self.options.on_error, owned=owned)

    def _assemble(
        self, payloads: list[Any], ids: np.ndarray, j: int, *, in_worker: bool, ring: Any
    ) -> dict[str, Any]:
        """Rank batch ``j`` from its payloads: decoded (or raw) items, keys, labels, ids."""
        decode = self.options.decode
        skipped: list[str] = []
        if self.field_fn is not None:
            return self._assemble_fields(payloads, ids, j, in_worker=in_worker, ring=ring)
        passes = self.items.per_item == 1 and getattr(self.sample_fn, "passes_through", False)
        if passes and all(p is not None for p in payloads):
            items, kept = payloads, ids  # raw bytes or stored arrays as they are: no per-sample work
        else:
            items, kept, skipped = self._decode_all(payloads, ids, j)
        first = self.items.samples_of(kept)[:, 0]  # each item's (first) sample
        batch: dict[str, Any] = {
            "key": self._keys_at(first),
            # Small arrays cross the worker queue pickled (a shared-memory segment per tiny
            # tensor costs more); the Loader turns them into tensors (finish_batch).
            "label": self.index.labels[first],
            "index": np.asarray(kept, dtype=np.int64),
        }
        if self.items.per_item > 1:
            batch.update(clip_meta(self.index, first))
        if decode == "raw":
            batch.update(self._raw_fields(items, in_worker=in_worker, ring=ring))
        elif decode == "pil":
            batch["image"] = items
        else:
            batch.update(self._image_fields(items, in_worker=in_worker, ring=ring))
        batch["_w"] = {"skipped": skipped, "batch": j}
        return batch

    def _assemble_fields(
        self, payloads: list[Any], ids: np.ndarray, j: int, *, in_worker: bool, ring: Any
    ) -> dict[str, Any]:
        """Rank batch ``j`` of a dataset with fields: image, keys, labels, ids and the fields."""
        items, kept, skipped = self._decode_all(payloads, ids, j)
        first = self.items.samples_of(kept)[:, 0]  # each item's (first) sample
        batch: dict[str, Any] = {"key": self._keys_at(first), "label": self.index.labels[first],
                                 "index": np.asarray(kept, dtype=np.int64)}
        if self.items.per_item > 1:
            batch.update(clip_meta(self.index, first))
        batch.update(self._image_fields([it["image"] for it in items], in_worker=in_worker, ring=ring))
        batch.update(assemble_fields(items, self.field_specs))
        batch["_fields"] = {s.name: s.kind for s in self.field_specs}
        batch["_w"] = {"skipped": skipped, "batch": j}
        return batch

    def _image_fields(self, items: list[Any], *, in_worker: bool, ring: Any) -> dict[str, Any]:
        """The decoded samples' batch field(s): here ``image``, a uint8 array (B, H, W, C)."""
        return {"image": stack_nhwc(items)}

    def _raw_fields(self, items: list[Any], *, in_worker: bool, ring: Any) -> dict[str, Any]:
        """Raw payloads' batch fields: ``data``/``offsets`` arrays leaving a worker, else ``image`` (views)."""
        if in_worker:
            data, offsets = pack_raw_numpy(items)
            return {"data": data, "offsets": offsets}
        return {"image": [x if isinstance(x, memoryview) else memoryview(x) for x in items]}

    def _decode_all(self, payloads: list[Any], ids: np.ndarray, j: int, rng: np.random.Generator | None = None
                    ) -> tuple[list[Any], np.ndarray, list[str]]:
        """Apply the sample function; returns ``(items, kept ids, skipped keys)`` (``on_error``). ``rng``:
        the batch's augmentation generator (default: rank batch ``j``'s; a mix shares one over its streams)."""
        idx = self.index
        if rng is None:
            rng = streams.augment(self.seed, self.epoch, self.world_size, self.rank, j)
        items, kept, skipped = [], [], []
        per = self.items.per_item
        # One input per item: a payload, or (windows) the list of its T frame payloads.
        inputs = payloads if per == 1 else [payloads[i : i + per] for i in range(0, len(payloads), per)]
        for payload, gid in zip(inputs, ids.tolist(), strict=True):
            try:
                if payload is None or (per > 1 and any(p is None for p in payload)):
                    raise CorruptSampleError("unreadable payload")
                fn = self.field_fn
                if self.clip_field_fn is not None:
                    items.append(self.clip_field_fn(payload, rng, self.items.samples_of(np.array([gid]))[0].tolist()))
                else:
                    items.append(self.sample_fn(payload, rng) if fn is None else fn(payload, rng, gid))
                kept.append(gid)
            except Exception as exc:
                gid = int(self.items.samples_of(np.array([gid]))[0, 0])
                key = idx.keys[gid]
                if self.options.on_error == "skip":
                    skipped.append(key)
                    continue
                shard = int(idx.shard_of(np.array([gid]))[0])
                raise CorruptSampleError(
                    f"{self.resolved.shard_path(shard)}: sample {key!r} cannot be decoded "
                    f"({type(exc).__name__}: {exc}); run `stager verify --deep` or pass on_error='skip'"
                ) from exc
        return items, np.asarray(kept, dtype=np.int64), skipped

    def _keys_at(self, ids: np.ndarray) -> list[str]:
        """The keys of global ids ``ids``: decoded from the mapped index (``Strings.take``), or
        through an object array built once for a listed folder's keys."""
        keys = self.index.keys
        if isinstance(keys, Strings):
            return keys.take(ids.tolist())
        if self._keys is None:
            self._keys = np.empty(len(keys), dtype=object)
            self._keys[:] = keys
        return self._keys[ids].tolist()


def single_threaded_cv2() -> None:
    """One OpenCV thread per worker (torch does the same for itself): W workers already fill W cores."""

    cv2 = sys.modules.get("cv2")
    if cv2 is not None:
        cv2.setNumThreads(1)
