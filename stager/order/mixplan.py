"""A mix's rank and worker plans: which items of which stream each worker reads, and in which batch.

From each stream's share (:func:`stager.order.mix.stream_share`) and the rank's batch layout
(:func:`stager.order.composition.batch_layout`), :func:`plan_mix_rank` makes what
:func:`stager.order.epoch.plan_rank` makes for one dataset, stream by stream:

* worker ``k`` of ``W`` produces the rank's batches ``k, k + W, ...`` (torch's round robin);
* for each stream, the rank's share is cut into one contiguous chunk per worker, sized by the items
  of that stream in the worker's batches (with ``shuffle=False``: the pieces of its own batches),
  so runs stay whole and every worker reads each stream front to back;
* each (worker, stream) chunk goes through its own shuffle buffer of ``K_i`` items;
* the worker's ``b``-th batch takes, for each stream, the next items its buffer emits, and places
  them where the layout's ``slots`` name that stream.

Each (worker, stream) part is an ordinary :class:`~stager.order.epoch.WorkerPlan` over the stream's
item ids, whose ``batches`` are the rank batches holding that stream, so the read schedule
(:func:`stager.order.reads.worker_reads`), the fetchers and the resume position work on it
unchanged. :func:`unconsumed_mix` is the elastic resume's "what is left of each stream's epoch".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from stager.errors import UsageError
from stager.order import streams
from stager.order.composition import COMPOSITIONS, BatchLayout, batch_layout
from stager.order.epoch import PlanConfig, WorkerPlan, buffer_shuffle
from stager.order.mix import StreamEpoch, StreamShare, plain_epoch, positions, stream_share


@dataclass(frozen=True)
class MixConfig(PlanConfig):
    """A :class:`~stager.order.epoch.PlanConfig` plus the mix's ``composition`` and per-stream shuffle
    buffers ``buffers`` (items per worker, one per stream; ``buffer_samples`` is their sum)."""

    composition: str = "random"
    buffers: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.composition not in COMPOSITIONS:
            raise UsageError(f"unknown composition {self.composition!r}; expected one of {', '.join(COMPOSITIONS)}")


@dataclass(frozen=True)
class MixWorkerPlan:
    """One worker's share of a rank's mixed epoch.

    ``batches``/``sizes``: the rank batches this worker produces (``k, k + W, ...``) and their sizes;
    ``slots``: (sum(sizes),), the stream of every place of those batches, batch after batch (the
    layout's small integer dtype). Per stream ``i``: ``parts[i]`` (a
    :class:`~stager.order.epoch.WorkerPlan` over stream ``i``'s item ids; its batches are those of
    this worker that hold stream ``i``), ``steps[i]`` (int64 (len(batches),): for each of this
    worker's batches, the index of that batch in ``parts[i]``, or -1) and ``pos[i]`` (each
    ``parts[i].stream`` entry's position in the stream's epoch order: an array, or a ``range``).
    """

    worker: int
    batches: np.ndarray
    sizes: np.ndarray
    slots: np.ndarray
    parts: tuple[WorkerPlan, ...]
    steps: tuple[np.ndarray, ...]
    pos: tuple[np.ndarray | range, ...]

    def batch_slots(self, b: int) -> np.ndarray:
        """The stream of each place of this worker's ``b``-th batch."""
        lo = int(self.sizes[:b].sum())
        return self.slots[lo : lo + int(self.sizes[b])]

    def batch_items(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """This worker's ``b``-th batch as ``(stream, item id)`` int64 arrays in hand-out order."""
        slots = self.batch_slots(b)
        ids = np.zeros(len(slots), dtype=np.int64)
        for i, part in enumerate(self.parts):
            step = int(self.steps[i][b])
            if step >= 0:
                ids[slots == i] = part.stream[part.batch_positions(step)]
        return slots.astype(np.int64), ids

    def consumed(self, stream: int, batches_done: int) -> np.ndarray:
        """Positions in stream ``stream``'s epoch order of the items this worker's rank batches below
        ``batches_done`` hold."""
        part = self.parts[stream]
        mine = int(np.searchsorted(part.batches, batches_done))
        lo = int(part.sizes[:mine].sum())
        return positions(self.pos[stream], part.emit[:lo])


@dataclass(frozen=True)
class MixRankPlan:
    """A rank's mixed epoch: its layout, padding, and one :class:`MixWorkerPlan` per worker stream.

    ``padded``: this rank's padding repeats; ``dropped``: items of the streams' epochs no rank's
    batches hold (``drop_last``), the same on every rank; ``shares``: the rank's share of each stream.
    """

    rank: int
    epoch: int
    layout: BatchLayout
    shares: tuple[StreamShare, ...]
    padded: int
    dropped: int
    workers: tuple[MixWorkerPlan, ...]

    @property
    def sizes(self) -> np.ndarray:
        return self.layout.sizes

    @property
    def num_batches(self) -> int:
        return len(self.layout.sizes)

    def batch_padding(self) -> np.ndarray:
        """Per batch (rank order): how many of its items are padding repeats (int64 (batches,))."""
        out = np.zeros(self.num_batches, dtype=np.int64)
        for w in self.workers:
            for part in w.parts:
                for b, j in enumerate(part.batches.tolist()):
                    out[j] += int(part.is_pad[part.batch_positions(b)].sum())
        return out

    def batch_items(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every batch in rank order as ``(stream, item id)`` arrays, by interleaving the workers."""
        out: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, np.int64), np.zeros(0, np.int64))] * self.num_batches
        for w in self.workers:
            for b, j in enumerate(w.batches.tolist()):
                out[j] = w.batch_items(b)
        return out


def _layout_rng(cfg: MixConfig, rank: int, epoch: int) -> np.random.Generator:
    if cfg.composition == "per_stream":  # the same order of streams' batches on every rank
        return streams.mix_batch_order(cfg.seed, epoch, cfg.world_size)
    return streams.mix_layout(cfg.seed, epoch, cfg.world_size, rank)


def _chunks(counts: np.ndarray, nw: int, mode: str) -> list[np.ndarray | slice]:
    """Per worker: the indices into the rank's share of one stream that worker reads (int64), or the slice
    of them (shuffled modes: one contiguous piece each, no copy)."""
    nb = len(counts)
    out: list[np.ndarray | slice] = []
    if mode == "none":  # exact order on the rank: each worker takes the pieces of its own batches
        cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        for k in range(nw):
            pieces = [np.arange(cum[j], cum[j + 1], dtype=np.int64) for j in range(k, nb, nw)]
            out.append(np.concatenate(pieces) if pieces else np.zeros(0, np.int64))
        return out
    lo = 0
    for k in range(nw):
        q = int(counts[k::nw].sum())
        out.append(slice(lo, lo + q))
        lo += q
    return out


def _worker_plan(layout: BatchLayout, shares: Sequence[StreamShare], chunks: list[list[np.ndarray | slice]],
                 cfg: MixConfig, *, rank: int, epoch: int, k: int) -> MixWorkerPlan:
    nw = cfg.streams
    mine = np.arange(k, len(layout.sizes), nw, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(layout.sizes)]).astype(np.int64)
    if nw == 1:
        slots = layout.slots
    else:
        pieces = [layout.slots[starts[j] : starts[j + 1]] for j in mine.tolist()]
        slots = np.concatenate(pieces) if pieces else np.zeros(0, layout.slots.dtype)
    parts, steps = [], []
    pos: list[np.ndarray | range] = []
    for i, share in enumerate(shares):
        chunk = chunks[i][k]
        per_batch = layout.counts[mine, i]
        holds = per_batch > 0
        rng = streams.mix_buffer(cfg.seed, epoch, cfg.world_size, rank, workers=nw, worker=k, stream=i)
        buf = cfg.buffers[i] if cfg.mode in ("runs", "shards") and i < len(cfg.buffers) else 0
        emit = buffer_shuffle(int(per_batch.sum()), buf, rng)
        parts.append(WorkerPlan(k, share.ids[chunk], emit, mine[holds], per_batch[holds], share.is_pad[chunk]))
        step = np.full(len(mine), -1, dtype=np.int64)
        step[holds] = np.arange(int(holds.sum()), dtype=np.int64)
        steps.append(step)
        if isinstance(chunk, slice):
            pos.append(share.pos[chunk])
        else:
            pos.append(positions(share.pos, chunk))
    return MixWorkerPlan(k, mine, layout.sizes[mine], slots, tuple(parts), tuple(steps), tuple(pos))


def _rank_layout(epochs: Sequence[StreamEpoch], cfg: MixConfig, rank: int, epoch: int
                 ) -> tuple[BatchLayout, tuple[StreamShare, ...], list[list[np.ndarray | slice]]]:
    """The rank's layout, its share of each stream (cut to what its batches hold) and every worker's chunks."""
    shares = tuple(stream_share(se) for se in epochs)
    counts = np.array([len(s.ids) for s in shares], dtype=np.int64)
    layout = batch_layout(counts, cfg.batch_size, cfg.drop_last, cfg.composition, _layout_rng(cfg, rank, epoch))
    used = layout.used
    shares = tuple(StreamShare(s.ids[:u], s.pos[:u], s.is_pad[:u]) for s, u in zip(shares, used.tolist(), strict=True))
    chunks = [_chunks(layout.counts[:, i], cfg.streams, cfg.mode) for i in range(len(shares))]
    return layout, shares, chunks


def plan_mix_worker(epochs: Sequence[StreamEpoch], cfg: MixConfig, rank: int, *, epoch: int,
                    worker: int) -> MixWorkerPlan:
    """Worker stream ``worker``'s plan of :func:`plan_mix_rank`, without the other workers' (what a worker
    process needs: their shuffle buffers are not simulated)."""
    layout, shares, chunks = _rank_layout(epochs, cfg, rank, epoch)
    return _worker_plan(layout, shares, chunks, cfg, rank=rank, epoch=epoch, k=worker)


def plan_mix_rank(epochs: Sequence[StreamEpoch], cfg: MixConfig, rank: int, *, epoch: int) -> MixRankPlan:
    """Plan rank ``rank``'s mixed epoch ``epoch`` from each stream's :class:`~stager.order.mix.StreamEpoch`
    (module docstring). Every rank of the same config gets the same batch sizes, and the same count of
    every stream."""
    layout, shares, chunks = _rank_layout(epochs, cfg, rank, epoch)
    used = layout.used
    workers = tuple(_worker_plan(layout, shares, chunks, cfg, rank=rank, epoch=epoch, k=k) for k in range(cfg.streams))
    padded = int(sum(int(s.is_pad.sum()) for s in shares))
    # Items of the streams' epochs no rank's batches hold (over the whole world; a node-partitioned
    # stream's count needs every node's share and is left to the loader's epoch count).
    dropped = sum(max(0, len(se.seq) - se.group_size * u)
                  for se, u in zip(epochs, used.tolist(), strict=True) if se.local is None)
    return MixRankPlan(rank, epoch, layout, shares, padded, dropped, workers)


def unconsumed_mix(
    seqs: Sequence[np.ndarray], cfg: MixConfig, *, epoch: int, batches_done: int
) -> list[np.ndarray]:
    """Each stream's epoch order (``seqs``) minus what every rank of ``cfg``'s world consumed in its first
    ``batches_done`` batches (by position, so an up-sampled stream's repeats count one by one), in
    order: what an elastic resume re-plans. Whole-world groups only (no node-partitioned stream)."""
    consumed = [np.zeros(len(s), dtype=bool) for s in seqs]
    for r in range(cfg.world_size):
        epochs = [plain_epoch(s, r, cfg.world_size, cfg.drop_last) for s in seqs]
        plan = plan_mix_rank(epochs, cfg, r, epoch=epoch)
        for w in plan.workers:
            for i in range(len(seqs)):
                consumed[i][w.consumed(i, batches_done)] = True
    return [np.asarray(s, dtype=np.int64)[~c] for s, c in zip(seqs, consumed, strict=True)]
