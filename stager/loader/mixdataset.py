"""``MixShardedDataset``: a mix of datasets (:class:`~stager.loader.mixing.MixDataset`) as a torch IterableDataset.

The mix's plan, reads and assembly with :class:`~stager.loader.dataset.ShardedDataset`'s torch side
(DataLoader worker ids, shared-memory batch rings, (B, C, H, W) tensors), so
:class:`~stager.loader.Loader` and its persistent workers run a mix as they run one dataset.
"""

from __future__ import annotations

from stager.loader.dataset import ShardedDataset
from stager.loader.mixing import MixDataset

__all__ = ["MixShardedDataset"]


class MixShardedDataset(MixDataset, ShardedDataset):
    """``MixShardedDataset(mix, LoaderOptions(...))``: see :class:`~stager.loader.mixing.MixDataset`."""
