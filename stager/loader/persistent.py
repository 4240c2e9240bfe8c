"""Persistent DataLoader workers: started once per :class:`~stager.loader.Loader`, told each epoch what to read.

Why: on a small-sample set (CIFAR-like, ~2.5 KB per sample) a whole epoch takes a fraction of a
second, and starting the DataLoader's worker processes was a third to a half of it. With torch's
``persistent_workers=True`` the workers stay alive and torch calls ``iter()`` again on *their own
copy* of the dataset at each epoch, so the main process' ``set_epoch`` / ``load_state_dict`` never
reach them by themselves. Here each epoch's parameters (epoch, resume position, elastic-resume
sequence) travel as one message per worker:

* main process, before each epoch (:meth:`WorkerPool.epoch_iter`): bump a shared generation counter,
  put an :class:`EpochMessage` (generation, the dataset's
  :class:`~stager.loader.torch_dataset.EpochPosition`) on every worker's queue, then ``iter()`` the
  DataLoader (torch sends its resume marker to each worker after that);
* worker, at the start of its epoch (:meth:`EpochFeed.__iter__`): read the generation and take
  messages off its queue until it holds the one of that generation (a late run of an abandoned
  epoch may already have taken it: then it is reused), move its dataset copy there
  (``seek``), iterate it.

The order is therefore exactly the non-persistent one (same plan, same worker round robin: torch
restarts its cycle at worker 0 each epoch). The shared-memory channel lives as long as the pool: the
feed carries its workers' end into them when they start (the main process then closes its copy), and
each worker keeps one batch ring across epochs; :meth:`WorkerPool.close` stops the workers first,
then closes the channel's inbox (:mod:`stager.loader.shm`). A ``weakref.finalize`` on the Loader calls it
when the Loader is collected or at interpreter exit.

A pool belongs to the process that started it: a process forked from it (``os.fork``) inherits the
Loader and the pool's objects, but the workers are not its children. There the Loader starts a pool of
its own, and never stops the parent's workers (its inherited finalizer, run when the child drops the
Loader or exits, does nothing).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from stager.loader import fork_guard, shm
from stager.loader.forkgc import frozen_for_fork
from stager.loader.torch_dataset import EpochPosition, TorchRankDataset

# How long a worker waits for its epoch message between checks that the main process still lives.
_POLL_S = 1.0


def _context(mp_context: Any) -> Any:
    if mp_context is None:
        return multiprocessing.get_context()
    if isinstance(mp_context, str):
        return multiprocessing.get_context(mp_context)
    return mp_context


@dataclass(frozen=True)
class EpochMessage:
    """One epoch's parameters for every persistent worker: generation ``gen``, where to read."""

    gen: int
    position: EpochPosition


class EpochFeed(IterableDataset):
    """What the persistent workers iterate: the dataset, re-parameterised by each epoch's message, its batch
    buffers sent over ``channel`` (the pool's :class:`~stager.loader.shm.Channel`; None: torch's tensors)."""

    def __init__(self, ds: TorchRankDataset, queues: list[Any], gen: Any, channel: shm.Channel | None) -> None:
        self.ds = ds
        self.queues = queues
        self.gen = gen
        self.channel = channel
        self.parent_pid = os.getpid()
        self._msg: EpochMessage | None = None

    def _message(self, worker: int) -> EpochMessage:
        target = int(self.gen.value)
        q = self.queues[worker]
        while self._msg is None or self._msg.gen < target:
            try:
                self._msg = q.get(timeout=_POLL_S)
            except queue.Empty:
                if os.getppid() != self.parent_pid:
                    raise RuntimeError("stager.loader: the main process is gone") from None
        return self._msg

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        if info is None:
            raise RuntimeError("EpochFeed runs only inside persistent DataLoader workers")
        m = self._message(info.id)
        self.ds.seek(m.position)
        self.ds.shm_channel = self.channel
        yield from self.ds.dataloader_batches()


class WorkerPool:
    """One Loader's persistent DataLoader (workers started at the first epoch) and its epoch channel."""

    def __init__(self, ds: TorchRankDataset, num_workers: int, dl_kwargs: dict[str, Any]) -> None:
        ctx = _context(dl_kwargs.get("multiprocessing_context"))
        self.queues = [ctx.Queue() for _ in range(num_workers)]
        self.gen = ctx.Value("q", 0, lock=False)
        self.channel = shm.open_channel()
        self.feed = EpochFeed(ds, self.queues, self.gen, self.channel)
        self.dl: DataLoader[Any] | None = DataLoader(
            self.feed, batch_size=None, num_workers=num_workers, persistent_workers=True, **dl_kwargs
        )
        self.closed = False
        self.owner = os.getpid()

    def epoch_iter(self, ds: TorchRankDataset) -> Iterator[Any]:
        """Send the main process' epoch parameters (``ds``) to every worker; the DataLoader's iterator."""
        assert self.dl is not None, "closed pool"
        g = int(self.gen.value) + 1
        self.gen.value = g
        msg = EpochMessage(g, ds.position)
        for q in self.queues:
            q.put(msg)
        with frozen_for_fork():  # the first iter() forks the workers
            it = iter(self.dl)
        fork_guard.track(it)
        if self.channel is not None:
            self.channel.close()  # the workers (started by the first iter()) hold their end
        return it

    def close(self) -> None:
        """Stop the workers (joined), then close their rings' inbox. Idempotent; nothing in a forked process
        (the workers are its parent's)."""
        if self.closed or os.getpid() != self.owner:
            return
        self.closed = True
        dl, self.dl = self.dl, None
        it = getattr(dl, "_iterator", None) if dl is not None else None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        for q in self.queues:
            q.cancel_join_thread()  # an unread message must not block the exit
            q.close()
        if self.channel is not None:
            self.channel.close()
            shm.cleanup(self.channel.token)
