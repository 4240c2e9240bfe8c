"""What every framework calls on a loader: the epoch hook, and the per-batch duties of an epoch.

:class:`EpochHook` is the Loader's ``sampler``: Lightning's fit and evaluation loops and Fabric's
dataloader call ``dataloader.sampler.set_epoch(epoch)`` at every epoch's start, for a
DistributedSampler's sake; for a stager loader it is ``loader.set_epoch(epoch)``, so the epoch (and so
the order) is the framework's: restored from a checkpoint, carried on after ``limit_train_batches`` cut
an epoch short, given to a loader rebuilt by ``reload_dataloaders_every_n_epochs``. After a
``load_state_dict``, ``set_epoch`` of the same epoch keeps the resume position (LoaderBase).

:func:`epoch_batches` wraps one pass of the Loader: batches moved to ``loader.device``, passed through
``loader.collate_fn``, and, while an Accelerator is active, the Loader registered as Accelerate's
active dataloader with ``end_of_dataloader`` set before the last batch is handed out
(:class:`AcceleratePass`; its wrappers of Accelerate's set-up calls are
:mod:`stager.loader.frameworks.accelerate`). This module imports no framework and nothing of the
Loader (the Loader imports it), only what the :class:`FrameworkLoader` protocol says.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any, Protocol

import numpy as np
from torch.utils.data import SequentialSampler

from stager.errors import UsageError

log = logging.getLogger("stager.loader")

_PAD_LOGGED: weakref.WeakSet[Any] = weakref.WeakSet()  # loaders whose unmovable padding was logged


class FrameworkLoader(Protocol):
    """What these hooks use of a :class:`~stager.loader.Loader` (typed here, not imported: the Loader imports
    this module)."""

    dataset: Any  # a TorchRankDataset
    device: Any
    collate_fn: Callable[[dict[str, Any]], Any] | None
    pin_memory: bool
    end_of_dataloader: bool
    remainder: int

    @property
    def batches_done(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def skip_to(self, batch: int) -> None: ...

    def close(self) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...


class EpochHook(SequentialSampler):
    """Sampler-like: ``set_epoch(epoch)`` sets the loader's epoch; ``len()`` and ``iter()``: its batch positions.

    A ``SequentialSampler`` to Lightning: the loader's order is its own (no sampler to swap in), so
    Lightning leaves it as it is (``overfit_batches`` would otherwise try to rebuild the loader as a
    DataLoader; for overfitting build it with ``shuffle=False``).
    """

    def __init__(self, loader: FrameworkLoader) -> None:  # no data_source: the loader is the source
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(int(epoch))

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.loader)))


def to_device(batch: Any, device: Any, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor in it (nested dicts, lists, tuples) moved to ``device``; other values as they are."""
    if hasattr(batch, "to") and hasattr(batch, "device"):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and any(hasattr(v, "device") for v in batch):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def epoch_batches(loader: FrameworkLoader, batches: Iterator[dict[str, Any]]) -> Generator[Any, None, None]:
    """One pass of ``loader`` (``batches``: LoaderBase's iterator) with the frameworks' per-batch duties."""
    session = AcceleratePass.begin(loader)
    device, collate = loader.device, loader.collate_fn
    try:
        for batch in batches:
            out: Any = batch
            if collate is not None:
                out = collate(out)
            if device is not None:
                out = to_device(out, device, non_blocking=bool(loader.pin_memory))
            if session is not None:
                session.before_yield()
            yield out
    finally:
        close = getattr(batches, "close", None)  # LoaderBase's generator: end the epoch's transport now
        if close is not None:
            close()
        if session is not None:
            session.end()


class AcceleratePass:
    """One pass of a Loader as Accelerate's active dataloader (``GradientState``), while an Accelerator exists."""

    def __init__(self, loader: FrameworkLoader, state: Any) -> None:
        self.loader = loader
        self.state = state
        self.length: int | None = None

    @classmethod
    def begin(cls, loader: FrameworkLoader) -> AcceleratePass | None:
        mod = sys.modules.get("accelerate.state")
        if mod is None or not mod.GradientState._shared_state:
            return None  # no Accelerator in this process
        state = mod.GradientState()
        loader.end_of_dataloader, loader.remainder = False, -1
        state._add_dataloader(loader)
        return cls(loader, state)

    def before_yield(self) -> None:
        """Mark the epoch's last batch before it is handed out (``accumulate`` reads the flag on entry)."""
        if self.length is None:
            self.length = len(self.loader.dataset)
        if self.loader.batches_done >= self.length and not self.loader.end_of_dataloader:
            self.loader.remainder = gather_remainder(self.loader)
            self.loader.end_of_dataloader = True

    def end(self) -> None:
        self.state._remove_dataloader(self.loader)


def gather_remainder(loader: FrameworkLoader) -> int:
    """The real rows of the epoch's last gathered batch (Accelerate's ``remainder``; 0: keep all rows).

    ``gather_for_metrics`` keeps the first ``remainder`` rows of the last batch gathered over the ranks
    (rank 0's rows first). That drops exactly the padding repeats when they all sit at the tail of that
    gathered batch: always when ``shuffle=False`` batches are dealt to the ranks in turn (what
    ``accelerator.prepare`` asks: the repeats are the epoch's last positions, the end of its last round),
    and with contiguous rank slices when they sit at the end of the last rank's last batch. Otherwise
    (shuffled padding lies anywhere in the last rank's share; a mix pads each stream's share on its own, inside
    its batches) nothing can be dropped there: 0, logged once with what to evaluate with instead.
    """
    ds = loader.dataset
    sizes = ds.batch_sizes()
    world = ds.group.world_size
    pad = world * int(sizes.sum()) - ds.samples_in_epoch()
    if not len(sizes) or pad <= 0:
        return 0
    if ds.deal_batches and ds.mode == "none":  # pad < world <= the last round's rows
        return world * int(sizes[-1]) - pad
    advice = "evaluate with shuffle=False (or drop_last=True)"
    try:
        last = None if ds.group.node_partitioned else ds.plan(rank=world - 1)
    except UsageError:  # a mix: one plan per stream, its padding anywhere in the layout
        last = None
        advice = ("a mix pads each stream on its own: evaluate each dataset with its own shuffle=False loader "
                  "(or the mix with drop_last=True)")
    if last is not None and _padding_at_tail(last, pad):
        return world * int(sizes[-1]) - pad
    if loader not in _PAD_LOGGED:
        _PAD_LOGGED.add(loader)
        log.info("stager.loader: %d padding repeats of this epoch are not at the end of the last batch, so "
                 "accelerate's gather_for_metrics keeps them; %s", pad, advice)
    return 0


def _padding_at_tail(plan: Any, pad: int) -> bool:
    """All ``pad`` repeats of the epoch in ``plan`` (the last rank's), at the end of its last batch."""
    if int(plan.padded) != pad or not plan.num_batches:
        return False
    nw = len(plan.workers)
    j = plan.num_batches - 1
    w = plan.workers[j % nw]
    is_pad = np.asarray(w.is_pad[w.batch_positions(j // nw)], dtype=bool)
    return len(is_pad) >= pad and bool(is_pad[len(is_pad) - pad :].all()) and int(is_pad.sum()) == pad
