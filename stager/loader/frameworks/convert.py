"""Which objects a framework's set-up call hands to stager: a Loader, or a DataLoader over a ShardedDataset.

A torch ``DataLoader(ShardedDataset(...), batch_size=None, num_workers=W)`` is already one rank's
share; Accelerate's ``prepare`` would split it across the ranks again and Fabric's loader would
never move its epoch. :func:`stager_loader_of` turns it into the :class:`~stager.loader.Loader` that
``make_loader`` would have built over the same dataset (its worker settings taken from the
DataLoader, its ``collate_fn`` kept), so both set-up calls give the same object either way.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from stager.errors import UsageError

if TYPE_CHECKING:
    from stager.loader.loader import Loader


def stager_loader_of(obj: Any) -> Loader | None:
    """``obj`` as a stager Loader: itself, a Loader over a DataLoader's ShardedDataset, or None (not stager's)."""
    from torch.utils.data import DataLoader  # noqa: PLC0415 (torch only where a framework hands us one)

    from stager.loader.dataset import ShardedDataset  # noqa: PLC0415 (torch)
    from stager.loader.loader import Loader  # noqa: PLC0415 (torch)

    if isinstance(obj, Loader):
        return obj
    if isinstance(obj, DataLoader) and isinstance(obj.dataset, ShardedDataset):
        return _loader_over(obj)
    return None


def _loader_over(dl: Any) -> Loader:
    from torch.utils.data._utils.collate import default_convert  # noqa: PLC0415 (torch)

    from stager.loader.loader import Loader  # noqa: PLC0415 (torch)

    ds = dl.dataset
    if dl.batch_size is not None:
        raise UsageError(
            f"DataLoader(ShardedDataset, batch_size={dl.batch_size}) would collate {dl.batch_size} of its batches "
            "into one: pass batch_size=None (the dataset's batch_size sets the batch); code that batches samples "
            "itself, such as the Hugging Face Trainer, takes stager.loader.SampleDataset"
        )
    workers = ds.options.num_workers
    if workers is not None and workers != dl.num_workers:
        raise UsageError(
            f"ShardedDataset was planned for num_workers={workers}, its DataLoader has num_workers={dl.num_workers}: "
            "pass the DataLoader's num_workers (or num_workers=None) to ShardedDataset"
        )
    many = dl.num_workers > 0
    ds.options = dataclasses.replace(
        ds.options,
        num_workers=dl.num_workers,
        pin_memory=bool(dl.pin_memory),
        prefetch_factor=dl.prefetch_factor if many else None,
        multiprocessing_context=dl.multiprocessing_context if many else None,
        timeout=dl.timeout,
        persistent_workers=None,  # the Loader's own (kept across epochs; the same batches as fresh ones)
    )
    loader = Loader(ds)
    if dl.collate_fn is not default_convert:
        loader.collate_fn = dl.collate_fn
    return loader
