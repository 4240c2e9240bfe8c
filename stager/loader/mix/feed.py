"""A worker's side of a mix: one feed per stream, and where each stream's items go in a batch.

:class:`StreamFeed` reads one stream of one worker's plan as that stream's own read schedule says
(:func:`stager.order.reads.worker_reads`, a :mod:`stager.loader.fetch` fetcher) and hands out each
batch's payloads; item ids, keys and labels are looked up a window of batches at a time
(:meth:`StreamFeed.window`) and put in the layout's order once per window (:func:`window_order`).
:func:`gather_order` turns the layout's slots into the permutation that puts the streams' items,
gathered stream after stream, in the batch's order; :func:`stream_counts` and :func:`subsequence_mask`
are its bookkeeping. :class:`~stager.loader.mix.dataset.MixDataset` runs them; no torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stager.loader.fetch import Fetcher, MappedFetcher, PreadFetcher
from stager.loader.rank import RankDataset
from stager.loader.shard_access import ShardAccess
from stager.manifest import Strings
from stager.order.epoch import WorkerPlan
from stager.order.mixplan import MixWorkerPlan
from stager.order.reads import worker_reads

GATHER_WINDOW = 64  # a worker's batches whose gather order, ids, keys and labels are computed at once
# The first window of a pass is short (what the first batch waits for), the next ones full.
FIRST_WINDOW = 2


def window_order(slots: np.ndarray, streams: int) -> np.ndarray:
    """Per place of a window of batches (int64, shape of ``slots``): its index in the streams' window items
    concatenated stream after stream (each stream's items in its own order: the k-th place of stream s is
    stream s's k-th item). A pass per stream for a few streams (a stable argsort costs ~2x at 16k places)."""
    order = np.empty(len(slots), dtype=np.int64)
    if streams > 8:
        order[np.argsort(slots, kind="stable")] = np.arange(len(slots), dtype=np.int64)
        return order
    off = 0
    for s in range(streams):
        where = np.flatnonzero(slots == s)
        order[where] = np.arange(off, off + len(where), dtype=np.int64)
        off += len(where)
    return order


def gather_order(order: np.ndarray, slots: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per place of a window of batches (int32, shape of ``slots``): its index among its batch's places sorted
    by stream (stably), i.e. where its item is once the batch's items of each stream are concatenated in
    stream order. ``order``: :func:`window_order` of ``slots``; ``counts``: the window's items per batch and
    stream (int64 (batches, streams), :func:`stream_counts`).

    A place of batch ``b`` and stream ``s`` that is stream ``s``'s k-th in the window (``order`` = the
    stream's offset + k) is its batch's ``k - (the stream's items in earlier batches)``-th of ``s``, after
    the batch's items of the streams before ``s``: one (batches, streams) table of corrections, one gather."""
    before = np.cumsum(counts, axis=0) - counts  # stream s's items in the window's batches before b
    offset = np.concatenate([[0], np.cumsum(counts.sum(axis=0))[:-1]]).astype(np.int64)
    within = np.cumsum(counts, axis=1) - counts  # batch b's items of the streams before s
    batch = np.repeat(np.arange(len(counts), dtype=np.int64), counts.sum(axis=1))
    return (order + (within - before - offset[None, :])[batch, slots]).astype(np.int32)


def stream_counts(wp: MixWorkerPlan) -> np.ndarray:
    """Items of each stream in each of the worker's batches (int64 (batches, streams))."""
    out = np.zeros((len(wp.batches), len(wp.parts)), dtype=np.int64)
    for i, (part, step) in enumerate(zip(wp.parts, wp.steps, strict=True)):
        has = step >= 0
        out[has, i] = part.sizes[step[has]]
    return out


def subsequence_mask(ids: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Which entries of ``ids`` the ordered subsequence ``kept`` keeps (bool, shape of ``ids``)."""
    mask = np.zeros(len(ids), dtype=bool)
    k = 0
    for i, x in enumerate(ids.tolist()):
        if k < len(kept) and x == int(kept[k]):
            mask[i] = True
            k += 1
    return mask


class StreamFeed:
    """One stream of one worker's plan: its reads, as the stream's read schedule says, and its items per batch."""

    def __init__(self, member: RankDataset, part: WorkerPlan, access: ShardAccess, *, start_batch: int,
                 owned: bool) -> None:
        self.member, self.part = member, part
        self.reading = member.items.reading_plan(part)
        reads = worker_reads(self.reading, member.index.starts, member.index.sizes, start_batch=start_batch)
        access.check_pid()
        if member.field_fn is not None:
            member.field_fn.access = access  # byte fields outside the payload (hdf5, parquet) are read through it
        self.fetcher: Fetcher
        cum = np.concatenate([[0], np.cumsum(part.sizes)]).astype(np.int64)
        self.cum, self.rcum = cum.tolist(), (cum * member.items.per_item).tolist()
        if access.mapped:
            self.fetcher = MappedFetcher(reads, self.reading, access)
        else:
            self.fetcher = PreadFetcher(reads, self.reading, access, on_error=member.options.on_error, owned=owned)
        self._ids = np.zeros(0, dtype=np.int64)
        self._first = 0  # the step the window's ids start at

    def window(self, lo: int, hi: int) -> tuple[np.ndarray, list[str], np.ndarray]:
        """The items of steps ``[lo, hi)``: ``(item ids int64, keys, labels int64)``, in the stream's order.
        One gather of the stream's key strings and labels per window of batches, not one per batch (its
        fixed cost is what a stream's few items per batch would otherwise pay most of)."""
        ids = self.part.stream[self.part.emit[self.cum[lo] : self.cum[hi]]].astype(np.int64, copy=False)
        m = self.member
        first = ids if m.items.per_item == 1 else m.items.samples_of(ids)[:, 0]
        keys = m.index.keys
        self._ids, self._first = ids, lo
        return (ids, keys.take(first) if isinstance(keys, Strings) else m._keys_at(first),
                np.asarray(m.index.labels[first], dtype=np.int64))

    def take(self, step: int) -> tuple[list[Any], int, np.ndarray]:
        """The stream's part of its ``step``-th batch (a step of the last :meth:`window`): ``(payloads,
        payload bytes read, item ids)``."""
        positions = self.reading.emit[self.rcum[step] : self.rcum[step + 1]]
        payloads, nbytes = self.fetcher.batch(step, positions)
        base = self.cum[self._first]
        return payloads, nbytes, self._ids[self.cum[step] - base : self.cum[step + 1] - base]
