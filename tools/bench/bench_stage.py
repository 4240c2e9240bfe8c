"""Staging throughput vs the tools people use instead, measured in the same run.

For an ImageNet-like set (JPEGs of ~100 KB) and a CIFAR-like set (PNGs of ~2 KB), packed into tar
shards with ``stager pack``:

* ``stage``: ``stager.stage.stage(packed, DEST)`` - parallel copy with xxh3 verification, receipt;
* ``cp -r shards``: ``cp -r`` of the same packed directory (no verification);
* ``stage --unpack only``: shards streamed, verified and written as an ImageFolder tree;
* ``tar xf``: GNU tar extracting one tar of the same image tree (the Alliance Canada recipe);
* ``cp -r tree``: ``cp -r`` of the original small-file tree.

Ratios (targets in the issue): stage/cp bytes/s >= 0.8; unpack/tar-xf files/s >= 1.0; staged shards
vs ``cp -r`` of the tree in samples/s >= 10 for CIFAR-like data.

Conditions: the page cache cannot be dropped here (no root on the host), so every source is read
hot from the page cache and DEST is on the same local disk; this measures the CPU/syscall cost of
each method, which is what separates them on node-local NVMe. Each figure is the median of
``--repeat`` runs. Prints one JSON object; writes docs/bench/stage.md.

Usage: ``python tools/bench/bench_stage.py [--small] [--out docs/bench/stage.md]``
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
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stager.pack import pack  # noqa: E402
from stager.stage import stage  # noqa: E402
from tools.datagen import make_cifar, make_imagefolder  # noqa: E402


def _count(tree: Path) -> tuple[int, int]:
    n = b = 0
    for r, _d, files in os.walk(tree):
        for f in files:
            n += 1
            b += os.path.getsize(os.path.join(r, f))
    return n, b


def _timed(fn: Any, cleanup: Path, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        shutil.rmtree(cleanup, ignore_errors=True)
        os.sync()  # start each run without other runs' dirty pages pending
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    shutil.rmtree(cleanup, ignore_errors=True)
    return statistics.median(times)


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    subprocess.run(cmd, check=True, cwd=cwd)


def bench_set(name: str, tree: Path, work: Path, repeat: int, workers: int) -> dict[str, Any]:
    packed = work / f"{name}-packed"
    pack(tree, packed, format="tar", shard_size=64 << 20, workers=1)
    files, tree_bytes = _count(tree)
    shard_bytes = sum(p.stat().st_size for p in packed.iterdir() if p.name != "manifest.json")
    tarball = work / f"{name}-tree.tar"
    _run(["tar", "cf", str(tarball), "-C", str(tree.parent), tree.name])
    dest = work / "dest"
    r: dict[str, Any] = {"files": files, "tree_bytes": tree_bytes, "shard_bytes": shard_bytes,
                         "shards": len(list(packed.glob("*.tar")))}
    r["stage_s"] = _timed(lambda: stage(packed, dest, workers=workers), dest, repeat)
    r["cp_shards_s"] = _timed(lambda: _run(["cp", "-r", str(packed), str(dest)]), dest, repeat)
    r["unpack_s"] = _timed(lambda: stage(packed, dest, workers=workers, unpack="only"), dest, repeat)

    def tar_x() -> None:
        dest.mkdir()
        _run(["tar", "xf", str(tarball), "-C", str(dest)])

    r["tar_xf_s"] = _timed(tar_x, dest, repeat)
    r["cp_tree_s"] = _timed(lambda: _run(["cp", "-r", str(tree), str(dest)]), dest, repeat)
    r["stage_GBps"] = shard_bytes / r["stage_s"] / 1e9
    r["cp_shards_GBps"] = shard_bytes / r["cp_shards_s"] / 1e9
    r["stage_samples_per_s"] = files / r["stage_s"]
    r["unpack_files_per_s"] = files / r["unpack_s"]
    r["tar_xf_files_per_s"] = files / r["tar_xf_s"]
    r["cp_tree_samples_per_s"] = files / r["cp_tree_s"]
    r["ratio_stage_vs_cp_bytes"] = r["stage_GBps"] / r["cp_shards_GBps"]
    r["ratio_unpack_vs_tar_xf_files"] = r["unpack_files_per_s"] / r["tar_xf_files_per_s"]
    r["ratio_shards_vs_tree_samples"] = r["stage_samples_per_s"] / r["cp_tree_samples_per_s"]
    return r


def write_md(path: Path, res: dict[str, Any]) -> None:
    lines = [
        "# Staging benchmark (tools/bench/bench_stage.py)",
        "",
        f"Conditions: {res['conditions']}",
        "",
        "| set | files | shard MB | stage GB/s (verified) | cp -r shards GB/s | stage/cp | unpack files/s | "
        "tar xf files/s | unpack/tar xf | stage samples/s | cp -r tree samples/s | shards/tree |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res["sets"].items():
        lines.append(
            f"| {name} | {r['files']} | {r['shard_bytes'] / 1e6:.1f} | {r['stage_GBps']:.2f} | "
            f"{r['cp_shards_GBps']:.2f} | {r['ratio_stage_vs_cp_bytes']:.2f}x | {r['unpack_files_per_s']:,.0f} | "
            f"{r['tar_xf_files_per_s']:,.0f} | {r['ratio_unpack_vs_tar_xf_files']:.2f}x | "
            f"{r['stage_samples_per_s']:,.0f} | {r['cp_tree_samples_per_s']:,.0f} | "
            f"{r['ratio_shards_vs_tree_samples']:.1f}x |"
        )
    lines += ["", "Targets: stage/cp >= 0.8x; unpack/tar xf >= 1.0x; CIFAR-like shards/tree >= 10x.", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny sets (smoke run)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "stage.md"))
    ap.add_argument("--work", default=None, help="scratch directory (default: a temp dir on /tmp)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_stage_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        per_class = 10 if args.small else 100
        inet = make_imagefolder(work / "imagenet" / "train", num_classes=10, per_class=per_class, seed=0)
        n_cifar = 2000 if args.small else 20000
        make_cifar(work / "cifar", n_train=n_cifar, n_test=10, seed=0, png_folder=True)
        cifar = work / "cifar" / "cifar-png" / "train"
        res: dict[str, Any] = {
            "conditions": "hot page cache (cannot drop caches here), source and DEST on the same local disk, "
            f"{os.cpu_count()} CPUs, workers={args.workers}, median of {args.repeat}",
            "sets": {},
        }
        res["sets"]["imagenet-like"] = bench_set("imagenet", inet, work, args.repeat, args.workers)
        res["sets"]["cifar-like"] = bench_set("cifar", cifar, work, args.repeat, args.workers)
        write_md(Path(args.out), res)
        print(json.dumps(res, indent=1))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
