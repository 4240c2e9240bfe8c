"""Memory of a mix (issue 31): per-process anonymous memory grows with streams, not samples.

A base pack of ``--samples`` (100k) tiny samples, and copies of it that are other datasets (shard and
sample-index files hard-linked, each manifest rewritten with its own ``source``, so its digest and
dataset id differ): up to ``--streams`` (20) streams of 100k samples, 2M samples in all, plus a
base pack of a tenth of the samples for the "same streams, fewer samples" rows.

Each configuration runs in a fresh process: ``make_loader`` over the mix (raw payloads, in-process, one
rank, the default run layout and shuffle buffer), then one whole epoch. Reported: ``RssAnon`` (the
process's anonymous resident memory, /proc/self/status) before, after construction and at its peak
during the epoch (sampled every 20 batches). In-process means the plan of the rank's epoch (per sample:
the draw, the share, the worker's stream and emission order) lives in the same process as the index
views; with workers each holds its own part of it.

Usage: ``python -m tools.bench.bench_mix_memory [--samples 100000] [--streams 20]``; prints JSON and
writes docs/bench/mix_memory.md.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stager.manifest import MANIFEST_NAME, load_manifest  # noqa: E402
from stager.pack import pack  # noqa: E402
from tools.datagen import jpeg_bytes  # noqa: E402


def make_source(root: Path, n: int) -> Path:
    """An ImageFolder of ``n`` tiny JPEGs: 16 rendered images, hard-linked under ``n`` names in 10 classes."""
    import numpy as np

    rng = np.random.default_rng(0)
    originals = []
    (root / "orig").mkdir(parents=True, exist_ok=True)
    for i in range(16):
        p = root / "orig" / f"{i}.jpg"
        p.write_bytes(jpeg_bytes(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)))
        originals.append(p)
    for c in range(10):
        (root / "tree" / f"c{c}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        os.link(originals[i % 16], root / "tree" / f"c{i % 10}" / f"{i:07d}.jpg")
    return root / "tree"


def copy_as_other_dataset(base: Path, out: Path, tag: int) -> Path:
    """``base``'s files hard-linked into ``out`` and its manifest rewritten with another ``source``: a distinct
    dataset (its own digest) over the same bytes."""
    out.mkdir(parents=True, exist_ok=True)
    for p in base.iterdir():
        if p.is_file() and p.name != MANIFEST_NAME:
            os.link(p, out / p.name)
    m = load_manifest(base)
    m.source = {**m.source, "copy": tag}
    m.created = ""
    m.write(out)
    return out


def prepare(work: Path, samples: int, streams: int) -> dict[str, Any]:
    sets: dict[str, Any] = {}
    for label, n in (("big", samples), ("small", samples // 10)):
        base = work / f"{label}-0"
        if not (base / MANIFEST_NAME).is_file():  # else kept from an earlier run with --work
            pack(make_source(work / f"src-{label}", n), base, "tar", samples_per_shard=max(1000, n // 50))
        copies = [work / f"{label}-{i}" for i in range(1, streams)]
        sets[label] = [str(base)] + [str(d if (d / MANIFEST_NAME).is_file() else copy_as_other_dataset(base, d, i))
                                     for i, d in enumerate(copies, 1)]
    return sets


def rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


def measure(paths: list[str], single: bool) -> dict[str, Any]:
    """In this process: anonymous memory before, after make_loader, and at its peak over one epoch."""
    import torch  # noqa: F401  (a training process has torch loaded; keep it out of the loader's figures)

    from stager.loader import make_loader

    before = rss_anon_kib()
    src: Any = paths[0] if single else paths
    ld = make_loader(src, 256, rank=0, world_size=1, decode="raw", staged=False)
    built = rss_anon_kib()
    peak, n = built, 0
    for k, b in enumerate(ld):
        n += len(b["key"])
        if k % 20 == 0:
            peak = max(peak, rss_anon_kib())
    peak = max(peak, rss_anon_kib())
    return {"streams": 1 if single else len(paths), "samples": n, "before_mib": before / 1024,
            "built_mib": built / 1024, "peak_mib": peak / 1024}


def run_child(paths: list[str], single: bool) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "tools.bench.bench_mix_memory", "--measure", json.dumps(paths),
                          *(["--single"] if single else [])], capture_output=True, text=True, cwd=ROOT, timeout=1200,
                         check=False)
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else str(out.returncode))
    return json.loads(out.stdout.strip().splitlines()[-1])


def to_markdown(res: dict[str, Any]) -> str:
    lines = ["# Mix memory (tools/bench/bench_mix_memory.py)", "",
             f"{res['machine']}; anonymous resident memory (RssAnon) of one process, raw payloads, in-process.",
             "", "| configuration | streams | samples per epoch | after import | after make_loader | peak over an "
             "epoch | loader's growth at construction | at peak | peak per sample |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        grow = r["built_mib"] - r["before_mib"]
        peak = r["peak_mib"] - r["before_mib"]
        lines.append(f"| {r['label']} | {r['streams']} | {r['samples']:,} | {r['before_mib']:.1f} MiB | "
                     f"{r['built_mib']:.1f} MiB | {r['peak_mib']:.1f} MiB | {grow:.1f} MiB | {peak:.1f} MiB | "
                     f"{peak * 2**20 / max(r['samples'], 1):.1f} B |")
    lines += ["", res.get("summary", ""), ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=100_000, help="samples per stream")
    ap.add_argument("--streams", type=int, default=20)
    ap.add_argument("--work", help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--md", default=str(ROOT / "docs" / "bench" / "mix_memory.md"))
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(json.loads(args.measure), args.single)))
        return 0
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-mix-mem-"))
    try:
        sets = prepare(work, args.samples, args.streams)
        big, small = sets["big"], sets["small"]
        plan = [("one dataset (not a mix)", big[:1], True), ("mix of 1 stream", big[:1], False)]
        plan += [(f"mix of {k} streams", big[:k], False) for k in sorted({2, 5, args.streams}) if k <= args.streams]
        plan += [(f"mix of {args.streams} streams, a tenth of the samples", small, False)]
        rows = []
        for label, paths, single in plan:
            rows.append({"label": label, **run_child(paths, single)})
        res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
               "samples_per_stream": args.samples, "rows": rows}
        res["summary"] = summarize(rows, args.streams)
        print(json.dumps(res, indent=1))
        if args.md:
            Path(args.md).parent.mkdir(parents=True, exist_ok=True)
            Path(args.md).write_text(to_markdown(res))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def summarize(rows: list[dict[str, Any]], streams: int) -> str:
    """One paragraph: construction memory per stream, and the epoch's plan per sample (mix vs one dataset)."""
    by = {r["label"]: r for r in rows}
    one = by["mix of 1 stream"]
    many = by[f"mix of {streams} streams"]
    few = by[f"mix of {streams} streams, a tenth of the samples"]
    single = by["one dataset (not a mix)"]

    def grow(r: dict[str, Any], key: str) -> float:
        return float(r[key] - r["before_mib"])

    per_stream = (grow(many, "built_mib") - grow(one, "built_mib")) / max(streams - 1, 1)
    sample_cost = (grow(many, "peak_mib") - grow(few, "peak_mib")) * 2**20 / max(many["samples"] - few["samples"], 1)
    single_cost = grow(single, "peak_mib") * 2**20 / max(single["samples"], 1)
    return (f"Construction: {per_stream * 1024:.0f} KiB per stream ({grow(many, 'built_mib'):.1f} MiB for {streams} "
            f"streams of {many['samples'] // streams:,} samples, {grow(few, 'built_mib'):.1f} MiB for {streams} "
            "streams of a tenth of them): the streams' per-sample columns are mapped, not copied. Over an epoch: "
            f"{sample_cost:.1f} B per sample of the rank's epoch (the {streams}-stream mix at 10x the samples), "
            f"{single_cost:.1f} B per sample for one dataset read alone: the epoch's plan, what the single-dataset "
            "loader holds too.")


if __name__ == "__main__":
    raise SystemExit(main())
