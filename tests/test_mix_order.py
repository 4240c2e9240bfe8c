"""The mix's order (stager/order/mix.py, composition.py, mixplan.py) checked as invariants of pure functions.

Takes and draws: weights, samples and repeats give exact epoch takes; a down-sampled stream never
repeats an item within an epoch and covers every item in ceil(1 / fraction) epochs; an up-sampled
one holds every item q or q + 1 times. Plans: every rank has the same batch sizes and the same count
of every stream; the world's batches hold each stream's draw exactly (plus the padding repeats);
stratified batches hold each stream's share to within one item; random ones spread like the
binomial; per_stream batches hold one stream, the same one on every rank at each step; the order
is seeded and differs per epoch; an elastic resume's remaining items are exactly the unconsumed ones.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from stager.errors import UsageError
from stager.order.composition import batch_layout, stratify
from stager.order.epoch import run_lengths
from stager.order.mix import (
    apportion,
    plain_epoch,
    rotation_cycle,
    stream_sequence,
    stream_takes,
)
from stager.order.mixplan import MixConfig, plan_mix_rank, unconsumed_mix

# Three streams: sizes, shards of 25 items (the last one short), runs of 4.
SIZES = (600, 230, 47)
MODES = ("runs", "shards", "random", "none")


def layout(n: int, shard: int = 25) -> tuple[np.ndarray, np.ndarray]:
    starts = np.append(np.arange(0, n, shard), n).astype(np.int64)
    return starts, run_lengths(np.diff(starts), np.diff(starts) * 1000, 4000)


def draws(takes: np.ndarray, mode: str, epoch: int, seed: int = 0) -> list[np.ndarray]:
    out = []
    for i, (n, take) in enumerate(zip(SIZES, takes.tolist(), strict=True)):
        starts, runs = layout(n)
        out.append(stream_sequence(starts, runs, mode, seed=seed, stream=i, epoch=epoch, take=take))
    return out


def world_batches(seqs: list[np.ndarray], cfg: MixConfig, epoch: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    return [plan_mix_rank([plain_epoch(s, r, cfg.world_size, cfg.drop_last) for s in seqs], cfg, r,
                          epoch=epoch).batch_items() for r in range(cfg.world_size)]


def test_takes_from_weights_samples_and_repeats() -> None:
    assert stream_takes(SIZES, [("repeat", 1)] * 3).tolist() == list(SIZES)
    # Weighted streams share what they hold together, exactly, in proportion (largest remainders).
    got = stream_takes(SIZES, [("weight", 0.5), ("weight", 0.3), ("weight", 0.2)])
    assert got.sum() == sum(SIZES) and np.abs(got - np.array([0.5, 0.3, 0.2]) * sum(SIZES)).max() < 1
    # Absolute takes first; the weighted ones share the rest of epoch_samples.
    got = stream_takes(SIZES, [("weight", 3), ("samples", 100), ("repeat", 2.5)], epoch_samples=1000)
    assert got.tolist() == [782, 100, 118]
    got = stream_takes(SIZES, [("weight", 1), ("weight", 1), ("samples", 5)], epoch_samples=105)
    assert got.tolist() == [50, 50, 5]
    assert apportion(10, [1, 1, 1]).tolist() == [4, 3, 3]
    with pytest.raises(UsageError, match="no stream has a weight"):
        stream_takes(SIZES, [("samples", 10)] * 3, epoch_samples=100)
    with pytest.raises(UsageError, match="leaves 0 samples"):
        stream_takes(SIZES, [("weight", 1), ("samples", 100), ("samples", 100)], epoch_samples=200)
    with pytest.raises(UsageError, match="'b': weight 1e-06 gives 0"):
        stream_takes(SIZES, [("weight", 1), ("weight", 1e-6), ("samples", 5)], names=["a", "b", "c"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.77])
def test_a_down_sampled_stream_rotates_through_every_item(mode: str, fraction: float) -> None:
    n = 230
    take = round(fraction * n)
    starts, runs = layout(n)
    k = rotation_cycle(n, take)
    assert k == int(np.ceil(1 / (take / n)))
    for cycle in range(3):
        seen = np.zeros(n, dtype=np.int64)
        for e in range(cycle * k, (cycle + 1) * k):
            seq = stream_sequence(starts, runs, mode, seed=5, stream=1, epoch=e, take=take)
            assert len(seq) == take and len(np.unique(seq)) == take  # without replacement within an epoch
            seen[seq] += 1
        assert seen.min() >= 1, f"cycle {cycle}: {int((seen == 0).sum())} items never drawn in {k} epochs"
        assert seen.max() <= 2 and seen.sum() == k * take


@pytest.mark.parametrize("mode", MODES)
def test_an_up_sampled_stream_repeats_whole_permutations(mode: str) -> None:
    n, take = 47, 47 * 3 + 20
    starts, runs = layout(n)
    extra = np.zeros(n, dtype=np.int64)
    for e in range(rotation_cycle(n, take)):
        seq = stream_sequence(starts, runs, mode, seed=1, stream=2, epoch=e, take=take)
        counts = np.bincount(seq, minlength=n)
        assert set(counts.tolist()) <= {3, 4}
        for j in range(3):  # each whole pass is a permutation
            assert sorted(seq[j * n : (j + 1) * n].tolist()) == list(range(n))
        extra += counts - 3
    assert extra.min() >= 1  # the remainder also rotates through every item


def test_draws_are_seeded_and_differ_per_epoch_and_stream() -> None:
    starts, runs = layout(230)
    a = stream_sequence(starts, runs, "runs", seed=0, stream=0, epoch=0, take=230)
    assert np.array_equal(a, stream_sequence(starts, runs, "runs", seed=0, stream=0, epoch=0, take=230))
    for other in ({"seed": 1, "stream": 0, "epoch": 0}, {"seed": 0, "stream": 1, "epoch": 0},
                  {"seed": 0, "stream": 0, "epoch": 1}):
        assert not np.array_equal(a, stream_sequence(starts, runs, "runs", take=230, **other))
    # Runs stay runs: most neighbours are consecutive ids (one read per run).
    assert np.mean(np.diff(a) == 1) > 0.6


CASES = list(itertools.product(("random", "stratified", "per_stream"), (1, 3), (0, 2), (False, True)))


@pytest.mark.parametrize(("composition", "world", "workers", "drop_last"), CASES)
def test_every_rank_gets_equal_batches_and_the_world_reads_each_draw(
    composition: str, world: int, workers: int, drop_last: bool
) -> None:
    takes = stream_takes(SIZES, [("weight", 5), ("weight", 3), ("repeat", 2)])
    cfg = MixConfig(batch_size=16, world_size=world, num_workers=workers, seed=3, composition=composition,
                    drop_last=drop_last, buffers=(32, 8, 4))
    seqs = draws(takes, "runs", epoch=2)
    plans = [plan_mix_rank([plain_epoch(s, r, world, drop_last) for s in seqs], cfg, r, epoch=2) for r in range(world)]
    assert len({tuple(p.sizes.tolist()) for p in plans}) == 1, "unequal batch sizes across ranks hang DDP"
    assert len({tuple(p.layout.used.tolist()) for p in plans}) == 1, "every rank holds the same mixture"
    if drop_last and composition != "per_stream":
        assert set(plans[0].sizes.tolist()) == {16}
    got = [np.zeros(n, dtype=np.int64) for n in SIZES]
    pads = 0
    for p in plans:
        pads += p.padded
        for slots, ids in p.batch_items():
            for i in range(3):
                np.add.at(got[i], ids[slots == i], 1)
    want = [np.bincount(s, minlength=n) for s, n in zip(seqs, SIZES, strict=True)]
    if drop_last:
        assert all((g <= w).all() for g, w in zip(got, want, strict=True))
        assert pads == 0
    else:  # every drawn item exactly as often as drawn, plus at most world - 1 repeats per stream
        extra = [g - w for g, w in zip(got, want, strict=True)]
        assert all(e.min() >= 0 for e in extra)
        assert sum(int(e.sum()) for e in extra) == pads <= 3 * (world - 1)


@pytest.mark.parametrize("seed", range(4))
def test_stratified_batches_hold_each_share_within_one_item(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(30):
        ns = int(rng.integers(1, 6))
        counts = rng.integers(1, 400, size=ns)
        bs = int(rng.integers(1, 64))
        for drop_last in (False, True):
            lay = batch_layout(counts, bs, drop_last, "stratified", np.random.default_rng(seed))
            used = lay.used
            exact = lay.sizes[:, None] * used[None, :] / used.sum()
            assert (np.abs(lay.counts - exact) < 1).all()
            assert (lay.counts.sum(axis=1) == lay.sizes).all() and (used <= counts).all()
            if not drop_last:
                assert (used == counts).all()
            # the places say the same: slots of each batch count what counts says
            starts = np.concatenate([[0], np.cumsum(lay.sizes)])
            for b in range(len(lay.sizes)):
                here = lay.slots[starts[b] : starts[b + 1]]
                assert np.bincount(here, minlength=ns).tolist() == lay.counts[b].tolist()


def test_stratify_is_exact_on_uneven_last_batches() -> None:
    sizes = np.array([7] * 9 + [3])
    counts = stratify(np.array([33, 20, 13]), sizes, np.random.default_rng(0))
    assert counts.sum(axis=0).tolist() == [33, 20, 13] and counts.sum(axis=1).tolist() == sizes.tolist()
    assert (np.abs(counts - sizes[:, None] * np.array([33, 20, 13]) / 66) < 1).all()


def proportions(composition: str, epochs: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per batch counts of each stream over ``epochs`` epochs (one rank of 2; ~140 batches an epoch), the
    streams' shares of the epoch, the batch size."""
    sizes, weights = (6000, 2300, 470), (0.6, 0.3, 0.1)
    takes = stream_takes(sizes, [("weight", w) for w in weights])
    cfg = MixConfig(batch_size=32, world_size=2, num_workers=2, seed=11, composition=composition, buffers=(16, 16, 16))
    rows = []
    for e in range(epochs):
        seqs = []
        for i, (n, take) in enumerate(zip(sizes, takes.tolist(), strict=True)):
            starts, runs = layout(n)
            seqs.append(stream_sequence(starts, runs, "runs", seed=11, stream=i, epoch=e, take=take))
        plan = plan_mix_rank([plain_epoch(s, 0, 2, False) for s in seqs], cfg, 0, epoch=e)
        rows.append(plan.layout.counts[plan.layout.sizes == 32])
    return np.concatenate(rows), takes / takes.sum(), 32


@pytest.mark.parametrize("epochs", [1, 10])
def test_proportions_stratified_and_random(epochs: int) -> None:
    counts, share, bs = proportions("stratified", epochs)
    assert (np.abs(counts - share * bs) <= 1).all()  # within one item in every batch
    counts, share, bs = proportions("random", epochs)
    total = counts.sum(axis=0)
    n = counts.sum()
    sigma = np.sqrt(n * share * (1 - share))
    assert (np.abs(total - n * share) <= 3 * sigma).all()
    # batch by batch the counts spread like the binomial's (hypergeometric: no wider)
    per_sigma = np.sqrt(bs * share * (1 - share))
    assert (np.abs(counts.mean(axis=0) - bs * share) <= 3 * per_sigma / np.sqrt(len(counts))).all()
    assert (counts.std(axis=0) <= 1.25 * per_sigma).all()
    assert np.mean(np.abs(counts - bs * share) > 3 * per_sigma) < 0.02


def test_per_stream_batches_are_one_stream_the_same_on_every_rank() -> None:
    takes = stream_takes(SIZES, [("weight", 2), ("weight", 1), ("samples", 40)])
    cfg = MixConfig(batch_size=16, world_size=3, num_workers=2, seed=0, composition="per_stream", buffers=(8, 8, 8))
    seqs = draws(takes, "runs", 0)
    per_rank = world_batches(seqs, cfg, 0)
    for batches in per_rank:
        assert all(len(set(slots.tolist())) == 1 for slots, _ in batches)
    steps = [[int(slots[0]) for slots, _ in batches] for batches in per_rank]
    assert steps[0] == steps[1] == steps[2]


def test_a_workers_plan_alone_is_its_part_of_the_rank_plan() -> None:
    from stager.order.mixplan import plan_mix_worker

    seqs = draws(np.array(SIZES), "runs", 1)
    cfg = MixConfig(batch_size=8, world_size=2, num_workers=3, composition="stratified", buffers=(8, 8, 8))
    epochs = [plain_epoch(s, 1, 2, False) for s in seqs]
    rank_plan = plan_mix_rank(epochs, cfg, 1, epoch=1)
    for k in range(3):
        alone, part = plan_mix_worker(epochs, cfg, 1, epoch=1, worker=k), rank_plan.workers[k]
        assert np.array_equal(alone.slots, part.slots) and all(
            np.array_equal(a.stream, b.stream) and np.array_equal(a.emit, b.emit)
            for a, b in zip(alone.parts, part.parts, strict=True))


def test_composition_does_not_depend_on_workers_and_order_differs_per_epoch() -> None:
    takes = np.array(SIZES)
    seqs = draws(takes, "runs", 0)
    plans = [plan_mix_rank([plain_epoch(s, 1, 2, False) for s in seqs],
                           MixConfig(batch_size=8, world_size=2, num_workers=w, composition="random",
                                     buffers=(8, 8, 8)), 1, epoch=0) for w in (0, 1, 3)]
    assert all(np.array_equal(p.layout.slots, plans[0].layout.slots) for p in plans)
    later = plan_mix_rank([plain_epoch(s, 1, 2, False) for s in draws(takes, "runs", 1)],
                          MixConfig(batch_size=8, world_size=2, num_workers=0, buffers=(8, 8, 8)), 1, epoch=1)
    assert not np.array_equal(later.layout.slots, plans[0].layout.slots)


@pytest.mark.parametrize(("composition", "mode"), [("random", "runs"), ("stratified", "none"), ("per_stream", "shards"),
                                                   ("stratified", "random")])
def test_unconsumed_is_what_no_rank_has_read(composition: str, mode: str) -> None:
    takes = stream_takes(SIZES, [("weight", 2), ("weight", 1), ("repeat", 3)])
    cfg = MixConfig(batch_size=12, world_size=2, num_workers=2, composition=composition, buffers=(8, 8, 8), mode=mode)
    seqs = draws(takes, mode, 4)
    done = 5
    left = unconsumed_mix(seqs, cfg, epoch=4, batches_done=done)
    read = [np.zeros(n, dtype=np.int64) for n in SIZES]
    for batches in world_batches(seqs, cfg, 4):
        for slots, ids in batches[:done]:
            for i in range(3):
                np.add.at(read[i], ids[slots == i], 1)
    for i in range(3):
        # the draw's multiset minus what was read is what is left (repeats counted one by one)
        want = np.bincount(seqs[i], minlength=SIZES[i]) - read[i]
        assert np.array_equal(np.bincount(left[i], minlength=SIZES[i]), want)
    # re-planned over 3 ranks, the rest is read exactly once more (no padding beyond world - 1 per stream)
    cfg3 = MixConfig(batch_size=8, world_size=3, num_workers=1, composition=composition, buffers=(8, 8, 8), mode=mode)
    again = [np.zeros(n, dtype=np.int64) for n in SIZES]
    for batches in world_batches(left, cfg3, 4):
        for slots, ids in batches:
            for i in range(3):
                np.add.at(again[i], ids[slots == i], 1)
    for i in range(3):
        assert 0 <= int((again[i] - np.bincount(left[i], minlength=SIZES[i])).sum()) <= 2
