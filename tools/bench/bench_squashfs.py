"""SquashFS as a stager format (issue 41): the four figures, side by side, interleaved rounds, medians.

    python tools/bench/bench_squashfs.py [--classes 10 --per-class 200] [--rounds 3]
        [--big-classes 1000 --big-per-class 1281] [--tiny-classes 20]
        [--epoch-classes 20 --epoch-per-class 1000] [--work /tmp/stager-bench-squashfs]
        [--only read,mount,epoch,pack,index] [--baseline /path/to/main]

1. **Read**: stager's loader (``make_loader``, ``decode="raw"``, one epoch, shuffled, in process)
   over the same ImageNet-like JPEGs in tar shards, in uncompressed images (``stager pack --format
   squashfs --compression none``; and ``mksquashfs -noI -noD -noF -noX -no-fragments`` adopted with
   ``stager index``), and in a zstd image of mksquashfs's defaults (fragments, every block tried:
   the samples are read by inode and decompressed in process). Samples/s and CPU microseconds per
   sample (the process's user + sys, and its workers'), from the loader's creation to the epoch's end.
   Then the same over samples that are all decompressed: tiny JPEGs (``--tiny-classes`` folders of the
   ImageNet-sized tree, ~1 KB each) in a tar and in a zstd image of mksquashfs's defaults, where every
   sample sits in a compressed fragment block.
2. **Against a mount**: each image (zstd, and uncompressed) mounted with squashfuse and read the way
   users read it today, a torch ``DataLoader`` over an ImageFolder-like dataset (one ``open()``/``read()``
   per file, shuffled, batches of the files' bytes), in process and with 2 workers, against stager's
   loader over the same image (adopted in place) with 0 and 2 workers. A fresh mount per epoch (its
   page cache goes with it, as a job's would); the squashfuse daemon's CPU is counted with the reader's.
   Twice: over the small tree, where starting 2 workers weighs on both sides of a sub-second epoch, and
   over a realistic epoch (``--epoch-classes x --epoch-per-class``, default 20,000 ImageNet-like JPEGs).
   Both scripts import torch and run a full garbage collection before their clock starts: the one torch's
   import leaves due (~0.05-0.15 s over its ~170,000 objects) would otherwise land in whichever side
   first imports or allocates long-lived objects (stager's loader, importing the format's modules).
3. **Pack**: ``stager pack TREE OUT --format squashfs --compression C`` (a fresh process: listing,
   plan, hashing, one image, fsynced) against ``mksquashfs TREE IMG -comp C`` (every core, its
   defaults; for ``none`` ``-noI -noD -noF -noX -no-fragments``, the layout the pack writes), wall,
   CPU and image bytes; and against mksquashfs followed by ``sync IMG``, the same image made durable
   as the pack's is when it returns.
4. **Index**: ``stager index IMG --out DIR`` of an ImageNet-sized image (1,281,000 ~1 KB JPEGs, made by
   mksquashfs once and cached under ``--work``, shared with bench_squashfs_codec.py) against
   ``unsquashfs -l IMG``, and the loader's first batch (256 samples) over the index, in a fresh
   process (imports excluded, loader creation included).

The machine's load is printed with the tables; CPU seconds are steadier than wall time on a busy box.
Every child runs with stager's bytecode compiled first (as a pip install leaves it; a development
checkout run with ``PYTHONDONTWRITEBYTECODE`` would recompile every module in every process).
Writes docs/bench/squashfs.md, prints its tables, then one JSON object. ``--only`` runs some of the
figures (``read`` is both read tables, ``mount`` the small tree's mount table, ``epoch`` the realistic
epoch's) and prints their tables without rewriting docs/bench/squashfs.md, which holds all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

from tools.datagen import make_imagefolder, make_tiny_imagefolder  # noqa: E402

PY = sys.executable
# Children import stager from this checkout, with its bytecode cached (compiled once in main()).
ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONPATH": str(ROOT)}
# What each measured stager runs: this checkout, and with --baseline another one (e.g. main), side by side.
CODES: dict[str, dict[str, str]] = {"": ENV}
# Children run from here: `python -c` and `-m` put their working directory first on sys.path, which from
# a checkout would import that checkout's stager whatever PYTHONPATH says.
NEUTRAL = tempfile.gettempdir()


def tagged(name: str, code: str) -> str:
    return f"{name} ({code})" if code else name

LOADER = """
import gc, json, resource, sys, time
import torch  # imported before the clock starts, as in the mount reader's script
from stager.loader import Loader, make_loader
path, workers = sys.argv[1], int(sys.argv[2])
def cpu():
    return sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
gc.collect()  # the full collection torch's import leaves due would land in whichever side allocates first
c0 = cpu()
t = time.perf_counter()
ld = make_loader(path, 256, rank=0, world_size=1, decode="raw", staged=False, num_workers=workers,
                 multiprocessing_context="fork", seed=1)
n = sum(len(b["key"]) for b in ld)
ld.close()
wall = time.perf_counter() - t
print(json.dumps({"n": n, "wall": wall, "cpu": cpu() - c0}))
"""

# What users do today: an ImageFolder-like Dataset over the mount, one open()/read() per file, batches of
# the files' bytes through a torch DataLoader (its workers send them to the training process).
MOUNT_READ = """
import gc, json, os, resource, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
root, workers = sys.argv[1], int(sys.argv[2])
def cpu():
    return sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))

class Files(Dataset):
    def __init__(self, root):
        self.paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
    def __len__(self):
        return len(self.paths)
    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return f.read()

gc.collect()  # as in the loader's script
c0 = cpu()
t = time.perf_counter()
dl = DataLoader(Files(root), batch_size=256, shuffle=True, num_workers=workers, collate_fn=list,
                generator=torch.Generator().manual_seed(1), multiprocessing_context="fork" if workers else None)
n = sum(len(b) for b in dl)
wall = time.perf_counter() - t
print(json.dumps({"n": n, "wall": wall, "cpu": cpu() - c0}))
"""

FIRST_BATCH = """
import json, sys, time
from stager.loader import make_numpy_loader
t = time.perf_counter()
ld = make_numpy_loader(sys.argv[1], 256, rank=0, world_size=1, decode="raw", staged=False, num_workers=0, seed=1)
b = next(iter(ld))
print(json.dumps({"first_batch": time.perf_counter() - t, "n": len(b["key"])}))
"""


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run(cmd: list[str], stdout: Any = subprocess.DEVNULL, env: dict[str, str] = ENV) -> tuple[float, float, str]:
    """``(wall s, CPU s of the child, its stdout)``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(cmd, check=True, stdout=subprocess.PIPE if stdout is None else stdout, text=True, env=env,
                       cwd=NEUTRAL)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), r.stdout or ""


def stager(*args: str | Path) -> None:
    subprocess.run([PY, "-m", "stager", *map(str, args), "-q"], check=True, env=ENV, cwd=NEUTRAL)


def mksquashfs(src: Path, out: Path, *opts: str) -> Path:
    out.unlink(missing_ok=True)
    subprocess.run(["mksquashfs", str(src), str(out), "-noappend", "-quiet", "-no-progress", *opts], check=True,
                   stdout=subprocess.DEVNULL)
    return out


def adopt(image: Path, out: Path) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    stager("index", image, "--out", out)
    return out


def measured(script: str, *args: str | Path, env: dict[str, str] = ENV) -> dict[str, float]:
    _, _, out = run([PY, "-c", script, *map(str, args)], stdout=None, env=env)
    return json.loads(out.strip().splitlines()[-1])


def bench_read(tree: Path, work: Path, rounds: int) -> list[dict[str, Any]]:
    """Figure 1: the loader's raw read of every sample, per dataset."""
    sets: dict[str, Path] = {}
    for name, fmt, extra in (("tar", "tar", ()), ("stager squashfs, none", "squashfs", ("--compression", "none"))):
        out = work / f"read-{name.replace(' ', '-').replace(',', '')}"
        shutil.rmtree(out, ignore_errors=True)
        stager("pack", tree, out, "--format", fmt, "--shard-size", "64M", *extra)
        sets[name] = out
    sets["mksquashfs uncompressed, adopted"] = adopt(
        mksquashfs(tree, work / "read-plain.sqfs", "-noI", "-noD", "-noF", "-noX", "-no-fragments"), work / "idx-plain")
    sets["mksquashfs zstd, adopted"] = adopt(mksquashfs(tree, work / "read-zstd.sqfs", "-comp", "zstd"),
                                             work / "idx-zstd")
    return read_rows(sets, rounds)


def read_rows(sets: dict[str, Path], rounds: int) -> list[dict[str, Any]]:
    """The loader over each of ``sets`` in process, each code in turn, interleaved rounds; rates
    against the first set (tar) read by this checkout."""
    got: dict[str, list[dict[str, float]]] = {}
    for _ in range(rounds):
        for name, path in sets.items():
            for code, env in CODES.items():
                got.setdefault(tagged(name, code), []).append(measured(LOADER, path, "0", env=env))
    rows = []
    tar_rate = 0.0
    for name, runs in got.items():
        n = runs[0]["n"]
        rate = n / med([r["wall"] for r in runs])
        tar_rate = tar_rate or rate
        rows.append({"dataset": name, "samples": n, "samples_per_s": rate, "x_tar": rate / tar_rate,
                     "cpu_us_per_sample": 1e6 * med([r["cpu"] for r in runs]) / n})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def _daemon_cpu(point: Path) -> float:
    """CPU seconds the squashfuse process serving ``point`` has used (it decompresses for the reader)."""
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"squashfuse" in cmd[0] and str(point).encode() in cmd:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue
    return 0.0


def _through_mount(image: Path, work: Path, workers: int) -> dict[str, float]:
    """One epoch read through a fresh squashfuse mount (cold: its page cache goes with the mount), with
    the daemon's CPU added to the reader's."""
    point = Path(tempfile.mkdtemp(prefix="sqfs-mnt-", dir=work))
    subprocess.run(["squashfuse", "-o", "ro", str(image), str(point)], check=True)
    try:
        before = _daemon_cpu(point)
        got = measured(MOUNT_READ, point, str(workers))
        got["cpu"] += _daemon_cpu(point) - before
    finally:
        subprocess.run(["fusermount3", "-u", str(point)], check=False)
        point.rmdir()
    return got


def bench_mount(images: dict[str, tuple[Path, Path]], work: Path, rounds: int) -> list[dict[str, Any]]:
    """Figure 2: each image through a squashfuse mount (open/read per file) vs stager's loader over it
    (``images``: label -> (image, its index))."""
    if shutil.which("squashfuse") is None or shutil.which("fusermount3") is None:
        print("squashfuse: skipped (apt-get install squashfuse fuse3)", file=sys.stderr)
        return []
    rows = []
    for label, (image, index) in images.items():
        got: dict[tuple[str, int], list[dict[str, float]]] = {}
        for _ in range(rounds):
            for workers in (0, 2):
                got.setdefault(("squashfuse mount, open/read per file", workers), []).append(
                    _through_mount(image, work, workers))
                for code, env in CODES.items():
                    got.setdefault((tagged("stager loader over the image", code), workers), []).append(
                        measured(LOADER, index, str(workers), env=env))
        for workers in (0, 2):
            base = got[("squashfuse mount, open/read per file", workers)]
            base_rate = base[0]["n"] / med([r["wall"] for r in base])
            for (name, w), runs in got.items():
                if w != workers:
                    continue
                rate = runs[0]["n"] / med([r["wall"] for r in runs])
                rows.append({"image": label, "reader": name, "workers": workers, "samples": runs[0]["n"],
                             "samples_per_s": rate, "x_mount": rate / base_rate,
                             "cpu_us_per_sample": 1e6 * med([r["cpu"] for r in runs]) / runs[0]["n"]})
                print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def epoch_images(work: Path, classes: int, per_class: int) -> dict[str, tuple[Path, Path]]:
    """A realistic epoch's tree (ImageNet-like JPEGs, made once under ``work``), its zstd image of
    mksquashfs's defaults and its uncompressed one, each adopted with stager index."""
    tree = work / f"jpeg-{classes}x{per_class}"
    if not tree.with_name(tree.name + ".done").exists():
        shutil.rmtree(tree, ignore_errors=True)
        make_imagefolder(tree, classes, per_class)
        tree.with_name(tree.name + ".done").touch()
    out = {}
    for label, name, opts in (("zstd (mksquashfs defaults)", "zstd", ("-comp", "zstd")),
                              ("uncompressed", "plain", ("-noI", "-noD", "-noF", "-noX", "-no-fragments"))):
        image = work / f"epoch-{classes}x{per_class}-{name}.sqfs"
        if not image.exists():
            mksquashfs(tree, Path(str(image) + ".partial"), *opts)
            os.replace(str(image) + ".partial", image)
        out[label] = (image, adopt(image, work / f"idx-epoch-{name}"))
    return out


def bench_read_compressed(tiny_tree: Path, work: Path, classes: int, rounds: int) -> list[dict[str, Any]]:
    """Figure 1b: every sample decompressed: ``classes`` folders of tiny JPEGs in a tar and in a zstd
    image of mksquashfs's defaults (compressed fragment blocks), the loader in process."""
    sub = work / f"tiny-{classes}"
    if not sub.with_name(sub.name + ".done").exists():
        shutil.rmtree(sub, ignore_errors=True)
        sub.mkdir(parents=True)
        for d in sorted(p for p in tiny_tree.iterdir() if p.is_dir())[:classes]:
            shutil.copytree(d, sub / d.name)
        sub.with_name(sub.name + ".done").touch()
    tar = work / f"read-tiny-{classes}-tar"
    shutil.rmtree(tar, ignore_errors=True)
    stager("pack", sub, tar, "--format", "tar", "--shard-size", "64M")
    sets = {"tar": tar, "mksquashfs zstd, adopted (every sample in a compressed fragment)": adopt(
        mksquashfs(sub, work / f"read-tiny-{classes}-zstd.sqfs", "-comp", "zstd"), work / "idx-tiny-zstd")}
    return read_rows(sets, rounds)


def bench_pack(tree: Path, work: Path, rounds: int, compressions: list[str]) -> list[dict[str, Any]]:
    """Figure 3: stager pack --format squashfs vs mksquashfs, same tree, same compression, one image."""
    rows = []
    for comp in compressions:
        times: dict[str, list[tuple[float, float]]] = {"stager": [], "mksquashfs": [], "sync": []}
        sizes: dict[str, int] = {}
        for _ in range(rounds):
            for code, env in CODES.items():
                out = work / f"pack-{comp}"
                shutil.rmtree(out, ignore_errors=True)
                wall, cpu, _ = run([PY, "-m", "stager", "pack", str(tree), str(out), "--format", "squashfs",
                                    "--compression", comp, "--shard-size", "64G", "-q"], env=env)
                times.setdefault(tagged("stager", code), []).append((wall, cpu))
                sizes[tagged("stager", code)] = sum(p.stat().st_size for p in out.glob("*.sqfs"))
            img = work / f"pack-{comp}.sqfs"
            img.unlink(missing_ok=True)
            # `none`: the pack stores every file whole, never in a fragment, so the like image is -no-fragments
            # (byte for byte the same size; with fragments mksquashfs also copies each JPEG's tail into one)
            opts = ["-noI", "-noD", "-noF", "-noX", "-no-fragments"] if comp == "none" else ["-comp", comp]
            wall, cpu, _ = run(["mksquashfs", str(tree), str(img), "-noappend", "-quiet", "-no-progress", *opts])
            times["mksquashfs"].append((wall, cpu))
            # The pack's image is durable when it returns (fsync, rename, directory fsync); mksquashfs's is
            # not: the same image made durable is mksquashfs then `sync IMAGE` (an fsync of it).
            times["sync"].append(run(["sync", str(img)])[:2])
            sizes["mksquashfs"] = img.stat().st_size
        s, m = times["stager"], times["mksquashfs"]
        synced = [w + ws for (w, _), (ws, _) in zip(m, times["sync"], strict=True)]
        row = {"compression": comp, "stager_s": med([w for w, _ in s]), "mksquashfs_s": med([w for w, _ in m]),
               "mksquashfs_sync_s": med(synced),
               "stager_cpu_s": med([c for _, c in s]), "mksquashfs_cpu_s": med([c for _, c in m]),
               "stager_bytes": sizes["stager"], "mksquashfs_bytes": sizes["mksquashfs"]}
        row["speed"] = row["mksquashfs_s"] / row["stager_s"]
        row["speed_durable"] = row["mksquashfs_sync_s"] / row["stager_s"]
        row["size"] = row["stager_bytes"] / row["mksquashfs_bytes"]
        for code in CODES:
            if code:
                row[f"stager_{code}_s"] = med([w for w, _ in times[tagged("stager", code)]])
                row[f"speed_{code}"] = row["mksquashfs_s"] / row[f"stager_{code}_s"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def big_image(work: Path, classes: int, per_class: int) -> Path:
    """The ImageNet-sized image (cached; the tree too, marked complete beside it)."""
    tree = work / f"tiny-{classes}x{per_class}"
    image = work / f"tiny-{classes}x{per_class}.sqfs"
    if image.exists():
        return image
    done = tree.with_name(tree.name + ".done")
    if not done.exists():
        shutil.rmtree(tree, ignore_errors=True)
        make_tiny_imagefolder(tree, classes, per_class, jobs=os.cpu_count() or 1)
        done.touch()
    # -no-duplicates: duplicate detection compares every pair of same-sized files (hours on 1.28M tiny files)
    subprocess.run(["mksquashfs", str(tree), str(image) + ".partial", "-noappend", "-quiet", "-no-progress",
                    "-no-duplicates"], check=True, stdout=subprocess.DEVNULL)
    os.replace(str(image) + ".partial", image)
    return image


def bench_index(image: Path, work: Path, rounds: int) -> dict[str, Any]:
    """Figure 4: stager index of the big image vs unsquashfs -l, and the loader's first batch over it."""
    ours: dict[str, list[tuple[float, float]]] = {}
    first: dict[str, list[float]] = {}
    theirs = []
    out = work / "idx-big"
    for _ in range(rounds):
        for code, env in CODES.items():
            shutil.rmtree(out, ignore_errors=True)
            ours.setdefault(code, []).append(run([PY, "-m", "stager", "index", str(image), "--out", str(out), "-q"],
                                                 env=env)[:2])
            first.setdefault(code, []).append(measured(FIRST_BATCH, out, env=env)["first_batch"])
        theirs.append(run(["unsquashfs", "-l", str(image)])[:2])
    n = json.loads((out / "manifest.json").read_text())["totals"]["samples"]
    res = {"samples": n, "unsquashfs_s": med([w for w, _ in theirs]), "unsquashfs_cpu_s": med([c for _, c in theirs])}
    for code in CODES:
        tag = f"_{code}" if code else ""
        res[f"stager{tag}_s"] = med([w for w, _ in ours[code]])
        res[f"stager{tag}_cpu_s"] = med([c for _, c in ours[code]])
        res[f"first_batch{tag}_s"] = med(first[code])
        res[f"ratio{tag}"] = res[f"stager{tag}_s"] / res["unsquashfs_s"]
        res[f"cpu_ratio{tag}"] = res[f"stager{tag}_cpu_s"] / res["unsquashfs_cpu_s"]
    print(json.dumps(res), file=sys.stderr)
    return res


FIGURES = ("read", "mount", "epoch", "pack", "index")


def markdown(res: dict[str, Any]) -> str:
    lines = ["## SquashFS images (tools/bench/bench_squashfs.py)", "",
             f"Tree: {res['files']} ImageNet-like JPEGs ({res['mb']:.0f} MB). Interleaved rounds ({res['rounds']}), "
             f"medians. Machine load (1, 5, 15 min) at the start: {res['load']}; {os.cpu_count()} CPUs.", ""]
    for keys, part in ((("read",), _md_read), (("mount", "mount_epoch"), _md_mount), (("pack",), _md_pack),
                       (("index",), _md_index)):
        if any(k in res for k in keys):
            lines += part(res)
    while lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def _md_read(res: dict[str, Any]) -> list[str]:
    lines = ["**Read** (the loader, `decode=\"raw\"`, in process, one shuffled epoch)", "",
             "| dataset | samples/s | x tar | CPU us/sample |", "|---|---|---|---|"]
    lines += [f"| {r['dataset']} | {r['samples_per_s']:.0f} | {r['x_tar']:.2f} | {r['cpu_us_per_sample']:.1f} |"
              for r in res["read"]]
    lines += ["", f"**Read, every sample decompressed** ({res['read_compressed'][0]['samples']} tiny JPEGs of ~1 KB, "
              "the loader in process)", "", "| dataset | samples/s | x tar | CPU us/sample |", "|---|---|---|---|"]
    lines += [f"| {r['dataset']} | {r['samples_per_s']:.0f} | {r['x_tar']:.2f} | {r['cpu_us_per_sample']:.1f} |"
              for r in res["read_compressed"]]
    return [*lines, ""]


def _md_mount(res: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for key, what in (("mount", f"{res['files']} samples"), ("mount_epoch", f"{res.get('epoch_files')} samples")):
        if key not in res:
            continue
        lines += ["", f"**Against a squashfuse mount, {what}** (a torch DataLoader over the mounted tree, "
                  "`open()`/`read()` per file, shuffled; a fresh mount per epoch, so its page cache starts cold as "
                  "the loader's decompression does; CPU includes the squashfuse daemon's; both scripts import torch "
                  "and run a full garbage collection before their clock starts)", ""]
        if res[key]:
            lines += ["| image | reader | workers | samples/s | x mount | CPU us/sample |", "|---|---|---|---|---|---|"]
            lines += [f"| {r['image']} | {r['reader']} | {r['workers']} | {r['samples_per_s']:.0f} | "
                      f"{r['x_mount']:.2f} | {r['cpu_us_per_sample']:.1f} |" for r in res[key]]
        else:
            lines.append("(skipped: no squashfuse)")
    return [*lines[1:], ""]


def _md_pack(res: dict[str, Any]) -> list[str]:
    lines = ["", "**Pack** (`stager pack --format squashfs`, a fresh process, against `mksquashfs`, one image each; "
             "`none` against `mksquashfs -noI -noD -noF -noX -no-fragments`, the same layout)",
              "", "| compression | stager s | mksquashfs s | speed (x mksquashfs) | mksquashfs + sync s | speed (x "
              "mksquashfs + sync) | stager CPU s | mksquashfs CPU s | stager MB | mksquashfs MB | size (x) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['compression']} | {r['stager_s']:.2f} | {r['mksquashfs_s']:.2f} | {r['speed']:.2f} | "
              f"{r['mksquashfs_sync_s']:.2f} | {r['speed_durable']:.2f} | "
              f"{r['stager_cpu_s']:.2f} | {r['mksquashfs_cpu_s']:.2f} | {r['stager_bytes'] / 1e6:.2f} | "
              f"{r['mksquashfs_bytes'] / 1e6:.2f} | {r['size']:.4f} |" for r in res["pack"]]
    for code in res["codes"][1:]:
        lines += ["", f"The pack as {code} had it: " + ", ".join(
            f"{r['compression']} {r[f'stager_{code}_s']:.2f} s ({r[f'speed_{code}']:.2f}x mksquashfs)"
            for r in res["pack"]) + "."]
    return [*lines[1:], ""]


def _md_index(res: dict[str, Any]) -> list[str]:
    i = res["index"]
    lines = ["**Index** (an image of mksquashfs's defaults; fresh processes)", "",
              "| samples | code | stager index s | unsquashfs -l s | ratio | stager CPU s | unsquashfs CPU s | "
              "CPU ratio | loader's first batch s |", "|---|---|---|---|---|---|---|---|---|"]
    for code in res["codes"]:
        t = f"_{code}" if code else ""
        lines.append(f"| {i['samples']} | {code or 'this branch'} | {i[f'stager{t}_s']:.2f} | "
                     f"{i['unsquashfs_s']:.2f} | {i[f'ratio{t}']:.2f} | {i[f'stager{t}_cpu_s']:.2f} | "
                     f"{i['unsquashfs_cpu_s']:.2f} | {i[f'cpu_ratio{t}']:.2f} | {i[f'first_batch{t}_s']:.2f} |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=200)
    p.add_argument("--big-classes", type=int, default=1000)
    p.add_argument("--big-per-class", type=int, default=1281)
    p.add_argument("--tiny-classes", type=int, default=20, help="folders of the big tree read decompressed")
    p.add_argument("--epoch-classes", type=int, default=20)
    p.add_argument("--epoch-per-class", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compressions", default="none,gzip,zstd,lz4", help="for the pack figure (xz: minutes)")
    p.add_argument("--work", default="/tmp/stager-bench-squashfs", help="cache of the trees and the big image")
    p.add_argument("--md", default=str(ROOT / "docs" / "bench" / "squashfs.md"))
    p.add_argument("--baseline", help="another checkout (e.g. main's) measured side by side, its rows marked "
                   "'(main)' (--baseline-name)")
    p.add_argument("--baseline-name", default="main")
    p.add_argument("--only", default=",".join(FIGURES),
                   help=f"comma-separated figures to run, of {', '.join(FIGURES)} (any subset: the tables are "
                        "printed, docs/bench/squashfs.md is rewritten only when all run)")
    a = p.parse_args(argv)
    only = [f.strip() for f in a.only.split(",") if f.strip()]
    if not only or set(only) - set(FIGURES):
        p.error(f"--only {a.only!r}: name figures of {', '.join(FIGURES)}")
    if a.baseline:
        CODES[a.baseline_name] = {**ENV, "PYTHONPATH": str(Path(a.baseline).resolve())}
        subprocess.run([PY, "-m", "compileall", "-q", str(Path(a.baseline) / "stager")], check=True,
                       stdout=subprocess.DEVNULL)
    if shutil.which("mksquashfs") is None or shutil.which("unsquashfs") is None:
        print("needs squashfs-tools: apt-get install squashfs-tools", file=sys.stderr)
        return 2
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    tree = work / f"jpeg-{a.classes}x{a.per_class}"
    if not tree.with_name(tree.name + ".done").exists():
        shutil.rmtree(tree, ignore_errors=True)
        make_imagefolder(tree, a.classes, a.per_class)
        tree.with_name(tree.name + ".done").touch()
    files = [f for f in tree.rglob("*") if f.is_file()]
    res: dict[str, Any] = {"files": len(files), "mb": sum(f.stat().st_size for f in files) / 1e6, "rounds": a.rounds,
                           "load": " ".join(f"{x:.1f}" for x in os.getloadavg()), "codes": list(CODES)}
    subprocess.run([PY, "-m", "compileall", "-q", str(ROOT / "stager")], check=True, stdout=subprocess.DEVNULL)
    if "read" in only or "index" in only:  # the ImageNet-sized image; its tree's tiny JPEGs are read too
        big = big_image(work, a.big_classes, a.big_per_class)
    if "read" in only:
        res["read"] = bench_read(tree, work, a.rounds)
        res["read_compressed"] = bench_read_compressed(work / f"tiny-{a.big_classes}x{a.big_per_class}", work,
                                                       a.tiny_classes, a.rounds)
    if "mount" in only:
        small = {"zstd (mksquashfs defaults)": (work / "read-zstd.sqfs", work / "idx-zstd"),
                 "uncompressed": (work / "read-plain.sqfs", work / "idx-plain")}
        for image, idx, opts in ((*small["zstd (mksquashfs defaults)"], ("-comp", "zstd")),
                                 (*small["uncompressed"], ("-noI", "-noD", "-noF", "-noX", "-no-fragments"))):
            if not (idx / "manifest.json").exists():  # made by the read figure; alone, made here
                adopt(mksquashfs(tree, image, *opts), idx)
        res["mount"] = bench_mount(small, work, a.rounds)
    if "epoch" in only:
        res["epoch_files"] = a.epoch_classes * a.epoch_per_class
        res["mount_epoch"] = bench_mount(epoch_images(work, a.epoch_classes, a.epoch_per_class), work, a.rounds)
    if "pack" in only:
        res["pack"] = bench_pack(tree, work, a.rounds, a.compressions.split(","))
    if "index" in only:
        res["index"] = bench_index(big, work, a.rounds)
    md = markdown(res)
    if set(only) == set(FIGURES):
        Path(a.md).parent.mkdir(parents=True, exist_ok=True)
        Path(a.md).write_text(md)
    print(md)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
