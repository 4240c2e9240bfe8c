"""Pack throughput: ``stager pack`` against webdataset, MosaicML streaming and LitData, same source.

Two sources from tools/datagen.py: an ImageNet-like ImageFolder (default 2,000 JPEGs of ~100 KB,
~500x375) and a CIFAR-like PNG ImageFolder (default 20,000 32x32 PNGs). Each writer packs the same
files (read from a warm page cache: every source file is read once before timing) into shards of
``--shard-mb`` (default 16 MB, so that even the small sets give ``--workers 2`` several shards: stager
parallelises over shards, one process per shard):

* ``webdataset``: ``ShardWriter`` with an integer ``mtime`` (reproducible tars), bytes passed through;
* ``mds``: ``streaming.MDSWriter`` with columns ``image: bytes, label: int``, no compression;
* ``litdata``: ``litdata.optimize`` with one worker, ``{"image": bytes, "label": int}`` per file;
* ``stager tar w1`` / ``w2``: :func:`stager.pack.pack` with ``workers=1`` / ``2`` (listing, planning,
  checking every image's header and end marker, hashing and fsyncing every shard included);
  ``stager record/hdf5 w1`` for reference.

Each timing covers the whole job from the source directory to finished output (listing included for
every tool). Prints one JSON object and writes docs/bench/pack.md. Peers come from
``make bench-setup`` (tools/bench/setup_peers.sh); a missing peer is reported, not fatal.

    python tools/bench/bench_pack.py [--imagenet 2000] [--cifar 20000] [--repeat 1] [--work DIR]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.datagen import make_cifar, make_imagefolder  # noqa: E402

SHARD_BYTES = 16 << 20  # set by --shard-mb; small enough that --workers 2 has several shards to share


def list_imagefolder(root: Path) -> list[tuple[str, Path, int]]:
    """``(key, path, label)`` for every file, sorted, labels from sorted class folder names."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    out = []
    for label, c in enumerate(classes):
        for f in sorted((root / c).iterdir()):
            out.append((f"{c}/{f.stem}", f, label))
    return out


def run_webdataset(src: Path, out: Path) -> int:
    import webdataset as wds

    items = list_imagefolder(src)
    out.mkdir(parents=True)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=10**9, maxsize=SHARD_BYTES, verbose=0, mtime=0) as w:
        for key, path, label in items:
            w.write({"__key__": key, path.suffix.lower().lstrip("."): path.read_bytes(), "cls": label})
    return len(items)


def run_mds(src: Path, out: Path) -> int:
    from streaming import MDSWriter

    items = list_imagefolder(src)
    with MDSWriter(out=str(out), columns={"image": "bytes", "label": "int"}, size_limit=SHARD_BYTES) as w:
        for _, path, label in items:
            w.write({"image": path.read_bytes(), "label": label})
    return len(items)


def _litdata_fn(item: tuple[str, int]) -> dict[str, Any]:
    path, label = item
    with open(path, "rb") as f:
        return {"image": f.read(), "label": label}


def run_litdata(src: Path, out: Path) -> int:
    from litdata import optimize

    items = [(str(p), lab) for _, p, lab in list_imagefolder(src)]
    optimize(
        fn=_litdata_fn,
        inputs=items,
        output_dir=str(out),
        chunk_bytes=SHARD_BYTES,
        num_workers=1,
        mode="overwrite",
        verbose=False,
        reorder_files=False,
    )
    return len(items)


def run_stager(fmt: str, workers: int) -> Callable[[Path, Path], tuple[int, float]]:
    """Time ``pack()`` inside a fresh interpreter, as ``stager pack`` runs: the peers leave threads
    behind in this process, which would make the pool start with ``spawn`` instead of ``fork``."""

    def run(src: Path, out: Path) -> tuple[int, float]:
        code = (
            "import json, sys, time\n"
            "from stager.pack import pack\n"
            "t = time.perf_counter()\n"
            f"r = pack({str(src)!r}, {str(out)!r}, {fmt!r}, shard_size={SHARD_BYTES}, workers={workers})\n"
            "print(json.dumps([r.samples, time.perf_counter() - t]))\n"
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
        n, dt = json.loads(p.stdout.strip().splitlines()[-1])
        return int(n), float(dt)

    return run


RUNNERS: dict[str, Callable[[Path, Path], Any]] = {
    "webdataset ShardWriter": run_webdataset,
    "mds MDSWriter": run_mds,
    "litdata optimize (1 worker)": run_litdata,
    "stager tar w1": run_stager("tar", 1),
    "stager tar w2": run_stager("tar", 2),
    "stager record w1": run_stager("record", 1),
    "stager hdf5 w1": run_stager("hdf5", 1),
}
PEERS = ("webdataset ShardWriter", "mds MDSWriter", "litdata optimize (1 worker)")


def warm(src: Path) -> int:
    total = 0
    for f in src.rglob("*"):
        if f.is_file():
            total += len(f.read_bytes())
    return total


def bench_set(name: str, src: Path, work: Path, repeat: int) -> dict[str, Any]:
    nbytes = warm(src)
    nfiles = sum(1 for f in src.rglob("*") if f.is_file())
    rows: dict[str, Any] = {}
    for label, fn in RUNNERS.items():
        best = None
        err = None
        for _ in range(repeat):
            out = work / f"out-{name}-{label.split()[0]}"
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            try:
                got = fn(src, out)
            except Exception as exc:  # a missing/broken peer is reported, not fatal
                err = f"{type(exc).__name__}: {exc}"[:200]
                break
            dt = time.perf_counter() - t0
            n, dt = got if isinstance(got, tuple) else (got, dt)
            assert n == nfiles, (label, n, nfiles)
            best = dt if best is None else min(best, dt)
            shutil.rmtree(out, ignore_errors=True)
        if best is None:
            rows[label] = {"error": err}
        else:
            rows[label] = {
                "seconds": round(best, 3),
                "samples_per_s": round(nfiles / best, 1),
                "mb_per_s": round(nbytes / best / 1e6, 1),
            }
    ok_peers = [rows[p]["samples_per_s"] for p in PEERS if "samples_per_s" in rows[p]]
    fastest = max(ok_peers) if ok_peers else None
    w1 = rows["stager tar w1"].get("samples_per_s")
    w2 = rows["stager tar w2"].get("samples_per_s")
    for r in rows.values():
        if fastest and "samples_per_s" in r:
            r["vs_fastest_peer"] = round(r["samples_per_s"] / fastest, 2)
    return {
        "files": nfiles,
        "bytes": nbytes,
        "mean_kb": round(nbytes / max(nfiles, 1) / 1e3, 1),
        "results": rows,
        "stager_w1_vs_fastest_peer": round(w1 / fastest, 2) if (w1 and fastest) else None,
        "stager_w2_vs_w1": round(w2 / w1, 2) if (w1 and w2) else None,
    }


def write_markdown(res: dict[str, Any], path: Path) -> None:
    lines = [
        "# Pack throughput",
        "",
        "Generated by `tools/bench/bench_pack.py` (" + res["command"] + f"), {res['machine']}.",
        f"All writers pack the same ImageFolder from a warm page cache into {SHARD_BYTES >> 20} MB shards; times",
        "cover the whole job (listing included; stager timed inside a fresh interpreter, as the CLI runs, so",
        "its worker pool forks). `vs fastest peer` divides samples/s by the fastest of webdataset,",
        "MDS and LitData on the same set. stager also checks each image (header + end marker), hashes",
        "(xxh3-128) and fsyncs every shard and writes a manifest; the peers do not fsync.",
        "",
    ]
    for name, s in res["sets"].items():
        lines += [
            f"## {name}: {s['files']:,} files, {s['bytes'] / 1e6:,.1f} MB (mean {s['mean_kb']} KB)",
            "",
            "| writer | seconds | samples/s | MB/s | vs fastest peer |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for label, r in s["results"].items():
            if "error" in r:
                lines.append(f"| {label} | - | - | - | not run: {r['error']} |")
            else:
                lines.append(
                    f"| {label} | {r['seconds']} | {r['samples_per_s']:,.0f} | {r['mb_per_s']:,.1f} | "
                    f"{r.get('vs_fastest_peer', '-')} |"
                )
        lines += [
            "",
            f"stager tar single-process vs fastest peer: **{s['stager_w1_vs_fastest_peer']}x**; "
            f"`--workers 2` vs single-process: **{s['stager_w2_vs_w1']}x** (target >= 1.0x and >= 1.7x).",
            "",
        ]
    if res.get("note"):
        lines += [res["note"], ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--imagenet", type=int, default=2000, help="ImageNet-like JPEGs (default 2000)")
    p.add_argument("--cifar", type=int, default=20000, help="CIFAR-like 32x32 PNGs (default 20000)")
    p.add_argument("--repeat", type=int, default=1, help="runs per writer; the best is reported")
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir, removed after)")
    p.add_argument("--markdown", default=str(ROOT / "docs" / "bench" / "pack.md"))
    p.add_argument("--shard-mb", type=int, default=16, help="shard size for every writer (default 16 MB)")
    p.add_argument("--note", default="", help="free text appended to the markdown (e.g. 'provisional')")
    args = p.parse_args(argv)
    global SHARD_BYTES  # noqa: PLW0603 - one module-wide setting read by every runner
    SHARD_BYTES = args.shard_mb << 20
    work = Path(args.work or tempfile.mkdtemp(prefix="stager-bench-pack-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        inet = work / "imagenet"
        if not inet.exists():
            per_class = max(1, args.imagenet // 20)
            make_imagefolder(inet, num_classes=20, per_class=per_class, seed=0)
        cif = work / "cifar" / "cifar-png" / "train"
        if not cif.exists():
            make_cifar(work / "cifar", n_train=args.cifar, n_test=10, seed=0, png_folder=True)
        res: dict[str, Any] = {
            "command": "python tools/bench/bench_pack.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "note": args.note,
            "sets": {
                "ImageNet-like JPEG": bench_set("imagenet", inet, work, args.repeat),
                "CIFAR-like PNG": bench_set("cifar", cif, work, args.repeat),
            },
        }
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    write_markdown(res, Path(args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
