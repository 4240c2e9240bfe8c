"""``Loader``: the object :func:`make_loader` returns: :class:`~stager.loader.base.LoaderBase` over torch.

It runs a :class:`~stager.loader.torch_dataset.TorchRankDataset` in a torch DataLoader (``batch_size=None``:
batches are built in the workers; persistent workers by default, :mod:`stager.loader.persistent`) or
in-process when ``num_workers=0``, and turns raw batches' shared buffers into per-sample
``memoryview`` slices and small arrays into tensors (:func:`~stager.loader.batching.finish_batch`).
Counting, epochs, resume state and stats are :class:`~stager.loader.base.LoaderBase`'s, shared with
the numpy transport. It moves the dataset only through the dataset's public surface
(``set_epoch``, ``resume``, ``start_batch``, ``worker_batches``, ``group``, ``samples_in_epoch``).

What training frameworks look for (:mod:`stager.loader.frameworks`): ``sampler``, an object whose
``set_epoch`` Lightning and Fabric call at every epoch's start (as they do for a DistributedSampler);
``device``, where batches are moved (set by ``accelerator.prepare`` and ``fabric.setup_dataloaders``);
Accelerate's ``end_of_dataloader``/``remainder`` while an Accelerator is active.
"""

from __future__ import annotations

import multiprocessing
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from stager.errors import UsageError
from stager.loader import fork_guard, frameworks, shm
from stager.loader.base import EpochBatches, LoaderBase
from stager.loader.batching import finish_batch
from stager.loader.forkgc import frozen_for_fork
from stager.loader.frameworks import convert
from stager.loader.frameworks.hooks import EpochHook, epoch_batches
from stager.loader.options import LoaderOptions
from stager.loader.persistent import WorkerPool
from stager.loader.torch_dataset import TorchRankDataset, WorkerStreams

__all__ = ["EpochBatches", "Loader"]


def _next_of(it: Any) -> Callable[[], dict[str, Any]]:
    # torch's iterator __next__ wraps each batch in a profiler record_function (a TorchBind op
    # call on enter and exit: ~20% of the main process' time per small raw batch here); its
    # _next_data is the batch itself (pin-memory thread, worker errors, timeouts included).
    return getattr(it, "_next_data", None) or it.__next__


class Loader(LoaderBase):
    """Iterable of batch dicts for one rank (see :class:`~stager.loader.torch_dataset.TorchRankDataset` for the batch
    layout).

    ``Loader(dataset)`` takes its worker-process settings (``num_workers``, ``pin_memory``,
    ``prefetch_factor``, ``multiprocessing_context``, ``timeout``, ``persistent_workers``) from
    ``dataset.options``; ``num_workers=None`` there means in-process.

    Epochs, ``len``, resume and stats: :class:`~stager.loader.base.LoaderBase`.

    ``persistent_workers`` (default: on when ``num_workers > 0``): the worker processes start at
    the first epoch and serve every later one (each epoch's parameters reach them through
    :mod:`stager.loader.persistent`); same batches as fresh workers per epoch. They stop at
    :meth:`close`, when the Loader is collected, or at interpreter exit.

    ``device`` (None: leave batches where they are): a ``torch.device`` every batch's tensors are moved to
    (``non_blocking`` with ``pin_memory``); ``collate_fn`` (None): a function applied to every finished
    batch. Both are set by Accelerate's and Fabric's set-up calls (:mod:`stager.loader.frameworks`).
    ``batch_sampler`` is None and ``sampler`` an epoch hook: what Lightning's and Fabric's loops call.
    """

    batch_sampler = None
    # Accelerate's dataloader flags, kept up to date while an Accelerator is active (frameworks.accelerate).
    end_of_dataloader = False
    remainder = -1

    def __init__(self, dataset: TorchRankDataset) -> None:
        opts: LoaderOptions = dataset.options
        self.dataset: TorchRankDataset = dataset
        self.device: Any = None
        self.collate_fn: Callable[[dict[str, Any]], Any] | None = None
        self.num_workers = int(opts.num_workers or 0)
        self.persistent_workers = self.num_workers > 0 and (
            opts.persistent_workers is None or bool(opts.persistent_workers)
        )
        self._pool: WorkerPool | None = None
        self._pool_finalizer: weakref.finalize[Any, Any] | None = None
        self.pin_memory = opts.pin_memory
        self.prefetch_factor = opts.prefetch_factor
        self.multiprocessing_context = opts.multiprocessing_context
        self.timeout = opts.timeout
        super().__init__(dataset)
        frameworks.install_present()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into other processes (a DataModule into ddp_spawn's ranks): the workers stay here.
        return {**self.__dict__, "_pool": None, "_pool_finalizer": None}

    @property
    def sampler(self) -> EpochHook:
        """The epoch hook Lightning and Fabric call each epoch (``sampler.set_epoch(e)`` is ``set_epoch(e)``)."""
        return EpochHook(self)

    def __iter__(self) -> Iterator[Any]:
        return epoch_batches(self, super().__iter__())

    def _open_epoch(self) -> EpochBatches:
        """The epoch's batch source: in this process, from the persistent pool, or from fresh workers."""
        ds = self.dataset
        if self.num_workers == 0:
            # In this process, whatever process it is (not dataloader_batches(), which would take a
            # DataLoader worker running this Loader for one of the Loader's own workers).
            return EpochBatches(ds.worker_batches(0, in_worker=False).__next__, lambda clean: None)
        if multiprocessing.current_process().daemon:
            raise UsageError(
                f"a Loader with num_workers={self.num_workers} cannot start worker processes inside a daemonic "
                "process (a DataLoader worker, a multiprocessing Pool's): build it with num_workers=0 there"
            )
        if self.persistent_workers:
            pool = self._worker_pool()

            def end_persistent(clean: bool) -> None:
                # A worker error or a broken contract: start afresh next epoch (unless a newer pass
                # already did, and the pool now serves it).
                if not clean and self._pool is pool:
                    self.close()

            return EpochBatches(_in_this_process(_next_of(pool.epoch_iter(ds))), end_persistent)
        from torch.utils.data import DataLoader  # noqa: PLC0415 (torch is imported only where a process group is used)

        channel = shm.open_channel()
        dl = DataLoader(WorkerStreams(ds, channel), batch_size=None, num_workers=self.num_workers,
                        **self._dl_kwargs())
        try:
            with frozen_for_fork():  # iter() forks the workers
                it = iter(dl)
            fork_guard.track(it)
        finally:
            if channel is not None:
                channel.close()  # the workers (started by iter()) hold their end

        def end_fresh(clean: bool) -> None:
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            # This epoch's channel: an abandoned epoch's iterator may be closed after the next one began.
            if channel is not None:
                shm.cleanup(channel.token)

        return EpochBatches(_in_this_process(_next_of(it)), end_fresh)

    def _finish(self, batch: dict[str, Any]) -> dict[str, Any]:
        return finish_batch(batch)

    def _dl_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "pin_memory": self.pin_memory,
            "multiprocessing_context": self.multiprocessing_context,
            "timeout": self.timeout,
            # Batches are already built; torch's default_convert would turn the small numpy
            # arrays into tensors inside the worker (one shared-memory segment each).
            "collate_fn": _identity,
        }
        if self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs

    def _worker_pool(self) -> WorkerPool:
        if self._pool is None or self._pool.closed or self._pool.owner != os.getpid():
            # (A forked process' inherited pool is its parent's: never used, never closed here.)
            self._pool = WorkerPool(self.dataset, self.num_workers, self._dl_kwargs())
            # Not a bound method: the finalizer must not keep the Loader alive.
            self._pool_finalizer = weakref.finalize(self, self._pool.close)
        return self._pool

    def close(self) -> None:
        """Stop persistent workers now (the next epoch starts new ones). No-op otherwise."""
        if self._pool_finalizer is not None:
            self._pool_finalizer()
        self._pool = self._pool_finalizer = None


def _in_this_process(next_batch: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """``next_batch``, refused in one line in a process forked from this one: the epoch's DataLoader workers are
    this process' (stager.loader.fork_guard leaves them to it), and a forked child starts its own with a new pass."""
    owner = os.getpid()

    def next_here() -> dict[str, Any]:
        if os.getpid() != owner:
            raise UsageError(f"this epoch's batches come from the DataLoader workers of process {owner}, which "
                             "this process was forked from: iterate the Loader anew here (a new pass starts "
                             "workers of its own)")
        return next_batch()

    return next_here


def _identity(batch: Any) -> Any:
    return batch


def _itself(obj: Any) -> Loader | None:
    """A Loader handed to a framework's set-up call is itself (:mod:`stager.loader.frameworks.convert`)."""
    return obj if isinstance(obj, Loader) else None


convert.register(_itself)
