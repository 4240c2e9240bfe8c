"""``TorchRankDataset``: whole batches of one rank's epoch plan, built by torch DataLoader workers.

It is :class:`~stager.loader.rank.RankDataset` (the plan, the reads, decoding and assembly: no
torch) run by torch's DataLoader: DataLoader worker ``k`` of ``W`` yields worker stream ``k``'s
batches (:meth:`~stager.loader.rank.RankDataset.worker_batches`), and torch's in-order round robin
hands them out as batches ``0, 1, 2, ...``. Here the decoded images become (B, C, H, W) uint8
tensors in channels-last memory, built in shared memory (:mod:`stager.loader.batching`, the
:mod:`stager.loader.shm` rings). Use it with ``DataLoader(ds, batch_size=None, num_workers=W)``, or
let :func:`stager.loader.make_loader` do that.

:class:`TorchRankDataset` is all of the above but *not* a torch ``IterableDataset``: it is what a
:class:`~stager.loader.Loader` holds (``loader.dataset``), and its DataLoader iterates it through
:class:`WorkerStreams`. Frameworks treat an object whose ``dataset`` is an ``IterableDataset`` as one
to split or to warn about (Lightning: "Your `IterableDataset` has `__len__` defined"); a Loader is
already one rank's share. :class:`~stager.loader.sharded.ShardedDataset` adds ``IterableDataset`` for
users' own DataLoaders.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from stager.errors import UsageError
from stager.loader.batching import pack_raw, stack_images
from stager.loader.rank import (
    LOCAL_MIN_RUN,
    LOCAL_RUN_BYTES,
    MAX_BUFFER_SAMPLES,
    SHARED_MIN_RUN,
    SHARED_RUN_BYTES,
    EpochPosition,
    PlanGroup,
    RankDataset,
    plan_group,
    run_size,
)
from stager.loader.shm import Channel, WorkerRing

__all__ = [
    "LOCAL_MIN_RUN",
    "LOCAL_RUN_BYTES",
    "MAX_BUFFER_SAMPLES",
    "SHARED_MIN_RUN",
    "SHARED_RUN_BYTES",
    "EpochPosition",
    "PlanGroup",
    "TorchRankDataset",
    "WorkerStreams",
    "plan_group",
    "run_size",
]


class TorchRankDataset(RankDataset):
    """One rank's shuffled, padded share of a packed dataset (or ImageFolder tree), as torch batches.

    ``TorchRankDataset(path, LoaderOptions(...))``, or ``TorchRankDataset(path, batch_size, **settings)``
    with :func:`~stager.loader.make_loader`'s keyword arguments. ``resolved``: an already resolved
    dataset to share (the prefetcher plans several ranks over one index).

    Batches are dicts: ``key`` (list[str]), ``label`` (int64 tensor (B,)), ``index`` (int64 tensor
    (B,), global sample ids in manifest order), and ``image`` (uint8 (B, C, H, W), channels-last
    memory) for ``decode="uint8"``, ``data``/``offsets`` (one uint8 buffer + int64 (B + 1,)) for
    ``"raw"`` in workers (in-process: ``image`` = list of ``memoryview``), or ``image`` (list of PIL
    images) for ``"pil"``. ``_w`` carries the worker's timing figures (consumed by
    :class:`~stager.loader.Loader`).

    ``num_workers=None`` takes the worker count from the DataLoader at iteration time (the order
    depends on it; the Loader always passes it explicitly so that its state can be resumed).

    Between epochs the owner moves it with :meth:`set_epoch`, :meth:`resume` (an explicit order
    after an elastic resume), ``start_batch`` (where the next pass starts) or :meth:`seek` (all
    three at once, as persistent workers receive it); ``shm_channel`` (set inside each worker from the
    Loader's :class:`WorkerStreams` or persistent feed) makes workers send batches through reused
    shared-memory rings over that channel (:mod:`stager.loader.shm`).
    """

    def _runtime_workers(self) -> int:
        info = get_worker_info()
        return info.num_workers if info is not None else 0

    def dataloader_batches(self) -> Iterator[dict[str, Any]]:
        """What a DataLoader over this dataset yields in the process it runs in: worker ``k`` of ``W``
        (``get_worker_info``) its stream's batches, the main process (no workers) all of them."""
        info = get_worker_info()
        phys, nphys = (info.id, info.num_workers) if info is not None else (0, 1)
        streams = self.config().streams
        if nphys != streams:
            raise UsageError(
                f"ShardedDataset was planned for {streams} worker stream(s) but runs in {nphys}; "
                "pass the DataLoader's num_workers (or num_workers=None) to ShardedDataset"
            )
        yield from self.worker_batches(phys, in_worker=info is not None)

    def _worker_ring(self) -> WorkerRing | None:
        """This worker's shared-memory batch ring on the Loader's current channel (None: torch's tensors)."""
        if self.shm_channel is None:
            return None
        if self._ring is None or self._ring.token != self.shm_channel.token:
            self._ring = WorkerRing(self.shm_channel)
        return self._ring

    def _image_fields(self, items: list[Any], *, in_worker: bool, ring: Any) -> dict[str, Any]:
        if ring is not None and items:
            return {"image_nhwc": stack_images(items, ring=ring)}
        return {"image": stack_images(items, shared=in_worker)}

    def _raw_fields(self, items: list[Any], *, in_worker: bool, ring: Any) -> dict[str, Any]:
        if in_worker:
            data, offsets = pack_raw(items, shared=True, ring=ring)
            return {"data": data, "offsets": offsets}
        return {"image": [x if isinstance(x, memoryview) else memoryview(x) for x in items]}


class WorkerStreams(IterableDataset):
    """What a Loader's DataLoader iterates: ``ds``'s :meth:`~TorchRankDataset.dataloader_batches`, its batch
    buffers sent over ``channel`` (the epoch's :class:`~stager.loader.shm.Channel`; None: torch's tensors)."""

    def __init__(self, ds: TorchRankDataset, channel: Channel | None = None) -> None:
        self.ds = ds
        self.channel = channel

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.ds.shm_channel = self.channel  # this worker's copy of the dataset
        return self.ds.dataloader_batches()
