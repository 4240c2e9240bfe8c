"""ImageNet count: stager vs MosaicML MDSWriter vs webdataset at 10k, 100k and 1.28M samples.

For each count the script builds an ImageFolder tree of tiny (~1 KB, 36 x 36) JPEGs in 1,000 class
folders (``tools.datagen.make_tiny_imagefolder``; 1,000 x 1,281 is ImageNet-1k's train split), reads
every file once (warm page cache, as a second epoch over the source would find it) and then runs,
each in a fresh interpreter and in interleaved rounds (``--repeat``):

* ``stager tar w2`` / ``w1``: ``stager.pack.pack(..., "tar", workers=2 / 1)`` with the default
  256 MiB ``--shard-size`` (listing, plan, JPEG checks, hashing, fsync and manifest included);
* ``mds MDSWriter``: ``streaming.MDSWriter`` (columns ``image: bytes, label: int``, 256 MiB shards,
  no compression), one process;
* ``webdataset ShardWriter``: ``ShardWriter`` (256 MiB shards), one process, one round at 1.28M
  (it takes minutes).

Reported per writer: the best wall time, the output's bytes (every file under OUT) and the peak
resident memory (``ru_maxrss`` of the process and of its largest child). Then stager's loader on
the ``w2`` output, in a fresh process: start-up (``make_loader`` + the first batch of 256, what a
training script waits for) and a raw epoch (``decode="raw"``, in-process: samples/s with no image
decoding), with its peak memory; and the start-up with 2 worker processes (``bench_startup.py``'s
probe, median of ``max(--repeat, 3)`` rounds; that script alone measures it without building the
tree, against other checkouts too). The page cache, not the disk, serves every read.

Writes docs/bench/scale.md (tables) and docs/bench/scale.png (time and bytes against the sample
count), and prints one JSON object. Peers come from ``make bench-setup``; a missing one is reported.

    python tools/bench/bench_scale.py [--counts 10000 100000 1281000] [--repeat 2] [--work DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.bench.bench_startup import measure as measure_startup  # noqa: E402
from tools.datagen import make_tiny_imagefolder  # noqa: E402

SHARD_BYTES = 256 << 20  # stager's default --shard-size, used by every writer
CLASSES = 1000
WRITERS = ("stager tar w2", "stager tar w1", "mds MDSWriter", "webdataset ShardWriter")
SLOW = {"webdataset ShardWriter"}  # one round only at the largest count
SELECTED: list[str] = []  # --writers: a subset of WRITERS (empty: all)

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import tools.bench.bench_pack as b
b.SHARD_BYTES = {shard}
if {label!r}.startswith("mds"):
    from tools.bench.bench_shard_writers import import_streaming
    import_streaming()
import importlib
for mod in b.PREIMPORT[{label!r}.split()[0]]:  # imports are not part of the timed job
    importlib.import_module(mod)
from pathlib import Path
t = time.perf_counter()
n = b.RUNNERS[{label!r}](Path({src!r}), Path({out!r}))
dt = time.perf_counter() - t
rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps([n, dt, rss * 1024]))
"""

LOADER_CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import torch  # a training script has torch loaded before it builds its loader: not part of the timing
import stager.loader.torch_dataset
from stager.loader import make_loader
t = time.perf_counter()
ld = make_loader({out!r}, 256, rank=0, world_size=1, decode="raw", staged=False)
it = iter(ld)
first = next(it)
t_first = time.perf_counter() - t
n = len(first["key"])
t = time.perf_counter()
for batch in it:
    n += len(batch["key"])
t_epoch = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"first_batch_s": t_first, "epoch_s": t_epoch, "samples": n, "peak_rss": rss}}))
"""


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def warm(src: Path) -> None:
    """Read every file once (the page cache then serves every writer alike)."""
    for d in os.scandir(src):
        if d.is_dir():
            for f in os.scandir(d.path):
                with open(f.path, "rb") as fh:
                    fh.read()


def run_writer(label: str, src: Path, out: Path) -> dict[str, Any]:
    code = CHILD.format(root=str(ROOT), shard=SHARD_BYTES, label=label, src=str(src), out=str(out))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    load = os.getloadavg()[0]
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if p.returncode != 0:
        raise RuntimeError((p.stderr.strip().splitlines() or ["failed"])[-1][:200])
    n, dt, rss = json.loads(p.stdout.strip().splitlines()[-1])
    return {"samples": n, "seconds": dt, "bytes": tree_bytes(out), "peak_rss": rss, "load": load}


def run_loader(out: Path) -> dict[str, Any]:
    code = LOADER_CHILD.format(root=str(ROOT), out=str(out))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if p.returncode != 0:
        raise RuntimeError((p.stderr.strip().splitlines() or ["failed"])[-1][:200])
    got = json.loads(p.stdout.strip().splitlines()[-1])
    got["samples_per_s"] = got["samples"] / got["epoch_s"]
    return got


def bench_count(count: int, work: Path, repeat: int, keep: bool) -> dict[str, Any]:
    per_class = max(1, count // CLASSES)
    src = work / f"tiny-{CLASSES}x{per_class}"
    if not src.exists():
        t = time.perf_counter()
        make_tiny_imagefolder(src.with_suffix(".partial"), CLASSES, per_class, jobs=2)
        src.with_suffix(".partial").rename(src)
        print(f"bench_scale: built {src} in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    n = CLASSES * per_class
    src_bytes = tree_bytes(src)
    warm(src)
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WRITERS}
    chosen = set(SELECTED or WRITERS)
    errors: dict[str, str] = {}
    largest = count >= 1_000_000
    for rnd in range(repeat):
        for label in WRITERS:
            if label in errors or label not in chosen or (label in SLOW and largest and rnd > 0):
                continue
            out = work / f"out-{label.split()[0]}-{label.split()[-1]}"
            shutil.rmtree(out, ignore_errors=True)
            try:
                r = run_writer(label, src, out)
            except Exception as exc:  # a missing or broken peer is reported, not fatal
                errors[label] = f"{type(exc).__name__}: {exc}"
                continue
            finally:
                if label != "stager tar w2":
                    shutil.rmtree(out, ignore_errors=True)
            assert r["samples"] == n, (label, r["samples"], n)
            runs[label].append(r)
            msg = f"bench_scale: {n:,} {label}: {r['seconds']:.1f} s, load {r['load']:.1f}"
            print(msg, file=sys.stderr, flush=True)
    rows: dict[str, Any] = {}
    for label in WRITERS:
        if not runs[label]:
            rows[label] = {"error": errors.get(label, "not run")}
            continue
        best = min(runs[label], key=lambda r: r["seconds"])
        rows[label] = {
            "seconds": round(best["seconds"], 2),
            "samples_per_s": round(n / best["seconds"]),
            "bytes": best["bytes"],
            "peak_rss_mb": round(max(r["peak_rss"] for r in runs[label]) / 2**20, 1),
            "runs": len(runs[label]),
            "load_avg": [round(r["load"], 1) for r in runs[label]],
        }
    mds = rows["mds MDSWriter"].get("seconds")
    mds_bytes = rows["mds MDSWriter"].get("bytes")
    for r in rows.values():
        if "seconds" in r and mds:
            r["speed_vs_mds"] = round(mds / r["seconds"], 2)
            r["bytes_vs_mds"] = round(r["bytes"] / mds_bytes, 2)
    w1, w2 = rows["stager tar w1"].get("seconds"), rows["stager tar w2"].get("seconds")
    loader: dict[str, Any] = {}
    out = work / "out-stager-w2"
    if (out / "manifest.json").exists():
        tries = [run_loader(out) for _ in range(max(repeat, 1))]
        best_first = min(t["first_batch_s"] for t in tries)
        best_epoch = max(t["samples_per_s"] for t in tries)
        loader = {
            "first_batch_s": round(best_first, 3),
            "epoch_samples_per_s": round(best_epoch),
            "peak_rss_mb": round(max(t["peak_rss"] for t in tries) / 2**20, 1),
            # manifest.json and, from manifest v2 on, the index files beside it: all but the shards
            "metadata_bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and ".tar" not in f.name),
            # With 2 worker processes, what a training script waits for (tools/bench/bench_startup.py; issue 40).
            "startup": measure_startup(out, [ROOT], max(repeat, 3))[str(ROOT)],
        }
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
        if largest:
            shutil.rmtree(src, ignore_errors=True)
    return {
        "samples": n,
        "source_bytes": src_bytes,
        "writers": rows,
        "w2_vs_w1": round(w1 / w2, 2) if (w1 and w2) else None,
        "loader": loader,
    }


def write_markdown(res: dict[str, Any], path: Path, plot: str | None) -> None:
    lines = [
        "# ImageNet count",
        "",
        f"Generated by `tools/bench/bench_scale.py` (`{res['command']}`), {res['machine']}. Trees of ~1 KB JPEGs in",
        "1,000 class folders (1.28M = ImageNet-1k's train count), read once beforehand (warm page cache); every writer",
        f"packs the same tree into {SHARD_BYTES >> 20} MiB shards in a fresh interpreter, runs interleaved, best wall",
        "time reported with the 1-minute load average of each run (the machine is shared: 2 cores). `bytes` counts",
        "every output file; `peak RSS` is the largest resident set of the process or any of its children.",
        "stager also checks every JPEG's structure, hashes (xxh3-128) and fsyncs every shard and writes a manifest.",
        "",
    ]
    for s in res["counts"]:
        n = s["samples"]
        lines += [
            f"## {n:,} samples ({s['source_bytes'] / 1e6:,.0f} MB of JPEGs)",
            "",
            "| writer | seconds | samples/s | speed vs MDS | output | bytes vs MDS | peak RSS | load avg |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for label, r in s["writers"].items():
            if "error" in r:
                lines.append(f"| {label} | - | - | - | - | - | - | not run: {r['error']} |")
                continue
            lines.append(
                f"| {label} | {r['seconds']} | {r['samples_per_s']:,} | {r.get('speed_vs_mds', '-')}x | "
                f"{r['bytes'] / 1e6:,.1f} MB | {r.get('bytes_vs_mds', '-')}x | {r['peak_rss_mb']:,.0f} MB | "
                f"{', '.join(map(str, r['load_avg']))} |"
            )
        lines += ["", f"stager `--workers 2` vs `--workers 1`: **{s['w2_vs_w1']}x**."]
        ld = s.get("loader")
        if ld:
            lines += [
                "",
                f"stager loader on that pack (manifest and index {ld['metadata_bytes'] / 1e6:,.2f} MB): first batch "
                f"of 256 after **{ld['first_batch_s']} s** (`make_loader` included), raw epoch "
                f"**{ld['epoch_samples_per_s']:,} samples/s** (in-process, no decoding), peak RSS "
                f"{ld['peak_rss_mb']:,.0f} MB.",
            ]
            su = ld.get("startup")
            if su:
                lines += [
                    "",
                    f"Start-up with 2 worker processes (`bench_startup.py`'s probe, median of {su['rounds']}): first "
                    f"batch after **{su['first_batch_s']} s** from `make_loader` ({su['with_import_s']} s with the "
                    f"import of stager's loader; torch imported before), workers {su['workers_cpu_s']} s CPU.",
                ]
        lines.append("")
    if plot:
        lines += [f"![time and bytes against the sample count]({plot})", ""]
    path.write_text("\n".join(lines))


def write_plot(res: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(10, 4))
    for label in WRITERS:
        pts = [(s["samples"], s["writers"][label]) for s in res["counts"] if "seconds" in s["writers"][label]]
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ax_t.plot(xs, [p[1]["seconds"] for p in pts], marker="o", label=label)
        ax_b.plot(xs, [p[1]["bytes"] / 1e9 for p in pts], marker="o", label=label)
    for ax, title, unit in ((ax_t, "pack wall time", "seconds"), (ax_b, "output size", "GB")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("samples (~1 KB JPEGs)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", type=int, nargs="+", default=[10_000, 100_000, 1_281_000])
    p.add_argument("--repeat", type=int, default=2, help="interleaved rounds per writer; the best is reported")
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the trees and the stager output in --work")
    p.add_argument("--markdown", default=str(ROOT / "docs" / "bench" / "scale.md"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "bench" / "scale.png"))
    p.add_argument("--writers", nargs="+", choices=WRITERS, default=None,
                   help="measure only these writers (default: all)")
    args = p.parse_args(argv)
    SELECTED[:] = args.writers or []
    work = Path(args.work or tempfile.mkdtemp(prefix="stager-bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        res: dict[str, Any] = {
            "command": "python tools/bench/bench_scale.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "counts": [bench_count(c, work, args.repeat, args.keep) for c in args.counts],
        }
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    plot = Path(args.plot)
    plotted = write_plot(res, plot)
    write_markdown(res, Path(args.markdown), f"bench/{plot.name}" if plotted else None)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
