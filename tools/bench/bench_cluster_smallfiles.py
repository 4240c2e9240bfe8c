"""The small-file problem on the one-machine Slurm cluster: an ImageFolder tree vs the same images
packed into shards, read over the cluster's network file system. Needs `make cluster`.

    .venv/bin/python tools/bench/bench_cluster_smallfiles.py --nodes 1 4 --repeat 2

Two sets, generated on the storage host's exported directory: ImageNet-like JPEGs (~500x375, about
110 KB) and CIFAR-like 32x32 PNGs (about 2.7 KB), each as an ImageFolder tree and as `stager pack`
tar shards. In a job, each of N nodes (srun, one task per node, all at once) reads the whole set
through its sshfs mount, as one epoch of "read the shared file system every epoch" would:

* tree: list the tree (os.scandir, as ImageFolder does at start-up), then open, read and close every
  file in the listing's order;
* shards: open and read each shard sequentially in 1 MiB reads.

Reported per set and N: seconds (median of --repeat runs; the slowest node of each run), files
(samples) per second per node and in total, MB/s, and the listing time alone. Nothing is cached
between runs: sshfs keeps no page cache across opens and its attribute/directory caches are off
(tools/cluster/sharedfs.py); the storage host serves from its own page cache in both cases. Writes
docs/bench/cluster-smallfiles.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.cluster.client import Cluster  # noqa: E402

READER = r'''
import json, os, sys, time
kind, root = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
if kind == "tree":
    files = []
    stack = [root]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            for e in sorted(it, key=lambda e: e.name):
                (stack.append if e.is_dir() else files.append)(e.path)
    files.sort()
    t_list = time.perf_counter() - t0
    n = 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            n += len(fh.read())
    count = len(files)
else:
    t_list = 0.0
    n = count = 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".tar"):
            with open(os.path.join(root, name), "rb", buffering=0) as fh:
                while chunk := fh.read(1 << 20):
                    n += len(chunk)
    count = int(sys.argv[3])
print(json.dumps({"host": os.uname().nodename, "seconds": time.perf_counter() - t0, "list_s": t_list,
                  "bytes": n, "items": count}))
'''


def make_sets(export: Path) -> dict[str, dict]:
    from stager.manifest import load_manifest
    from stager.pack import pack
    from tools.datagen import make_cifar, make_imagefolder

    sets = {}
    inet = make_imagefolder(export / "imagenet-like", num_classes=10, per_class=100, seed=7)
    make_cifar(export / "cifar-like", n_train=10000, n_test=10, seed=7, png_folder=True)
    cifar_tree = export / "cifar-like" / "cifar-png" / "train"
    for name, tree in (("ImageNet-like JPEG", Path(inet)), ("CIFAR-like PNG", cifar_tree)):
        packed = export / f"{name.split('-')[0].lower()}-tar"
        pack(tree, packed, "tar")
        m = load_manifest(packed)
        files = [p for p in tree.rglob("*") if p.is_file()]
        sets[name] = {"tree": tree, "packed": packed, "files": len(files), "samples": m.num_samples,
                      "tree_bytes": sum(p.stat().st_size for p in files), "shard_bytes": m.num_bytes,
                      "shard_files": len(m.shards)}
    return sets


def read_on_nodes(c: Cluster, work: Path, tag: str, nodes: int, *, kind: str, path: Path, items: int) -> dict:
    reader = work / "reader.py"
    reader.write_text(READER)
    tasks = work / f"{tag}.tasks"
    tasks.mkdir()
    script = work / f"{tag}.sh"
    script.write_text(f"#!/bin/bash\nsource .venv/bin/activate\n"
                      f"srun --ntasks-per-node=1 --output={tasks}/%N.out python {reader} {kind} "
                      f"{c.shared_path(path)} {items}\n")
    before = c.served_bytes()
    job = c.sbatch([f"--nodes={nodes}", "--ntasks-per-node=1", "--cpus-per-task=1", "--exclusive", str(script)],
                   output=script.with_suffix(".out"), cwd=ROOT, timeout=1800)
    if job.state != "COMPLETED":
        raise SystemExit(f"{tag}: {job.describe()}")
    res = [json.loads(f.read_text().strip().splitlines()[-1]) for f in sorted(tasks.glob("*.out"))]
    return {"seconds": max(r["seconds"] for r in res), "list_s": max(r["list_s"] for r in res),
            "bytes": res[0]["bytes"], "items": res[0]["items"], "served": c.served_bytes() - before}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "cluster-smallfiles.md"))
    a = ap.parse_args(argv)
    c = Cluster()
    work = Path(c.env["CLUSTER_STATE"]) / "bench-small"
    export = c.export / "bench-small"
    for d in (work, export):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    try:
        sets = make_sets(export)
        rows = []
        for name, s in sets.items():
            for n in a.nodes:
                row = {"set": name, "nodes": n, **{k: v for k, v in s.items() if k not in ("tree", "packed")}}
                for kind, path, items in (("tree", s["tree"], s["files"]), ("shards", s["packed"], s["samples"])):
                    runs = [read_on_nodes(c, work, f"{kind}-{len(rows)}-{n}-{r}", n, kind=kind, path=path,
                                          items=items)
                            for r in range(a.repeat)]
                    row[kind] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                    print(f"{name:20s} {n} node(s) {kind:6s} {row[kind]['seconds']:7.2f}s "
                          f"{items / row[kind]['seconds']:9.0f} items/s per node", flush=True)
                rows.append(row)
        write_md(Path(a.out), rows, c)
        print(json.dumps(rows, indent=1, default=float))
    finally:
        shutil.rmtree(export, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def write_md(path: Path, rows: list[dict], c: Cluster) -> None:
    lines = [
        "# The small-file problem on the one-machine Slurm cluster",
        "",
        f"`tools/bench/bench_cluster_smallfiles.py` on `make cluster`: every node reads the whole set through "
        f"its sshfs mount of the storage host (link capped at {c.env['CLUSTER_STORAGE_MBIT']} Mbit/s), N nodes "
        "at once, median of the runs, slowest node. tree = list the ImageFolder tree, then open/read/close each "
        "file; shards = read the `stager pack` tar shards sequentially. items/s = files (tree) or samples "
        "(shards) per second per node; total = times N.",
        "",
        "| set | nodes | files read | read | seconds | listing s | items/s per node | items/s total | MB/s per node "
        "| shards vs tree |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        for kind in ("tree", "shards"):
            x = r[kind]
            per = x["items"] / x["seconds"]
            speed = r["tree"]["seconds"] / r["shards"]["seconds"]
            opened = r["files"] if kind == "tree" else r["shard_files"]
            lines.append(f"| {r['set']} | {r['nodes']} | {opened} | {kind} | "
                         f"{x['seconds']:.2f} | {x['list_s']:.2f} | {per:,.0f} | {per * r['nodes']:,.0f} | "
                         f"{x['bytes'] / x['seconds'] / 1e6:.1f} | {f'{speed:.1f}x' if kind == 'shards' else ''} |")
    lines += ["", "Raw figures (JSON):", "", "```json", json.dumps(rows, indent=1, default=float), "```", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
