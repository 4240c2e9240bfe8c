"""Loader start-up at ImageNet count: time to the first batch with worker processes, phase by phase.

What a training script waits for before its first step: a fresh interpreter with torch already
imported (a training script has it; not timed), then, timed, the import of stager's loader,
``make_loader(path, 256, num_workers=2, decode="raw", staged=False)`` and the first batch. The
dataset is one tar pack of ``--samples`` small valid JPEGs (1,281,167: ImageNet-1k's train count)
in ``--shards`` shards, written with stager's own tar writer; the page cache serves every read.

Reported per source tree (this one, and each ``--against`` tree: another checkout of stager, run
with the same interpreter over the same pack, rounds interleaved), medians over ``--rounds``:

* ``first_batch_s``: ``make_loader`` to the first batch (the figure of issue 40; stager imported
  before, as in ``bench_footprint.py``), and ``with_import_s`` (the import of stager's loader too);
* the phases: ``import``, ``make_loader``, ``first`` (``iter`` + ``next``: worker start, each worker's
  plan, reads, the batch's hand-over), wall and CPU seconds of the main process;
* ``workers_cpu_s``: CPU seconds of the worker processes up to the first batch (summed), with their
  minor page faults (copied or newly mapped pages). On a shared machine CPU seconds are the steadier
  figure: wall time includes waiting for a core.

Each tree's ``stager`` package is byte-compiled before the rounds (``compileall``), and each tree is
probed once unrecorded first.

``--phases`` adds each worker's CPU timeline: set-up after the fork (torch's worker loop, and the
full garbage collections in it), the plan, the read schedule, the fetcher and the first batch, from
stamps around stager's own ``RankDataset`` methods (any version's; installed after the timed import).

``--budget S`` makes the command exit 1 when this tree's median ``first_batch_s`` exceeds ``S``
seconds (issue 40: 0.3 s on an idle machine), so that the start-up cannot creep unnoticed.
``bench_scale.py`` reports the same probe on the pack it builds.

    python tools/bench/bench_startup.py                          # 1.28M samples, 14 shards, 7 rounds
    python tools/bench/bench_startup.py --against /src/stager-83e24ae --rounds 9 --budget 0.3
    python tools/bench/bench_startup.py --work /data/startup --keep   # keep the pack for the next run
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# One round in a fresh interpreter; prints one JSON line. The workers are the interpreter's children.
PROBE = r"""
import gc, json, os, sys, time
import torch  # a training script has torch loaded before it builds its loader: not timed

def stat(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    hz = os.sysconf("SC_CLK_TCK")
    return (int(f[11]) + int(f[12])) / hz, int(f[7])  # utime + stime, minor faults

def children():
    me = str(os.getpid())
    out = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == me:
                out.append(p)
        except OSError:
            pass
    return out

marks = [("start", time.perf_counter(), time.process_time())]
def mark(name):
    marks.append((name, time.perf_counter(), time.process_time()))
from stager.loader import make_loader
import stager.loader.loader  # the torch transport
mark("import")
timeline = sys.argv[3] if len(sys.argv) > 3 else ""
if timeline:  # the workers' CPU timeline (--phases): installed untimed
    _t, _c = time.perf_counter(), time.process_time()
    HOOKS  # (replaced)
    _t, _c = time.perf_counter() - _t, time.process_time() - _c
    marks = [(n, t + _t, c + _c) for n, t, c in marks]
loader = make_loader(sys.argv[1], 256, num_workers=int(sys.argv[2]), decode="raw", staged=False)
mark("make_loader")
it = iter(loader)
batch = next(it)
mark("first")
workers = [stat(p) for p in children()]
assert len(batch["key"]) == 256
phases = {marks[i][0]: [marks[i][1] - marks[i - 1][1], marks[i][2] - marks[i - 1][2]] for i in range(1, len(marks))}
res = {"first_batch_s": marks[-1][1] - marks[1][1], "with_import_s": marks[-1][1] - marks[0][1],
       "phases": phases, "main_cpu_s": marks[-1][2] - marks[0][2],
       "workers_cpu_s": sum(w[0] for w in workers), "workers_minflt": sum(w[1] for w in workers),
       "workers": len(workers)}
if timeline:
    for _ in range(len(workers) - 1):
        next(it)  # every worker has made its first batch
    res["worker_phases"] = [json.load(open(os.path.join(timeline, f))) for f in sorted(os.listdir(timeline))]
print(json.dumps(res))
del it
loader.close()
"""

# --phases: CPU-time stamps in each worker (fork, the full garbage collections, the plan, the read
# schedule and fetcher, the first batch), through stager's own RankDataset methods of any version.
HOOKS = r"""
from stager.loader import rank as _rank
_events = []
def _ev(name):
    _events.append((name, time.process_time()))
def _gc_event(phase, info):
    if info["generation"] == 2:
        _ev("gc>" if phase == "start" else "gc<")
def _forked():
    _events.clear()
    _ev("forked")
    gc.callbacks.append(_gc_event)
os.register_at_fork(after_in_child=_forked)
def _stamped(name):
    f = getattr(_rank.RankDataset, name, None)
    if f is None:
        return
    def g(self, *a, **k):
        _ev(name + ">")
        r = f(self, *a, **k)
        _ev(name + "<")
        return r
    setattr(_rank.RankDataset, name, g)
for _name in ("plan", "worker_plan", "_fetcher"):
    _stamped(_name)
_batches = _rank.RankDataset.worker_batches
def _worker_batches(self, *a, **k):
    _ev("worker_batches")
    for i, b in enumerate(_batches(self, *a, **k)):
        if i == 0 and os.getpid() != _main:
            _ev("first")
            with open(os.path.join(timeline, f".{os.getpid()}"), "w") as f:
                json.dump(_events, f)
            os.replace(os.path.join(timeline, f".{os.getpid()}"), os.path.join(timeline, f"w{os.getpid()}"))
        yield b
_rank.RankDataset.worker_batches = _worker_batches
_main = os.getpid()
"""


def worker_phases(events: list[list[Any]]) -> dict[str, float]:
    """One worker's CPU seconds per phase from its stamps: set-up after the fork (torch's worker loop;
    ``gc``: the full collections in it), the plan, the read schedule (plan to fetcher), the fetcher and
    the first batch."""
    t = {name: c for name, c in events}
    first = dict(events[:1])
    gc_s = sum(c2 - c1 for (n1, c1), (n2, c2) in itertools.pairwise(events) if n1 == "gc>" and n2 == "gc<")
    plan = "worker_plan" if "worker_plan>" in t else "plan"
    return {"setup": t["worker_batches"] - first["forked"], "gc": gc_s, "plan": t[f"{plan}<"] - t[f"{plan}>"],
            "schedule": t["_fetcher>"] - t[f"{plan}<"], "fetcher": t["_fetcher<"] - t["_fetcher>"],
            "first": t["first"] - t["_fetcher<"], "total": t["first"] - first["forked"]}


def fabricate(out: Path, samples: int, shards: int) -> None:
    """The pack: ``samples`` small JPEGs in ``shards`` tar shards (stager's writer), manifest v2."""
    sys.path.insert(0, str(ROOT))
    from tools.bench.bench_footprint import fabricate as write_pack  # the one writer of such packs

    part = out.with_name(out.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    write_pack(part, samples, -(-samples // shards))
    part.rename(out)


def probe(tree: Path, pack: Path, workers: int, phases: bool = False) -> dict[str, Any]:
    """One round: the probe in a fresh interpreter with ``tree`` first on its path (``phases``: with the
    workers' CPU timeline)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = PROBE.replace("HOOKS  #", textwrap.indent(HOOKS, "    ").strip() + "  #")
    with tempfile.TemporaryDirectory(prefix="stager-bench-startup-") as timeline:
        p = subprocess.run([sys.executable, "-c", code, str(pack), str(workers), *([timeline] if phases else [])],
                           capture_output=True, text=True, env=env, check=False, cwd=tempfile.gettempdir(), timeout=600)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{tree}: {(p.stderr.strip().splitlines() or ['failed'])[-1][:300]}")
    got = json.loads(lines[-1])
    if phases:
        got["worker_phases"] = [worker_phases(ev) for ev in got["worker_phases"]]
    return got


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds (and the spread of the headline figure)."""
    def med(get: Any) -> float:
        return round(statistics.median(get(r) for r in runs), 3)

    firsts = sorted(r["first_batch_s"] for r in runs)
    out: dict[str, Any] = {
        "rounds": len(runs),
        "first_batch_s": med(lambda r: r["first_batch_s"]),
        "first_batch_range_s": [round(firsts[0], 3), round(firsts[-1], 3)],
        "with_import_s": med(lambda r: r["with_import_s"]),
        "main_cpu_s": med(lambda r: r["main_cpu_s"]),
        "workers_cpu_s": med(lambda r: r["workers_cpu_s"]),
        "workers_minflt": int(med(lambda r: r["workers_minflt"])),
    }
    for phase in runs[0]["phases"]:
        out[f"{phase}_wall_s"] = med(lambda r, ph=phase: r["phases"][ph][0])
        out[f"{phase}_cpu_s"] = med(lambda r, ph=phase: r["phases"][ph][1])
    per_worker = [w for r in runs for w in r.get("worker_phases", [])]
    if per_worker:  # medians over every worker of every round
        out["worker_cpu_s"] = {k: round(statistics.median(w[k] for w in per_worker), 3) for k in per_worker[0]}
    return out


def measure(pack: Path, trees: list[Path], rounds: int, workers: int = 2, phases: bool = False
            ) -> dict[str, dict[str, Any]]:
    """``rounds`` interleaved rounds over ``trees`` (one probe each per round); medians per tree.

    Every tree is byte-compiled first (a tree run under ``PYTHONDONTWRITEBYTECODE`` would otherwise
    compile its modules in every round) and probed once unrecorded (page cache, shard mappings)."""
    for t in trees:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(t / "stager")], check=True,
                       capture_output=True)
        probe(t, pack, workers)
    runs: dict[str, list[dict[str, Any]]] = {str(t): [] for t in trees}
    for rnd in range(rounds):
        for t in trees:
            r = probe(t, pack, workers, phases)
            runs[str(t)].append(r)
            print(f"bench_startup: round {rnd + 1}/{rounds} {t}: first batch {r['first_batch_s']:.3f} s, "
                  f"workers {r['workers_cpu_s']:.2f} s CPU, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    return {t: summarize(rs) for t, rs in runs.items()}


def label(tree: str) -> str:
    """A tree as a table names it: this checkout or the directory, with its commit when it is a git checkout."""
    p = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    name = "this checkout" if Path(tree) == ROOT else Path(tree).name
    return f"{name} ({p.stdout.strip()})" if p.returncode == 0 and p.stdout.strip() else name


def table(res: dict[str, dict[str, Any]]) -> str:
    """A markdown table, one row per tree."""
    lines = ["| tree | first batch (median, range) | with import | import | make_loader | iter + first batch | "
             "main CPU | workers CPU | workers' minor faults |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for tree, s in res.items():
        lo, hi = s["first_batch_range_s"]
        lines.append(f"| {label(tree)} | **{s['first_batch_s']:.3f} s** ({lo:.2f}-{hi:.2f}) | "
                     f"{s['with_import_s']:.3f} s | "
                     f"{s['import_wall_s']:.3f} s | {s['make_loader_wall_s']:.3f} s | {s['first_wall_s']:.3f} s | "
                     f"{s['main_cpu_s']:.3f} s | {s['workers_cpu_s']:.2f} s | {s['workers_minflt']:,} |")
    if all("worker_cpu_s" in s for s in res.values()):
        lines += ["", "Per worker, CPU seconds up to its first batch (medians over every worker of every round):", "",
                  "| tree | set-up after fork | of which full garbage collections | plan | read schedule | "
                  "fetcher | first batch | total |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for tree, s in res.items():
            w = s["worker_cpu_s"]
            lines.append(f"| {label(tree)} | {w['setup']:.3f} | {w['gc']:.3f} | {w['plan']:.3f} | "
                         f"{w['schedule']:.3f} | {w['fetcher']:.3f} | {w['first']:.3f} | **{w['total']:.3f}** |")
    return "\n".join(lines)


def shown_args(argv: list[str]) -> str:
    """The command line as the markdown shows it: a machine's own paths (the pack's directory, the other
    checkouts) as ``<DIR>`` and ``<checkout at COMMIT>``."""
    out = []
    for a in argv:
        if a.startswith("/") and Path(a).is_dir():
            p = subprocess.run(["git", "-C", a, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                               check=False)
            out.append(f"<checkout at {p.stdout.strip()}>" if p.returncode == 0 and (Path(a) / "stager").is_dir()
                       else "<DIR>")
        else:
            out.append(a)
    return " ".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=1_281_167)
    ap.add_argument("--shards", type=int, default=14)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds; medians are reported")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--against", nargs="*", default=[], help="other stager source trees to measure alongside")
    ap.add_argument("--work", default=None, help="where the pack is written (default: a temp dir, removed after)")
    ap.add_argument("--keep", action="store_true", help="keep the pack in --work (and reuse it next time)")
    ap.add_argument("--budget", type=float, default=None, help="exit 1 when this tree's median exceeds it (s)")
    ap.add_argument("--phases", action="store_true",
                    help="also time each worker's phases (CPU: set-up, garbage collection, plan, reads, first batch)")
    ap.add_argument("--markdown", default=str(ROOT / "docs" / "bench" / "startup.md"))
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="stager-bench-startup-"))
    pack = work / f"tar-{args.samples}x{args.shards}"
    try:
        if not (pack / "manifest.json").exists():
            print(f"bench_startup: writing {pack}", file=sys.stderr, flush=True)
            fabricate(pack, args.samples, args.shards)
        trees = [ROOT, *(Path(t).resolve() for t in args.against)]
        res = measure(pack, trees, args.rounds, args.workers, args.phases)
    finally:
        if not args.keep:
            shutil.rmtree(pack, ignore_errors=True)
            if args.work is None:
                shutil.rmtree(work, ignore_errors=True)
    md = "\n".join([
        "### Loader start-up: first batch with worker processes",
        "",
        f"`python tools/bench/bench_startup.py {shown_args(argv if argv is not None else sys.argv[1:])}`: "
        f"{args.samples:,} samples in {args.shards} tar shards, {args.workers} workers, `decode=\"raw\"`, torch "
        f"imported first; medians of {args.rounds} interleaved rounds on {os.cpu_count()} cores "
        f"(1-minute load average {os.getloadavg()[0]:.1f} at the end). Seconds are wall time unless marked CPU.",
        "",
        table(res),
        "",
    ])
    Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
    Path(args.markdown).write_text(md)
    print(md)
    print(json.dumps({"samples": args.samples, "shards": args.shards, "workers": args.workers,
                      "cores": os.cpu_count(), "trees": res}, indent=1))
    mine = res[str(ROOT)]["first_batch_s"]
    if args.budget is not None and mine > args.budget:
        print(f"bench_startup: first batch {mine:.3f} s is over the budget of {args.budget} s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
