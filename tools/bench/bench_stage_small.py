"""Staging as a user times it (issue 40): whole commands on a cold source, each ending with ``sync``.

A user who wants to know what ``stager stage`` costs runs it next to ``cp -r`` and ``tar xf`` and
waits for the disk: ``stager stage SRC DEST && sync`` against ``cp -r SRC DEST && sync``. On the
small sets most people stage (CIFAR, a validation split, a fine-tuning set) the fixed costs decide:
interpreter start, imports, the lock, journal and receipt, the fsyncs. This benchmark measures
exactly that, per set, from ~85 MB to ~9 GB:

* ``stager stage``: ``python -m stager stage --json SRC DEST`` (verified and durable: the default),
  then ``sync``; with ``--against TREE`` the same command importing stager from another checkout
  (``git archive <commit> | tar -x -C TREE``: the "before" of a change), in the same rounds;
* ``stager stage --no-fsync``: the same without stager's own fsyncs, then ``sync`` (so the data is
  durable at the end of both): the share durability costs;
* ``cp -r SRC DEST``, then ``sync``;
* with ``--unpack``: ``stager stage --unpack`` (shards and an ImageFolder tree) and ``--unpack only``
  (the tree alone), then ``sync``, against ``tar xf`` of every shard into DEST, then ``sync``.

Method. Contenders run in turn, ``--rounds`` rounds (the order reversed every other round), so
every contender sees the same load; every figure is the median of its rounds, and a ratio is the
median of the per-round ratios. Before every run: the previous DEST is removed and ``sync`` run
(nothing of the last run left to write), the source files are dropped from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (cold source; ``fincore`` shows none of their pages left;
``echo 1 > /proc/sys/vm/drop_caches`` would drop every other job's cache too), and 1.25x the set's
bytes of memory are touched and freed (``bench_stage.prepare_pages``: on this VM freed memory goes
back to the host within seconds and the first touch of such a page costs a host fault; without
this, which contender got fast pages depended on which ran before it). Unpacked trees go into a
fresh directory each run, dropped from the page cache once synced (so that the trees of earlier runs
do not fill memory) and deleted after the set's last run (deleting many files right before a run slows
its creates: ``bench_stage.py``).

Each stager run reports its own phases (``StageResult.phases``; absent in trees before issue 40):
the in-process seconds of the plan, DEST checks, lock, journal, copy, seal (receipt), and what the
command spends outside them (interpreter start, imports, argument parsing, exit) is the command's
wall time less ``StageResult.seconds``.

    python tools/bench/bench_stage_small.py --rounds 5 [--sets c85 i317 i4g i9g] [--unpack]
        [--against /tmp/base] [--work DIR] [--json FILE] [--markdown FILE]

Sets (made once under ``--work`` by tools/datagen.py and ``stager pack``, 256 MiB tar shards, the
default): ``c85`` 20,000 CIFAR-like PNGs (~85 MB, one shard); ``i317`` 3,600 ImageNet-like JPEGs
(~317 MB, 2 shards); ``i4g`` 48,000 (~4.2 GB, 17 shards); ``i9g`` 100,800 (~8.9 GB, 34 shards). The
ImageNet-like sets are one 1,200-JPEG tree hard-linked K times under new names (``bench_stage.replicate``).
Disk: a set, plus one DEST at a time (unpack runs: one tree per run until the set's last run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.bench.bench_stage import prepare_pages, replicate  # noqa: E402

SETS: dict[str, tuple[str, int]] = {  # name: (kind, replication of the 1,200-JPEG tree)
    "c85": ("cifar", 0),
    "i317": ("imagenet", 3),
    "i4g": ("imagenet", 40),
    "i9g": ("imagenet", 84),
}


def make_set(name: str, work: Path) -> Path:
    """The packed set ``name`` under ``work`` (made, and packed in a child process, when missing)."""
    packed = work / name
    if (packed / "manifest.json").exists():
        return packed
    kind, k = SETS[name]
    from tools.datagen import make_cifar, make_imagefolder

    if kind == "cifar":
        tree = work / "cifar" / "cifar-png" / "train"
        if not tree.exists():
            make_cifar(work / "cifar", n_train=20_000, n_test=10, seed=0, png_folder=True)
    else:
        base = work / "inet"
        if not base.exists():
            make_imagefolder(base, num_classes=12, per_class=100, seed=0)
        tree = replicate(base, work / f"inet-x{k}", k)
    subprocess.run([sys.executable, "-m", "stager", "pack", "-q", str(tree), str(packed), "--format", "tar",
                    "--workers", "1"], check=True, cwd=ROOT)
    return packed


def drop_cache(paths: list[Path]) -> None:
    """Evict ``paths`` from the page cache (clean pages only: the caller syncs first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Runner:
    """Runs one whole command (and then ``sync``) on a cold source; returns its figures."""

    def __init__(self, src: Path, nbytes: int, pages: bool) -> None:
        self.src = src
        self.files = sorted(p for p in src.iterdir() if p.is_file())
        self.nbytes = nbytes
        self.pages = pages

    def prepare(self, dest: Path | None) -> None:
        if dest is not None:
            shutil.rmtree(dest, ignore_errors=True)
        os.sync()
        drop_cache(self.files)
        if self.pages:
            prepare_pages(self.nbytes)

    def run(self, cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
        c0, t0 = _children_cpu(), time.perf_counter()
        # cwd: not a checkout (``python -m`` puts the cwd first on sys.path, before PYTHONPATH).
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, cwd=self.src.parent)
        t1 = time.perf_counter()
        if out.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)}: exit {out.returncode}\n{out.stderr[-2000:]}")
        subprocess.run(["sync"], check=True)
        t2 = time.perf_counter()
        res: dict[str, Any] = {"s": t2 - t0, "command_s": t1 - t0, "sync_s": t2 - t1, "cpu_s": _children_cpu() - c0}
        if out.stdout.lstrip().startswith("{"):
            got = json.loads(out.stdout)
            res["inner_s"] = got.get("seconds")
            res["phases"] = got.get("phases") or {}
        return res


PYTHON = [sys.executable]  # the interpreter of the stager commands (--python)


def stager_cmd(tree: Path, *args: str) -> tuple[list[str], dict[str, str]]:
    """``python -m stager stage --json ARGS`` importing stager from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("STAGER_CACHE", None)
    return [PYTHON[0], "-m", "stager", "stage", "--json", *args], env


def check_tree(tree: Path, cwd: Path) -> None:
    """Byte-compile ``tree``'s stager (a user's install has its .pyc files; with
    ``PYTHONDONTWRITEBYTECODE`` set nothing would write them and every run would compile every module)
    and check that a run with its environment imports stager from it."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "stager")], check=True,
                   stdout=subprocess.DEVNULL)
    _, env = stager_cmd(tree)
    got = subprocess.run([PYTHON[0], "-c", "import stager; print(stager.__file__)"], env=env, cwd=cwd,
                         capture_output=True, text=True, check=True).stdout.strip()
    if Path(got).resolve().parent.parent != tree.resolve():
        raise SystemExit(f"a run meant for {tree} imports stager from {got}")


def contenders(src: Path, trees: dict[str, Path], unpack: bool) -> dict[str, Callable[[Path], tuple[list[str], Any]]]:
    """``{name: dest -> (argv, env)}`` for one set."""
    out: dict[str, Callable[[Path], tuple[list[str], Any]]] = {}
    for who, tree in trees.items():
        suffix = "" if who == "new" else f" ({who})"
        if not unpack:
            out[f"stager stage{suffix}"] = lambda d, t=tree: stager_cmd(t, str(src), str(d))
            if who == "new":
                out["stager stage --no-fsync"] = lambda d, t=tree: stager_cmd(t, "--no-fsync", str(src), str(d))
        else:
            for how in ("also", "only"):  # flags after SRC DEST would also do; --unpack takes an optional value
                label = f"stager stage --unpack{' only' if how == 'only' else ''}{suffix}"
                out[label] = lambda d, t=tree, h=how: stager_cmd(t, "--unpack", h, str(src), str(d))
    if not unpack:
        out["cp -r"] = lambda d: (["cp", "-r", str(src), str(d)], None)
    else:
        shards = " ".join(f"'{p}'" for p in sorted(src.glob("*.tar")))
        out["tar xf (every shard)"] = lambda d: (
            ["bash", "-c", f"mkdir '{d}' && for s in {shards}; do tar xf \"$s\" -C '{d}' || exit 1; done"], None)
    return out


def bench_set(name: str, src: Path, work: Path, trees: dict[str, Path], *, rounds: int, unpack: bool,
              pages: bool) -> dict[str, Any]:
    nbytes = sum(p.stat().st_size for p in src.iterdir())
    # What the largest contender writes: --unpack keeps the shards and writes the tree (twice the set).
    runner = Runner(src, 2 * nbytes if unpack else nbytes, pages)
    methods = contenders(src, trees, unpack)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in methods}
    loads = [os.getloadavg()[0]]
    made: list[Path] = []
    order = list(methods)
    for r in range(-1, rounds):  # round -1: warm-up (byte-compiles what each tree imports lazily), not counted
        for k in order if r % 2 == 0 else order[::-1]:
            dest = work / "runs" / f"{name}-{len(made)}"
            runner.prepare(None if unpack else dest)
            argv, env = methods[k](dest)
            got = runner.run(argv, env)
            if r >= 0:
                runs[k].append(got)
            if unpack:
                made.append(dest)
                # Kept (see above), but out of the page cache: the trees of earlier runs would otherwise pile
                # up in memory, and reclaiming them would slow whichever run writes the most.
                drop_cache([Path(r, f) for r, _, fs in os.walk(dest) for f in fs])
            else:
                shutil.rmtree(dest, ignore_errors=True)
        loads.append(os.getloadavg()[0])
    for d in made:
        shutil.rmtree(d, ignore_errors=True)
    ref = "tar xf (every shard)" if unpack else "cp -r"
    res: dict[str, Any] = {"bytes": nbytes, "shards": len(list(src.glob("*.tar"))), "load": [min(loads), max(loads)],
                           "reference": ref, "methods": {}}
    for k, rs in runs.items():
        row: dict[str, Any] = {
            "median_s": statistics.median(x["s"] for x in rs),
            "command_median_s": statistics.median(x["command_s"] for x in rs),
            "sync_median_s": statistics.median(x["sync_s"] for x in rs),
            "cpu_median_s": statistics.median(x["cpu_s"] for x in rs),
            "vs_reference": statistics.median(b["s"] / a["s"] for a, b in zip(rs, runs[ref], strict=True)),
            "over_reference_s": statistics.median(a["s"] - b["s"] for a, b in zip(rs, runs[ref], strict=True)),
            "runs_s": [round(x["s"], 3) for x in rs],
        }
        if rs and rs[0].get("inner_s") is not None:
            row["inner_median_s"] = statistics.median(x["inner_s"] for x in rs)
            row["outside_median_s"] = statistics.median(x["command_s"] - x["inner_s"] for x in rs)
            names = sorted({p for x in rs for p in x.get("phases", {})})
            row["phases_median_s"] = {p: statistics.median(x["phases"].get(p, 0.0) for x in rs) for p in names}
        res["methods"][k] = row
    return res


# The --profile child: ``stager stage SRC DEST`` as the CLI runs it, with its steps timed from outside the
# code (wrapped module functions: the same names in trees before and after issue 40), every fsync and
# thread counted. Prints one JSON object; the parent adds the interpreter's start and exit.
PROFILE_CHILD = r"""
import json, os, sys, threading, time
T0 = time.perf_counter()
import stager.cli as cli
try:
    parser = cli.build_parser(["stage"])  # only the stage command's parser, as `stager stage` builds it
except TypeError:  # a tree before that
    parser = cli.build_parser()
T1 = time.perf_counter()
import stager.stage.run as run, stager.stage.dest as dest, stager.stage.journal as journal, stager.fs.verified as v
T2 = time.perf_counter()
spent, calls = {}, {}
def wrap(owner, name, label):
    f = getattr(owner, name, None)
    if f is None:
        return
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
            calls[label] = calls.get(label, 0) + 1
    setattr(owner, name, timed)
for name, label in [("read_src_manifest", "manifest"), ("plan_stage", "plan"), ("make_dest_dir", "dest checks"),
                    ("_already_staged", "receipt check"), ("claim_dest", "claim"), ("begin_journal", "journal begin"),
                    ("kept_files", "resume"), ("check_free_space", "free space"), ("_copy", "copy phase"),
                    ("_unpack", "unpack phase"), ("_seal", "seal (receipt)"), ("confirm_staged", "confirm"),
                    ("_remember", "history")]:
    wrap(run, name, label)
wrap(run.NodeLock, "__enter__", "lock")
wrap(run.NodeLock, "__exit__", "unlock")
wrap(dest.StagedManifest, "prepare", "staged manifest (beside the copy)")
wrap(journal.Journal, "close", "journal close")
wrap(v.PartialCopy, "publish", "publish: fsync + rename (finishers)")
wrap(os, "fsync", "fsync (every call)")
wrap(threading.Thread, "start", "threads started")
args = parser.parse_args(["stage", "-q", *sys.argv[1:]])
args.quiet = True
T3 = time.perf_counter()
args.func(args)
T4 = time.perf_counter()
print(json.dumps({"imports cli": T1 - T0, "imports stage": T2 - T1, "run": T4 - T3, "in script": T4 - T0,
                  "spent": spent, "calls": calls, "numpy": "numpy" in sys.modules, "modules": len(sys.modules)}))
# Leave as the tree's `stager stage` would (cli.entry: os._exit when nothing is left for teardown).
if hasattr(cli, "entry") and cli._nothing_left_at_exit():
    os._exit(0)
"""


def profile(name: str, src: Path, work: Path, trees: dict[str, Path], *, rounds: int, unpack: bool) -> dict[str, Any]:
    """Where ``stager stage`` of set ``name`` spends its time, per tree: medians over ``rounds`` cold runs
    (interleaved) of the interpreter's start and exit, imports, and each step (:data:`PROFILE_CHILD`)."""
    nbytes = sum(p.stat().st_size for p in src.iterdir())
    runner = Runner(src, 2 * nbytes if unpack else nbytes, True)
    runs: dict[str, list[dict[str, Any]]] = {who: [] for who in trees}
    extra = ["--unpack", "also"] if unpack else []
    made: list[Path] = []
    for r in range(-1, rounds):
        for who in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            d = work / "runs" / f"profile-{name}-{who}-{r}"
            runner.prepare(d)
            env = {**os.environ, "PYTHONPATH": str(trees[who])}
            t = time.perf_counter()
            out = subprocess.run([PYTHON[0], "-c", PROFILE_CHILD, *extra, str(src), str(d)], env=env, cwd=work,
                                 capture_output=True, text=True, check=True)
            wall = time.perf_counter() - t
            got = json.loads(out.stdout.splitlines()[-1])
            got["start and exit"] = wall - got["in script"]
            got["wall"] = wall
            if r >= 0:
                runs[who].append(got)
            if unpack:  # kept until the end, out of the page cache (as in bench_set)
                made.append(d)
                drop_cache([Path(q, f) for q, _, fs in os.walk(d) for f in fs])
            else:
                shutil.rmtree(d, ignore_errors=True)
    for d in made:
        shutil.rmtree(d, ignore_errors=True)
    res: dict[str, Any] = {}
    for who, rs in runs.items():
        keys = ["wall", "start and exit", "imports cli", "imports stage", "run"]
        row = {k: statistics.median(x[k] for x in rs) for k in keys}
        steps = sorted({k for x in rs for k in x["spent"]})
        row["steps"] = {k: statistics.median(x["spent"].get(k, 0.0) for x in rs) for k in steps}
        row["calls"] = {k: statistics.median(x["calls"].get(k, 0) for x in rs) for k in steps}
        row["numpy"], row["modules"] = rs[0]["numpy"], rs[0]["modules"]
        res[who] = row
    return res


def profile_markdown(name: str, prof: dict[str, Any]) -> str:
    whos = list(prof)
    lines = [f"| {name}: ms (median) | " + " | ".join(whos) + " |", "| --- |" + " ---: |" * len(whos)]
    for k in ["wall", "start and exit", "imports cli", "imports stage", "run"]:
        lines.append(f"| {k} | " + " | ".join(f"{prof[w][k] * 1000:.1f}" for w in whos) + " |")
    steps = sorted({k for w in whos for k in prof[w]["steps"]})
    for k in steps:
        cells = []
        for w in whos:
            t, n = prof[w]["steps"].get(k), prof[w]["calls"].get(k)
            cells.append("" if t is None else (f"{n:g}" if k == "threads started" else f"{t * 1000:.1f} ({n:g}x)"))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append("| numpy imported, modules | " + " | ".join(f"{prof[w]['numpy']}, {prof[w]['modules']}" for w in whos)
                 + " |")
    return "\n".join(lines) + "\n"


def interpreter_start(rounds: int) -> dict[str, float]:
    """Medians of ``python -c pass`` and of importing what ``stager stage`` imports (this tree)."""
    cases = {"python -c pass": "pass",
             "python -c 'import stager.cli; build_parser(); import stager.stage.run'":
             "import stager.cli as c; c.build_parser(); import stager.stage.run"}
    out = {}
    for label, code in cases.items():
        ts = []
        for _ in range(max(rounds, 5)):
            t = time.perf_counter()
            subprocess.run([PYTHON[0], "-c", code], check=True, cwd=ROOT)
            ts.append(time.perf_counter() - t)
        out[label] = statistics.median(ts)
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = ["# Staging as a user times it (tools/bench/bench_stage_small.py)", "",
             f"Conditions: {res['conditions']}", "",
             "| set | MB | shards | contender | s (median) | command s | sync s | vs reference | over reference s "
             "| stager in-process s | outside s (start, imports, exit) | CPU s |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in res["sets"].items():
        for k, m in r["methods"].items():
            inner = f"{m['inner_median_s']:.3f}" if "inner_median_s" in m else ""
            outside = f"{m['outside_median_s']:.3f}" if "outside_median_s" in m else ""
            lines.append(f"| {name} | {r['bytes'] / 1e6:.0f} | {r['shards']} | {k} | {m['median_s']:.3f} | "
                         f"{m['command_median_s']:.3f} | {m['sync_median_s']:.3f} | {m['vs_reference']:.2f}x | "
                         f"{m['over_reference_s']:+.3f} | {inner} | {outside} | {m['cpu_median_s']:.3f} |")
    lines += ["", "Phases (median; stager runs that report them):", ""]
    for name, r in res["sets"].items():
        for k, m in r["methods"].items():
            if m.get("phases_median_s"):
                ph = ", ".join(f"{p} {v * 1000:.1f} ms" for p, v in m["phases_median_s"].items())
                lines.append(f"- {name}, {k}: {ph}")
    lines += ["", f"Command: `python tools/bench/bench_stage_small.py {res['args']}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--sets", nargs="+", default=["c85", "i317"], choices=list(SETS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--unpack", action="store_true", help="--unpack and --unpack only vs tar xf of every shard")
    ap.add_argument("--against", action="append", default=[], metavar="TREE",
                    help="another stager checkout run in the same rounds (repeatable)")
    ap.add_argument("--work", default="/tmp/stager-bench-stage-small", help="scratch directory, kept and reused")
    ap.add_argument("--pages", choices=["warm", "none"], default="warm")
    ap.add_argument("--keep-sets", action="store_true", help="keep the packed sets (default: delete the large ones)")
    ap.add_argument("--profile", action="store_true",
                    help="where the time goes instead (per tree: start, imports, each step; --unpack: of --unpack)")
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter of the stager commands (e.g. a venv with a non-editable install: no "
                    "editable-install finder at start-up)")
    ap.add_argument("--json", default=None, help="write the raw figures here")
    ap.add_argument("--markdown", default=None, help="write the table here")
    args = ap.parse_args()
    PYTHON[0] = args.python
    work = Path(args.work)
    (work / "runs").mkdir(parents=True, exist_ok=True)
    trees = {"new": ROOT, **{Path(t).name or t: Path(t).resolve() for t in args.against}}
    res: dict[str, Any] = {"sets": {}, "args": " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
                           "python": platform.python_version(), "start": interpreter_start(args.rounds)}
    for tree in trees.values():
        check_tree(tree, work)
    if args.profile:
        profs = {name: profile(name, make_set(name, work), work, trees, rounds=args.rounds, unpack=args.unpack)
                 for name in args.sets}
        md = "\n".join(profile_markdown(n, p) for n, p in profs.items())
        print(md)
        if args.json:
            Path(args.json).write_text(json.dumps(profs, indent=1))
        if args.markdown:
            Path(args.markdown).write_text(md)
        return
    for name in args.sets:
        src = make_set(name, work)
        res["sets"][name] = bench_set(name, src, work, trees, rounds=args.rounds, unpack=args.unpack,
                                      pages=args.pages == "warm")
        print(json.dumps({name: res["sets"][name]}, indent=1), flush=True)
        if not args.keep_sets and SETS[name][1] >= 40:
            shutil.rmtree(src, ignore_errors=True)
    loads = [x for r in res["sets"].values() for x in r["load"]]
    res["conditions"] = (f"{os.cpu_count()} CPUs, Python {res['python']}, {args.rounds} interleaved rounds, load "
                         f"average {min(loads):.1f}-{max(loads):.1f}; source dropped from the page cache before "
                         f"every run (posix_fadvise DONTNEED); python -c pass "
                         f"{res['start']['python -c pass'] * 1000:.0f} ms")
    md = markdown(res)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(md)


if __name__ == "__main__":
    main()
