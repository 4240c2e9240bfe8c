"""A mix of datasets (:class:`~stager.loader.mix.dataset.MixDataset`) on the torch transport.

The mix's plan, reads and assembly with :class:`~stager.loader.torch_dataset.TorchRankDataset`'s torch side
(DataLoader worker ids, shared-memory batch rings, (B, C, H, W) tensors), so
:class:`~stager.loader.Loader` and its persistent workers run a mix as they run one dataset.
:class:`MixTorchRankDataset` is what a Loader of a mix holds (no ``IterableDataset``, as for one dataset:
docs/training.md, "Frameworks"); :class:`MixShardedDataset` is the same as a torch ``IterableDataset``
for users' own DataLoaders.
"""

from __future__ import annotations

from stager.loader.mix.dataset import MixDataset
from stager.loader.sharded import ShardedDataset
from stager.loader.torch_dataset import TorchRankDataset

__all__ = ["MixShardedDataset", "MixTorchRankDataset"]


class MixTorchRankDataset(MixDataset, TorchRankDataset):
    """``MixTorchRankDataset(mix, LoaderOptions(...))``: see :class:`~stager.loader.mix.dataset.MixDataset`."""


class MixShardedDataset(MixDataset, ShardedDataset):
    """``MixShardedDataset(mix, LoaderOptions(...))``: see :class:`~stager.loader.mix.dataset.MixDataset`."""
