"""Packing small sets (issue 40): ``stager pack`` against MDSWriter and webdataset, each in a fresh fork.

Most sets people pack are small (CIFAR, a fine-tuning set, a validation split), so the fixed and
per-file costs decide. This benchmark times what a new user would try, with every tool's defaults
(stager's 256 MiB shards, MDSWriter's 64 MiB, webdataset's 3 GB), on two ImageFolder trees made by
tools/datagen.py: 20,000 CIFAR-like 32x32 PNGs (~2.5 KB) and 3,000 ImageNet-like JPEGs (~85 KB).

Method. For each family of contenders (stager's, MDSWriter's, webdataset's) one server process
imports what that family needs (stager's pack with its formats and h5py; MosaicML streaming;
webdataset) and reads every source file once (warm page cache); no contender inherits another's
imports (streaming loads torch: a process that forks pack workers would fork torch's pages too).
In ``--rounds`` interleaved rounds the bench asks the servers in turn; for every request a server
forks one fresh child, which times the job from the source directory to finished output (listing
included, imports not: they happened before the fork, for every contender alike) and reports its
wall time, and the server takes the child's CPU time (user + system, of the child and of the
workers it waited for) from ``os.wait4``. Reported: medians over the rounds. On a shared machine
CPU per sample is the figure to judge a change by; wall time needs a quiet one. stager's rows also
report its phases (``PackResult.phases``: list, plan, resume, write, publish) and, with
``--workers 2``, each worker's CPU seconds (``PackResult.workers_cpu``) and the serial part: the
phases in which the parent works alone (plan, resume, publish and what no phase covers), as a
share of the wall time.

``cat (1 process)`` and ``cat (2 processes)`` are the reference for ``--workers 2``: they read and
write the same bytes (the class folders' files, catted into one file per process and fsynced) with
nothing else to do, so their ratio is what a second process can buy on the machine at hand.

``stager pack`` (whole command) runs the CLI in a new interpreter (``python -m stager pack``), so it
adds interpreter start-up and imports to the in-process figure.

    python tools/bench/bench_pack_small.py --rounds 5 [--work DIR] [--sets cifar imagenet]
        [--only 'stager tar' MDSWriter ...] [--json FILE] [--markdown FILE]

prints the Markdown tables of docs/benchmarks.md ("Packing small sets (issue 40)"), writes them to
docs/bench/pack_small.md (``make bench`` splices that in) and, with ``--json``, the raw figures.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import resource
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
# A baseline server (--baseline DIR) imports stager from another checkout: the same bench, other code.
TREE = Path(os.environ.get("STAGER_BENCH_TREE") or ROOT)
if TREE != ROOT:
    sys.path.insert(0, str(TREE))
BASELINE = " (baseline)"  # the suffix of a contender run from --baseline's tree

from tools.datagen import make_cifar, make_imagefolder  # noqa: E402

SETS = {
    "cifar": "CIFAR-like PNG, 20,000 files",
    "imagenet": "ImageNet-like JPEG, 3,000 files",
}


def make_set(name: str, work: Path) -> Path:
    """The source tree of set ``name`` under ``work`` (made by tools/datagen.py when missing)."""
    if name == "cifar":
        src = work / "cifar" / "cifar-png" / "train"
        if not src.exists():
            make_cifar(work / "cifar", n_train=20_000, n_test=10, seed=0, png_folder=True)
        return src
    src = work / "imagenet"
    if not src.exists():
        make_imagefolder(src, num_classes=20, per_class=150, seed=0)
    return src


def list_imagefolder(root: Path) -> list[tuple[str, Path, int]]:
    """``(key, path, label)`` of every file, sorted, labels from sorted class folders: what a user of
    MDSWriter or webdataset writes first (the listing is part of their timed job, as it is of stager's)."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    out = []
    for label, c in enumerate(classes):
        for f in sorted((root / c).iterdir()):
            out.append((f"{c}/{f.stem}", f, label))
    return out


def run_mds(src: Path, out: Path) -> dict[str, Any]:
    from streaming import MDSWriter  # type: ignore[import-not-found]

    items = list_imagefolder(src)
    with MDSWriter(out=str(out), columns={"image": "bytes", "label": "int"}) as w:
        for _, path, label in items:
            w.write({"image": path.read_bytes(), "label": label})
    return {"samples": len(items)}


def run_webdataset(src: Path, out: Path) -> dict[str, Any]:
    import webdataset as wds  # type: ignore[import-not-found]

    items = list_imagefolder(src)
    out.mkdir(parents=True)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), verbose=0) as w:
        for key, path, label in items:
            w.write({"__key__": key, path.suffix.lower().lstrip("."): path.read_bytes(), "cls": label})
    return {"samples": len(items)}


def run_stager(fmt: str, workers: int) -> Callable[[Path, Path], dict[str, Any]]:
    def run(src: Path, out: Path) -> dict[str, Any]:
        from stager.pack import pack

        r = pack(str(src), str(out), fmt, workers=workers)
        # getattr: a baseline tree may predate the phases (issue 40).
        return {"samples": r.samples, "phases": getattr(r, "phases", {}),
                "workers_cpu": sorted(getattr(r, "workers_cpu", {}).values())}

    return run


def run_cat(procs: int) -> Callable[[Path, Path], dict[str, Any]]:
    """The reference for ``--workers``: ``cat`` the class folders' files into ``procs`` files, one
    ``cat`` process each (process ``k`` takes the ``k``-th run of class folders, its shell lists them),
    then fsync them (durable, as stager's shards are). Reading and writing the same bytes with no
    format, hash or plan: how much faster ``procs`` processes copy them on this machine than one."""
    def run(src: Path, out: Path) -> dict[str, Any]:
        classes = sorted(d.name for d in src.iterdir() if d.is_dir())
        out.mkdir(parents=True)
        parts = [out / f"part-{k}" for k in range(procs)]
        cmds = [" ".join(f"'{c}'/*" for c in classes[k * len(classes) // procs:(k + 1) * len(classes) // procs])
                for k in range(procs)]
        ps = [subprocess.Popen(f"exec cat {cmd} > '{part}'", shell=True, cwd=src)
              for cmd, part in zip(cmds, parts, strict=True)]
        if any(p.wait() != 0 for p in ps):
            raise RuntimeError("cat failed")
        for part in parts:
            fd = os.open(part, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return {}

    return run


CONTENDERS: dict[str, Callable[[Path, Path], dict[str, Any]]] = {
    "stager tar": run_stager("tar", 1),
    "stager hdf5": run_stager("hdf5", 1),
    "stager tar --workers 2": run_stager("tar", 2),
    "stager hdf5 --workers 2": run_stager("hdf5", 2),
    "MDSWriter": run_mds,
    "webdataset ShardWriter": run_webdataset,
    "cat (1 process)": run_cat(1),
    "cat (2 processes)": run_cat(2),
}
# Each second row's speed against the first's (median wall): what a second process buys.
SCALING = (("stager tar", "stager tar --workers 2"), ("stager hdf5", "stager hdf5 --workers 2"),
           ("cat (1 process)", "cat (2 processes)"))
PEERS = ("MDSWriter", "webdataset ShardWriter")
WHOLE = "stager pack (whole command, tar)"
IMPORTS = [
    "stager.pack",
    "stager.pack.workers",
    "stager.fs.lustre",
    "stager.formats.tar",
    "stager.formats.hdf5",
    "h5py",  # the hdf5 writer imports it on first use; the peers' imports are not timed either
    "webdataset",
]


FAMILIES = {"stager": IMPORTS[:-1], "mds": [], "webdataset": ["webdataset"], "cat": []}


def family(label: str) -> str:
    """Which server runs contender ``label`` (a baseline contender: the baseline tree's stager server;
    the whole command runs in a new interpreter, no server)."""
    if label.removesuffix(BASELINE) == WHOLE:
        return "whole"
    if label.endswith(BASELINE):
        return "baseline"
    return "mds" if label == "MDSWriter" else label.split(maxsplit=1)[0]


def preimport(fam: str) -> bool:
    """Import family ``fam``'s modules here, before any fork; whether they are all there."""
    try:
        for mod in FAMILIES[fam]:
            importlib.import_module(mod)
    except ImportError:
        return False
    if fam == "mds":
        from tools.bench.bench_shard_writers import import_streaming

        return import_streaming()
    return True


def serve(fam: str) -> int:
    """A family's server: import it, then per request line ``{"label", "src", "out"}`` on stdin fork
    one child (:func:`run_forked`) and answer one JSON line on stdout."""
    ok = preimport(fam)
    print(json.dumps({"ready": ok}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        res = run_forked(CONTENDERS[req["label"]], Path(req["src"]), Path(req["out"]))
        print(json.dumps(res), flush=True)
    return 0


class Server:
    """The bench's handle on one family's server process."""

    def __init__(self, fam: str, tree: Path = ROOT) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", fam], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(tree), "STAGER_BENCH_TREE": str(tree)},
        )
        assert self.proc.stdout is not None
        self.ok = bool(json.loads(self.proc.stdout.readline() or '{"ready": false}')["ready"])

    def run(self, label: str, src: Path, out: Path) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        label = label.removesuffix(BASELINE)
        self.proc.stdin.write(json.dumps({"label": label, "src": str(src), "out": str(out)}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline() or '{"error": "server died"}')

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):  # a server that died already
                self.proc.stdin.close()
        self.proc.wait()


def run_forked(fn: Callable[[Path, Path], dict[str, Any]], src: Path, out: Path) -> dict[str, Any]:
    """Run ``fn(src, out)`` in a child forked from this process: its result, wall seconds (timed in
    the child) and CPU seconds (``wait4``: the child and the workers it waited for)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: time the job, report, leave without running the parent's exit handlers
        os.close(r)
        code = 0
        try:
            t = time.perf_counter()
            res = fn(src, out)
            res["wall"] = time.perf_counter() - t
            if res.get("phases"):  # what the phases do not cover: pack()'s set-up, the pool's shutdown
                res["phases"]["other"] = res["wall"] - sum(res["phases"].values())
        except BaseException as exc:
            res, code = {"error": f"{type(exc).__name__}: {exc}"[:300]}, 1
        os.write(w, json.dumps(res).encode())
        os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    _, _, ru = os.wait4(pid, 0)
    res = json.loads(b"".join(chunks) or b'{"error": "child died"}')
    res["cpu"] = ru.ru_utime + ru.ru_stime
    res["sys"] = ru.ru_stime
    return res


def run_whole_command(src: Path, out: Path, tree: Path = ROOT) -> dict[str, Any]:
    """``python -m stager pack SRC OUT --format tar`` (stager from ``tree``) in a new interpreter: wall
    and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "stager", "pack", str(src), str(out), "--format", "tar", "-q"],
        capture_output=True, text=True, check=False, env={**os.environ, "PYTHONPATH": str(tree)},
    )
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall": wall, "cpu": cpu, "sys": after.ru_stime - before.ru_stime}


def warm(src: Path) -> tuple[int, int]:
    """Read every file of ``src`` once; ``(files, bytes)``."""
    n = total = 0
    for dirpath, _, files in os.walk(src):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                total += len(fh.read())
            n += 1
    return n, total


def bench_set(name: str, src: Path, work: Path, rounds: int, labels: list[str], *,
              servers: dict[str, Server], baseline: Path | None = None) -> dict[str, Any]:
    nfiles, nbytes = warm(src)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    errors: dict[str, str] = {}
    loads = []
    for _ in range(rounds):  # interleaved: every contender sees the same spread of machine load
        for label in labels:
            if label in errors:
                continue
            out = work / f"out-{name}"
            shutil.rmtree(out, ignore_errors=True)
            loads.append(os.getloadavg()[0])
            if label.removesuffix(BASELINE) == WHOLE:
                res = run_whole_command(src, out, baseline if label.endswith(BASELINE) and baseline else ROOT)
            else:
                res = servers[family(label)].run(label, src, out)
            shutil.rmtree(out, ignore_errors=True)
            if "error" in res:
                errors[label] = res["error"]
                continue
            if "samples" in res and res["samples"] != nfiles:
                errors[label] = f"packed {res['samples']} of {nfiles} files"
                continue
            runs[label].append(res)
    rows: dict[str, Any] = {}
    for label in labels:
        rs = runs[label]
        if not rs:
            rows[label] = {"error": errors.get(label, "not run")}
            continue
        wall = statistics.median(r["wall"] for r in rs)
        cpu = statistics.median(r["cpu"] for r in rs)
        row: dict[str, Any] = {
            "wall_s": round(wall, 4),
            "cpu_s": round(cpu, 4),
            "sys_s": round(statistics.median(r["sys"] for r in rs), 4),
            "us_per_sample": round(wall / nfiles * 1e6, 2),
            "cpu_us_per_sample": round(cpu / nfiles * 1e6, 2),
            "runs": len(rs),
        }
        phases = [r["phases"] for r in rs if r.get("phases")]
        if phases:
            row["phases"] = {k: round(statistics.median(p.get(k, 0.0) for p in phases), 4) for k in phases[0]}
            # The parent alone: every phase but listing (on the pool with workers) and writing.
            serial = [sum(v for k, v in p.items() if k not in ("list", "write")) / r["wall"]
                      for p, r in zip(phases, rs, strict=True)]
            row["serial_share"] = round(statistics.median(serial), 3)
        cpus = [r["workers_cpu"] for r in rs if r.get("workers_cpu")]
        if cpus:
            row["workers_cpu_s"] = [round(statistics.median(c[i] for c in cpus if len(c) > i), 3)
                                    for i in range(max(map(len, cpus)))]
        rows[label] = row
    _ratios(rows)
    return {"files": nfiles, "bytes": nbytes, "load_avg_1min": [min(loads), max(loads)] if loads else None,
            "rows": rows}


def _ratios(rows: dict[str, Any]) -> None:
    """Each row's speed against the fastest peer (median wall) and its CPU against the leanest; the
    second row of each :data:`SCALING` pair, its speed against the first."""
    peers = [rows[p] for p in PEERS if p in rows and "wall_s" in rows[p]]
    if peers:
        fastest = min(p["wall_s"] for p in peers)
        leanest = min(p["cpu_s"] for p in peers)
        for r in rows.values():
            if "wall_s" in r:
                r["speed_vs_fastest_peer"] = round(fastest / r["wall_s"], 2)
                r["cpu_vs_leanest_peer"] = round(r["cpu_s"] / leanest, 2)
    for one, two in [*SCALING, *((a + BASELINE, b + BASELINE) for a, b in SCALING)]:
        w1, w2 = rows.get(one, {}), rows.get(two, {})
        if "wall_s" in w1 and "wall_s" in w2:
            w2["speed_vs_one"] = round(w1["wall_s"] / w2["wall_s"], 2)


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio}x"


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"`{res['command']}`; {res['machine']}; medians of {res['rounds']} interleaved rounds, each contender in "
        "a child forked after the imports.",
        "",
    ]
    for name, s in res["sets"].items():
        load = s["load_avg_1min"]
        lines += [
            f"**{SETS[name]}** ({s['bytes'] / 1e6:,.1f} MB; 1-minute load average {load[0]:.1f}-{load[1]:.1f}):",
            "",
            "| contender | wall s | CPU s (sys) | CPU us/sample | speed vs fastest peer | CPU vs leanest peer |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for label, r in s["rows"].items():
            if "error" in r:
                lines.append(f"| {label} | not run: {r['error']} | | | | |")
                continue
            extra = f" ({r['speed_vs_one']}x one process)" if "speed_vs_one" in r else ""
            lines.append(
                f"| {label} | {r['wall_s']:.3f} | {r['cpu_s']:.3f} ({r['sys_s']:.3f}) | {r['cpu_us_per_sample']:.1f} | "
                f"{_x(r.get('speed_vs_fastest_peer'))}{extra} | {_x(r.get('cpu_vs_leanest_peer'))} |"
            )
        phased = {label: r["phases"] for label, r in s["rows"].items() if "phases" in r}
        if phased:
            keys = list(next(iter(phased.values())))
            lines += ["", "| stager phases, ms (median) | " + " | ".join(keys) + " |",
                      "| --- |" + " ---: |" * len(keys)]
            for label, ph in phased.items():
                lines.append(f"| {label} | " + " | ".join(f"{ph.get(k, 0.0) * 1e3:.1f}" for k in keys) + " |")
        for label, r in s["rows"].items():
            if "workers_cpu_s" in r:
                lines += ["", f"{label}: CPU seconds per worker {', '.join(map(str, r['workers_cpu_s']))}; the parent "
                              f"alone (plan, resume, publish, other) {r['serial_share'] * 100:.0f}% of the wall time."]
        lines.append("")
    return "\n".join(lines)


def _profile_once(src: Path, fmt: str, out: Path) -> tuple[dict[str, float], int]:
    """One pack of ``src`` with its phases called one by one (as :func:`stager.pack.pack` does): the
    CPU seconds of each, and the samples packed."""
    from stager.pack.api import PackRun
    from stager.pack.options import PackOptions

    shutil.rmtree(out, ignore_errors=True)
    run = PackRun(out, PackOptions(format=fmt), None, time.perf_counter())
    cpu: dict[str, float] = {}
    c = time.process_time()
    listing = run.list_source(src, run.check())
    cpu["list"], c = time.process_time() - c, time.process_time()
    plan = run.plan(listing)
    cpu["plan"], c = time.process_time() - c, time.process_time()
    kept = run.resume(listing, plan)
    cpu["resume"], c = time.process_time() - c, time.process_time()
    done = run.write(listing, plan, kept)
    cpu["write"], c = time.process_time() - c, time.process_time()
    result = run.publish(listing, plan, kept, done)
    cpu["publish"] = time.process_time() - c
    shutil.rmtree(out, ignore_errors=True)
    return cpu, result.samples


def phase_profile(src: Path, fmt: str, runs: int, out: Path) -> dict[str, float]:
    """CPU microseconds per sample of each phase of packing ``src`` to ``fmt`` in this process, the
    least of ``runs`` runs: the profile docs/benchmarks.md compares before and after (run it on
    another tree with ``PYTHONPATH``). Least, not median: contention only ever adds CPU time."""
    best: dict[str, float] = {}
    samples = 1
    for _ in range(runs):
        cpu, samples = _profile_once(src, fmt, out)
        for k, v in cpu.items():
            best[k] = min(best.get(k, v), v)
    res = {k: round(v / samples * 1e6, 2) for k, v in best.items()}
    res["total"] = round(sum(res.values()), 2)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians are reported)")
    p.add_argument("--work", default="/tmp/stager-bench-pack-small", help="where the sets and outputs go (kept)")
    p.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS))
    p.add_argument("--only", nargs="+", choices=[*CONTENDERS, WHOLE], default=[*CONTENDERS, WHOLE])
    p.add_argument("--json", default=None, help="also write the raw figures here")
    p.add_argument("--markdown", default=str(ROOT / "docs" / "bench" / "pack_small.md"),
                   help="write the tables here too (make bench splices it into docs/benchmarks.md)")
    p.add_argument("--baseline", metavar="DIR", default=None,
                   help="also run stager's contenders from the checkout at DIR (e.g. a worktree of main), interleaved")
    p.add_argument("--serve", choices=list(FAMILIES), help=argparse.SUPPRESS)  # a family's server (internal)
    p.add_argument("--phase-profile", type=int, metavar="RUNS", default=0,
                   help="instead: CPU us/sample of each pack phase in this process, least of RUNS runs")
    args = p.parse_args(argv)
    if args.serve:
        return serve(args.serve)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.phase_profile:
        prof = {f"{name} {fmt}": phase_profile(make_set(name, work), fmt, args.phase_profile, work / "out-profile")
                for name in args.sets for fmt in ("tar", "hdf5")}
        print(json.dumps(prof, indent=1))
        return 0
    only = list(args.only)
    if args.baseline:  # each stager contender of --only, then the same from the baseline tree
        only = [x for lb in only for x in ([lb, lb + BASELINE] if family(lb) in ("stager", "whole") else [lb])]
    servers = {fam: Server(fam) for fam in {family(lb) for lb in only} if fam not in ("baseline", "whole")}
    if args.baseline:
        servers["baseline"] = Server("stager", Path(args.baseline).resolve())
    try:
        missing = sorted(fam for fam, sv in servers.items() if not sv.ok)
        labels = [lb for lb in only if family(lb) == "whole" or family(lb) not in missing]
        res: dict[str, Any] = {
            "command": "python tools/bench/bench_pack_small.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "rounds": args.rounds,
            "missing": missing,
            "sets": {name: bench_set(name, make_set(name, work), work, args.rounds, labels, servers=servers,
                                     baseline=Path(args.baseline).resolve() if args.baseline else None)
                     for name in args.sets},
        }
    finally:
        for sv in servers.values():
            sv.close()
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    text = markdown(res)
    print(text)
    if args.markdown:
        head = "# Packing small sets (issue 40)\n\nGenerated by `tools/bench/bench_pack_small.py`: "
        Path(args.markdown).write_text(head + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
