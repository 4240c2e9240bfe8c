"""Invariants of the loader's epoch plan (pure functions: no files, no processes)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stager.order import epoch as planlib
from stager.order.reads import segment_bounds


def _starts(counts: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _all_rank_batches(starts, run_len, cfg, epoch):  # type: ignore[no-untyped-def]
    return [planlib.plan_rank(starts, run_len, cfg, r, epoch=epoch) for r in range(cfg.world_size)]


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    world=st.integers(1, 5),
    workers=st.integers(0, 3),
    batch=st.integers(1, 9),
    mode=st.sampled_from(planlib.SHUFFLE_MODES),
    drop_last=st.booleans(),
    buffer=st.integers(0, 30),
    seed=st.integers(0, 2**31),
    deal=st.booleans(),
)
def test_every_sample_once_equal_counts(  # noqa: PLR0917 (hypothesis passes strategies by keyword)
    counts, world, workers, batch, mode, drop_last, buffer, seed, deal
):  # type: ignore[no-untyped-def]
    starts = _starts(counts)
    n = int(starts[-1])
    if n == 0 and not drop_last:
        return
    run_len = planlib.run_lengths(np.array(counts), np.array(counts) * 1000, 3000, 2)
    cfg = planlib.PlanConfig(batch, world, workers, seed, mode, drop_last, buffer, deal_batches=deal)
    plans = _all_rank_batches(starts, run_len, cfg, epoch=3)
    nb = {p.num_batches for p in plans}
    assert len(nb) == 1, "every rank must get the same number of batches"
    assert len({tuple(p.sizes.tolist()) for p in plans}) == 1
    seen = np.concatenate([np.concatenate(p.batch_ids()) if p.num_batches else np.zeros(0, np.int64) for p in plans])
    counts_seen = np.bincount(seen, minlength=n) if n else np.zeros(0, np.int64)
    padded = sum(p.padded for p in plans)
    if drop_last:
        assert counts_seen.max(initial=0) <= 1, "drop_last never repeats a sample"
        assert plans[0].dropped == n - len(seen)
        assert all(p.sizes.min(initial=batch) == batch for p in plans)
    else:
        assert counts_seen.min() >= 1, "padding mode loses no sample"
        assert len(seen) == n + padded
        assert int((counts_seen - 1).sum()) == padded
        assert padded < world or n < world
    for p in plans:
        assert int(p.batch_padding().sum()) == p.padded
        # What the main process asks before its workers start: from the layout alone, no epoch order.
        assert planlib.batch_padding(n, cfg, p.rank, epoch=3).tolist() == p.batch_padding().tolist()
        for w in p.workers:
            assert sorted(w.emit.tolist()) == list(range(len(w.stream)))
            assert np.all(w.batches % cfg.streams == w.worker)
            # What a worker process plans: its own stream alone, equal to its part of the rank's plan.
            alone = planlib.plan_worker(starts, run_len, cfg, p.rank, w.worker, epoch=3)
            assert all(np.array_equal(getattr(alone, f.name), getattr(w, f.name))
                       for f in dataclasses.fields(w)), w.worker
    if deal:
        contiguous = _all_rank_batches(starts, run_len, dataclasses.replace(cfg, deal_batches=False), epoch=3)
        _assert_dealt(plans, contiguous, n, ordered=mode == "none")


def _assert_dealt(plans, contiguous, n, *, ordered):  # type: ignore[no-untyped-def]
    """``deal_batches`` (what Accelerate's ``prepare`` asks of a ``shuffle=False`` loader) against the
    contiguous layout of the same config: the same batch sizes and padding counts; and ``ordered``
    (``shuffle=False``): step ``j``'s batches of ranks 0, 1, ... concatenated, step after step, are the
    manifest order, then the padding repeats (the first samples again) at the tail of the last step only."""
    assert [p.sizes.tolist() for p in plans] == [p.sizes.tolist() for p in contiguous]
    assert sum(p.padded for p in plans) == sum(p.padded for p in contiguous)
    if ordered:
        batches = [p.batch_ids() for p in plans]
        steps = plans[0].num_batches
        gathered = [i for j in range(steps) for r in range(len(plans)) for i in batches[r][j].tolist()]
        assert gathered == [i % n for i in range(len(plans) * int(plans[0].sizes.sum()))]  # n == 0: none


def test_shuffle_false_is_manifest_order_contiguous() -> None:
    starts = _starts([10, 10, 11])
    run_len = planlib.run_lengths(np.diff(starts), np.diff(starts) * 10, 1 << 20)
    cfg = planlib.PlanConfig(batch_size=4, world_size=3, num_workers=2, mode="none")
    plans = _all_rank_batches(starts, run_len, cfg, epoch=0)
    assert [p.ids.tolist() for p in plans] == [list(range(0, 11)), list(range(11, 22)), [*range(22, 31), 0, 1]]
    assert plans[2].padded == 2
    assert np.concatenate(plans[0].batch_ids()).tolist() == list(range(11))


def test_deterministic_and_epochs_differ() -> None:
    starts = _starts([50] * 7)
    run_len = planlib.run_lengths(np.diff(starts), np.diff(starts) * 100, 800, 2)
    for mode in ("runs", "shards", "random"):
        cfg = planlib.PlanConfig(batch_size=7, world_size=3, num_workers=2, seed=5, mode=mode, buffer_samples=20)
        a = [np.concatenate(p.batch_ids()) for p in _all_rank_batches(starts, run_len, cfg, 1)]
        b = [np.concatenate(p.batch_ids()) for p in _all_rank_batches(starts, run_len, cfg, 1)]
        c = [np.concatenate(p.batch_ids()) for p in _all_rank_batches(starts, run_len, cfg, 2)]
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
        assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True)), mode
        other_seed = planlib.PlanConfig(7, 3, 2, 6, mode, False, 20)
        d = [np.concatenate(p.batch_ids()) for p in _all_rank_batches(starts, run_len, other_seed, 1)]
        assert not all(np.array_equal(x, y) for x, y in zip(a, d, strict=True))


def test_seeds_do_not_collide_like_seed_plus_epoch() -> None:
    starts = _starts([40] * 5)
    run_len = planlib.run_lengths(np.diff(starts), np.diff(starts) * 100, 800, 2)
    a = planlib.epoch_sequence(starts, run_len, planlib.PlanConfig(4, seed=1), epoch=2)
    b = planlib.epoch_sequence(starts, run_len, planlib.PlanConfig(4, seed=2), epoch=1)
    assert not np.array_equal(a, b)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 300), k=st.integers(0, 50), seed=st.integers(0, 1000))
def test_buffer_shuffle_is_bounded_permutation(n: int, k: int, seed: int) -> None:
    out = planlib.buffer_shuffle(n, k, np.random.default_rng(seed))
    assert sorted(out.tolist()) == list(range(n))
    # Memory bound: when the i-th sample is emitted, at most max(k, 1) positions have been read
    # past it, i.e. the emitted position is < i + k.
    assert all(p < i + max(k, 1) for i, p in enumerate(out.tolist()))


def test_runs_cover_shards_and_stay_inside() -> None:
    starts = _starts([13, 0, 29, 1])
    run_len = np.array([4, 1, 5, 1])
    for seed in range(5):
        a, b = planlib.make_runs(starts, run_len, np.random.default_rng(seed))
        ids = planlib.expand_runs(a, b)
        assert sorted(ids.tolist()) == list(range(43))
        shard = np.searchsorted(starts, a, side="right") - 1
        assert np.all(b <= starts[shard + 1])
        assert np.all(b - a <= run_len[shard])


def test_runs_mode_reads_runs_not_samples() -> None:
    starts = _starts([200] * 10)
    run_len = planlib.run_lengths(np.diff(starts), np.diff(starts) * 10_000, 100_000, 4)  # R = 10
    cfg = planlib.PlanConfig(batch_size=16, world_size=2, num_workers=2, mode="runs", buffer_samples=64)
    for p in _all_rank_batches(starts, run_len, cfg, 0):
        for w in p.workers:
            lo, hi, _shard = segment_bounds(w.stream, starts)
            # ~one read per run of 10 (each shard has one extra, jittered run; plus the cuts at
            # rank/worker boundaries), not one read per sample.
            assert len(lo) <= len(w.stream) / 10 * 1.1 + 3
            assert int((hi - lo).sum()) == len(w.stream)


def test_worker_streams_produce_round_robin_batches() -> None:
    starts = _starts([37] * 3)
    run_len = planlib.run_lengths(np.diff(starts), np.diff(starts), 8, 2)
    cfg = planlib.PlanConfig(batch_size=5, world_size=1, num_workers=3, mode="runs", buffer_samples=9)
    p = planlib.plan_rank(starts, run_len, cfg, 0, epoch=0)
    assert [w.batches.tolist() for w in p.workers] == [list(range(k, 23, 3)) for k in range(3)]
    assert p.sizes.tolist() == [5] * 22 + [1]


def test_shuffle_quality_metric_separates_orders() -> None:
    """tools/bench/shuffle_quality.py's metric on a class-ordered index: the defaults are close to a
    full random permutation, while a plain shard-order loader (and webdataset's default recipe on
    shards of 300) fail the same threshold."""
    from tools.bench.shuffle_quality import measure

    res = measure("tiny", workers=2)["results"]
    floor = res["full-random"]["tv"]
    threshold = floor + 0.05
    assert res["stager-runs (default, local copy)"]["tv"] < threshold
    assert res["stager-runs (default, Lustre/URL)"]["tv"] < threshold
    assert res["stager-none (shard order)"]["tv"] > 0.5 > threshold
    assert res["webdataset"]["tv"] > threshold


def _reference_reads(wp, starts, sizes, start_batch, cap):  # type: ignore[no-untyped-def]
    """The worker loop written out: read segments in stream order until each batch's positions are loaded."""
    from collections import OrderedDict

    lo, hi, shard = segment_bounds(wp.stream, starts)
    b0 = int(np.searchsorted(wp.batches, start_batch))
    skip = int(wp.sizes[:b0].sum())
    needed = np.zeros(len(wp.stream), dtype=bool)
    needed[wp.emit[skip:]] = True
    held: OrderedDict[int, None] = OrderedDict()
    out, seg, loaded = [], 0, 0
    for b in range(b0, len(wp.batches)):
        pos = wp.batch_positions(b)
        while loaded < int(pos.max()) + 1:
            a, z, s = int(lo[seg]), int(hi[seg]), int(shard[seg])
            seg += 1
            loaded = z
            want = np.flatnonzero(needed[a:z]) + a
            if not len(want):
                continue
            opens = s not in held
            held[s] = None
            held.move_to_end(s)
            if len(held) > cap:
                held.popitem(last=False)
            out.append((a, z, s, b, int(sizes[wp.stream[want]].sum()), opens))
    return out


@settings(max_examples=80, deadline=None)
@given(
    counts=st.lists(st.integers(0, 30), min_size=1, max_size=10),
    world=st.integers(1, 3),
    workers=st.integers(0, 3),
    batch=st.integers(1, 7),
    mode=st.sampled_from(planlib.SHUFFLE_MODES),
    buffer=st.integers(0, 20),
    seed=st.integers(0, 2**31),
    start=st.integers(0, 12),
    cap=st.integers(1, 4),
)
def test_read_schedule_is_the_worker_loop(  # noqa: PLR0917 (hypothesis passes strategies by keyword)
    counts, world, workers, batch, mode, buffer, seed, start, cap
):  # type: ignore[no-untyped-def]
    """The vectorised schedule equals the worker loop written out; every needed sample is read once,
    before the batch that emits it, and its read is held (``last_step``) until then."""
    from stager.order.reads import read_schedule

    starts = _starts(counts)
    sizes = (np.arange(int(starts[-1])) % 7 + 1).astype(np.int64)
    run_len = planlib.run_lengths(np.array(counts), np.array(counts) * 100, 300, 2)
    cfg = planlib.PlanConfig(batch, world, workers, seed, mode, False, buffer)
    for rank in range(world):
        rp = planlib.plan_rank(starts, run_len, cfg, rank, epoch=1)
        sched = read_schedule(rp, starts, sizes, start_batch=start)
        for wp, wr in zip(rp.workers, sched.workers, strict=True):
            got = list(zip(wr.lo.tolist(), wr.hi.tolist(), wr.shard.tolist(), wr.load_step.tolist(),
                           wr.nbytes.tolist(), wr.opens(cap).tolist(), strict=True))
            assert got == _reference_reads(wp, starts, sizes, start, cap)
            assert (wr.batch == wp.batches[wr.load_step]).all()
            read_of = np.full(len(wp.stream), -1)
            for i, (a, z) in enumerate(zip(wr.lo.tolist(), wr.hi.tolist(), strict=True)):
                read_of[a:z] = i
            last = np.full(len(wr), -1)
            for b in range(wr.first_step, len(wp.batches)):
                pos = wp.batch_positions(b)
                assert wr.needed[pos].all() and (read_of[pos] >= 0).all()
                assert (wr.load_step[read_of[pos]] <= b).all()
                np.maximum.at(last, read_of[pos], b)
            assert (last == wr.last_step).all()
            emitted = [b for b in range(wr.first_step, len(wp.batches)) for _ in wp.batch_positions(b)]
            assert len(emitted) == int(wr.needed.sum())
        flat = sched.shard.tolist()
        assert flat == [s for w in sched.workers for s in w.shard.tolist()]


def test_order_is_pure_numpy() -> None:
    """stager/order/ imports only numpy, stager.errors and itself (no torch, manifest or loader), so
    the loader, stage --partition and the prefetcher can all import its one copy."""
    import ast
    from pathlib import Path

    import stager.order

    allowed = ("numpy", "stager.errors", "stager.order", "__future__", "collections", "dataclasses", "heapq")
    for path in Path(stager.order.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.startswith(allowed), f"{path.name} imports {name}"


def _buffer_shuffle_reference(n: int, buffer: int, rng: np.random.Generator) -> np.ndarray:
    """The fill-then-swap buffer, one arrival at a time (the definition the vectorised one must match)."""
    if buffer <= 1 or n <= 1:
        return np.arange(n, dtype=np.int64)
    k = min(buffer, n)
    held = list(range(k))
    out = []
    for arriving, j in zip(range(k, n), rng.integers(0, k, size=n - k).tolist(), strict=True):
        out.append(held[j])
        held[j] = arriving
    out.extend(held[t] for t in rng.permutation(k).tolist())
    return np.asarray(out, dtype=np.int64)


@pytest.mark.parametrize("n,buffer", [(0, 4), (1, 4), (2, 2), (7, 3), (10, 10), (10, 50), (1000, 1), (1000, 2),
                                      (1000, 37), (5000, 4096), (3001, 1000), (70000, 65536), (70000, 65537),
                                      (140000, 66000)])
def test_buffer_shuffle_equals_the_one_at_a_time_definition(n: int, buffer: int) -> None:
    for seed in range(5):
        got = planlib.buffer_shuffle(n, buffer, np.random.default_rng(seed))
        want = _buffer_shuffle_reference(n, buffer, np.random.default_rng(seed))
        assert got.tolist() == want.tolist()
        assert sorted(got.tolist()) == list(range(n))
