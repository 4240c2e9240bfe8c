"""``MixDataset``: one rank's batches of several datasets read as one, planned, read and assembled: no torch.

The loader's single-dataset core (:class:`~stager.loader.rank.RankDataset`) with several datasets
under one plan (docs/loader.md, "Mixing datasets"):

* each stream is a :class:`RankDataset` of its own (:func:`~stager.loader.mix.members.open_members`):
  resolved (staged copy or source), indexed, with its run layout, partition and decoding;
* each epoch, every stream's draw (:func:`stager.order.mix.stream_sequence`) is shared out over the
  ranks, the rank's batches are laid out by the composition and cut into worker plans
  (:func:`stager.order.mixplan.plan_mix_rank`): pure functions of (seed, epoch, world, workers);
* a worker reads each stream with that stream's own read schedule and fetcher
  (:func:`stager.order.reads.worker_reads`, :mod:`stager.loader.fetch`), decodes each stream's items
  with its member, and places them where the layout says; batches carry ``stream`` (int64 (B,), the
  stream's position in the mix) and ``index`` (the item's id within its stream).

It is a :class:`RankDataset`, so both transports run it unchanged (the torch one through
:class:`~stager.loader.mix.torch_dataset.MixShardedDataset`), and :class:`~stager.loader.base.LoaderBase`'s
epochs, counting, resume and elastic resume work through the same hooks (``dataset_id``,
``plan_key``, ``unconsumed``, ``batch_padding``, ``origin``, ``batch_fields``). An elastic resume's
remaining items are one int64 array of shape (2, n): stream, item id, stream after stream.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from stager.errors import UsageError
from stager.fs.kernel import release_free_heap
from stager.loader.clips import clip_meta, item_shard_groups
from stager.loader.fields import assemble_fields
from stager.loader.mix.feed import (
    FIRST_WINDOW,
    GATHER_WINDOW,
    StreamFeed,
    gather_order,
    stream_counts,
    subsequence_mask,
    window_order,
)
from stager.loader.mix.members import open_members
from stager.loader.options import LoaderOptions
from stager.loader.rank import MAX_BUFFER_SAMPLES, PlanGroup, RankDataset, _options_of, single_threaded_cv2
from stager.loader.shard_access import ShardAccess
from stager.loader.state import LoaderState
from stager.mix import Mix, Stream, as_mix
from stager.order import streams
from stager.order.composition import batch_layout
from stager.order.epoch import RankPlan, batch_sizes, samples_per_rank
from stager.order.mix import (
    StreamEpoch,
    partitioned_per_rank,
    plain_epoch,
    rotation_cycle,
    stream_sequence,
    stream_takes,
)
from stager.order.mixplan import MixConfig, MixRankPlan, MixWorkerPlan, plan_mix_rank, plan_mix_worker, unconsumed_mix
from stager.order.partition import assign_shards_to_nodes
from stager.order.reads import ReadSchedule
from stager.redact import redact
from stager.world import World, process_group_world

log = logging.getLogger("stager.loader")
_LOGGED: set[str] = set()  # the epoch table is logged once per process and mix


@dataclass(frozen=True)
class NodeLayout:
    """A stream read from a node-partitioned staged copy: which node holds each shard, this node, the
    node's ranks (``ranks_per_node``) and this rank among them."""

    node_of_shard: np.ndarray
    node: int
    num_nodes: int
    ranks_per_node: int
    local_rank: int


def _share(s: Stream) -> tuple[str, float]:
    for kind in ("weight", "samples", "repeat"):
        v = getattr(s, kind)
        if v is not None:
            return kind, float(v)
    return "repeat", 1.0


def _node_layout(member: RankDataset) -> NodeLayout | None:
    if not member.group.node_partitioned:
        return None
    part = member.resolved.partition or {}
    num_nodes, rpn = int(part["num_nodes"]), int(part["ranks_per_node"])
    m = member.index.manifest
    assert m is not None
    nodes = assign_shards_to_nodes(m.shard_bytes, num_nodes, int(part.get("seed", 0)), item_shard_groups(member.index))
    node_of = np.zeros(member.index.num_shards, dtype=np.int64)
    for n, shards in enumerate(nodes):
        node_of[shards] = n
    return NodeLayout(node_of, int(part["node"]), num_nodes, rpn, member.group.rank)


@dataclass(frozen=True)
class _Window:
    """Batches ``[lo, hi)`` of a worker's plan, per place from ``base`` on (int64 or lists of the window's
    places): its stream, item id, key and label in the layout's order, and its index among its batch's
    places sorted by stream (``gather``)."""

    lo: int = 0
    hi: int = 0
    base: int = 0
    stream: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    keys: list[Any] = field(default_factory=list)
    labels: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    gather: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))


class MixDataset(RankDataset):
    """One rank's share of a mix of datasets, as batches (module docstring): no torch.

    ``MixDataset(mix, LoaderOptions(...))`` or ``MixDataset(mix, batch_size, **settings)``: ``mix`` is a
    :class:`~stager.mix.Mix`, a list of paths, ``(path, weight)`` pairs or :class:`~stager.mix.Stream`
    objects, or a mix file (:func:`stager.mix.as_mix`). ``options.composition`` overrides the mix's.
    Batches are :class:`RankDataset`'s plus ``stream`` (int64 (B,)); ``index`` is the item's id in its stream.
    """

    def __init__(self, mix: Any, options: LoaderOptions | int, **settings: Any) -> None:
        # RankDataset.__init__ opens one path; a mix opens one member dataset per stream instead.
        self.options = opts = _options_of(options, settings)
        self.mix: Mix = as_mix(mix, composition=opts.composition, storage_options=opts.storage_options)
        world = World.detect(opts.rank, opts.world_size)
        self.rank, self.world_size, self.world_source = world.rank, world.world_size, world.source
        self.members = open_members(self.mix, opts, self.rank, self.world_size)
        self.names = self.mix.names
        self.sizes = [int(m.items.count) for m in self.members]
        self.takes = stream_takes(self.sizes, [_share(s) for s in self.mix.streams], self.mix.epoch_samples,
                                  self.names)
        for name, take in zip(self.names, self.takes.tolist(), strict=True):
            if take < self.world_size:
                raise UsageError(f"stream {name!r} gives {take} samples per epoch, fewer than the {self.world_size} "
                                 "ranks; raise its share or run on fewer ranks")
        self.nodes = [_node_layout(m) for m in self.members]
        self.group = PlanGroup(self.rank, self.world_size)
        self.per_item = self.members[0].items.per_item
        # Streams whose payloads pass through unchanged (raw bytes, stored arrays with no transform).
        self._passes = [m.items.per_item == 1 and m.field_fn is None and bool(getattr(m.sample_fn, "passes_through",
                                                                                      False)) for m in self.members]
        self.field_specs = self.members[0].field_specs
        self.epoch = 0
        self.start_batch = 0
        self._remaining: np.ndarray | None = None
        self.shm_channel: Any = None  # a worker's stager.loader.shm.Channel (set in the worker only)
        self._ring: Any = None
        self._keys = None
        # Per-rank counts of the current position (key: epoch, explicit order): a partitioned stream's
        # needs the epoch's draw; the draws themselves are made where the plan is (and then dropped).
        self._counts_at: tuple[Any, np.ndarray] | None = None
        self._log_epoch()

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_counts_at": None}

    def rebind_world(self) -> bool:
        """:meth:`RankDataset.rebind_world` for a mix: its members and shares are cut for one world, so a
        detected world that no longer matches the initialised process group opens them again for it
        (the epoch is kept; the position and an elastic order are dropped, as for one dataset)."""
        if self.world_source == "explicit":
            return False
        now = process_group_world()
        if now is None or now == (self.rank, self.world_size):
            return False
        log.info("stager.loader: rank %d of %d became rank %d of %d (the initialised process group): mix re-planned",
                 self.rank, self.world_size, *now)
        epoch = self.epoch
        MixDataset.__init__(self, self.mix, self.options)  # the world-dependent phases, in the new world
        self.epoch = epoch
        return True

    # ---- the mix's epoch ------------------------------------------------------------------------
    def epoch_table(self) -> list[dict[str, Any]]:
        """Per stream: ``name``, ``size`` (items), ``take`` (items per epoch), ``share`` of the epoch,
        ``passes`` (take / size) and ``cycle`` (epochs in which a down-sampled stream's rotation covers
        every item; 0 when the take is whole passes)."""
        total = int(self.takes.sum())
        return [{"name": n, "size": size, "take": take, "share": take / total, "passes": take / size,
                 "cycle": rotation_cycle(size, take)}
                for n, size, take in zip(self.names, self.sizes, self.takes.tolist(), strict=True)]

    def epoch_summary(self) -> str:
        """The epoch's length and each stream's part of it, in one line."""
        parts = []
        for row in self.epoch_table():
            how = f"{row['take']} of {row['size']}"
            if row["take"] < row["size"]:
                how += f", every sample within {row['cycle']} epochs"
            elif row["take"] > row["size"]:
                how += f", {row['passes']:.2f} passes"
            parts.append(f"{row['name']} {row['share']:.1%} ({how})")
        return (f"mix of {len(self.names)} streams, {self.mix.composition} batches: {int(self.takes.sum())} samples "
                "per epoch: " + "; ".join(parts))

    def _log_epoch(self) -> None:
        key = f"{self.dataset_id}:{self.world_size}"
        if key not in _LOGGED:
            _LOGGED.add(key)
            log.info("stager.loader: %s", self.epoch_summary())

    def stream_sequence(self, i: int, epoch: int) -> np.ndarray:
        """Stream ``i``'s items of ``epoch`` in their epoch order (:func:`stager.order.mix.stream_sequence`)."""
        m = self.members[i]
        return stream_sequence(m.items.starts, m.run_len, self.mode, seed=self.seed, stream=i, epoch=epoch,
                               take=int(self.takes[i]))

    def _split(self, remaining: np.ndarray) -> list[np.ndarray]:
        return [remaining[1][remaining[0] == i].astype(np.int64) for i in range(len(self.members))]

    def _explicit(self, epoch: int) -> bool:
        return self._remaining is not None and epoch == self.epoch

    def stream_epochs(self, epoch: int | None = None) -> list[StreamEpoch]:
        """Each stream's epoch as this rank's group plans it: an elastic resume's remaining items, or the
        epoch's draws. Made afresh on each call (O(samples)): the plan keeps what it needs of them."""
        e = self.epoch if epoch is None else epoch
        if self._explicit(e):
            assert self._remaining is not None
            seqs = self._split(self._remaining)
        else:
            seqs = [self.stream_sequence(i, e) for i in range(len(self.members))]
        return [self._stream_epoch(i, seq) for i, seq in enumerate(seqs)]

    def _stream_epoch(self, i: int, seq: np.ndarray) -> StreamEpoch:
        layout = self.nodes[i]
        if layout is None:
            return plain_epoch(seq, self.rank, self.world_size, self.drop_last)
        starts = self.members[i].items.starts
        node_of = layout.node_of_shard[np.searchsorted(starts, seq, side="right") - 1]
        per = partitioned_per_rank(node_of, layout.num_nodes, layout.ranks_per_node, self.drop_last)
        local = np.flatnonzero(node_of == layout.node).astype(np.int64)
        if per and not len(local):
            raise UsageError(f"stream {self.names[i]!r}: this node's partition holds none of the {len(seq)} samples "
                             "the stream draws this epoch; raise the stream's share or stage it in full (without "
                             "--partition)")
        return StreamEpoch(seq, per, layout.local_rank, layout.ranks_per_node, local)

    # ---- the plan's arguments -------------------------------------------------------------------
    def _buffers(self, nw: int) -> tuple[int, ...]:
        """Per stream, the items each worker's buffer holds: ``shuffle_buffer`` split over the streams,
        or the byte budget per rank / workers / streams / the stream's mean item size."""
        ns = len(self.members)
        if self.options.shuffle_buffer is not None:
            return (max(1, int(self.options.shuffle_buffer) // ns),) * ns
        per = self.options.shuffle_buffer_bytes / max(1, nw) / ns
        return tuple(int(max(1, min(MAX_BUFFER_SAMPLES, per // max(m._mean_sample, 1.0)))) for m in self.members)

    def buffer_samples(self, streams: int | None = None) -> int:
        return sum(self._buffers(streams or self.streams()))

    def config(self) -> MixConfig:
        nw = self.streams() if self.num_workers is None else self.num_workers
        buffers = self._buffers(max(1, nw))
        return MixConfig(batch_size=self.batch_size, world_size=self.world_size, num_workers=nw, seed=self.seed,
                         mode=self.mode, drop_last=self.drop_last, buffer_samples=sum(buffers),
                         composition=self.mix.composition, buffers=buffers)

    def deal_batches_in_turn(self) -> bool:
        """A mix keeps its layout (its batches mix the streams; there is no one dataset order to gather in)."""
        return False

    def mix_plan(self, epoch: int | None = None) -> MixRankPlan:
        """This rank's plan of ``epoch`` (default: the current one, over an elastic resume's remaining items)."""
        e = self.epoch if epoch is None else epoch
        return plan_mix_rank(self.stream_epochs(e), self.config(), self.rank, epoch=e)

    def plan(self, epoch: int | None = None, *, rank: int | None = None) -> RankPlan:
        raise UsageError("a mix has one plan per stream: use mix_plan()")

    def epoch_sequence(self, epoch: int) -> np.ndarray:
        raise UsageError("a mix has one epoch order per stream: use stream_sequence(i, epoch)")

    def read_schedule(self, epoch: int | None = None, *, start_batch: int = 0) -> ReadSchedule:
        raise UsageError("stage --follow and the prefetcher follow one dataset, not a mix; stage the mix's streams "
                         "with `stager stage MIX.yaml DEST`")

    def _lengths(self) -> list[int]:
        """Items of each stream's epoch at the current position: its take, or what an elastic resume left."""
        if self._remaining is not None:
            return np.bincount(self._remaining[0], minlength=len(self.members)).tolist()
        return self.takes.tolist()

    def samples_in_epoch(self) -> int:
        return int(sum(self._lengths()))

    def _counts(self) -> np.ndarray:
        """Items of each stream per rank this epoch (the same on every rank). Without a node-partitioned
        stream this needs no draw: ``ceil`` (``floor`` with ``drop_last``) of the take over the ranks."""
        key = (self.epoch, id(self._remaining))
        if self._counts_at is not None and self._counts_at[0] == key:
            return self._counts_at[1]
        if any(layout is not None for layout in self.nodes):
            counts = np.array([se.per_rank for se in self.stream_epochs()], dtype=np.int64)
        else:
            counts = np.array([samples_per_rank(n, self.world_size, self.drop_last) for n in self._lengths()],
                              dtype=np.int64)
        self._counts_at = (key, counts)
        return counts

    def batch_sizes(self) -> np.ndarray:
        counts = self._counts()
        if self.mix.composition == "per_stream":
            rng = streams.mix_batch_order(self.seed, self.epoch, self.world_size)
            return batch_layout(counts, self.batch_size, self.drop_last, "per_stream", rng).sizes
        return batch_sizes(int(counts.sum()), self.batch_size, self.drop_last)

    # ---- LoaderBase's hooks -----------------------------------------------------------------------
    @property
    def dataset_id(self) -> str:
        h = xxhash.xxh3_64()
        for name, m, take in zip(self.names, self.members, self.takes.tolist(), strict=True):
            h.update(f"{name}\0{m.index.dataset_id}\0{take}\n".encode())
        h.update(self.mix.composition.encode())
        return "mix-" + h.hexdigest()

    def plan_key(self) -> str:
        h = xxhash.xxh3_64()
        for m, layout in zip(self.members, self.nodes, strict=True):
            h.update(m.plan_key().encode())
            if layout is not None:
                h.update(f"{layout.node}/{layout.num_nodes}x{layout.ranks_per_node}".encode())
        return h.hexdigest()

    def origin(self) -> dict[str, Any]:
        infos = [{"name": n, "source": redact(m.resolved.source), "reading_from": redact(m.resolved.root),
                  "staged": m.resolved.staged, "staged_mode": m.resolved.staged_mode}
                 for n, m in zip(self.names, self.members, strict=True)]
        return {"source": redact(self.mix.source or self.mix.describe()),
                "reading_from": "; ".join(f"{i['name']}: {i['reading_from']}" for i in infos),
                "staged": all(i["staged"] for i in infos),
                "staged_mode": modes.pop() if len(modes := {i["staged_mode"] for i in infos}) == 1 else None,
                "streams": infos}

    def batch_fields(self) -> tuple[str, ...]:
        return (*super().batch_fields(), "stream", *(s.name for s in self.field_specs))

    def batch_padding(self) -> np.ndarray:
        return self.mix_plan().batch_padding()

    def unconsumed(self, state: LoaderState, seq: np.ndarray | None) -> np.ndarray:
        """``state``'s epoch minus what its world consumed, per stream, as int64 (2, n) (stream, item id)."""
        partitioned = [n for n, layout in zip(self.names, self.nodes, strict=True) if layout is not None]
        if partitioned:
            raise UsageError(f"cannot resume elastically over node-partitioned staged copies (streams {partitioned}); "
                             "re-stage for the new world size")
        seqs = self._split(seq) if seq is not None else [self.stream_sequence(i, state.epoch)
                                                          for i in range(len(self.members))]
        buffers = self._buffers(max(1, state.num_workers))
        if sum(buffers) != state.buffer_samples:
            raise UsageError(f"cannot resume: the state's shuffle buffers hold {state.buffer_samples} items, this "
                             f"loader's would hold {sum(buffers)} with {state.num_workers} workers; keep the shuffle "
                             "buffer settings of the run that saved it")
        cfg = MixConfig(batch_size=state.batch_size, world_size=state.world_size, num_workers=state.num_workers,
                        seed=state.seed, mode=state.mode, drop_last=state.drop_last,
                        buffer_samples=state.buffer_samples, composition=self.mix.composition, buffers=buffers)
        left = unconsumed_mix(seqs, cfg, epoch=state.epoch, batches_done=state.batches_done)
        tags = [np.full(len(x), i, dtype=np.int64) for i, x in enumerate(left)]
        return np.stack([np.concatenate(tags), np.concatenate(left)]).astype(np.int64)

    # ---- iteration ------------------------------------------------------------------------------
    def worker_batches(self, worker: int, *, in_worker: bool) -> Iterator[dict[str, Any]]:
        cfg = self.config()
        wp = plan_mix_worker(self.stream_epochs(), cfg, self.rank, epoch=self.epoch,
                             worker=(worker + self.start_batch) % cfg.streams)
        accesses = [ShardAccess(m.resolved, use_mmap=self.options.use_mmap) for m in self.members]
        try:
            yield from self._mix_batches(wp, accesses, cfg, in_worker=in_worker)
        finally:
            for a in accesses:
                a.close()

    def _mix_batches(self, wp: MixWorkerPlan, accesses: Sequence[ShardAccess], cfg: MixConfig, *,
                     in_worker: bool) -> Iterator[dict[str, Any]]:
        """Worker ``wp``'s batches from ``start_batch`` on: each stream read as its schedule says, decoded
        by its member, placed where the layout says.

        Item ids, keys, labels and streams are put in the layout's order a window of batches at a time
        (:data:`GATHER_WINDOW`: one gather each, of bounded size); a batch then slices them, and gathers
        only its payloads."""
        shuffled = self.mode in ("runs", "shards")
        feeds = [StreamFeed(m, wp.parts[i], accesses[i], start_batch=self.start_batch,
                             owned=shuffled and cfg.buffers[i] > 1) for i, m in enumerate(self.members)]
        ring = self._worker_ring() if in_worker else None
        if in_worker:
            single_threaded_cv2()
        release_free_heap()
        starts = np.concatenate([[0], np.cumsum(wp.sizes)]).astype(np.int64).tolist()
        steps = [st.tolist() for st in wp.steps]
        per_stream = stream_counts(wp)
        counts = per_stream.tolist()
        batches = wp.batches.tolist()
        win = _Window()
        for b in range(int(np.searchsorted(wp.batches, self.start_batch)), len(batches)):
            if not win.lo <= b < win.hi:
                hi = min(b + (GATHER_WINDOW if win.hi else FIRST_WINDOW), len(batches))
                win = self._window(wp, feeds, b, hi, starts, counts=per_stream)
            t = time.perf_counter()
            got: list[tuple[int, list[Any], np.ndarray]] = []
            nbytes = [0] * len(feeds)
            for i, feed in enumerate(feeds):
                step = steps[i][b]
                if step >= 0:
                    payloads, nbytes[i], ids = feed.take(step)
                    got.append((i, payloads, ids))
            io_s = time.perf_counter() - t
            t = time.perf_counter()
            lo, hi = starts[b] - win.base, starts[b + 1] - win.base
            batch = self._assemble_mix(got, win, lo, hi, batches[b], in_worker=in_worker, ring=ring,
                                       counts=counts[b])
            batch["_w"].update(bytes=sum(nbytes), io_s=io_s, decode_s=time.perf_counter() - t, stream_bytes=nbytes)
            yield batch

    def _window(self, wp: MixWorkerPlan, feeds: Sequence[StreamFeed], lo: int, hi: int,
                starts: list[int], *, counts: np.ndarray) -> _Window:
        """Batches ``[lo, hi)`` of the worker's plan: their places' streams, item ids, keys and labels in the
        layout's order, and each batch's gather order of payloads (:func:`gather_order`)."""
        base, end = starts[lo], starts[hi]
        slots = wp.slots[base:end]
        keys: list[Any] = []
        ids, labels = [], []
        for i, feed in enumerate(feeds):
            taken = wp.steps[i][lo:hi]
            taken = taken[taken >= 0]
            if len(taken):  # a stream's steps in a run of batches are consecutive
                got_ids, got_keys, got_labels = feed.window(int(taken[0]), int(taken[-1]) + 1)
                ids.append(got_ids)
                keys += got_keys
                labels.append(got_labels)
        order = window_order(slots, len(feeds))
        pick = operator.itemgetter(*order.tolist())
        return _Window(lo, hi, base, slots.astype(np.int64),
                       np.concatenate(ids)[order], list(pick(keys)) if len(order) > 1 else keys,
                       np.concatenate(labels)[order], gather_order(order, slots, counts[lo:hi]))

    def _decode_stream(self, i: int, payloads: list[Any], ids: np.ndarray, j: int,
                       rng: list[np.random.Generator]) -> tuple[list[Any], np.ndarray, list[str]]:
        """Stream ``i``'s items of rank batch ``j``: ``(items, kept ids, skipped keys)``. ``rng``: the batch's
        one augmentation generator, made on first use (raw payloads that pass through need none)."""
        m = self.members[i]
        if self._passes[i] and (m.options.on_error == "raise" or all(p is not None for p in payloads)):
            return payloads, ids, []  # raw bytes or stored arrays as they are: no per-sample work
        if not rng:
            rng.append(streams.augment(self.seed, self.epoch, self.world_size, self.rank, j))
        return m._decode_all(payloads, ids, j, rng=rng[0])

    def _assemble_mix(self, got: list[tuple[int, list[Any], np.ndarray]], win: _Window, lo: int, hi: int, j: int,
                      *, in_worker: bool, ring: Any, counts: list[int]) -> dict[str, Any]:
        """Rank batch ``j`` (places ``[lo, hi)`` of ``win``) from each stream's payloads: decoded items in the
        layout's places, with keys, labels, item ids, streams (and a clip pack's sequence/start frame, the
        common fields).

        Each stream's items are decoded stream after stream, then put in the layout's order with one
        gather (the window's ``gather``: per place, its index among the batch's places sorted by stream),
        so the per-item work is a C-level lookup."""
        rng: list[np.random.Generator] = []
        items: list[Any] = []
        meta = []
        skipped: list[str] = []
        stream, gather = win.stream[lo:hi], win.gather[lo:hi]
        keep: np.ndarray | None = None
        for i, payloads, ids in got:
            out, kept, lost = self._decode_stream(i, payloads, ids, j, rng)
            if lost:
                skipped += lost
                keep = np.ones(hi - lo, dtype=bool) if keep is None else keep
                keep[np.flatnonzero(stream == i)[~subsequence_mask(ids, kept)]] = False
            items += out
            if self.per_item > 1:
                m = self.members[i]
                meta.append(clip_meta(m.index, m.items.samples_of(kept)[:, 0]))
        keys, label, index = win.keys[lo:hi], win.labels[lo:hi], win.ids[lo:hi]
        if keep is not None:  # skipped items (on_error="skip"): the places left, re-sorted by stream
            keys = [k for k, ok in zip(keys, keep.tolist(), strict=True) if ok]
            stream, label, index = stream[keep], label[keep], index[keep]
            counts = np.bincount(stream, minlength=len(self.members)).tolist()
            gather = np.empty(len(stream), dtype=np.int64)
            gather[np.argsort(stream, kind="stable")] = np.arange(len(stream), dtype=np.int64)
        batch: dict[str, Any] = {"label": label, "index": index, "stream": stream, "key": keys}
        if len(got) > 1 and len(gather) > 1:
            items = list(operator.itemgetter(*gather.tolist())(items))  # one C-level gather (~0.6x a map)
        if meta:
            seq = [x for md in meta for x in md["sequence"]]
            batch["sequence"] = [seq[k] for k in gather.tolist()]
            batch["start_frame"] = np.concatenate([md["start_frame"] for md in meta]).astype(np.int64)[gather]
        batch.update(self._payload_fields(items, in_worker=in_worker, ring=ring))
        batch["_w"] = {"skipped": skipped, "batch": j, "stream_samples": counts}
        return batch

    def _payload_fields(self, items: list[Any], *, in_worker: bool, ring: Any) -> dict[str, Any]:
        decode = self.options.decode
        if decode == "raw":
            return self._raw_fields(items, in_worker=in_worker, ring=ring)
        if decode == "pil":
            return {"image": items}
        if not self.field_specs:
            return self._image_fields(items, in_worker=in_worker, ring=ring)
        out = self._image_fields([it["image"] for it in items], in_worker=in_worker, ring=ring)
        out.update(assemble_fields(items, self.field_specs))
        out["_fields"] = {s.name: s.kind for s in self.field_specs}
        return out

