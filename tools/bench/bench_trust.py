"""Paired check: staging and loader start-up of two checkouts, alternating, on the same data.

The trust rules of issue 29 (docs/security.md) add checks to every stage (DEST creation, the
journal and lock opened through stager.fs.safe, each kept or vouched-for file ``lstat``-checked) and
to the loader's lookup of a staged copy (each candidate's directory, receipt and shards). This
measures whether that moved anything, the way that can see a few percent on a shared machine: the
same commands alternate between ``--before`` and ``--after`` (checkouts run with ``PYTHONPATH``),
round after round, and the table gives medians and best-of with per-round paired ratios.

Commands, each in a fresh interpreter:

* ``stage``: ``stager stage SRC DEST`` into a fresh DEST: the command's own ``seconds`` (inner) and
  the process's wall time; for an ImageNet-like pack (few large shards) and a CIFAR-like pack with
  many small shards (per-file costs dominate);
* ``again``: the same command once DEST is staged (the fast path: receipt and sizes checked);
* ``loader``: ``make_loader(SRC, staged="auto")`` up to its first batch (raw bytes, no workers),
  torch imported before the clock starts, with the staged copy among ``--others`` other
  directories in the staging root (the loader's candidate scan).

Usage: ``python -m tools.bench.bench_trust --before /path/to/main --after . [--rounds 8]``; prints a
JSON object and a Markdown table.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LOADER = """
import json, sys, time
import torch  # as a training script has it: not part of the loader's start-up
from stager.loader import make_loader
t0 = time.perf_counter()
loader = make_loader(sys.argv[1], 64, staged="auto", staging_roots=(sys.argv[2],), decode="raw", num_workers=0)
it = iter(loader)
next(it)
print(json.dumps({"seconds": time.perf_counter() - t0, "staged": loader.dataset.resolved.staged}))
"""


def run(code: Path, argv: list[str]) -> tuple[dict, float]:
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, check=False, cwd="/")
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{code}: {' '.join(argv)} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1]), wall


def make_sets(work: Path) -> dict[str, Path]:
    from stager.pack import pack
    from tools.datagen import make_cifar, make_imagefolder

    sets = {}
    tree = make_imagefolder(work / "imagenet-tree", num_classes=10, per_class=60, seed=1)
    pack(tree, work / "imagenet", "tar", shard_size=16 << 20)
    sets["imagenet"] = work / "imagenet"
    cifar = make_cifar(work / "cifar-src", n_train=6000, n_test=10, seed=2)
    pack(cifar, work / "cifar", "tar", samples_per_shard=30)
    sets["cifar"] = work / "cifar"
    return sets


def summary(pairs: list[tuple[float, float]]) -> dict[str, float]:
    before = [b for b, _ in pairs]
    after = [a for _, a in pairs]
    return {"before_median": statistics.median(before), "after_median": statistics.median(after),
            "before_best": min(before), "after_best": min(after),
            "paired_ratio_median": statistics.median(a / b for b, a in pairs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="checkout to compare against (e.g. main)")
    ap.add_argument("--after", type=Path, default=ROOT)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--others", type=int, default=200, help="other directories in the staging root")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-trust-"))
    sets = make_sets(work)
    codes = {"before": args.before.resolve(), "after": args.after.resolve()}
    results: dict[str, list[tuple[float, float]]] = {}
    roots = {}
    for side in codes:
        roots[side] = work / f"root-{side}"
        roots[side].mkdir()
        for i in range(args.others):
            (roots[side] / f"other-{i:04d}").mkdir()
    for rnd in range(args.rounds):
        order = list(codes) if rnd % 2 == 0 else list(reversed(codes))
        got: dict[str, dict[str, float]] = {}
        for side in order:
            code = codes[side]
            for name, src in sets.items():
                dest = work / f"dest-{side}-{name}"
                shutil.rmtree(dest, ignore_errors=True)
                res, wall = run(code, ["-m", "stager", "stage", str(src), str(dest), "--json", "-q"])
                got.setdefault(side, {})[f"stage {name}, inner"] = res["seconds"]
                got[side][f"stage {name}, wall"] = wall
                _, wall = run(code, ["-m", "stager", "stage", str(src), str(dest), "--json", "-q"])
                got[side][f"again {name}, wall"] = wall
            staged = roots[side] / "zz-copy"
            if not staged.exists():
                run(code, ["-m", "stager", "stage", str(sets["imagenet"]), str(staged), "--json", "-q"])
            res, _ = run(code, ["-c", LOADER, str(sets["imagenet"]), str(roots[side])])
            assert res["staged"], res
            got[side]["loader first batch (staged, 200 other dirs)"] = res["seconds"]
        for key in got["before"]:
            results.setdefault(key, []).append((got["before"][key], got["after"][key]))
    out = {"load_average": os.getloadavg(), "rounds": args.rounds,
           "rows": {k: summary(v) for k, v in results.items()}}
    print(json.dumps(out, indent=1))
    print("\n| command | before median | after median | before best | after best | paired after/before |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: |")
    for k, s in out["rows"].items():
        print(f"| {k} | {s['before_median'] * 1e3:.0f} ms | {s['after_median'] * 1e3:.0f} ms | "
              f"{s['before_best'] * 1e3:.0f} ms | {s['after_best'] * 1e3:.0f} ms | {s['paired_ratio_median']:.3f} |")
    print(f"\nload average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
