"""Mixing several datasets (issue 31): proportions, and speed against one dataset and MosaicML Streaming.

Data: a CIFAR-like set (32x32 PNGs, ~2.5 KB) and an ImageNet-like set (~500x375 JPEGs, ~90 KB), each
split by class into three streams of 50/30/20% of its samples, and also packed whole ("one dataset
of the same total size"). Each is packed by stager (tar) and written by MosaicML's ``MDSWriter``.

* **proportions** (no timing): the real loader over the CIFAR-like streams with weights 1:1:2 on 2
  ranks, batches of 64: each stream's share over 1 and 10 epochs; ``stratified``: the largest
  deviation of a batch's count from its share; ``random``: the spread of a batch's count against the
  binomial's, and the batches beyond 3 sigma; a stream down-sampled to 0.3 of its samples: epochs until
  every sample was read (stager: its rotation; Streaming's ``Stream(choose=...)``, balanced sampling).
* **speed**: raw samples/s (every payload touched, one byte per 4 KiB page, as tools/bench/bench_loader.py
  does), in-process and through 2 workers (steady state, persistent workers), for stager's one dataset,
  stager's three-stream mix (each sample once an epoch: weights = sizes; ``random`` and ``stratified``
  batches), Streaming's ``StreamingDataset(local=...)`` over the whole set and
  ``StreamingDataset(streams=[Stream(local=..., proportion=...)])`` over the three with the same
  proportions (``shuffle=True``, ``batching_method="random"``). stager's three loaders run in one
  process per mode, epochs alternating among them (so they meet the same load); Streaming's readers
  each in a process of their own (their shared memory); rounds interleave all of these; medians over
  rounds are reported, with the CPU time per sample (the load-robust second figure) and the load
  average.

Usage: ``python -m tools.bench.bench_mix [--cifar 30000] [--imagenet 3000] [--rounds 5] [--batch 256]``
(``make bench-setup`` installs Streaming); prints JSON and writes docs/bench/mix.md. The memory figures
are tools/bench/bench_mix_memory.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stager.loader import Stream, make_loader  # noqa: E402
from stager.pack import pack  # noqa: E402
from tools.bench.bench_loader import (  # noqa: E402
    SHARD_BYTES,
    _count_batch,
    _count_list,
    _cpu,
    list_folder,
    make_sets,
    touch,
)

SPLIT = (0.5, 0.3, 0.2)  # the streams' shares of a set's classes
MIN_SECONDS = 1.0


# ---- data --------------------------------------------------------------------------------------
def split_streams(src: Path, work: Path) -> list[Path]:
    """Three ImageFolder trees of ``src``'s classes (50/30/20% of them), as symlinks."""
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    cuts = np.cumsum([0, *[round(f * len(classes)) for f in SPLIT]])
    cuts[-1] = len(classes)
    out = []
    for i in range(3):
        d = work / f"stream{i}"
        d.mkdir(parents=True, exist_ok=True)
        for c in classes[cuts[i] : cuts[i + 1]]:
            if not (d / c).exists():
                os.symlink(src / c, d / c)
        out.append(d)
    return out


def write_mds(src: Path, out: Path) -> None:
    from streaming import MDSWriter

    if (out / "index.json").is_file():  # kept from an earlier run with --work
        return
    with MDSWriter(out=str(out), columns={"image": "bytes", "label": "int", "idx": "int"},
                   size_limit=SHARD_BYTES) as w:
        for i, (path, label) in enumerate(list_folder(src)):
            w.write({"image": path.read_bytes(), "label": label, "idx": i})


def sources(work: Path, n_cifar: int, n_imagenet: int) -> dict[str, Path]:
    """bench_loader's CIFAR-like and ImageNet-like ImageFolder trees (reused when ``work`` has them)."""
    done = work / f".made-{n_cifar}-{n_imagenet}"
    if done.exists():
        return {name: Path(p) for name, p in json.loads(done.read_text()).items()}
    sets = make_sets(work, n_cifar, n_imagenet)
    done.write_text(json.dumps({k: str(v) for k, v in sets.items()}))
    return sets


def prepare(name: str, src: Path, work: Path) -> dict[str, Any]:
    """Pack ``src`` whole and as three streams, for stager and for Streaming (not timed)."""
    base = work / name
    streams = split_streams(src, base / "src")
    sets: dict[str, Any] = {"whole": base / "stager-whole", "streams": [base / f"stager-s{i}" for i in range(3)],
                            "sizes": [len(list_folder(s)) for s in streams]}
    for s, out in [(src, sets["whole"]), *zip(streams, sets["streams"], strict=True)]:
        if not (out / "manifest.json").is_file():  # kept from an earlier run with --work
            pack(s, out, "tar", shard_size=SHARD_BYTES)
    try:
        write_mds(src, base / "mds-whole")
        for i, s in enumerate(streams):
            write_mds(s, base / f"mds-s{i}")
        sets["mds"] = {"whole": base / "mds-whole", "streams": [base / f"mds-s{i}" for i in range(3)]}
    except Exception as exc:  # an optional peer: any import failure means "skip with a note"
        sets["mds_note"] = f"skipped: {type(exc).__name__}: {exc}"[:200]
    return sets


# ---- readers -----------------------------------------------------------------------------------
def stager_mix(sets: dict[str, Any], batch: int, composition: str, **kw: Any) -> Any:
    mix = [(str(p), n) for p, n in zip(sets["streams"], sets["sizes"], strict=True)]
    return make_loader(mix, batch, rank=0, world_size=1, decode="raw", staged=False, composition=composition, **kw)


def stager_whole(sets: dict[str, Any], batch: int, **kw: Any) -> Any:
    return make_loader(sets["whole"], batch, rank=0, world_size=1, decode="raw", staged=False, **kw)


def streaming_dataset(sets: dict[str, Any], batch: int, *, mixed: bool) -> Any:
    from streaming import Stream as MdsStream
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    total = sum(sets["sizes"])
    if not mixed:
        return StreamingDataset(local=str(sets["mds"]["whole"]), shuffle=True, batch_size=batch)
    streams = [MdsStream(local=str(p), proportion=n / total)
               for p, n in zip(sets["mds"]["streams"], sets["sizes"], strict=True)]
    return StreamingDataset(streams=streams, shuffle=True, batch_size=batch, epoch_size=total,
                            batching_method="random")


def _rate(one_pass: Callable[[], int], n_expect: int) -> dict[str, float]:
    """Samples/s and CPU us/sample over whole passes (after one warm-up pass), at least MIN_SECONDS."""
    if one_pass() < n_expect:
        raise RuntimeError(f"a pass yielded fewer than {n_expect} samples")
    passes, t, c = 0, time.perf_counter(), _cpu()
    while time.perf_counter() - t < MIN_SECONDS:
        one_pass()
        passes += 1
    wall, cpu = time.perf_counter() - t, _cpu() - c
    return {"sps": passes * n_expect / wall, "cpu_us": cpu / (passes * n_expect) * 1e6}


def _images(samples: list[dict[str, Any]]) -> list[Any]:
    return [s["image"] for s in samples]


def _batches(loader: Any) -> Callable[[], int]:
    return lambda: sum(_count_batch(b) for b in loader)


def _samples(ds: Any) -> Callable[[], int]:
    def one() -> int:
        n = 0
        for s in ds:
            touch(s["image"])
            n += 1
        return n

    return one


GROUPS = {"in-process": {}, "2 workers": {"num_workers": 2, "multiprocessing_context": "fork"}}
EPOCHS_PER_ROUND = 15


def stager_group(mode: str, sets: dict[str, Any], batch: int) -> dict[str, dict[str, float]]:
    """stager's one dataset and its mixes (random, stratified), in one process, epochs alternating among
    them (``EPOCHS_PER_ROUND`` each, after a warm-up epoch): the medians of samples/s and CPU us/sample.
    Alternating epoch by epoch exposes the readers to the same load, which a shared machine varies."""
    kw = GROUPS[mode]
    suffix = "" if mode == "in-process" else f", {mode}"
    loaders = {f"stager one dataset{suffix}": stager_whole(sets, batch, **kw),
               f"stager mix, random{suffix}": stager_mix(sets, batch, "random", **kw),
               f"stager mix, stratified{suffix}": stager_mix(sets, batch, "stratified", **kw)}
    n = sum(sets["sizes"])
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in loaders}
    try:
        for ld in loaders.values():
            _batches(ld)()
        for _ in range(EPOCHS_PER_ROUND):
            for name, ld in loaders.items():
                t, c = time.perf_counter(), _cpu()
                got = _batches(ld)()
                if got < n:
                    raise RuntimeError(f"{name}: an epoch of {got} samples, expected {n}")
                runs[name].append((n / (time.perf_counter() - t), (_cpu() - c) / n * 1e6))
    finally:
        for ld in loaders.values():
            ld.close()
    return {name: {"sps": statistics.median(r[0] for r in rs), "cpu_us": statistics.median(r[1] for r in rs)}
            for name, rs in runs.items()}


def peers(sets: dict[str, Any], batch: int) -> dict[str, Callable[[], tuple[Any, Callable[[], int]]]]:
    """Streaming's readers: name -> a factory of ``(object, one pass)``; each measured in its own process
    (its shared memory and workers never meet another reader's)."""
    if "mds" not in sets:
        return {}

    def peer(mixed: bool) -> Callable[[], tuple[Any, Callable[[], int]]]:
        def build() -> tuple[Any, Callable[[], int]]:
            ds = streaming_dataset(sets, batch, mixed=mixed)
            return ds, _samples(ds)
        return build

    def peer_dl() -> tuple[Any, Callable[[], int]]:
        # Streaming's own way: the dataset made once in the main process, its workers coordinated by it.
        from torch.utils.data import DataLoader

        dl = DataLoader(streaming_dataset(sets, batch, mixed=True), batch_size=batch, num_workers=2,
                        collate_fn=_images, multiprocessing_context="fork", persistent_workers=True, timeout=120)
        return dl, lambda: sum(_count_list(b) for b in dl)

    return {"streaming one dataset": peer(False), "streaming mix (streams=)": peer(True),
            "streaming mix (streams=), 2 workers": peer_dl}


def measure(name: str, sets: dict[str, Any], batch: int) -> dict[str, dict[str, float]]:
    """In this process (``--measure``): a stager group (:func:`stager_group`), or one peer reader (built,
    one warm-up pass, then timed passes for at least ``MIN_SECONDS``)."""
    if name in GROUPS:
        return stager_group(name, sets, batch)
    obj, one = peers(sets, batch)[name]()
    try:
        return {name: _rate(one, sum(sets["sizes"]))}
    finally:
        it = getattr(obj, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


def _measure_in_child(name: str, sets: dict[str, Any], batch: int) -> dict[str, dict[str, float]]:
    import subprocess

    doc = json.dumps(sets, default=str)
    out = subprocess.run([sys.executable, "-m", "tools.bench.bench_mix", "--measure", name, "--sets", doc,
                          "--batch", str(batch)], capture_output=True, text=True, cwd=ROOT, timeout=1200, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{name}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_speed(sets: dict[str, Any], batch: int, rounds: int) -> dict[str, Any]:
    """Rounds of: stager in-process, stager with 2 workers (each a group alternating epochs), then each
    Streaming reader, each measurement in a fresh process; medians over the rounds."""
    n = sum(sets["sizes"])
    runs: dict[str, list[dict[str, float]]] = {}
    for _ in range(rounds):
        for name in [*GROUPS, *peers(sets, batch)]:
            for reader, r in _measure_in_child(name, sets, batch).items():
                runs.setdefault(reader, []).append(r)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("sps", "cpu_us")} for name, rs in runs.items()}
    out: dict[str, Any] = {"samples": n, "batch": batch, "rounds": rounds, "epochs_per_round": EPOCHS_PER_ROUND,
                           "median": med, "all_sps": {k: [round(r["sps"]) for r in v] for k, v in runs.items()}}
    def paired(a: str, b: str) -> dict[str, float] | None:
        """Median over the rounds of each round's ratio ``a / b`` (CPU: ``b / a``: higher is better for ``a``)."""
        if a not in runs or b not in runs:
            return None
        pairs = list(zip(runs[a], runs[b], strict=True))
        return {"sps": statistics.median(x["sps"] / y["sps"] for x, y in pairs),
                "cpu": statistics.median(y["cpu_us"] / x["cpu_us"] for x, y in pairs)}

    ratios = {}
    for mode in ("", ", 2 workers"):
        for comp in ("random", "stratified"):
            r = paired(f"stager mix, {comp}{mode}", f"stager one dataset{mode}")
            if r:
                ratios[f"mix {comp}{mode} / one dataset"] = r
        r = paired(f"stager mix, random{mode}", f"streaming mix (streams=){mode}")
        if r:
            ratios[f"mix random{mode} / streaming mix"] = r
    out["ratios"] = ratios
    return out


# ---- proportions -------------------------------------------------------------------------------
def bench_proportions(sets: dict[str, Any], epochs: int = 10, batch: int = 64) -> dict[str, Any]:
    """Stream shares and per-batch composition over ``epochs`` epochs, 2 ranks (no timing)."""
    weights = (1, 1, 2)
    mix = [(str(p), w) for p, w in zip(sets["streams"], weights, strict=True)]
    out: dict[str, Any] = {"weights": weights, "batch": batch, "epochs": epochs}
    for comp in ("stratified", "random"):
        rows, shares = [], None
        for rank in range(2):
            ld = make_loader(mix, batch, rank=rank, world_size=2, decode="raw", staged=False, composition=comp)
            shares = np.array([r["share"] for r in ld.dataset.epoch_table()])
            for e in range(epochs):
                ld.set_epoch(e)
                for b in ld:
                    if len(b["key"]) == batch:
                        rows.append((e, np.bincount(b["stream"].numpy(), minlength=3)))
        assert shares is not None
        counts = np.array([c for _, c in rows])
        first = np.array([c for e, c in rows if e == 0])
        sigma = np.sqrt(batch * shares * (1 - shares))
        out[comp] = {
            "shares": [round(float(s), 4) for s in shares],
            "epoch_share": [round(float(x), 4) for x in first.sum(0) / first.sum()],
            "ten_epoch_share": [round(float(x), 4) for x in counts.sum(0) / counts.sum()],
            "max_batch_deviation": [round(float(x), 3) for x in np.abs(counts - batch * shares).max(0)],
            "batch_sd": [round(float(x), 3) for x in counts.std(0)],
            "binomial_sd": [round(float(x), 3) for x in sigma],
            "beyond_3_sigma": float(np.mean(np.abs(counts - batch * shares) > 3 * sigma)),
            "batches": len(counts),
        }
    out["coverage"] = coverage(sets)
    return out


def coverage(sets: dict[str, Any], fraction: float = 0.3, limit: int = 20) -> dict[str, Any]:
    """Epochs until a stream down-sampled to ``fraction`` of its samples has shown every sample."""
    size = sets["sizes"][0]
    take = round(fraction * size)
    ld = make_loader([Stream(str(sets["streams"][0]), samples=take)], 256, rank=0, world_size=1, decode="raw",
                     staged=False)
    seen: set[int] = set()
    stager_epochs = None
    for e in range(limit):
        ld.set_epoch(e)
        seen.update(i for b in ld for i in b["index"].tolist())
        if len(seen) == size:
            stager_epochs = e + 1
            break
    out: dict[str, Any] = {"fraction": fraction, "samples": size, "expected": int(np.ceil(1 / fraction)),
                           "stager": stager_epochs}
    if "mds" in sets:
        from streaming import Stream as MdsStream
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        ds = StreamingDataset(streams=[MdsStream(local=str(sets["mds"]["streams"][0]), choose=take)], shuffle=True,
                              batch_size=256)
        seen_mds: Counter[int] = Counter()
        out["streaming"] = None
        for e in range(limit):
            seen_mds.update(int(s["idx"]) for s in ds)
            if len(seen_mds) == size:
                out["streaming"] = e + 1
                break
        out["streaming_note"] = f"{len(seen_mds)} of {size} seen after {e + 1} epochs"
    return out


# ---- report ------------------------------------------------------------------------------------
def to_markdown(res: dict[str, Any]) -> str:
    lines = ["# Mixing benchmark (tools/bench/bench_mix.py)", "",
             f"{res['machine']}; load average {res['load_before']} before, {res['load_after']} after; "
             f"medians of {res['rounds']} interleaved rounds (stager's loaders: each round the median of "
             f"{EPOCHS_PER_ROUND} epochs, alternating among them in one process).", ""]
    for name, s in res["sets"].items():
        sp = s["speed"]
        lines += [f"## {name}: {sp['samples']} samples in 3 streams ({s['sizes']}), batch {sp['batch']}", "",
                  "| reader | samples/s (median) | CPU us/sample | per round |", "| --- | --- | --- | --- |"]
        for reader, m in sp["median"].items():
            lines.append(f"| {reader} | {m['sps']:,.0f} | {m['cpu_us']:.2f} | {sp['all_sps'][reader]} |")
        lines += ["", "| ratio (median of the rounds' ratios) | samples/s | CPU/sample |", "| --- | --- | --- |"]
        for k, v in sp["ratios"].items():
            lines.append(f"| {k} | {v['sps']:.2f}x | {v['cpu']:.2f}x |")
        lines.append("")
        if "mds_note" in s:
            lines += [f"Streaming: {s['mds_note']}", ""]
    p = res.get("proportions")
    if p:
        lines += ["## Proportions (CIFAR-like streams, weights 1:1:2, 2 ranks, batch 64)", "",
                  "| | stream shares | share over 1 epoch | over 10 epochs | max batch deviation | batch sd | "
                  "binomial sd | batches beyond 3 sigma |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for comp in ("stratified", "random"):
            c = p[comp]
            lines.append(f"| {comp} | {c['shares']} | {c['epoch_share']} | {c['ten_epoch_share']} | "
                         f"{c['max_batch_deviation']} | {c['batch_sd']} | {c['binomial_sd']} | "
                         f"{c['beyond_3_sigma']:.3%} of {c['batches']} |")
        cov = p["coverage"]
        lines += ["", f"A stream down-sampled to {cov['fraction']} of its {cov['samples']} samples: every sample read "
                  f"after {cov['stager']} epochs with stager (ceil(1/{cov['fraction']}) = {cov['expected']}); "
                  f"Streaming (`Stream(choose=...)`, balanced sampling): {cov.get('streaming_note', 'not run')}.", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cifar", type=int, default=30000, help="CIFAR-like samples (0: skip)")
    ap.add_argument("--imagenet", type=int, default=3000, help="ImageNet-like samples (0: skip)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--no-proportions", action="store_true")
    ap.add_argument("--work", help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--md", default=str(ROOT / "docs" / "bench" / "mix.md"))
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # one reader, in a child process (bench_speed)
    ap.add_argument("--sets", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        sets = json.loads(args.sets)
        print(json.dumps(measure(args.measure, sets, args.batch)))
        return 0
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-mix-"))
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)
    try:
        srcs = sources(work / "src", args.cifar, args.imagenet)
        res: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
                               f"{platform.python_version()}", "rounds": args.rounds,
                               "load_before": [round(x, 2) for x in os.getloadavg()], "sets": {}}
        prepared = {name: prepare(name, src, work) for name, src in srcs.items()}
        if "cifar" in prepared and not args.no_proportions:
            res["proportions"] = bench_proportions(prepared["cifar"])
        for name, sets in prepared.items():
            res["sets"][name] = {"sizes": sets["sizes"], "speed": bench_speed(sets, args.batch, args.rounds)}
            if "mds_note" in sets:
                res["sets"][name]["mds_note"] = sets["mds_note"]
        res["load_after"] = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps(res, indent=1, default=str))
        if args.md:
            Path(args.md).parent.mkdir(parents=True, exist_ok=True)
            Path(args.md).write_text(to_markdown(res))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
