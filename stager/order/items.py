"""What the epoch plan deals out: *items*. An item is one sample, or one window of frames.

:mod:`stager.order.epoch` plans over item ids ``0 .. M-1`` grouped by shard (``starts``, shape
(shards + 1,)); :mod:`stager.order.reads` schedules reads over *sample* ids. An :class:`ItemSpace`
connects the two: it gives the plan its per-shard item layout and turns a worker's item plan into
the sample plan the read schedule and the fetchers work on (:meth:`ItemSpace.reading_plan`).

* :class:`SampleItems`: an item is a sample; the reading plan is the plan itself.
* :class:`~stager.order.windows.Windows`: an item is a window of T frames (docs/clips.md).
"""

from __future__ import annotations

import numpy as np

from stager.order.epoch import WorkerPlan


class ItemSpace:
    """The items of a dataset, as the plan needs them.

    ``starts``: int64 (shards + 1,), the first item id of each shard, then M (items are grouped by
    the shard they start in). ``per_item``: samples per item (1, or T).
    """

    starts: np.ndarray
    per_item: int

    @property
    def count(self) -> int:
        raise NotImplementedError

    def shard_bytes(self, sizes: np.ndarray) -> np.ndarray:
        """Per shard (int64, (shards,)): payload bytes of its items (``sizes``: per sample, (N,))."""
        raise NotImplementedError

    def samples_of(self, items: np.ndarray) -> np.ndarray:
        """Sample ids of ``items`` (int64, (n, per_item)), in frame order."""
        raise NotImplementedError

    def item_mask(self, sample_mask: np.ndarray) -> np.ndarray:
        """Items (bool, (M,)) whose samples are all in ``sample_mask`` (bool, (N,))."""
        raise NotImplementedError

    def reading_plan(self, wp: WorkerPlan) -> WorkerPlan:
        """``wp`` (over item ids) as a plan over sample ids for :func:`~stager.order.reads.worker_reads`."""
        raise NotImplementedError


class SampleItems(ItemSpace):
    """Items are samples: the identity (``starts`` = the dataset's sample starts)."""

    per_item = 1

    def __init__(self, starts: np.ndarray) -> None:
        self.starts = np.asarray(starts, dtype=np.int64)

    @property
    def count(self) -> int:
        return int(self.starts[-1]) if len(self.starts) else 0

    def shard_bytes(self, sizes: np.ndarray) -> np.ndarray:
        csum = np.concatenate([[0], np.cumsum(sizes)])
        return (csum[self.starts[1:]] - csum[self.starts[:-1]]).astype(np.int64)

    def samples_of(self, items: np.ndarray) -> np.ndarray:
        return np.asarray(items, dtype=np.int64).reshape(-1, 1)

    def item_mask(self, sample_mask: np.ndarray) -> np.ndarray:
        return sample_mask

    def reading_plan(self, wp: WorkerPlan) -> WorkerPlan:
        return wp
