"""Which stream fills each place of a rank's batches: the three batch compositions of a mix.

Input: ``counts`` (int64 (S,)), the items of each stream a rank holds this epoch (the same on every
rank, :mod:`stager.order.mix`). Output: a :class:`BatchLayout`: the rank's batch sizes, how many
items of each stream every batch holds, and the stream of every place in hand-out order.

* ``"random"``: the rank's places are a uniformly random arrangement of its items: each batch's
  count of a stream is hypergeometric (mean ``B * c_i / sum(c)``, at most the binomial's spread).
* ``"stratified"``: every batch holds each stream's share to within one item: the floor or the
  ceiling of ``s_b * c_i / sum(c)`` (:func:`stratify`), and the epoch still holds exactly ``c_i``.
* ``"per_stream"``: every batch holds one stream only: each stream's items cut into batches of
  ``B`` (its last one shorter unless ``drop_last``), the streams' batches in a random order that is the
  same on every rank (all ranks read the same stream at each step, as stream-specific heads need).

Batch sizes are those of the single-dataset loader (full batches and a short last one, or only full
ones with ``drop_last``), except ``per_stream``'s (one short batch per stream). With ``drop_last``
the dropped items are spread over the streams in proportion. Pure numpy; the generators come from
:mod:`stager.order.streams` (``mix_layout``, ``mix_batch_order``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stager.errors import UsageError
from stager.order.epoch import batch_sizes
from stager.order.mix import apportion

COMPOSITIONS = ("random", "stratified", "per_stream")


@dataclass(frozen=True)
class BatchLayout:
    """A rank's batches of one epoch: ``sizes`` (int64 (nb,)), ``counts`` (int64 (nb, S): items of each
    stream in each batch) and ``slots`` ((sum(sizes),): the stream of every place, batch after batch, in
    the order the batch hands its items out; int8, or int16 beyond 127 streams: one byte per place)."""

    sizes: np.ndarray
    counts: np.ndarray
    slots: np.ndarray

    @property
    def used(self) -> np.ndarray:
        """Items of each stream the rank's batches hold (int64 (S,))."""
        return self.counts.sum(axis=0).astype(np.int64)


def stream_dtype(streams: int) -> type:
    """The smallest signed integer type that numbers ``streams`` streams (slots, :class:`BatchLayout`)."""
    return np.int8 if streams <= 127 else np.int16 if streams <= 32767 else np.int32


def _stream_ids(counts: np.ndarray) -> np.ndarray:
    """``np.repeat(arange(S), counts)`` in :func:`stream_dtype`."""
    ids: np.ndarray = np.arange(len(counts), dtype=stream_dtype(len(counts)))
    return np.repeat(ids, counts)


def _counts_of(slots: np.ndarray, sizes: np.ndarray, streams: int) -> np.ndarray:
    batch = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    flat = np.bincount(batch * streams + slots.astype(np.int64), minlength=len(sizes) * streams)
    return flat.reshape(len(sizes), streams).astype(np.int64)


def _shuffle_within(slots: np.ndarray, sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    batch = np.repeat(np.arange(len(sizes), dtype=np.float64), sizes)
    return slots[np.argsort(batch + rng.random(len(slots)), kind="stable")]


def stratify(used: np.ndarray, sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Per-batch counts (int64 (nb, S)) with row sums ``sizes``, column sums ``used``, each entry the floor
    or ceiling of ``sizes[b] * used[i] / sum(used)`` (``sum(sizes) == sum(used)``).

    Such a rounding always exists (the exact shares are a fractional solution of a transportation
    problem); this builds one directly for the shape batch sizes have, all equal but at most one: the odd
    batch first takes its extra items from the streams that need the most, then the equal batches take
    the rest round robin (a stream's extras are consecutive, at most one per batch), batches and streams
    in random order.
    """
    used = np.asarray(used, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    total, nb, ns = int(used.sum()), len(sizes), len(used)
    counts = np.zeros((nb, ns), dtype=np.int64)
    if nb == 0 or total == 0:
        return counts
    if int(sizes.sum()) != total:
        raise ValueError(f"batch sizes hold {int(sizes.sum())} items, the streams {total}")
    num = sizes[:, None] * used[None, :]
    counts[:] = num // total
    fractional = num % total != 0
    need = used - counts.sum(axis=0)  # extra items each stream still needs (at most one per batch)
    full = int(np.bincount(sizes).argmax()) if nb else 0
    for b in np.flatnonzero(sizes != full).tolist():  # the odd batch: at most one
        extra = int(sizes[b] - counts[b].sum())
        ok = np.flatnonzero(fractional[b])
        pick = ok[np.lexsort((rng.random(len(ok)), -need[ok]))][:extra]
        counts[b, pick] += 1
        need[pick] -= 1
    rows = np.flatnonzero(sizes == full)
    if len(rows) and need.sum():
        cols = rng.permutation(ns)
        cols = cols[need[cols] > 0]
        seq = np.repeat(cols, need[cols])  # each stream's extras consecutive
        row_of = rows[rng.permutation(len(rows))][np.arange(len(seq)) % len(rows)]
        np.add.at(counts, (row_of, seq), 1)
    return counts


def random_layout(counts: np.ndarray, batch_size: int, drop_last: bool, rng: np.random.Generator) -> BatchLayout:
    counts = np.asarray(counts, dtype=np.int64)
    sizes = batch_sizes(int(counts.sum()), batch_size, drop_last)
    total = int(sizes.sum())
    # What drop_last drops is spread over the streams in proportion, so every rank holds the same mixture.
    used = counts if total == int(counts.sum()) else apportion(total, counts)
    slots = rng.permutation(_stream_ids(used))
    return BatchLayout(sizes, _counts_of(slots, sizes, len(counts)), slots)


def stratified_layout(counts: np.ndarray, batch_size: int, drop_last: bool,
                      rng: np.random.Generator) -> BatchLayout:
    counts = np.asarray(counts, dtype=np.int64)
    sizes = batch_sizes(int(counts.sum()), batch_size, drop_last)
    total = int(sizes.sum())
    used = counts if total == int(counts.sum()) else apportion(total, counts)
    per_batch = stratify(used, sizes, rng)
    ids: np.ndarray = np.arange(len(counts), dtype=stream_dtype(len(counts)))
    slots = np.repeat(np.tile(ids, len(sizes)), per_batch.ravel())
    return BatchLayout(sizes, per_batch, _shuffle_within(slots, sizes, rng))


def per_stream_layout(counts: np.ndarray, batch_size: int, drop_last: bool,
                      rng: np.random.Generator) -> BatchLayout:
    counts = np.asarray(counts, dtype=np.int64)
    used = counts - counts % batch_size if drop_last else counts
    nbs = -(-used // batch_size)
    order = rng.permutation(np.repeat(np.arange(len(counts), dtype=np.int64), nbs))  # one entry per batch
    sizes = np.full(len(order), batch_size, dtype=np.int64)
    for i in np.flatnonzero(used % batch_size).tolist():  # each stream's last batch is its short one
        sizes[np.flatnonzero(order == i)[-1]] = int(used[i] % batch_size)
    per_batch = np.zeros((len(order), len(counts)), dtype=np.int64)
    per_batch[np.arange(len(order)), order] = sizes
    return BatchLayout(sizes, per_batch, np.repeat(order.astype(stream_dtype(len(counts))), sizes))


LAYOUTS = {"random": random_layout, "stratified": stratified_layout, "per_stream": per_stream_layout}


def batch_layout(
    counts: np.ndarray, batch_size: int, drop_last: bool, composition: str, rng: np.random.Generator
) -> BatchLayout:
    """The rank's :class:`BatchLayout` for ``composition`` (module docstring) from its per-stream ``counts``."""
    try:
        make = LAYOUTS[composition]
    except KeyError:
        raise UsageError(f"unknown composition {composition!r}; expected one of {', '.join(COMPOSITIONS)}") from None
    return make(counts, batch_size, drop_last, rng)
