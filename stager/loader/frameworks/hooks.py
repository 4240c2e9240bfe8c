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
(:mod:`stager.loader.frameworks.accelerate`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any, Protocol

from torch.utils.data import SequentialSampler


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

    def __len__(self) -> int: ...


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
    from stager.loader.frameworks.accelerate import AcceleratePass  # noqa: PLC0415 (no accelerate import there)

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
