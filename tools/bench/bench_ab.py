"""Staging with two stager trees, A/B in the same run: is a change within noise of the commit before?

Each staging path runs in a fresh child process per run, importing stager from the tree under test
(``--base``: a checkout of the commit before, e.g. ``git worktree add /tmp/base main`` or
``git archive main | tar -x -C /tmp/base``; the other: this repository). Runs alternate base, new,
new, base, ... for ``--rounds`` rounds, on the same hot-cache sources, each into a fresh DEST
(deleted afterwards; the unpacked trees after the path's last run), so both trees see the same
disk and load; a first round per path is not counted (it byte-compiles what each tree imports
lazily). The paths, each timed around the call only (no interpreter start or import):

* ``stage``: ``stage(packed, DEST)``, the copy streams (default tuning: write-behind, finishers);
* ``stage --cache``: the same through a fresh shard cache (fill, then hard links into DEST);
* ``stream sink``: the collective's and the prefetcher's path (``ShareReader`` -> ``StreamSink``, 8 MiB
  chunks), every shard of the set as one stream;
* ``unpack only``: ``stage(packed, DEST, unpack="only")`` of a CIFAR-like set (one create per file).

For each path and tree: wall seconds (median and best), CPU seconds per GB of the child (user +
system, less sensitive to other load), the ratio new/base as the median of per-round ratios, and
every run's ``[wall, cpu]``. Prints JSON; nothing is written to docs/. On a shared, loaded machine
the figures scatter widely: compare the system calls too (``strace -f -c`` of one run per tree),
which do not depend on load.

Usage: ``python tools/bench/bench_ab.py --base /tmp/base [--rounds 7] [--scale 10] [--work DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stager.pack import pack  # noqa: E402
from tools.bench.bench_stage import replicate  # noqa: E402
from tools.datagen import make_cifar, make_imagefolder  # noqa: E402

CHILD = r'''
import json, os, resource, sys, time
path, src, dest = sys.argv[1], sys.argv[2], sys.argv[3]
# Every path's imports happen before the clock, in both trees: since stager/lazy.py a plain stage imports
# neither numpy nor the collective's modules, so timing them inside would count imports (~0.13 s of CPU)
# in the newer tree only, not the path's work.
import numpy
from stager.cache.config import CacheOptions
from stager.manifest import load_manifest
from stager.stage import stage
from stager.stage.collective.io import IoCounters, ShareReader, StreamSink, copy_share
from stager.stage.collective.plan import FileEntry, StreamLayout
from stager.stage.options import StageOptions
from stager.stage.run import run_stage
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
if path == "stage":
    stage(src, dest)
elif path == "stage --cache":
    run_stage(src, dest, StageOptions(cache=CacheOptions(dir=dest + "-cache")))
elif path == "stream sink":
    m = load_manifest(src)
    lay = StreamLayout(0, tuple(FileEntry(s.name, s.bytes, s.hash, i) for i, s in enumerate(m.shards)))
    os.mkdir(dest, 0o755)
    c = IoCounters()
    copy_share(ShareReader(src, dest, lay, counters=c), StreamSink(dest, lay, algo=m.hash_algo, counters=c, have=set()),
               8 << 20)
elif path == "unpack only":
    stage(src, dest, unpack="only")
t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
import stager
print(json.dumps({"wall": t1 - t0, "cpu": cpu, "tree": os.path.dirname(os.path.dirname(stager.__file__))}))
'''

PATHS = {"stage": "big", "stage --cache": "big", "stream sink": "big", "unpack only": "small-files"}


def _run(tree: Path, path: str, src: Path, dest: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(src), str(dest)], env=env, cwd=tree,
                         capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if Path(got.pop("tree")).resolve() != tree:
        raise SystemExit(f"the child imported stager from elsewhere than {tree}; install stager non-editable")
    return got


def _remove(paths: list[Path]) -> None:
    """Delete the runs' trees. Many small files deleted right before the next run slow its creates
    (ext4 skips recently deleted inodes one by one: tools/bench/bench_stage.py), so the unpack runs'
    trees are deleted only after the path's last run."""
    for d in paths:
        shutil.rmtree(d, ignore_errors=True)
    paths.clear()


def _bytes(packed: Path) -> int:
    return sum(p.stat().st_size for p in packed.iterdir() if p.suffix == ".tar")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--base", required=True, help="a stager tree (checkout) of the commit before")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--scale", type=int, default=10, help="the ImageNet-like set replicated K times")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {', '.join(PATHS)}")
    ap.add_argument("--work", default=None, help="scratch directory, kept and reused (default: a temp dir)")
    args = ap.parse_args()
    trees = {"base": Path(args.base).resolve(), "new": ROOT}
    work = Path(args.work or tempfile.mkdtemp(prefix="stager-bench-ab-"))
    work.mkdir(parents=True, exist_ok=True)
    inet = work / "imagenet" / "train"
    if not inet.exists():
        make_imagefolder(inet, num_classes=10, per_class=100, seed=0)
    cifar = work / "cifar" / "cifar-png" / "train"
    if not cifar.exists():
        make_cifar(work / "cifar", n_train=20000, n_test=10, seed=0, png_folder=True)
    sets = {"big": replicate(inet, work / f"imagenet-x{args.scale}" / "train", args.scale), "small-files": cifar}
    packed = {}
    for name, tree in sets.items():
        packed[name] = work / f"{name}-packed"
        if not (packed[name] / "manifest.json").exists():
            pack(tree, packed[name], format="tar", shard_size=64 << 20, workers=1)
        subprocess.run(f"cat '{packed[name]}'/* > /dev/null", shell=True, check=True)  # hot page cache
    load0 = os.getloadavg()
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    for path in args.paths.split(","):
        src = packed[PATHS[path]]
        runs[path] = {"base": [], "new": []}
        made: list[Path] = []
        for r in range(-1, args.rounds):  # round -1 warms up (byte-compiles lazily imported modules), not counted
            order = ["base", "new"] if r % 2 == 0 else ["new", "base"]
            for who in order:
                dest = work / f"dest-{who}-{r}"
                got = _run(trees[who], path, src, dest)
                if r >= 0:
                    runs[path][who].append(got)
                made += [dest, Path(f"{dest}-cache")]
                if PATHS[path] == "big":  # small files are deleted after the path's last run: see below
                    _remove(made)
        _remove(made)
    res: dict[str, Any] = {"paths": {}, "load_average": {"start": load0, "end": os.getloadavg()},
                           "cpus": os.cpu_count(), "rounds": args.rounds, "work": str(work)}
    for path, by in runs.items():
        gb = _bytes(packed[PATHS[path]]) / 1e9
        row: dict[str, Any] = {"GB": round(gb, 3)}
        for who, rs in by.items():
            walls = [x["wall"] for x in rs]
            row[who] = {"wall_median_s": round(statistics.median(walls), 3), "wall_best_s": round(min(walls), 3),
                        "cpu_s_per_GB_median": round(statistics.median(x["cpu"] for x in rs) / gb, 3)}
        ratios = [n["wall"] / b["wall"] for b, n in zip(by["base"], by["new"], strict=True)]
        row["new/base wall, median of rounds"] = round(statistics.median(ratios), 3)
        row["runs"] = {who: [[round(x["wall"], 3), round(x["cpu"], 3)] for x in rs] for who, rs in by.items()}
        res["paths"][path] = row
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
