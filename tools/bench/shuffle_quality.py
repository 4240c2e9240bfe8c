"""Shuffle quality of the loader's modes versus a full random permutation and the peers' defaults.

Metric (lower is better): the dataset is packed in class order (``keep_order=True``: all of class
0, then class 1, ...), the hardest case for shard-based shuffling. Cut the order a rank consumes
into consecutive windows of ``window`` samples (default 1,000) and take the mean, over windows,
of the total-variation distance between the window's label histogram and the dataset's label
distribution: ``TV = 0.5 * sum_c |count_c / window - p_c|``. 0 means every window is a perfect
miniature of the dataset; a class-ordered stream scores close to 1. A full random permutation
scores the sampling noise floor (about 0.04 for 10 classes, 0.37 for 1,000 classes at window
1,000), so results are also given as ``excess = TV - TV(random)``.

Orders compared on the same index (world size 1, ``--workers`` DataLoader workers):

* stager ``runs`` (default), ``shards``, ``random`` and ``none`` (``shuffle=False``: the plain
  shard-order loader), straight from :mod:`stager.order.epoch` (the loader's own order: the
  loader tests check that it yields exactly the plan's batches);
* ``full-random``: ``numpy`` permutation of all samples;
* ``webdataset``: its default recipe ``WebDataset(urls, shardshuffle=100).shuffle(1000)``, run
  with webdataset's own shuffle stage on the shard list and the sample stream when installed
  (a re-implementation of the same buffer otherwise);
* ``mosaicml-py1e``: MosaicML Streaming's default algorithm (``py1e``, canonical nodes = physical
  nodes = 1, ``shuffle_block_size = max(4_000_000 // canonical nodes, 1 << 18)``) simulated from
  its published description: shards permuted, samples of each shard spread by a uniform shift
  over a block, then sorted. Memory: it must hold every shard touched by a block (up to the whole
  dataset here), which is why its quality is near random.

Usage: ``python -m tools.bench.shuffle_quality [--scenario cifar|imagenet] [--json]``; prints a JSON
object and (with ``--md``) writes the table into docs/bench/loader.md's shuffle section.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from stager.order import epoch as planlib

SCENARIOS: dict[str, dict[str, Any]] = {
    # 10 classes x 5,000 PNG-sized samples (~2.6 KB), 10 shards of 5,000: CIFAR-10's train split.
    "cifar": {"classes": 10, "per_class": 5000, "sample_bytes": 2600, "shard_samples": 5000},
    # 1,000 classes x 1,300 JPEGs (~110 KB), shards of 256 MiB (~2,400 samples): ImageNet-1k.
    "imagenet": {"classes": 1000, "per_class": 1300, "sample_bytes": 110_000, "shard_samples": 2400},
    # Small, for tests: 10 classes x 600 samples of ~3 KB in shards of 300, with run and buffer
    # sizes scaled down 256x (1 MiB runs -> 4 KiB, 512 MiB buffer -> 2 MiB: ~6% of the set) so the
    # buffer cannot simply hold everything.
    "tiny": {"classes": 10, "per_class": 600, "sample_bytes": 3000, "shard_samples": 300, "scale": 256},
}


def tv_metric(labels: np.ndarray, num_classes: int, window: int = 1000, p: np.ndarray | None = None) -> float:
    """Mean total-variation distance between each full window's label histogram and ``p``.

    ``labels``: int array, the consumed order's labels. ``p``: reference distribution (default: the
    histogram of ``labels`` itself).
    """
    labels = np.asarray(labels, dtype=np.int64)
    if p is None:
        p = np.bincount(labels, minlength=num_classes) / max(1, len(labels))
    nwin = len(labels) // window
    if nwin == 0:
        raise ValueError(f"need at least {window} samples, got {len(labels)}")
    w = labels[: nwin * window].reshape(nwin, window)
    offs = (np.arange(nwin) * num_classes)[:, None]
    hist = np.bincount((w + offs).ravel(), minlength=nwin * num_classes).reshape(nwin, num_classes) / window
    return float((0.5 * np.abs(hist - p[None, :]).sum(axis=1)).mean())


def class_ordered_index(classes: int, per_class: int, shard_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """``(labels, starts)`` of a dataset packed in class order into shards of ``shard_samples``."""
    n = classes * per_class
    labels = np.repeat(np.arange(classes, dtype=np.int64), per_class)
    starts = np.unique(np.concatenate([np.arange(0, n, shard_samples), [n]])).astype(np.int64)
    return labels, starts


def stager_order(
    starts: np.ndarray,
    sample_bytes: int,
    mode: str,
    *,
    workers: int = 2,
    batch_size: int = 64,
    seed: int = 0,
    epoch: int = 0,
    run_bytes: int = 1 << 20,
    min_run: int = 4,
    buffer_bytes: int = 512 << 20,
) -> tuple[np.ndarray, int]:
    """Rank 0's consumed order (world size 1) and the per-worker buffer (samples) the loader would use.

    Mirrors :class:`stager.loader.ShardedDataset`'s defaults: runs of ``run_bytes``, shuffle buffer
    ``buffer_bytes / workers`` (at most 65,536 samples) per worker.
    """
    counts = np.diff(starts)
    run_len = planlib.run_lengths(counts, counts * sample_bytes, run_bytes, min_run)
    buf = int(max(1, min(1 << 16, buffer_bytes / max(1, workers) // sample_bytes)))
    cfg = planlib.PlanConfig(batch_size, 1, workers, seed, mode, False, buf)
    rp = planlib.plan_rank(starts, run_len, cfg, 0, epoch=epoch)
    return np.concatenate(rp.batch_ids()), buf


def _wds_shuffle(items: list[Any], bufsize: int, seed: int) -> list[Any]:
    try:
        from webdataset.filters import _shuffle

        return list(_shuffle(iter(items), bufsize, 100, rng=random.Random(seed)))
    except ImportError:  # same algorithm: grow to ``bufsize`` two at a time, pick uniformly, remove
        rng = random.Random(seed)
        buf: list[Any] = []
        out: list[Any] = []
        it: Iterator[Any] = iter(items)
        for x in it:
            buf.append(x)
            if len(buf) < bufsize:
                nxt = next(it, None)
                if nxt is not None:
                    buf.append(nxt)
            if len(buf) >= min(100, bufsize):
                out.append(buf.pop(rng.randrange(len(buf))))
        while buf:
            out.append(buf.pop(rng.randrange(len(buf))))
        return out


def webdataset_order(starts: np.ndarray, seed: int = 0) -> np.ndarray:
    """webdataset's recipe: ``shardshuffle=100`` (buffer of 100 shards) then ``.shuffle(1000)``."""
    shards = _wds_shuffle(list(range(len(starts) - 1)), 100, seed)
    stream = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in shards]).tolist()
    return np.asarray(_wds_shuffle(stream, 1000, seed + 1), dtype=np.int64)


def mosaic_py1e_order(starts: np.ndarray, seed: int = 0, epoch: int = 0, canonical_nodes: int = 1) -> np.ndarray:
    """MosaicML Streaming's ``py1e`` order for one node, one rank, one worker (see module docstring).

    Uses ``streaming.base.shuffle.get_shuffle`` when installed; otherwise a re-implementation of
    the published algorithm: permute shards with a run-fixed seed, permute the shard order and the
    samples inside each shard per epoch, add to each sample's position a uniform shift in
    ``+-(block - shard) / 2`` (block drawn in ``[0.75, 1.25] * shuffle_block_size``), clip to the
    dataset, and sort by shifted position.
    """
    counts = np.diff(starts)
    block = max(4_000_000 // canonical_nodes, 1 << 18)
    try:
        from streaming.base.shuffle import get_shuffle

        return np.asarray(get_shuffle("py1e", counts, canonical_nodes, seed, epoch, block), dtype=np.int64)
    except ImportError:
        pass
    n = int(starts[-1])
    spans = [(int(starts[i]), int(starts[i + 1])) for i in range(len(counts))]
    np.random.default_rng(seed).shuffle(spans)
    rng = np.random.default_rng(seed + epoch)  # the peer's own seeding (seed + epoch)
    order = rng.permutation(len(spans))
    spans = [spans[i] for i in order]
    samples = np.concatenate([rng.permutation(np.arange(a, b)) for a, b in spans])
    pos = np.arange(n, dtype=np.float64)
    off = 0
    for a, b in spans:
        size = b - a
        rb = int(rng.integers(int(0.75 * block), int(1.25 * block)))
        cut = max(0.0, (rb - size) / 2)
        lo, hi = max(-cut, -off), min(cut, n - off - size)
        pos[off : off + size] += rng.uniform(lo, hi, size=size)
        off += size
    return samples[np.argsort(pos, kind="stable")]


def measure(scenario: str, *, workers: int = 2, window: int = 1000, seed: int = 0) -> dict[str, Any]:
    sc = SCENARIOS[scenario]
    labels, starts = class_ordered_index(sc["classes"], sc["per_class"], sc["shard_samples"])
    p = np.full(sc["classes"], 1.0 / sc["classes"])
    rows: dict[str, Any] = {}

    def add(name: str, order: np.ndarray, memory: str, t: float) -> None:
        rows[name] = {
            "tv": round(tv_metric(labels[order], sc["classes"], window, p), 4),
            "memory": memory,
            "seconds": round(time.perf_counter() - t, 3),
        }

    variants = {
        # The loader's defaults (run_bytes="auto"): node-local copy vs shared file system / URL.
        "stager-runs (default, local copy)": ("runs", 256 << 10, 2),
        "stager-runs (default, Lustre/URL)": ("runs", 1 << 20, 4),
        "stager-shards": ("shards", 1 << 20, 4),
        "stager-random": ("random", 1 << 20, 4),
        "stager-none (shard order)": ("none", 1 << 20, 4),
    }
    scale = sc.get("scale", 1)
    for name, (mode, rb, mr) in variants.items():
        t = time.perf_counter()
        order, buf = stager_order(
            starts,
            sc["sample_bytes"],
            mode,
            workers=workers,
            seed=seed,
            run_bytes=rb // scale,
            min_run=mr,
            buffer_bytes=(512 << 20) // scale,
        )
        mem = (
            f"{buf} samples/worker ({buf * sc['sample_bytes'] / 2**20:.1f} MiB)" if mode in ("runs", "shards") else "0"
        )
        add(name, order, mem, t)
    t = time.perf_counter()
    add("full-random", np.random.default_rng((seed, 99)).permutation(len(labels)), "whole index (random reads)", t)
    t = time.perf_counter()
    add("webdataset", webdataset_order(starts, seed), "1,000 samples + 100 shard names", t)
    t = time.perf_counter()
    add("mosaicml-py1e", mosaic_py1e_order(starts, seed), "shards of a 4M-sample block (here: all)", t)
    floor = rows["full-random"]["tv"]
    for r in rows.values():
        r["excess"] = round(r["tv"] - floor, 4)
    return {"scenario": scenario, "window": window, "workers": workers, **sc, "results": rows}


def to_markdown(results: list[dict[str, Any]]) -> str:
    lines = []
    for res in results:
        lines.append(
            f"\n**{res['scenario']}** ({res['classes']} classes x {res['per_class']}, class-ordered, "
            f"{res['sample_bytes']} B/sample, shards of {res['shard_samples']}; window {res['window']}, "
            f"{res['workers']} workers)\n"
        )
        lines.append("| order | mean TV (lower is better) | excess over random | shuffle memory |")
        lines.append("| --- | --- | --- | --- |")
        for name, r in res["results"].items():
            lines.append(f"| {name} | {r['tv']:.3f} | {r['excess']:+.3f} | {r['memory']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--md", action="store_true", help="print the markdown table to stderr")
    args = ap.parse_args(argv)
    results = [
        measure(s, workers=args.workers, window=args.window, seed=args.seed) for s in (args.scenario or ["cifar"])
    ]
    print(json.dumps(results, indent=1))
    if args.md:
        print(to_markdown(results), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
