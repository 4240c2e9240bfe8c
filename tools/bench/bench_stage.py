"""Staging throughput vs the tools people use instead, measured in the same run, runs alternating.

For an ImageNet-like set (JPEGs of ~90 KB) and a CIFAR-like set (PNGs of ~2 KB), packed into tar
shards with ``stager pack``:

* ``stage``: ``stager.stage.stage(packed, DEST)``: parallel copy with xxh3 verification, every
  shard fsynced before its rename, receipt;
* ``cp``: ``cp -r`` of the same packed directory (no verification; nothing is durable when it
  returns: the data sits in the page cache);
* ``cp+sync``: ``cp -r`` then ``sync DEST DEST/*`` (fsync of every file and the directory: the
  durability stage gives);
* ``unpack``: ``stage --unpack only``: shards streamed, verified and written as an ImageFolder tree;
* ``tar xf``: GNU tar extracting one tar of the same image tree (the Alliance Canada recipe);
* ``cp tree``: ``cp -r`` of the original small-file tree.

Ratios (targets in the issue): stage/cp bytes/s >= 0.8; unpack/tar-xf files/s >= 1.0; staged shards
vs ``cp -r`` of the tree in samples/s >= 10 for CIFAR-like data.

Measuring on a busy machine: methods run alternately (stage, cp, cp+sync, stage, ...) for
``--rounds`` rounds; each figure is the best of its rounds (the run least disturbed by others),
with the median alongside, and a ratio is also given as the median of per-round ratios (the two
runs of a round saw similar load). CPU seconds per GB (user+system of the process and its
children) is a second, less load-sensitive figure. The load average is recorded. The page cache
cannot be dropped here (no root), so sources are read hot and DEST is on the same disk: this
measures the CPU/syscall/fsync cost of each method, which is what separates them on node-local
NVMe. ``--scale K`` replicates the ImageNet-like tree K times (hard links, distinct keys) so the
shard bytes are large enough that fixed costs (manifest, lock, receipt, a few fsyncs) stop
dominating; the small set is also reported.

``--sweep`` adds block size (1-8 MiB) x streams (1-8) for the verified copy; ``--engines`` compares
the copy engine's variants (O_DIRECT vs buffered; for buffered: fsync inline vs finisher threads,
write-behind on/off).

``--unpack-only`` runs only ``stage --unpack only`` vs ``tar xf`` vs ``tar xf`` + ``sync -f`` (the
durability unpack gives: one syncfs) and rewrites only its own section of the markdown. Every run
extracts into a **fresh directory**; all are deleted at the end. (Deleting the previous run's tree
right before a run, as ``alternate`` does, makes ext4 without a journal skip each recently deleted
inode one by one in ``find_inode_bit``/``recently_deleted`` for ~30 s: measured here, that put
~0.9 ms of kernel time on every file created, ten times the cost of the create itself, for both
methods alike.)

Usage: ``python tools/bench/bench_stage.py [--small] [--rounds 5] [--scale 10] [--sweep] [--engines]
[--unpack-only]``
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stager.fs.copy import CopyTuning  # noqa: E402
from stager.pack import pack  # noqa: E402
from stager.stage import stage  # noqa: E402
from tools.datagen import make_cifar, make_imagefolder  # noqa: E402

ENGINES = {
    # The first engine: each stream fsyncs and renames its own file, no write-behind.
    "buffered, inline fsync": CopyTuning(window=-1, sync_threads=0, direct=False),
    "buffered, finishers": CopyTuning(window=-1, direct=False),
    "buffered, write-behind": CopyTuning(sync_threads=0, direct=False),
    "buffered, write-behind + finishers (default)": CopyTuning(),
    "O_DIRECT + finishers (--direct)": CopyTuning(direct=True),
}


def _count(tree: Path) -> tuple[int, int]:
    n = b = 0
    for r, _d, files in os.walk(tree):
        for f in files:
            n += 1
            b += os.path.getsize(os.path.join(r, f))
    return n, b


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _run(cmd: list[str] | str) -> None:
    subprocess.run(cmd, check=True, shell=isinstance(cmd, str))


PAGES = {"warm": "every run starts right after 1.25x its bytes of memory were touched and freed (hot "
                 "pages, as on bare metal)",
         "cold": "every run starts 3 s after the previous run's files were deleted (the hypervisor has "
                 "taken the freed pages back; every new page-cache page faults on the host)"}
SETTINGS = {"pages": "warm"}  # --pages


def prepare_pages(nbytes: int) -> None:
    """Put every method in the same memory state before it runs (see :data:`PAGES`).

    This VM returns freed guest memory to the host (virtio-balloon free page reporting, ~2 s after
    the free): the first touch of such a page then costs a host fault, ~2.4 ms per MB measured here,
    which caps a fresh page-cache copy at ~0.5 GB/s. Whether a run gets hot or cold pages depended on
    what ran just before it (a buffered copy's freed pages are hot for the next run; an O_DIRECT
    copy frees none), so without this the ratios were an artefact of the order of the methods.
    """
    if SETTINGS["pages"] == "cold":
        time.sleep(3)
    elif SETTINGS["pages"] == "warm":
        import numpy as np

        # Never more than is free (the sources must stay in the page cache): MemAvailable - 2 GiB.
        avail = _meminfo("MemAvailable") - (2 << 30)
        a = np.empty(max(0, min(int(nbytes * 1.25), avail)), np.uint8)
        a[:: mmap.PAGESIZE] = 1  # touch every page, then hand them all back to the guest's free lists
        del a


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def alternate(methods: dict[str, Callable[[], object]], dest: Path, rounds: int, nbytes: int = 0
              ) -> dict[str, list[tuple[float, float]]]:
    """Run every method once per round, in turn; return ``{method: [(seconds, cpu seconds), ...]}``.

    ``nbytes``: what one run writes (sizes the page warm-up of :func:`prepare_pages`).
    """
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            shutil.rmtree(dest, ignore_errors=True)
            os.sync()  # start each run without other runs' dirty pages pending
            prepare_pages(nbytes)
            c, t = _cpu(), time.perf_counter()
            fn()
            out[name].append((time.perf_counter() - t, _cpu() - c))
    shutil.rmtree(dest, ignore_errors=True)
    return out


def summarize(runs: dict[str, list[tuple[float, float]]], amount: float, per: str) -> dict[str, dict[str, Any]]:
    """Per method: best and median rate (``amount`` per second) and CPU seconds per ``per``."""
    res: dict[str, dict[str, Any]] = {}
    for name, v in runs.items():
        ts = [t for t, _ in v]
        cs = [c for _, c in v]
        res[name] = {"best": amount / min(ts), "median": amount / statistics.median(ts),
                     f"cpu_s_per_{per}": min(cs) / amount, f"cpu_s_per_{per}_median": statistics.median(cs) / amount,
                     "runs_s": [round(t, 4) for t in ts]}
    return res


def paired(runs: dict[str, list[tuple[float, float]]], a: str, b: str) -> float:
    """Median over rounds of (rate of a) / (rate of b) = time of b / time of a."""
    return statistics.median(tb / ta for (ta, _), (tb, _) in zip(runs[a], runs[b], strict=True))


def copy_methods(packed: Path, dest: Path, workers: int | None) -> dict[str, Callable[[], object]]:
    return {
        "stage": lambda: stage(packed, dest, workers=workers),
        "cp": lambda: _run(["cp", "-r", str(packed), str(dest)]),
        "cp+sync": lambda: _run(f"cp -r '{packed}' '{dest}' && sync '{dest}' '{dest}'/*"),
        "stage --direct": lambda: stage(packed, dest, workers=workers, tuning=CopyTuning(direct=True)),
        "stage --no-fsync": lambda: stage(packed, dest, workers=workers, fsync=False),
    }


def bench_copy(packed: Path, dest: Path, rounds: int, workers: int | None, *, large: bool = False
               ) -> dict[str, Any]:
    nbytes = sum(p.stat().st_size for p in packed.iterdir())
    methods = copy_methods(packed, dest, workers)
    if large:  # minutes per round: the variants that matter most
        del methods["stage --direct"]
    runs = alternate(methods, dest, rounds, nbytes)
    s = summarize(runs, nbytes / 1e9, "GB")
    return {
        "bytes": nbytes, "shards": len(list(packed.glob("*.tar"))), "GBps": s,
        "paired": {k: paired(runs, k, "cp") for k in runs},
        "stage_vs_cp_best": s["stage"]["best"] / s["cp"]["best"],
        "stage_vs_cp_paired_median": paired(runs, "stage", "cp"),
        "stage_vs_cp_sync_best": s["stage"]["best"] / s["cp+sync"]["best"],
        "stage_vs_cp_sync_paired_median": paired(runs, "stage", "cp+sync"),
    }


def bench_files(name: str, tree: Path, packed: Path, work: Path, *, rounds: int, workers: int | None
                ) -> dict[str, Any]:
    """--unpack only vs tar xf (files/s) and staged shards vs cp -r of the tree (samples/s)."""
    files, _ = _count(tree)
    tarball = work / f"{name}-tree.tar"
    if not tarball.exists():
        _run(["tar", "cf", str(tarball), "-C", str(tree.parent), tree.name])
    dest = work / "dest"

    def tar_x() -> None:
        dest.mkdir()
        _run(["tar", "xf", str(tarball), "-C", str(dest)])

    runs = alternate({
        "stage": lambda: stage(packed, dest, workers=workers),
        "cp tree": lambda: _run(["cp", "-r", str(tree), str(dest)]),
        "unpack": lambda: stage(packed, dest, workers=workers, unpack="only"),
        "tar xf": tar_x,
    }, dest, rounds, sum(p.stat().st_size for p in packed.iterdir()))
    s = summarize(runs, files, "file")
    return {
        "files": files, "per_s": s,
        "unpack_vs_tar_xf_best": s["unpack"]["best"] / s["tar xf"]["best"],
        "unpack_vs_tar_xf_paired_median": paired(runs, "unpack", "tar xf"),
        "shards_vs_tree_best": s["stage"]["best"] / s["cp tree"]["best"],
        "shards_vs_tree_paired_median": paired(runs, "stage", "cp tree"),
    }


def bench_unpack(name: str, tree: Path, packed: Path, work: Path, *, rounds: int, workers: int | None
                 ) -> dict[str, Any]:
    """--unpack only vs tar xf vs tar xf + sync -f (files/s), each run into a fresh directory."""
    files, _ = _count(tree)
    tarball = work / f"{name.replace(' ', '_')}-tree-deref.tar"
    if not tarball.exists():  # the x{scale} tree is hard links: tar would store (and extract) links
        _run(["tar", "cf", str(tarball), "--hard-dereference", "-C", str(tree.parent), tree.name])
    # Deleted by the caller after every set has run: a delete just before a run slows it (see above).
    nbytes = sum(p.stat().st_size for p in packed.iterdir())
    runs_dir = work / "unpack-runs" / name.replace(" ", "_")
    runs_dir.mkdir(parents=True)

    def tar_x(d: Path, sync: bool) -> None:
        d.mkdir()
        _run(["tar", "xf", str(tarball), "-C", str(d)])
        if sync:
            _run(["sync", "-f", str(d)])

    methods: dict[str, Callable[[Path], object]] = {
        "unpack": lambda d: stage(packed, d, workers=workers, unpack="only"),
        "unpack --no-fsync": lambda d: stage(packed, d, workers=workers, unpack="only", fsync=False),
        "tar xf": lambda d: tar_x(d, False),
        "tar xf+sync": lambda d: tar_x(d, True),
    }
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in methods}
    for r in range(rounds):
        for k in list(methods) if r % 2 == 0 else list(methods)[::-1]:  # cancel drift within a round
            d = runs_dir / f"{k.replace(' ', '_').replace('+', '_')}-{r}"
            os.sync()
            prepare_pages(nbytes)
            c, t = _cpu(), time.perf_counter()
            methods[k](d)
            runs[k].append((time.perf_counter() - t, _cpu() - c))
    per_s: dict[str, dict[str, Any]] = {
        k: {"best": files / min(t for t, _ in v), "median": files / statistics.median(t for t, _ in v),
            "cpu_s_per_1000_files": 1000 * min(c for _, c in v) / files,
            "cpu_s_per_1000_files_median": 1000 * statistics.median(c for _, c in v) / files,
            "runs_s": [round(t, 4) for t, _ in v]} for k, v in runs.items()}
    return {"files": files, "per_s": per_s,
            "unpack_vs_tar_xf_best": per_s["unpack"]["best"] / per_s["tar xf"]["best"],
            "unpack_vs_tar_xf_paired_median": paired(runs, "unpack", "tar xf"),
            "unpack_vs_tar_xf_sync_best": per_s["unpack"]["best"] / per_s["tar xf+sync"]["best"],
            "unpack_vs_tar_xf_sync_paired_median": paired(runs, "unpack", "tar xf+sync"),
            "unpack_nofsync_vs_tar_xf_best": per_s["unpack --no-fsync"]["best"] / per_s["tar xf"]["best"],
            "unpack_nofsync_vs_tar_xf_paired_median": paired(runs, "unpack --no-fsync", "tar xf")}


UNPACK_START, UNPACK_END = "<!-- unpack-only:start -->", "<!-- unpack-only:end -->"


def write_unpack_md(path: Path, res: dict[str, Any]) -> None:
    """Replace (or append) the marked --unpack-only section of ``path``; the rest is left alone."""
    lines = [UNPACK_START, "## --unpack only vs tar xf (fresh directory per run)", "",
             f"Conditions: {res['conditions']}", "",
             "`tar xf` returns with the files in the page cache only; `tar xf+sync` adds `sync -f` (one "
             "syncfs: the durability `--unpack` gives before its receipt). Files/s best of the rounds "
             "(median in brackets); ratios best-of and median of per-round ratios; CPU = user+system "
             "seconds per 1,000 files of the process and its children, best (median): kernel write-back "
             "threads are not counted, for either.", "",
             "`unpack --no-fsync` returns like `tar xf` (files in the page cache, journal and receipt marked "
             "with the boot id).", "",
             "| set | files | unpack files/s | unpack --no-fsync | tar xf files/s | tar xf+sync files/s | "
             "unpack/tar xf best | paired | --no-fsync/tar xf best | paired | "
             "unpack/(tar xf+sync) best | paired | CPU s/1k unpack | CPU s/1k tar xf |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res["unpack"].items():
        p = r["per_s"]

        def cell(k: str, p: dict[str, Any] = p) -> str:
            return f"{p[k]['best']:,.0f} ({p[k]['median']:,.0f})"

        def cpu(k: str, p: dict[str, Any] = p) -> str:
            return f"{p[k]['cpu_s_per_1000_files']:.3f} ({p[k]['cpu_s_per_1000_files_median']:.3f})"

        lines.append(
            f"| {name} | {r['files']} | {cell('unpack')} | {cell('unpack --no-fsync')} | {cell('tar xf')} | "
            f"{cell('tar xf+sync')} | "
            f"{r['unpack_vs_tar_xf_best']:.2f}x | {r['unpack_vs_tar_xf_paired_median']:.2f}x | "
            f"{r['unpack_nofsync_vs_tar_xf_best']:.2f}x | {r['unpack_nofsync_vs_tar_xf_paired_median']:.2f}x | "
            f"{r['unpack_vs_tar_xf_sync_best']:.2f}x | {r['unpack_vs_tar_xf_sync_paired_median']:.2f}x | "
            f"{cpu('unpack')} | {cpu('tar xf')} |")
    lines += ["", f"Command: `python tools/bench/bench_stage.py --unpack-only {res['args']}`", UNPACK_END]
    replace_section(path, UNPACK_START, UNPACK_END, "\n".join(lines))


def bench_sweep(packed: Path, dest: Path, rounds: int) -> dict[str, Any]:
    nbytes = sum(p.stat().st_size for p in packed.iterdir())
    methods: dict[str, Callable[[], object]] = {"cp": lambda: _run(["cp", "-r", str(packed), str(dest)])}
    for mib in (1, 2, 4, 8):
        for w in (1, 2, 4, 8):
            methods[f"{mib}MiB x{w}"] = functools.partial(stage, packed, dest, workers=w,
                                                         tuning=CopyTuning(block=mib << 20))
    runs = alternate(methods, dest, rounds, nbytes)
    s = summarize(runs, nbytes / 1e9, "GB")
    return {k: {**v, "vs_cp_paired_median": paired(runs, k, "cp")} for k, v in s.items()}


def bench_engines(packed: Path, dest: Path, rounds: int, workers: int | None) -> dict[str, Any]:
    nbytes = sum(p.stat().st_size for p in packed.iterdir())
    methods: dict[str, Callable[[], object]] = {"cp": lambda: _run(["cp", "-r", str(packed), str(dest)])}
    for name, tuning in ENGINES.items():
        methods[name] = functools.partial(stage, packed, dest, workers=workers, tuning=tuning)
    runs = alternate(methods, dest, rounds, nbytes)
    s = summarize(runs, nbytes / 1e9, "GB")
    return {k: {**v, "vs_cp_paired_median": paired(runs, k, "cp")} for k, v in s.items()}


def replicate(tree: Path, out: Path, k: int) -> Path:
    """``out``: ``tree``'s class folders with every file hard-linked ``k`` times under new names."""
    if out.exists():
        return out
    for cls in sorted(p for p in tree.iterdir() if p.is_dir()):
        (out / cls.name).mkdir(parents=True)
        for f in sorted(cls.iterdir()):
            for i in range(k):
                target = out / cls.name / f"r{i}_{f.name}"
                try:
                    os.link(f, target)
                except OSError:
                    shutil.copyfile(f, target)
    return out


MAIN_START, MAIN_END = "<!-- stage-main:start -->", "<!-- stage-main:end -->"


def replace_section(path: Path, start: str, end: str, section: str) -> None:
    """Replace the ``start``..``end`` marked part of ``path`` with ``section`` (which carries the
    markers), or append it; everything else in the file (analysis written by hand) is kept."""
    old = path.read_text() if path.exists() else "# Staging benchmark (tools/bench/bench_stage.py)\n"
    if start in old and end in old:
        head, rest = old.split(start, 1)
        new = head + section + rest.split(end, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def write_md(path: Path, res: dict[str, Any]) -> None:
    lines = [MAIN_START, "## Verified copy vs cp (bytes/s)", "", f"Conditions: {res['conditions']}.",
             f"Memory state: {PAGES[res['pages']]}.", "",
             "`cp` returns with the data only in the page cache; `cp+sync` and `stage` return with every "
             "file fsynced; `stage --direct` writes with O_DIRECT (and fsyncs); `stage --no-fsync` returns "
             "like `cp` (verified, renamed, not fsynced). GB/s best of the rounds (median in brackets); "
             "ratios are medians of per-round ratios (the runs of a round saw the same load); CPU = "
             "user+system seconds per GB, best.", "",
             "| set | GB | cp | cp+sync | stage | stage --direct | stage --no-fsync | stage/cp | "
             "--direct/cp | --no-fsync/cp | stage/(cp+sync) | CPU s/GB cp, stage, direct, no-fsync |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res["copy"].items():
        g, pr = r["GBps"], r["paired"]

        def cell(k: str, g: dict[str, Any] = g) -> str:
            return f"{g[k]['best']:.2f} ({g[k]['median']:.2f})" if k in g else "-"

        def ratio(k: str, pr: dict[str, float] = pr) -> str:
            return f"{pr[k]:.2f}x" if k in pr else "-"

        cpus = ", ".join(f"{g[k]['cpu_s_per_GB']:.2f}" if k in g else "-"
                         for k in ("cp", "stage", "stage --direct", "stage --no-fsync"))
        lines.append(
            f"| {name} | {r['bytes'] / 1e9:.2f} | {cell('cp')} | {cell('cp+sync')} | {cell('stage')} | "
            f"{cell('stage --direct')} | {cell('stage --no-fsync')} | {ratio('stage')} | "
            f"{ratio('stage --direct')} | {ratio('stage --no-fsync')} | {r['stage_vs_cp_sync_paired_median']:.2f}x | "
            f"{cpus} |")
    lines += ["", "## Files: --unpack only vs tar xf, staged shards vs cp -r of the tree", "",
              "Each run here deletes the previous run's files first; on this ext4 that slows every file "
              "create for a while (see the --unpack-only section, which extracts into fresh directories).", "",
              "| set | files | unpack files/s | tar xf files/s | unpack/tar xf best | paired | stage samples/s | "
              "cp -r tree samples/s | shards/tree best | paired |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res["files"].items():
        p = r["per_s"]
        lines.append(
            f"| {name} | {r['files']} | {p['unpack']['best']:,.0f} | {p['tar xf']['best']:,.0f} | "
            f"{r['unpack_vs_tar_xf_best']:.2f}x | {r['unpack_vs_tar_xf_paired_median']:.2f}x | "
            f"{p['stage']['best']:,.0f} | {p['cp tree']['best']:,.0f} | {r['shards_vs_tree_best']:.1f}x | "
            f"{r['shards_vs_tree_paired_median']:.1f}x |")
    for key, title in (("engines", "Copy engine variants"), ("sweep", "Block size x streams")):
        if key not in res:
            continue
        lines += ["", f"## {title} ({res['big_set']})", "",
                  "| variant | GB/s best (median) | vs cp paired | CPU s/GB best (median) |", "|---|---|---|---|"]
        for k, v in res[key].items():
            lines.append(f"| {k} | {v['best']:.2f} ({v['median']:.2f}) | {v['vs_cp_paired_median']:.2f}x | "
                         f"{v['cpu_s_per_GB']:.2f} ({v['cpu_s_per_GB_median']:.2f}) |")
    lines += ["", "Targets: stage/cp >= 0.8x; unpack/tar xf >= 1.0x; CIFAR-like shards/tree >= 10x.", "",
              f"Command: `python tools/bench/bench_stage.py {res['args']}`", MAIN_END]
    replace_section(path, MAIN_START, MAIN_END, "\n".join(lines))


def _args_for_doc(argv: list[str]) -> str:
    """The command line as a reader would rerun it: without ``--out``/``--work`` and their values."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--out", "--work"):
            skip = True
        elif not a.startswith(("--out=", "--work=")):
            out.append(a)
    return " ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny sets, 2 rounds (smoke run)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scale", type=int, default=None,
                    help="replicas of the ImageNet-like tree for the large set (default 10; 2 with --unpack-only)")
    ap.add_argument("--large", type=int, default=0, metavar="K",
                    help="also copy-benchmark the ImageNet-like tree replicated K times (K=100: 8.9 GB, more "
                    "than this VM's dirty-page limit, so cp too must wait for the disk; default: skip)")
    ap.add_argument("--workers", type=int, default=None, help="copy streams (default: stage's default)")
    ap.add_argument("--sweep", action="store_true", help="block size x streams sweep on the large set")
    ap.add_argument("--engines", action="store_true", help="copy engine variants on the large set")
    ap.add_argument("--unpack-only", action="store_true",
                    help="only --unpack only vs tar xf (fresh directory per run); rewrites only that section")
    ap.add_argument("--pages", choices=sorted(PAGES), default="warm",
                    help="memory state every run starts in (see prepare_pages; default warm)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "stage.md"))
    ap.add_argument("--work", default=None, help="scratch directory, kept and reused (default: a temp dir)")
    args = ap.parse_args()
    SETTINGS["pages"] = args.pages
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_stage_"))
    work.mkdir(parents=True, exist_ok=True)
    rounds = 2 if args.small else args.rounds
    scale = 2 if args.small else args.scale or (2 if args.unpack_only else 10)
    load0 = os.getloadavg()
    try:
        per_class = 10 if args.small else 100
        inet = work / "imagenet" / "train"
        if not inet.exists():
            make_imagefolder(inet, num_classes=10, per_class=per_class, seed=0)
        cifar = work / "cifar" / "cifar-png" / "train"
        if not cifar.exists():
            make_cifar(work / "cifar", n_train=2000 if args.small else 20000, n_test=10, seed=0, png_folder=True)
        big = replicate(inet, work / f"imagenet-x{scale}" / "train", scale)
        sets = {"imagenet-like": inet, f"imagenet-like x{scale}": big, "cifar-like": cifar}
        if args.large and not args.unpack_only:
            sets[f"imagenet-like x{args.large}"] = replicate(inet, work / f"imagenet-x{args.large}" / "train",
                                                             args.large)
        packed = {}
        for name, tree in sets.items():
            packed[name] = work / f"{name.replace(' ', '_')}-packed"
            if not (packed[name] / "manifest.json").exists():
                pack(tree, packed[name], format="tar", shard_size=64 << 20, workers=1)
        for p in packed.values():  # hot page cache for every source, as in every run after the first
            _run(f"cat '{p}'/* > /dev/null")
        dest = work / "dest"
        if args.unpack_only:
            ures: dict[str, Any] = {"unpack": {}}
            if (work / "unpack-runs").exists():  # a crashed run's leftovers: delete, let ext4 forget them
                shutil.rmtree(work / "unpack-runs", ignore_errors=True)
                time.sleep(35)
            try:
                for name, tree in sets.items():
                    ures["unpack"][name] = bench_unpack(name, tree, packed[name], work, rounds=rounds,
                                                        workers=args.workers)
            finally:
                os.sync()
                shutil.rmtree(work / "unpack-runs", ignore_errors=True)
            load1 = os.getloadavg()
            ures["conditions"] = (
                f"hot page cache, source and DEST on the same local disk ({Path(work).resolve()}), "
                f"{os.cpu_count()} CPUs, workers={args.workers or 'default'}, {rounds} alternating rounds "
                f"(order reversed every other round), load average {load0[0]:.1f} at start, {load1[0]:.1f} at end")
            ures["args"] = _args_for_doc([a for a in sys.argv[1:] if a != "--unpack-only"])
            ures["load_average"] = {"start": load0, "end": load1}
            write_unpack_md(Path(args.out), ures)
            print(json.dumps(ures, indent=1))
            return
        res: dict[str, Any] = {"copy": {}, "files": {}, "big_set": f"imagenet-like x{scale}"}
        for name in sets:
            res["copy"][name] = bench_copy(packed[name], dest, rounds, args.workers,
                                           large=name == f"imagenet-like x{args.large}")
        for name in ("imagenet-like", "cifar-like"):
            res["files"][name] = bench_files(name, sets[name], packed[name], work, rounds=rounds, workers=args.workers)
        if args.engines:
            res["engines"] = bench_engines(packed[res["big_set"]], dest, rounds, args.workers)
        if args.sweep:
            res["sweep"] = bench_sweep(packed[res["big_set"]], dest, max(2, rounds // 2))
        load1 = os.getloadavg()
        res["conditions"] = (
            f"hot page cache (cannot drop caches here), source and DEST on the same local disk "
            f"({Path(work).resolve()}), {os.cpu_count()} CPUs, workers={args.workers or 'default'}, "
            f"{rounds} alternating rounds, load average {load0[0]:.1f} at start, {load1[0]:.1f} at end")
        res["load_average"] = {"start": load0, "end": load1}
        res["pages"] = args.pages
        res["args"] = _args_for_doc(sys.argv[1:])
        write_md(Path(args.out), res)
        print(json.dumps(res, indent=1))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
