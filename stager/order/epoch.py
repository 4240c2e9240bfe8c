"""The epoch plan: which rank and worker gets which samples, in which order. Pure functions only.

Everything here is a function of integers and arrays (no I/O, no torch), so the invariants the
loader promises are tested directly on these functions and then again end to end.

Vocabulary (all sample ids are *global*: positions in manifest order, shard after shard):

* a **run** is a range ``[start, stop)`` of consecutive samples inside one shard; a worker reads a
  run with one ``pread`` over the manifest extents;
* the **epoch sequence** is the concatenation of the epoch's runs in their (shuffled) order;
* the **rank slice** is a contiguous piece of the epoch sequence (padded by wrapping around, or
  truncated), equal in length on every rank, so every rank gets the same number of batches; or,
  with ``deal_batches``, the ranks take the sequence's batches in turn (rank ``r`` of ``R``: batches
  ``r, r + R, ...``, the order Accelerate's own DataLoader deals them in, so that gathering a step's
  batches over the ranks gives the sequence's order);
* the rank slice is cut contiguously into one **stream** per worker, sized so that worker ``k``
  produces exactly the rank's batches ``k, k + W, k + 2W, ...`` (``W`` workers): the order in which
  torch's DataLoader round-robins over workers, which makes the rank's batch order deterministic
  (with ``shuffle=False`` worker ``k``'s stream is instead the slices of its own batches, so the
  rank sees exact manifest order);
* a worker emits its stream through a **shuffle buffer** of ``K`` samples (the classic
  fill-then-swap reservoir), simulated here on positions so the order is known in advance and
  only the stream (never the buffer's order) decides what is read when.

Shuffle modes:

* ``"runs"`` (default): runs of ~``run_bytes`` with per-epoch jittered boundaries, globally
  permuted, then the shuffle buffer. Reads stay large and sequential.
* ``"shards"``: whole shards permuted, then the buffer (webdataset-style; best I/O, worst mixing).
* ``"random"``: one global permutation of samples; every sample is its own read (one ``pread``
  each). Meant for local NVMe/tmpfs copies, where seeks are cheap.
* ``"none"`` (``shuffle=False``): manifest order, runs are whole shards, no buffer.

Seeds: every random draw uses ``numpy.random.default_rng((seed, epoch, ...))`` (never
``seed + epoch``, which collides across runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stager.errors import UsageError
from stager.order import streams

SHUFFLE_MODES = ("runs", "shards", "random", "none")


@dataclass(frozen=True)
class PlanConfig:
    """Everything the order depends on besides the dataset index.

    ``samples_per_rank`` overrides the equal per-rank count (node-partitioned staging computes it
    from the global assignment so every node agrees). ``buffer_samples`` is the per-worker shuffle
    buffer (``K``); ``run_samples`` is per shard (``R``), see :func:`run_lengths`. ``deal_batches``:
    the ranks take the epoch sequence's batches in turn instead of contiguous slices
    (:func:`rank_positions`).
    """

    batch_size: int
    world_size: int = 1
    num_workers: int = 0
    seed: int = 0
    mode: str = "runs"
    drop_last: bool = False
    buffer_samples: int = 0
    samples_per_rank: int | None = None
    deal_batches: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise UsageError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.world_size < 1:
            raise UsageError(f"world_size must be >= 1, got {self.world_size}")
        if self.num_workers < 0:
            raise UsageError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.mode not in SHUFFLE_MODES:
            raise UsageError(f"unknown shuffle mode {self.mode!r}; expected one of {', '.join(SHUFFLE_MODES)}")
        if self.buffer_samples < 0:
            raise UsageError(f"shuffle buffer must be >= 0 samples, got {self.buffer_samples}")

    @property
    def streams(self) -> int:
        """Number of worker streams per rank (the main process counts as one when num_workers=0)."""
        return max(1, self.num_workers)


def run_lengths(counts: np.ndarray, shard_bytes: np.ndarray, run_bytes: int, min_run: int = 4) -> np.ndarray:
    """Per-shard run length ``R`` (int64, shape (shards,)): ~``run_bytes`` of payload, at least ``min_run``.

    ``shard_bytes`` is each shard's payload size (sum of sample sizes). ``R`` never exceeds the
    shard's sample count (a shard of 1 sample, e.g. an ImageFolder file, has runs of 1).
    """
    counts = np.asarray(counts, dtype=np.int64)
    mean = np.asarray(shard_bytes, dtype=np.float64) / np.maximum(counts, 1)
    r = np.floor(run_bytes / np.maximum(mean, 1.0)).astype(np.int64)
    r = np.maximum(r, min_run)
    return np.maximum(np.minimum(r, counts), 1)


def make_runs(
    starts: np.ndarray, run_len: np.ndarray, rng: np.random.Generator | None
) -> tuple[np.ndarray, np.ndarray]:
    """Split every shard into runs; return ``(run_starts, run_stops)`` (global ids, int64).

    ``starts`` has shape (shards + 1,) (global id of each shard's first sample, then the total).
    With an ``rng`` the first run of each shard has a random length in ``[1, R]`` so that run
    boundaries move from epoch to epoch; without one, runs start at the shard's first sample.
    Runs never cross a shard boundary and together cover every sample exactly once.
    """
    starts = np.asarray(starts, dtype=np.int64)
    rs, re_ = [], []
    for s in range(len(starts) - 1):
        a, b = int(starts[s]), int(starts[s + 1])
        if b <= a:
            continue
        r = int(run_len[s])
        first = int(rng.integers(1, r + 1)) if rng is not None else r
        cuts = np.arange(a + first, b, r, dtype=np.int64)
        bounds = np.concatenate([[a], cuts, [b]])
        rs.append(bounds[:-1])
        re_.append(bounds[1:])
    if not rs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(rs), np.concatenate(re_)


def expand_runs(run_starts: np.ndarray, run_stops: np.ndarray) -> np.ndarray:
    """Concatenate runs into one int64 array of sample ids (vectorised ``[range(a, b) for ...]``)."""
    lengths = (run_stops - run_starts).astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    offsets = np.repeat(run_starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return (np.arange(total, dtype=np.int64) + offsets).astype(np.int64)


def epoch_sequence(starts: np.ndarray, run_len: np.ndarray, cfg: PlanConfig, epoch: int) -> np.ndarray:
    """The epoch's global sample order (int64, shape (N,)): a permutation of ``range(N)``.

    Independent of world size and worker count, so the global order is one thing all ranks share.
    """
    if cfg.mode == "none":
        return shuffled_order(starts, run_len, "none", None)
    return shuffled_order(starts, run_len, cfg.mode, streams.epoch_runs(cfg.seed, epoch))


def shuffled_order(starts: np.ndarray, run_len: np.ndarray, mode: str, rng: np.random.Generator | None) -> np.ndarray:
    """A permutation of ``range(N)`` (int64) in shuffle mode ``mode``, drawn from ``rng`` (None for ``"none"``):
    runs of ~``run_len`` permuted, whole shards permuted, every sample permuted, or manifest order.

    :func:`epoch_sequence` draws it once per epoch; a mix draws one per stream pass (:mod:`stager.order.mix`).
    """
    starts = np.asarray(starts, dtype=np.int64)
    n = int(starts[-1]) if len(starts) else 0
    if mode == "none" or rng is None:
        return np.arange(n, dtype=np.int64)
    if mode == "random":
        return rng.permutation(n).astype(np.int64)
    if mode == "shards":
        a, b = starts[:-1], starts[1:]
        keep = b > a
        a, b = a[keep], b[keep]
    else:
        a, b = make_runs(starts, run_len, rng)
    perm = rng.permutation(len(a))
    return expand_runs(a[perm], b[perm])


def samples_per_rank(total: int, world_size: int, drop_last: bool) -> int:
    """Equal per-rank sample count: ``ceil(N/W)`` when padding, ``floor(N/W)`` when dropping."""
    return total // world_size if drop_last else -(-total // world_size)


def batch_sizes(n: int, batch_size: int, drop_last: bool) -> np.ndarray:
    """Sizes of a rank's batches (int64): full batches, plus a short last one unless ``drop_last``."""
    full, rest = divmod(n, batch_size)
    sizes = [batch_size] * full
    if rest and not drop_last:
        sizes.append(rest)
    return np.asarray(sizes, dtype=np.int64)


def rank_slice(seq: np.ndarray, rank: int, world_size: int, per_rank: int) -> tuple[np.ndarray, int]:
    """Rank ``rank``'s contiguous piece of ``seq``: ``(ids, padded)``.

    The sequence is repeated (``numpy.resize``) to ``world_size * per_rank`` when that is longer
    than it, so padding repeats samples from the start of the epoch order; ``padded`` counts this
    rank's repeated samples. When shorter, the tail of the sequence is dropped.
    """
    if not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} out of range for world size {world_size}")
    n = len(seq)
    need = world_size * per_rank
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    if n == 0:
        if per_rank:
            raise UsageError("cannot pad an empty dataset to a non-zero number of samples per rank")
        return np.zeros(0, np.int64), 0
    ext = np.resize(seq, need) if need > n else seq
    padded = max(0, hi - max(lo, n))
    return np.asarray(ext[lo:hi], dtype=np.int64), padded


def rank_positions(rank: int, world_size: int, per_rank: int, sizes: np.ndarray, *, deal_batches: bool) -> np.ndarray:
    """Where rank ``rank``'s samples sit in the epoch sequence (padded by wrapping around to
    ``world_size * per_rank``), in the rank's batch order: int64, shape (``sizes.sum()``,).

    Contiguous (the default): ``rank * per_rank`` on. ``deal_batches``: the world's batches ``j`` of all
    ranks (each ``sizes[j]`` samples) make one round of the sequence, rank after rank, so rank ``r``
    holds the sequence's batches ``r, r + R, ...`` and the padding repeats (the sequence's last
    positions) end the last round, after every real sample of it.
    """
    if not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} out of range for world size {world_size}")
    used = int(sizes.sum())
    if not deal_batches:
        return np.arange(rank * per_rank, rank * per_rank + used, dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    first = world_size * cum[:-1] + rank * sizes  # each batch's first position
    return np.repeat(first - cum[:-1], sizes) + np.arange(used, dtype=np.int64)


def _take_wrapped(seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """``seq`` at positions ``pos`` (int64), wrapping around past its end (the padding repeats)."""
    if not len(pos):
        return np.zeros(0, np.int64)
    if not len(seq):
        raise UsageError("cannot pad an empty dataset to a non-zero number of samples per rank")
    return np.asarray(seq[pos % len(seq)], dtype=np.int64)


def _stable_order(picks: np.ndarray, k: int) -> np.ndarray:
    """``np.argsort(picks, kind="stable")`` for values in ``[0, k)``, faster: a radix sort of 16-bit keys
    (``k <= 65536``, the default buffer's bound: ~8x faster than sorting int64), else a sort of unique
    keys ``(value, position)`` (the order is then the only one, so it is the stable one)."""
    if k <= 1 << 16:
        return np.argsort(picks.astype(np.uint16), kind="stable").astype(np.int64, copy=False)
    return np.argsort(picks * len(picks) + np.arange(len(picks), dtype=np.int64)).astype(np.int64, copy=False)


def buffer_shuffle(n: int, buffer: int, rng: np.random.Generator) -> np.ndarray:
    """Emission order (int64 permutation of ``range(n)``) of a fill-then-swap shuffle buffer.

    Positions enter in order; once ``buffer`` are held, each new arrival replaces a uniformly
    chosen held one, which is emitted; at the end the held ones drain in random order. So at most
    ``buffer`` positions are ever "read but not yet emitted": the memory bound. ``buffer <= 1``
    returns the identity.
    """
    if buffer <= 1 or n <= 1:
        return np.arange(n, dtype=np.int64)
    k = min(buffer, n)
    picks = rng.integers(0, k, size=n - k)
    # Vectorised simulation (the per-arrival loop took ~1.8 s per 1.28M samples, most of an epoch's
    # first batch): arrival ``k + t`` lands in slot ``picks[t]`` and the value it evicts is whatever
    # the slot's previous arrival put there (or the slot's initial position ``picks[t]``). Grouping
    # the arrivals by slot (stable, so by time within a slot) makes "previous arrival in the same
    # slot" a shift by one; the draws are the same as before, so orders are unchanged.
    order = _stable_order(picks, k)
    slot = picks[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = slot[1:] != slot[:-1]
    evicted = np.where(first, slot, k + np.roll(order, 1))
    head = np.empty(len(order), dtype=np.int64)
    head[order] = evicted
    held = np.arange(k, dtype=np.int64)
    last = np.ones(len(order), dtype=bool)
    last[:-1] = slot[:-1] != slot[1:]
    held[slot[last]] = k + order[last]
    tail = rng.permutation(k)
    return np.concatenate([head, held[tail]])


@dataclass(frozen=True)
class WorkerPlan:
    """One worker's share of a rank's epoch.

    ``stream``: sample ids in read order (int64, shape (n,)). ``emit``: positions into ``stream``
    in emission order (a permutation of ``range(n)``). ``batches``: the rank-level batch indices
    this worker produces (``k, k + W, ...``), and ``sizes`` their sample counts; the worker's
    ``b``-th batch is ``stream[emit[cum[b]:cum[b+1]]]``.
    """

    worker: int
    stream: np.ndarray
    emit: np.ndarray
    batches: np.ndarray
    sizes: np.ndarray
    is_pad: np.ndarray  # bool, shape (n,): stream entries that are padding repeats

    def batch_positions(self, b: int) -> np.ndarray:
        """Stream positions of this worker's ``b``-th batch, in emission order."""
        lo = int(self.sizes[:b].sum())
        return self.emit[lo : lo + int(self.sizes[b])]


@dataclass(frozen=True)
class RankPlan:
    """A rank's epoch: its samples, its batch sizes, its padding, and one plan per worker stream.

    ``padded``: this rank's repeated samples. ``dropped``: samples of the whole epoch that no rank
    sees (``drop_last``), identical on every rank.
    """

    rank: int
    epoch: int
    ids: np.ndarray
    sizes: np.ndarray
    padded: int
    dropped: int
    workers: tuple[WorkerPlan, ...]

    @property
    def num_batches(self) -> int:
        return len(self.sizes)

    def batch_padding(self) -> np.ndarray:
        """Per batch (rank order): how many of its samples are padding repeats (int64, (batches,))."""
        out = np.zeros(self.num_batches, dtype=np.int64)
        for w in self.workers:
            for b, j in enumerate(w.batches.tolist()):
                out[j] = int(w.is_pad[w.batch_positions(b)].sum())
        return out

    def batch_ids(self) -> list[np.ndarray]:
        """All of the rank's batches in rank order (sample ids), by interleaving the workers."""
        out: list[np.ndarray] = [np.zeros(0, np.int64)] * self.num_batches
        for w in self.workers:
            for b, j in enumerate(w.batches.tolist()):
                out[j] = w.stream[w.batch_positions(b)]
        return out


@dataclass(frozen=True)
class RankShare:
    """What a rank's epoch is before any worker's shuffle buffer: its samples and where they sit.

    ``ids``: the rank's sample ids (int64, shape (``sizes.sum()``,)), in the order its workers' streams
    are cut from; ``pos``: each one's position in the epoch sequence (``>= n`` is a padding repeat);
    ``n``: the sequence's length; ``sizes``: the rank's batch sizes.
    """

    rank: int
    epoch: int
    ids: np.ndarray
    pos: np.ndarray
    n: int
    sizes: np.ndarray
    padded: int
    dropped: int


def _rank_layout(n: int, cfg: PlanConfig, rank: int) -> tuple[int, np.ndarray, np.ndarray]:
    """For an epoch sequence of ``n`` samples: ``(per_rank, sizes, pos)``, the count every rank gets, this
    rank's batch sizes and its samples' positions in the sequence (``>= n``: padding). No sequence needed."""
    per_rank = cfg.samples_per_rank
    if per_rank is None:
        per_rank = samples_per_rank(n, cfg.world_size, cfg.drop_last)
    sizes = batch_sizes(per_rank, cfg.batch_size, cfg.drop_last)
    return per_rank, sizes, rank_positions(rank, cfg.world_size, per_rank, sizes, deal_batches=cfg.deal_batches)


def rank_share(seq: np.ndarray, cfg: PlanConfig, rank: int, *, epoch: int) -> RankShare:
    """Rank ``rank``'s share of the epoch sequence ``seq``: its samples, padded or truncated to the count
    every rank gets (contiguous, or its batches dealt in turn: ``cfg.deal_batches``)."""
    per_rank, sizes, pos = _rank_layout(len(seq), cfg, rank)
    used = int(sizes.sum())
    if cfg.deal_batches:
        ids = _take_wrapped(seq, pos)
        padded = int((pos >= len(seq)).sum())
    else:
        ids, padded = rank_slice(seq, rank, cfg.world_size, per_rank)
        ids = ids[:used]
        padded = min(padded, used)
    # Samples of the epoch that no rank's batches hold (drop_last): the same figure on every rank.
    dropped = max(0, len(seq) - cfg.world_size * used)
    return RankShare(rank, epoch, ids, pos, len(seq), sizes, padded, dropped)


def _stream_layout(
    sizes: np.ndarray, cfg: PlanConfig, worker: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | slice]:
    """Worker stream ``worker`` of a rank with batch sizes ``sizes``: ``(batches, their sizes, where its
    stream lies in the rank's samples)`` (an index array, or a slice for the shuffled modes)."""
    nw = cfg.streams
    if not 0 <= worker < nw:
        raise UsageError(f"worker {worker} out of range for {nw} worker stream(s)")
    mine = np.arange(worker, len(sizes), nw, dtype=np.int64)
    wsizes = sizes[mine]
    if cfg.mode == "none":
        # Exact manifest order on the rank: worker k takes the slices of its own batches.
        cum = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        pieces = [np.arange(cum[j], cum[j + 1], dtype=np.int64) for j in mine.tolist()]
        return mine, wsizes, np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    # Shuffled modes: one contiguous chunk per worker (after the earlier workers') keeps runs whole.
    lo = sum(int(sizes[k::nw].sum()) for k in range(worker))
    return mine, wsizes, slice(lo, lo + int(wsizes.sum()))


def _emission(cfg: PlanConfig, epoch: int, rank: int, worker: int, q: int) -> np.ndarray:
    """Worker ``worker``'s shuffle buffer over its ``q`` stream positions (its own random stream)."""
    rng = streams.shuffle_buffer(cfg.seed, epoch, cfg.world_size, rank, workers=cfg.streams, worker=worker)
    return buffer_shuffle(q, cfg.buffer_samples if cfg.mode in ("runs", "shards") else 0, rng)


def worker_plan(share: RankShare, cfg: PlanConfig, worker: int) -> WorkerPlan:
    """Worker stream ``worker`` of ``share``: the rank's batches ``worker, worker + W, ...`` and the shuffle
    buffer's emission order over them (its own random stream: no other worker's draws are needed)."""
    mine, wsizes, spos = _stream_layout(share.sizes, cfg, worker)
    # A copy, not a view of the rank's ids: a worker keeps only its own stream once the share is freed.
    stream = share.ids[spos].copy()
    # From epoch position n on, the sequence wraps around: padding repeats.
    is_pad = share.pos[spos] >= share.n
    emit = _emission(cfg, share.epoch, share.rank, worker, len(stream))
    return WorkerPlan(worker, stream, emit, mine, wsizes, is_pad)


def batch_padding(n: int, cfg: PlanConfig, rank: int, *, epoch: int) -> np.ndarray:
    """``plan_rank(...).batch_padding()`` for an epoch sequence of ``n`` samples, without the sequence: which
    positions are padding depends on the layout alone, and only a worker whose stream holds any needs its
    shuffle buffer simulated (int64, shape (batches,))."""
    _per_rank, sizes, pos = _rank_layout(n, cfg, rank)
    out = np.zeros(len(sizes), dtype=np.int64)
    for k in range(cfg.streams):
        mine, wsizes, spos = _stream_layout(sizes, cfg, k)
        is_pad = pos[spos] >= n
        if not is_pad.any():
            continue
        pads = np.concatenate([[0], np.cumsum(is_pad[_emission(cfg, epoch, rank, k, len(is_pad))])])
        cum = np.concatenate([[0], np.cumsum(wsizes)]).astype(np.int64)
        out[mine] = pads[cum[1:]] - pads[cum[:-1]]
    return out


def plan_worker(
    starts: np.ndarray, run_len: np.ndarray, cfg: PlanConfig, rank: int, worker: int, *, epoch: int,
    seq: np.ndarray | None = None,
) -> WorkerPlan:
    """``plan_rank(...).workers[worker]`` alone (what a worker process needs): the other workers' shuffle
    buffers are not simulated."""
    if seq is None:
        seq = epoch_sequence(starts, run_len, cfg, epoch)
    return worker_plan(rank_share(seq, cfg, rank, epoch=epoch), cfg, worker)


def plan_rank(
    starts: np.ndarray, run_len: np.ndarray, cfg: PlanConfig, rank: int, *, epoch: int, seq: np.ndarray | None = None
) -> RankPlan:
    """Plan rank ``rank``'s epoch ``epoch``.

    ``seq`` overrides the epoch sequence (used to plan over a subset, e.g. the shards staged on
    this node or the samples left after an elastic resume). Returns a :class:`RankPlan` whose
    workers together produce ``len(sizes)`` batches; every rank of the same config gets the same
    ``sizes``.
    """
    if seq is None:
        seq = epoch_sequence(starts, run_len, cfg, epoch)
    share = rank_share(seq, cfg, rank, epoch=epoch)
    workers = tuple(worker_plan(share, cfg, k) for k in range(cfg.streams))
    return RankPlan(rank, epoch, share.ids, share.sizes, share.padded, share.dropped, workers)


def unconsumed(
    seq: np.ndarray, starts: np.ndarray, run_len: np.ndarray, cfg: PlanConfig, *, epoch: int, batches_done: int
) -> np.ndarray:
    """``seq`` (an epoch's order) minus what every rank of ``cfg``'s world consumed in its first
    ``batches_done`` batches, in ``seq``'s order (int64): what an elastic resume re-plans.

    Under DDP every rank consumes its batches in lockstep, so one count holds for all ranks.
    """
    n = int(starts[-1]) if len(starts) else 0
    consumed = np.zeros(n, dtype=bool)
    for r in range(cfg.world_size):
        rp = plan_rank(starts, run_len, cfg, r, epoch=epoch, seq=seq)
        for ids in rp.batch_ids()[:batches_done]:
            consumed[ids] = True
    return seq[~consumed[seq]]
