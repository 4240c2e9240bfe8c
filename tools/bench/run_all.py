"""Run every benchmark in one go and rebuild docs/benchmarks.md (``make bench``).

Each benchmark script measures stager side by side with its peers and the machine's limits in one
run and writes its own table to docs/bench/<topic>.md. This runner calls them in sequence (never in
parallel: they would measure each other), records the machine and its load, and splices the tables
into docs/benchmarks.md between the ``bench:begin``/``bench:end`` markers, leaving the hand-written
summary above them alone.

    python tools/bench/run_all.py            # full sizes (tens of minutes on 2 cores)
    python tools/bench/run_all.py --quick    # small sizes: proves every script runs
    python tools/bench/run_all.py --only pack loader
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

# topic -> (script, full-size args, quick args, markdown file it writes)
SUITE: dict[str, tuple[str, list[str], list[str], str]] = {
    "pack": ("bench_pack.py", [], ["--imagenet", "200", "--cifar", "2000", "--repeat", "1"], "pack.md"),
    # Small sets (issue 40): every contender in a child forked after its imports; medians of interleaved rounds.
    "pack_small": ("bench_pack_small.py", ["--rounds", "5"],
                   ["--rounds", "1", "--sets", "cifar", "--only", "stager tar", "MDSWriter"], "pack_small.md"),
    # ImageNet count (1.28M ~1 KB JPEGs): stager vs MDSWriter vs webdataset, loader start-up; ~25 min.
    "scale": ("bench_scale.py", [], ["--counts", "2000", "--repeat", "1"], "scale.md"),
    "shard_writers": ("bench_shard_writers.py", [], [], "shard_writers.md"),
    "hdf5_layout": ("bench_hdf5_layout.py", [], ["--n", "100"], "hdf5_layout.md"),
    "decode": ("bench_decode.py", [], ["--n", "16", "--rounds", "1", "--seconds", "0.5"], "decode.md"),
    "fields": ("bench_fields.py", [], ["--n", "60", "--rounds", "1"], "fields.md"),
    "loader": ("bench_loader.py", [], ["--cifar", "2000", "--imagenet", "200", "--crops", "64"], "loader.md"),
    "shuffle_quality": ("shuffle_quality.py", ["--md"], ["--scenario", "tiny", "--md"], "shuffle_quality.md"),
    "stage": ("bench_stage.py", ["--rounds", "3", "--large", "100"], ["--small"], "stage.md"),
    # Staging as a user times it (issue 40): whole commands on a cold source, each ending with sync.
    "stage_small": ("bench_stage_small.py", ["--rounds", "5", "--sets", "c85", "i317", "i4g",
                                             "--markdown", "docs/bench/stage_small.md"],
                    ["--rounds", "1", "--sets", "c85", "--markdown", "docs/bench/stage_small.md"], "stage_small.md"),
    "collective": ("bench_collective.py", [], ["--nodes", "2", "--mb", "16"], "collective.md"),
    # DALI's index scripts are compared when $STAGER_DALI_SCRIPTS names where they were extracted (docs/index.md).
    "index": ("bench_index.py", ["--n", "2000", *(["--dali-scripts", os.environ["STAGER_DALI_SCRIPTS"]]
                                                  if os.environ.get("STAGER_DALI_SCRIPTS") else [])],
              ["--n", "200", "--rounds", "1"], "index.md"),
    "footprint": ("bench_footprint.py", [], ["--n", "100000"], "footprint.md"),
    # SquashFS codec (issue 41): writer vs mksquashfs, listing an ImageNet-sized image vs unsquashfs -l.
    "squashfs_codec": ("bench_squashfs_codec.py", [],
                       ["--classes", "2", "--per-class", "20", "--text", "100", "--big-classes", "10",
                        "--big-per-class", "100", "--rounds", "1", "--work", "/tmp/stager-bench-squashfs-quick"],
                       "squashfs_codec.md"),
    # SquashFS as a format (issue 41): loader vs tar and vs a squashfuse mount, pack vs mksquashfs,
    # index vs unsquashfs -l (the 1.28M-file image is cached under --work, shared with squashfs_codec).
    "squashfs": ("bench_squashfs.py", [],
                 ["--classes", "2", "--per-class", "20", "--big-classes", "10", "--big-per-class", "100",
                  "--rounds", "1", "--compressions", "none,zstd", "--work", "/tmp/stager-bench-squashfs-quick"],
                 "squashfs.md"),
    # The first batch with 2 worker processes at 1.28M samples (issue 40); ~3 min with the pack.
    "startup": ("bench_startup.py", [], ["--samples", "20000", "--shards", "4", "--rounds", "1"], "startup.md"),
    # DALI's rec2idx.py imports MXNet: $STAGER_MXNET_PYTHON names a venv's python with mxnet==1.9.1, numpy<1.24.
    "legacy": ("bench_legacy.py", [*(["--dali-scripts", os.environ["STAGER_DALI_SCRIPTS"]]
                                     if os.environ.get("STAGER_DALI_SCRIPTS") else [])],
               ["--rec", "200", "--lmdb", "2000", "--rounds", "1"], "legacy.md"),
    "objstore": ("bench_objstore.py", [], ["--shards", "4", "--shard-mb", "4", "--images", "200", "--rounds", "1"],
                 "objstore.md"),
    # PyAV writes the H.264 videos; DALI's CPU readers.sequence is compared where nvidia-dali imports.
    "clips": ("bench_clips.py", ["--rounds", "5"],
              ["--sequences", "3", "--frames", "60", "--rounds", "1", "--batches", "4", "--skip", "1",
               "--seconds", "0"], "clips.md"),
}


def machine() -> dict[str, object]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch

    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg_start": os.getloadavg(),
    }


def run(topic: str, quick: bool) -> dict[str, object]:
    script, full, small, md = SUITE[topic]
    cmd = [sys.executable, str(BENCH / script), *(small if quick else full)]
    t0 = time.perf_counter()
    print(f"bench: {topic}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if topic == "shuffle_quality" and proc.returncode == 0:
        # This script prints its markdown on stderr; keep the table lines only.
        table = [ln for ln in proc.stderr.splitlines() if ln.startswith("|")]
        (ROOT / "docs" / "bench" / md).write_text("# Shuffle quality\n\n" + "\n".join(table) + "\n")
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
    return {"topic": topic, "rc": proc.returncode, "seconds": round(seconds, 1), "load_avg_end": os.getloadavg()}


def splice(sections: list[str], info: dict[str, object], ran_topics: list[str]) -> None:
    ran = ", ".join(ran_topics) or "none (--splice-only)"
    parts = [BEGIN, "", f"_Spliced by `make bench` (tools/bench/run_all.py) on {info['date']} from the latest run of "
             f"each script; each section states its own run and conditions. Run now: {ran}; {info['cpu']}, "
             f"{info['cores']} cores, {info['mem_gib']} GiB, Python {info['python']}, torch {info['torch']}; "
             f"load average at start {tuple(round(x, 2) for x in info['load_avg_start'])}._", ""]  # type: ignore[attr-defined]
    for name in sections:
        path = ROOT / "docs" / "bench" / SUITE[name][3]
        if path.exists():
            text = path.read_text().strip()
            # Demote the section's headings one level under this document's.
            text = "\n".join("#" + ln if ln.startswith("#") else ln for ln in text.splitlines())
            parts += [text, ""]
    parts.append(END)
    doc = DOC.read_text() if DOC.exists() else "# Benchmarks\n\n"
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        doc = head + "\n".join(parts) + tail
    else:
        doc = doc.rstrip() + "\n\n" + "\n".join(parts) + "\n"
    DOC.write_text(doc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every script")
    ap.add_argument("--only", nargs="+", choices=sorted(SUITE), help="run only these topics")
    ap.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    ap.add_argument("--splice-only", action="store_true", help="rebuild docs/benchmarks.md only")
    args = ap.parse_args(argv)
    info = machine()
    topics = args.only or list(SUITE)
    results = [] if args.splice_only else [run(t, args.quick) for t in topics]
    if not args.no_doc:
        splice(list(SUITE), info, [r["topic"] for r in results])
    print(json.dumps({"machine": info, "runs": results}, default=str))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
