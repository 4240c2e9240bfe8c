"""A mix's epoch, per stream: how many items each stream gives, which ones, and each rank's share.

Pure functions of the streams' sizes and shares, the run layout and (seed, epoch, world); the batch
composition on top of them is :mod:`stager.order.composition`, the rank and worker plans
:mod:`stager.order.mixplan`. Items are what a stream's plan deals out (samples, or a clip pack's
windows); ids are the stream's own (``0 .. N_i - 1``).

**Takes.** Stream ``i`` gives ``n_i`` items per epoch (:func:`stream_takes`): ``samples``, or
``round(repeat * N_i)``, or, for weighted streams, a share of what they split: ``epoch_samples``
minus the absolute takes, or by default as many items as the weighted streams hold together, cut by
largest remainders so the takes add up exactly.

**Draws** (:func:`stream_sequence`). With ``n_i = q * N_i + r`` (``0 <= r < N_i``), an epoch holds
``q`` whole passes over the stream (each its own shuffled order, so an up-sampled stream repeats
whole permutations: every item ``q`` or ``q + 1`` times an epoch) and ``r`` more items from a
*rotation*: one shuffled order per cycle of ``k = ceil(N_i / r)`` epochs, read ``r`` at a time, so a
down-sampled stream (``q = 0``) takes every item once in each cycle of ``k`` epochs before it
repeats one, never an item twice in one epoch (the cycle's last epoch tops its piece up from the
cycle's first items). Each order is :func:`~stager.order.epoch.shuffled_order` in the loader's
shuffle mode, so a piece of it is still runs of consecutive items: one read per run.

**Shares** (:func:`stream_share`). Every stream is split across ranks as the single-dataset loader
splits a dataset: rank ``r`` takes ``c_i`` items, the contiguous piece ``[r * c_i, (r + 1) * c_i)``
of the stream's epoch order, wrapped around to pad (``c_i = ceil(n_i / W)``) or cut
(``drop_last``: ``floor``). So every rank holds the same count of every stream, and its batches can
hold the same mixture. On a node-partitioned staged copy the group is the node's ranks over the
node's items, with ``c_i`` from every node's count of the draw (:func:`partitioned_per_rank`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stager.errors import UsageError
from stager.order import streams
from stager.order.epoch import samples_per_rank, shuffled_order

SHARE_KINDS = ("weight", "samples", "repeat")


def apportion(total: int, weights: Sequence[float] | np.ndarray) -> np.ndarray:
    """``total`` split in proportion to ``weights`` by largest remainders (ties: lower index first).

    Returns int64 (len(weights),) summing to ``total``; each entry is the floor or the ceiling of its
    exact share ``total * w / sum(w)``.
    """
    w = np.asarray(weights, dtype=np.float64)
    if total <= 0 or len(w) == 0:
        return np.zeros(len(w), dtype=np.int64)
    exact = total * w / w.sum()
    base = np.floor(exact).astype(np.int64)
    rest = int(total - base.sum())
    if rest > 0:
        order = np.lexsort((np.arange(len(w)), -(exact - base)))
        base[order[:rest]] += 1
    return base


def stream_takes(
    sizes: Sequence[int], shares: Sequence[tuple[str, float]], epoch_samples: int | None = None,
    names: Sequence[str] | None = None,
) -> np.ndarray:
    """Items each stream gives per epoch (int64 (S,)); see the module docstring.

    ``sizes``: each stream's item count ``N_i``; ``shares``: ``(kind, value)`` per stream, kind one of
    :data:`SHARE_KINDS` (``("repeat", 1)`` for a stream given none). ``epoch_samples``: the epoch's
    length, which the weighted streams share after the absolute takes. A one-line :class:`UsageError`
    when the numbers cannot work (a stream left with no item, an epoch too short for the absolute takes).
    """
    names = list(names) if names is not None else [f"stream {i}" for i in range(len(sizes))]
    takes = np.zeros(len(sizes), dtype=np.int64)
    weighted = [i for i, (kind, _) in enumerate(shares) if kind == "weight"]
    for i, (kind, value) in enumerate(shares):
        if kind == "samples":
            takes[i] = int(value)
        elif kind == "repeat":
            takes[i] = max(1, round(float(value) * int(sizes[i])))
        elif kind != "weight":
            raise UsageError(f"{names[i]!r}: unknown share {kind!r}; expected one of {', '.join(SHARE_KINDS)}")
    fixed = int(takes.sum())
    if not weighted:
        if epoch_samples is not None and epoch_samples != fixed:
            raise UsageError(f"epoch_samples={epoch_samples} but no stream has a weight to share it; the streams' "
                             f"samples and repeats give {fixed} per epoch: drop epoch_samples or give weights")
        return takes
    if epoch_samples is None:
        pool = int(sum(int(sizes[i]) for i in weighted))
    else:
        pool = epoch_samples - fixed
        if pool < len(weighted):
            raise UsageError(f"epoch_samples={epoch_samples} leaves {max(pool, 0)} samples for the weighted streams "
                             f"after the absolute ones take {fixed}; raise epoch_samples")
    got = apportion(pool, [float(shares[i][1]) for i in weighted])
    for i, n in zip(weighted, got.tolist(), strict=True):
        if n < 1:
            raise UsageError(f"stream {names[i]!r}: weight {shares[i][1]:g} gives 0 of the {pool} weighted samples "
                             "per epoch; raise its weight or epoch_samples")
        takes[i] = n
    return takes


def rotation_cycle(size: int, take: int) -> int:
    """Epochs in which a stream's rotation covers every item once: ``ceil(N / r)`` for the remainder
    ``r = take mod N`` (0 when the take is whole passes only)."""
    r = take % size if size else 0
    return -(-size // r) if r else 0


def stream_sequence(
    starts: np.ndarray, run_len: np.ndarray, mode: str, *, seed: int, stream: int, epoch: int, take: int
) -> np.ndarray:
    """Stream ``stream``'s items of ``epoch`` in their epoch order (int64 (take,)): ``q`` whole shuffled
    passes, then the epoch's piece of the rotation (module docstring).

    ``starts``: int64 (shards + 1,), the stream's first item id per shard, then ``N``; ``run_len``:
    its per-shard run lengths; ``mode``: the loader's shuffle mode.
    """
    starts = np.asarray(starts, dtype=np.int64)
    n = int(starts[-1]) if len(starts) else 0
    if n == 0 or take <= 0:
        return np.zeros(0, dtype=np.int64)
    q, r = divmod(int(take), n)
    parts = [shuffled_order(starts, run_len, mode, streams.mix_round(seed, stream, epoch, j)) for j in range(q)]
    if r:
        cycle, j = divmod(epoch, rotation_cycle(n, take))
        order = shuffled_order(starts, run_len, mode, streams.mix_cycle(seed, stream, cycle))
        lo, hi = j * r, (j + 1) * r
        # The cycle's last epoch reads past the order's end: its rest comes from the cycle's first
        # items, which are not in its piece (hi - n <= lo because r <= n): still no repeat in an epoch.
        parts.append(order[lo:hi] if hi <= n else np.concatenate([order[lo:], order[: hi - n]]))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class StreamEpoch:
    """One stream's epoch as a rank's group plans it.

    ``seq``: int64 (n,), the stream's items in the epoch's order. ``per_rank``: items each rank of the
    group takes (``c_i``). ``group_rank``/``group_size``: this rank in its group (the whole world, or
    on a node-partitioned staged copy the node's ranks). ``local``: on such a copy, the positions in
    ``seq`` of the node's items (int64), else None (every position).
    """

    seq: np.ndarray
    per_rank: int
    group_rank: int
    group_size: int
    local: np.ndarray | None = None


@dataclass(frozen=True)
class StreamShare:
    """A rank's share of one stream's epoch: ``ids`` (int64 (c,), the stream's item ids), ``pos`` (their
    positions in the stream's epoch order: an int64 array, or a ``range`` when they are consecutive, as
    without padding: no per-item memory) and ``is_pad`` (bool (c,), padding repeats; a read-only view
    of False when there are none)."""

    ids: np.ndarray
    pos: np.ndarray | range
    is_pad: np.ndarray


def positions(pos: np.ndarray | range, idx: np.ndarray) -> np.ndarray:
    """``pos[idx]`` (int64) for an array or a ``range`` of positions (:class:`StreamShare`)."""
    if isinstance(pos, range):
        return (pos.start + np.asarray(idx, dtype=np.int64) * pos.step).astype(np.int64)
    return np.asarray(pos[idx], dtype=np.int64)


def stream_share(se: StreamEpoch) -> StreamShare:
    """The group rank's contiguous piece of the stream's epoch order (or of the node's part of it),
    wrapped around to ``group_size * per_rank`` when that is longer (module docstring)."""
    cand = np.arange(len(se.seq), dtype=np.int64) if se.local is None else np.asarray(se.local, dtype=np.int64)
    n, per, r = len(cand), se.per_rank, se.group_rank
    if not 0 <= r < se.group_size:
        raise UsageError(f"rank {r} out of range for a group of {se.group_size}")
    if per and n == 0:
        raise UsageError("cannot pad a stream with no item in this epoch to a non-zero share per rank")
    lo, hi = r * per, (r + 1) * per
    if se.local is None and hi <= n:  # no padding: a slice of the epoch's order (no copy)
        return StreamShare(se.seq[lo:hi], range(lo, hi), np.broadcast_to(np.False_, (per,)))
    slot = np.arange(lo, hi, dtype=np.int64)
    pos = cand[slot % n] if n else np.zeros(0, dtype=np.int64)
    return StreamShare(se.seq[pos].astype(np.int64), pos, slot >= n)


def plain_epoch(seq: np.ndarray, rank: int, world_size: int, drop_last: bool) -> StreamEpoch:
    """A stream's epoch over the whole world: ``c = ceil(n / W)`` (``floor`` with ``drop_last``)."""
    return StreamEpoch(np.asarray(seq, dtype=np.int64), samples_per_rank(len(seq), world_size, drop_last),
                       rank, world_size)


def partitioned_per_rank(node_of: np.ndarray, num_nodes: int, ranks_per_node: int, drop_last: bool) -> int:
    """Items per rank of a partitioned stream: from every node's count of the epoch's draw (``node_of``:
    int (n,), the node holding each drawn item), the largest ``ceil(count / rpn)`` (the smallest
    ``floor`` with ``drop_last``), so that every node agrees without communicating."""
    counts = np.bincount(np.asarray(node_of, dtype=np.int64), minlength=num_nodes)
    per = [samples_per_rank(int(c), ranks_per_node, drop_last) for c in counts.tolist()]
    return min(per) if drop_last else max(per)
