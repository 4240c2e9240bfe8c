"""``ShardedDataset``: a torch IterableDataset that yields whole batches of one rank's epoch plan.

It is :class:`~stager.loader.torch_dataset.TorchRankDataset` (what a :class:`~stager.loader.Loader`
holds) plus torch's ``IterableDataset``, for users' own ``DataLoader(ds, batch_size=None,
num_workers=W)``. A detected world follows the initialised process group
(:meth:`~stager.loader.rank.RankDataset.rebind_world`) wherever the dataset is measured or iterated.

Such a DataLoader is already one rank's share: Accelerate's ``prepare`` would split it across the ranks
again and Fabric's loader would never move its epoch. This module registers with
:mod:`stager.loader.frameworks.convert` (as it is imported, so before any ShardedDataset exists) how
a framework's set-up call turns that DataLoader into the :class:`~stager.loader.Loader` that
``make_loader`` would have built over the same dataset (its worker settings taken from the
DataLoader, its ``collate_fn`` kept), and that the dataset is one rank's share, which Accelerate's
splitting wrappers refuse (:mod:`stager.loader.frameworks.accelerate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.collate import default_convert

from stager.errors import UsageError
from stager.loader.frameworks import convert, install_present
from stager.loader.loader import Loader
from stager.loader.torch_dataset import TorchRankDataset

__all__ = ["ShardedDataset"]


class ShardedDataset(TorchRankDataset, IterableDataset):
    """:class:`TorchRankDataset` as a torch ``IterableDataset``, for ``DataLoader(ds, batch_size=None,
    num_workers=W)``: one rank's batches, ``len(ds)`` of them per epoch (see :class:`TorchRankDataset`).

    It is already this rank's share. ``accelerator.prepare`` and ``fabric.setup_dataloaders`` of such a
    DataLoader give the stager Loader over it (:mod:`stager.loader.frameworks`); Accelerate's wrappers
    that would split it again across ranks (``IterableDatasetShard``, ``DataLoaderDispatcher``) refuse it
    in one line.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install_present()  # a framework imported after stager: its set-up calls then know this dataset

    def __len__(self) -> int:
        self.rebind_world()
        return super().__len__()

    def set_epoch(self, epoch: int) -> None:
        self.rebind_world()
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # In a forked DataLoader worker too: it inherits the initialised group (spawned workers do not;
        # their copy was made when the main process last measured or moved the dataset).
        self.rebind_world()
        yield from self.dataloader_batches()


def loader_over(dl: Any) -> Loader | None:
    """A framework's ``DataLoader(ShardedDataset, batch_size=None, ...)`` as the Loader over its dataset
    (None: not such a DataLoader). ``batch_size`` other than None is refused: it would collate batches."""
    if not isinstance(dl, DataLoader) or not isinstance(dl.dataset, ShardedDataset):
        return None
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
    collate: Any = dl.collate_fn
    if collate is not default_convert:
        loader.collate_fn = collate
    return loader


convert.register(loader_over, rank_share=ShardedDataset)
