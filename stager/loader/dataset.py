"""``ShardedDataset``: a torch IterableDataset that yields whole batches of one rank's epoch plan.

Each DataLoader worker ``k`` of ``W`` produces the rank's batches ``k, k + W, ...`` (torch's
in-order round robin then hands them out as batches ``0, 1, 2, ...``): its
:class:`~stager.order.epoch.WorkerPlan` says which samples in which order, its
:class:`~stager.order.reads.WorkerReads` which shard segments it reads while loading which batch
(one read each, front to back), and a :mod:`stager.loader.fetch` fetcher makes those reads and
hands out the payloads the shuffle buffer emits. Use it with ``DataLoader(ds, batch_size=None,
num_workers=W)``, or let :func:`stager.loader.make_loader` do that.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from stager.errors import CorruptSampleError, UsageError
from stager.loader.access import Resolved, ShardAccess, check_shards, resolve, validate_partition
from stager.loader.batching import pack_raw, stack_images
from stager.loader.fetch import Fetcher, MappedFetcher, PreadFetcher
from stager.loader.shm import WorkerRing
from stager.loader.transforms import make_sample_fn
from stager.order import epoch as planlib
from stager.order import streams
from stager.order.reads import ReadSchedule, WorkerReads, read_schedule, worker_reads

# Run size by storage (run_bytes="auto"): on a shared/network file system (Lustre, GPFS, BeeGFS,
# NFS, fsspec URLs) reads should be whole stripes (1 MiB+); on node-local NVMe/tmpfs (a staged copy)
# 256 KiB reads already run at full device speed, and shorter runs shuffle better for the same
# buffer memory (docs/loader.md, "Shuffle quality").
SHARED_RUN_BYTES, SHARED_MIN_RUN = 1 << 20, 4
LOCAL_RUN_BYTES, LOCAL_MIN_RUN = 256 << 10, 2
DEFAULT_BUFFER_BYTES = 512 << 20
MAX_BUFFER_SAMPLES = 1 << 16


class ShardedDataset(IterableDataset):
    """One rank's shuffled, padded share of a packed dataset (or ImageFolder tree), as batches.

    Batches are dicts: ``key`` (list[str]), ``label`` (int64 tensor (B,)), ``index`` (int64 tensor
    (B,), global sample ids in manifest order), and ``image`` (uint8 (B, C, H, W), channels-last
    memory) for ``decode="uint8"``, ``data``/``offsets`` (one uint8 buffer + int64 (B + 1,)) for
    ``"raw"`` in workers (in-process: ``image`` = list of ``memoryview``), or ``image`` (list of PIL
    images) for ``"pil"``. ``_w`` carries the worker's timing
    figures (consumed by :class:`~stager.loader.Loader`).

    ``num_workers=None`` takes the worker count from the DataLoader at iteration time (the order
    depends on it; the Loader always passes it explicitly so that its state can be resumed).
    """

    def __init__(
        self,
        path: Any,
        batch_size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int | None = 0,
        seed: int = 0,
        shuffle: bool | str = True,
        decode: str = "uint8",
        transform: Any = None,
        image_size: int = 224,
        drop_last: bool = False,
        on_error: str = "raise",
        storage_options: dict[str, Any] | None = None,
        staged: bool | str = "auto",
        staging_roots: tuple[str, ...] = (),
        run_bytes: int | str = "auto",
        min_run: int | None = None,
        shuffle_buffer: int | None = None,
        shuffle_buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        resolved: Resolved | None = None,
        use_mmap: bool = True,
    ) -> None:
        from stager.world import World

        if on_error not in ("raise", "skip"):
            raise UsageError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        mode = ("runs" if shuffle is True else "none") if isinstance(shuffle, bool) else shuffle
        if mode not in planlib.SHUFFLE_MODES:
            raise UsageError(
                f"shuffle must be True, False or one of {', '.join(planlib.SHUFFLE_MODES)}, got {shuffle!r}"
            )
        self.res = resolved or resolve(
            path, storage_options=storage_options, staged=staged, staging_roots=staging_roots
        )
        if mode == "random" and not self.res.is_local:
            raise UsageError(
                f"{self.res.root}: shuffle='random' reads one sample per request and is meant for local copies; "
                "use the default shuffle='runs' for remote storage"
            )
        world = World.detect(rank, world_size)
        self.rank, self.world_size = world.rank, world.world_size
        self.index = self.res.index
        self.num_workers = num_workers
        self.batch_size, self.seed, self.mode, self.drop_last = batch_size, seed, mode, drop_last
        self.decode, self.transform, self.image_size, self.on_error = decode, transform, image_size, on_error
        self._sample_fn = make_sample_fn(decode, transform, image_size, self.index.kind)
        payload = self.index.payload_bytes()
        counts = np.diff(self.index.starts)
        rb, mr = self._run_size(run_bytes, min_run)
        self.run_bytes, self.min_run = rb, mr
        self.run_len = planlib.run_lengths(counts, payload, rb, mr)
        mean = float(payload.sum()) / max(1, self.index.num_samples)
        self._buffer_override = shuffle_buffer
        self._buffer_bytes = shuffle_buffer_bytes
        self._mean_sample = mean
        # Node-partitioned staged copy: this rank plans over the node's shards only, as rank
        # ``local_rank`` of ``ranks_per_node``, with a per-rank count every node derives alike.
        self._local_mask: np.ndarray | None = None
        self._plan_rank, self._plan_world, self._per_rank = self.rank, self.world_size, None
        if self.res.local_shards is not None:
            _node, rpn, lrank = validate_partition(self.res, self.rank, self.world_size)
            self._plan_rank, self._plan_world = lrank, rpn
            self._per_rank = self._partition_per_rank(rpn)
            self._local_mask = np.zeros(self.index.num_samples, dtype=bool)
            for s in self.res.local_shards.tolist():
                self._local_mask[self.index.starts[s] : self.index.starts[s + 1]] = True
        needed = self.res.local_shards if self.res.local_shards is not None else np.arange(self.index.num_shards)
        check_shards(self.res, needed)
        self.epoch = 0
        self.start_batch = 0
        # Local shards of encoded formats are mapped (zero-copy payload views) unless disabled.
        self.use_mmap = use_mmap
        # Set by the Loader for each epoch: workers then send batches through reused shared
        # memory rings named by it (stager.loader.shm), which the Loader cleans up.
        self._ipc_token: str | None = None
        # The worker's ring, kept across the epochs a persistent worker serves under one token.
        self._ring: WorkerRing | None = None
        self._keys: np.ndarray | None = None
        # Elastic resume: the epoch's remaining samples in the old plan's order (None: plain plan).
        self.seq_override: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_keys": None, "_ring": None}  # rebuilt where needed

    # ---- planning -------------------------------------------------------------------------------
    def _run_size(self, run_bytes: int | str, min_run: int | None) -> tuple[int, int]:
        if run_bytes != "auto":
            if not isinstance(run_bytes, int) or run_bytes < 1:
                raise UsageError(f"run_bytes must be a positive integer or 'auto', got {run_bytes!r}")
            return run_bytes, SHARED_MIN_RUN if min_run is None else min_run
        shared = True
        if self.res.is_local:
            from stager.fs.info import detect_fs

            try:
                shared = detect_fs(self.res.root.removeprefix("file://")).is_shared
            except OSError:
                shared = True
        if shared:
            return SHARED_RUN_BYTES, SHARED_MIN_RUN if min_run is None else min_run
        return LOCAL_RUN_BYTES, LOCAL_MIN_RUN if min_run is None else min_run

    def _partition_per_rank(self, rpn: int) -> int:
        from stager.order.partition import assign_shards_to_nodes

        part = self.res.partition or {}
        m = self.index.manifest
        assert m is not None
        groups = assign_shards_to_nodes(m.shard_bytes, int(part["num_nodes"]), int(part.get("seed", 0)))
        totals = [sum(m.shards[s].samples for s in g) for g in groups]
        per = [planlib.samples_per_rank(t, rpn, self.drop_last) for t in totals]
        return min(per) if self.drop_last else max(per)

    def streams(self) -> int:
        nw = self.num_workers
        if nw is None:
            info = get_worker_info()
            nw = info.num_workers if info is not None else 0
        return max(1, nw)

    def buffer_samples(self, streams: int | None = None) -> int:
        """Per-worker shuffle buffer ``K`` (samples): ``shuffle_buffer`` or the byte budget per rank / workers."""
        if self._buffer_override is not None:
            return int(self._buffer_override)
        per_worker = self._buffer_bytes / (streams or self.streams())
        return int(max(1, min(MAX_BUFFER_SAMPLES, per_worker // max(self._mean_sample, 1.0))))

    def config(self) -> planlib.PlanConfig:
        return planlib.PlanConfig(
            batch_size=self.batch_size,
            world_size=self._plan_world,
            num_workers=self.streams() if self.num_workers is None else self.num_workers,
            seed=self.seed,
            mode=self.mode,
            drop_last=self.drop_last,
            buffer_samples=self.buffer_samples(),
            samples_per_rank=self._per_rank,
        )

    def epoch_sequence(self, epoch: int) -> np.ndarray:
        """The epoch's order of the samples this rank's group plans over (all, or this node's)."""
        seq = planlib.epoch_sequence(self.index.starts, self.run_len, self.config(), epoch)
        if self._local_mask is not None:
            seq = seq[self._local_mask[seq]]
        return seq

    def plan(self, epoch: int | None = None) -> planlib.RankPlan:
        e = self.epoch if epoch is None else epoch
        seq = self.seq_override if (self.seq_override is not None and e == self.epoch) else self.epoch_sequence(e)
        return planlib.plan_rank(self.index.starts, self.run_len, self.config(), self._plan_rank, epoch=e, seq=seq)

    def read_schedule(self, epoch: int | None = None, *, start_batch: int = 0) -> ReadSchedule:
        """The shard reads of :meth:`plan` ``(epoch)`` from ``start_batch`` on (:mod:`stager.order.reads`)."""
        return read_schedule(self.plan(epoch), self.index.starts, self.index.sizes, start_batch=start_batch)

    def batch_sizes(self) -> np.ndarray:
        """This rank's batch sizes for the current epoch (cheap: no shuffling)."""
        if self.seq_override is not None:
            total = len(self.seq_override)
        elif self._local_mask is not None:
            total = int(self._local_mask.sum())
        else:
            total = self.index.num_samples
        per = (
            self._per_rank
            if self._per_rank is not None
            else planlib.samples_per_rank(total, self._plan_world, self.drop_last)
        )
        return planlib.batch_sizes(per, self.batch_size, self.drop_last)

    def __len__(self) -> int:
        """Batches per rank in the current epoch (the same on every rank)."""
        return len(self.batch_sizes())

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.seq_override = None
        self.epoch = epoch
        self.start_batch = 0

    # ---- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        phys, nphys = (info.id, info.num_workers) if info is not None else (0, 1)
        cfg = self.config()
        if nphys != cfg.streams:
            raise UsageError(
                f"ShardedDataset was planned for {cfg.streams} worker stream(s) but runs in {nphys}; "
                "pass the DataLoader's num_workers (or num_workers=None) to ShardedDataset"
            )
        logical = (phys + self.start_batch) % cfg.streams
        rplan = self.plan()
        wp = rplan.workers[logical]
        access = ShardAccess(self.res, use_mmap=self.use_mmap)
        try:
            yield from self._worker_batches(wp, access)
        finally:
            access.close()

    def _worker_batches(self, wp: planlib.WorkerPlan, access: ShardAccess) -> Iterator[dict[str, Any]]:
        """Worker ``wp``'s batches from ``start_batch`` on: read as scheduled, decode, assemble."""
        idx = self.index
        reads = worker_reads(wp, idx.starts, idx.sizes, start_batch=self.start_batch)
        in_worker = get_worker_info() is not None
        ring = None
        if in_worker and self._ipc_token is not None:
            if self._ring is None or self._ring.token != self._ipc_token:
                self._ring = WorkerRing(self._ipc_token)
            ring = self._ring
        if in_worker:
            _single_threaded_cv2()
        keys = self._keys_array()
        access.check_pid()
        fetcher = self._fetcher(reads, wp, access)
        cum = np.concatenate([[0], np.cumsum(wp.sizes)]).astype(np.int64)
        for b in range(reads.first_step, len(wp.batches)):
            pos = wp.emit[cum[b] : cum[b + 1]]
            t = time.perf_counter()
            payloads, nbytes = fetcher.batch(b, pos)
            io_s = time.perf_counter() - t
            j = int(wp.batches[b])
            ids = wp.stream[pos]
            t = time.perf_counter()
            skipped: list[str] = []
            if self.decode == "raw" and all(p is not None for p in payloads):
                items, kept = payloads, ids  # nothing to decode: no per-sample work
            else:
                items, kept, skipped = self._decode_all(payloads, ids, j)
            batch: dict[str, Any] = {
                "key": keys[kept].tolist(),
                # Small arrays cross the worker queue pickled (a shared-memory segment per tiny
                # tensor costs more); the Loader turns them into tensors (finish_batch).
                "label": idx.labels[kept],
                "index": np.asarray(kept, dtype=np.int64),
            }
            if self.decode == "raw":
                if in_worker:
                    batch["data"], batch["offsets"] = pack_raw(items, shared=True, ring=ring)
                else:
                    batch["image"] = [x if isinstance(x, memoryview) else memoryview(x) for x in items]
            elif self.decode == "pil":
                batch["image"] = items
            elif ring is not None and items:
                batch["image_nhwc"] = stack_images(items, ring=ring)
            else:
                batch["image"] = stack_images(items, shared=in_worker)
            dec_s = time.perf_counter() - t
            batch["_w"] = {"bytes": nbytes, "io_s": io_s, "decode_s": dec_s, "skipped": skipped, "batch": j}
            yield batch

    def _fetcher(self, reads: WorkerReads, wp: planlib.WorkerPlan, access: ShardAccess) -> Fetcher:
        if access.mapped:
            return MappedFetcher(reads, wp, access)
        # A payload is a view of its run's read buffer; a sample waiting in the shuffle buffer would
        # pin that whole run. Copying out keeps the bound at K samples (not K runs) per worker.
        owned = self.config().buffer_samples > 1 and self.mode in ("runs", "shards")
        return PreadFetcher(reads, wp, access, on_error=self.on_error, owned=owned)

    def _decode_all(self, payloads: list[Any], ids: np.ndarray, j: int) -> tuple[list[Any], np.ndarray, list[str]]:
        """Apply the sample function; returns ``(items, kept ids, skipped keys)`` (``on_error``)."""
        idx = self.index
        rng = streams.augment(self.seed, self.epoch, self.world_size, self.rank, j)
        items, kept, skipped = [], [], []
        for payload, gid in zip(payloads, ids.tolist(), strict=True):
            try:
                if payload is None:
                    raise CorruptSampleError("unreadable payload")
                items.append(self._sample_fn(payload, rng))
                kept.append(gid)
            except Exception as exc:
                key = idx.keys[gid]
                if self.on_error == "skip":
                    skipped.append(key)
                    continue
                shard = int(idx.shard_of(np.array([gid]))[0])
                raise CorruptSampleError(
                    f"{self.res.shard_path(shard)}: sample {key!r} cannot be decoded "
                    f"({type(exc).__name__}: {exc}); run `stager verify --deep` or pass on_error='skip'"
                ) from exc
        return items, np.asarray(kept, dtype=np.int64), skipped

    def _keys_array(self) -> np.ndarray:
        """The keys as an object array, so a batch's keys are one fancy-indexing call."""
        if self._keys is None:
            self._keys = np.empty(len(self.index.keys), dtype=object)
            self._keys[:] = self.index.keys
        return self._keys


def _single_threaded_cv2() -> None:
    """One OpenCV thread per worker (torch does the same for itself): W workers already fill W cores."""
    import sys

    cv2 = sys.modules.get("cv2")
    if cv2 is not None:
        cv2.setNumThreads(1)

