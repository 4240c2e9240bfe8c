"""SquashFS codec figures: stager's writer against mksquashfs, its listing against ``unsquashfs -l``,
and raw read rates over images against tar.

    python tools/bench/bench_squashfs_codec.py [--classes 10 --per-class 100] [--big-classes 1000
        --big-per-class 1281] [--rounds 5] [--work DIR]

* **Write**: the same tree, each compression, ``mksquashfs SRC IMG -comp C`` (every core, its
  defaults: 128 KiB blocks, fragments, duplicate detection, export table) against a fresh interpreter
  that reads the tree and writes it with :class:`SquashWriter` (its thread pool on every core).
  ``none`` is mksquashfs's ``-noI -noD -noF -noX``. Two trees: ImageNet-like JPEGs
  (tools/datagen.py, ~110 KB; stager stores them as they are, mksquashfs tries each block with the
  compressor and keeps what is smaller) and compressible text, where both compress everything.
  Interleaved rounds, medians: wall seconds, CPU seconds (user + sys of the process and its
  threads), image bytes.
* **List**: an ImageNet-sized image (``--big-classes x --big-per-class`` ~1 KB JPEGs, made once by
  mksquashfs and cached under ``--work``): ``SquashImage(IMG).listing()`` (every path, size, inode and
  extent) in a fresh interpreter against ``unsquashfs -l IMG > /dev/null``; medians of interleaved
  rounds, whole process (interpreter start and imports included) and the listing call alone.
* **Read**: every file of the JPEG tree in a shuffled order, 256 a batch, from an uncompressed image
  (``read_many``: one ``pread`` per run) and a zstd image (decompressed in process), against the same
  files in a tar read at their offsets with ``pread_runs`` (what the loader does for tar shards).
  Page cache warm; samples/s and CPU microseconds per sample, medians.

Writes docs/bench/squashfs_codec.md and prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stager.formats.base import pread_runs  # noqa: E402
from stager.formats.squashfs import SquashImage  # noqa: E402
from tools.datagen import make_imagefolder, make_tiny_imagefolder  # noqa: E402

COMPRESSIONS = ("none", "gzip", "zstd", "lz4", "xz")
MKSQUASHFS = {"none": ["-noI", "-noD", "-noF", "-noX"], **{c: ["-comp", c] for c in COMPRESSIONS if c != "none"}}

WRITE = """
import os, sys
from stager.formats.squashfs.writer import SquashWriter
src, out, comp, force = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
with SquashWriter(out, compression=comp, compress_precompressed=force) as w:
    for d, dirs, files in os.walk(src):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                w.add_file(os.path.relpath(p, src), fh.read())
"""

LIST = """
import sys, time
t = time.perf_counter()
from stager.formats.squashfs import SquashImage
im = SquashImage(sys.argv[1])
n = len(im.listing())
print(time.perf_counter() - t, n)
"""


def run(cmd: list[str], stdout: object = subprocess.DEVNULL) -> tuple[float, float, str]:
    """``(wall s, CPU s of the child, its stdout)``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(cmd, check=True, stdout=subprocess.PIPE if stdout is None else stdout, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, r.stdout or ""


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bench_write(src: Path, work: Path, rounds: int, force: bool) -> list[dict[str, object]]:
    rows = []
    for comp in COMPRESSIONS:
        times: dict[str, list[tuple[float, float]]] = {"stager": [], "mksquashfs": []}
        sizes = {}
        for _ in range(rounds):  # interleaved: both see the same spread of machine load
            for who in ("stager", "mksquashfs"):
                out = work / f"w-{who}-{comp}.sqfs"
                out.unlink(missing_ok=True)
                if who == "stager":
                    cmd = [sys.executable, "-c", WRITE, str(src), str(out), comp, "1" if force else "0"]
                else:
                    cmd = ["mksquashfs", str(src), str(out), "-noappend", "-quiet", "-no-progress", *MKSQUASHFS[comp]]
                wall, cpu, _ = run(cmd)
                times[who].append((wall, cpu))
                sizes[who] = out.stat().st_size
        s, m = times["stager"], times["mksquashfs"]
        rows.append({"compression": comp, "stager_s": med([w for w, _ in s]), "mksquashfs_s": med([w for w, _ in m]),
                     "stager_cpu_s": med([c for _, c in s]), "mksquashfs_cpu_s": med([c for _, c in m]),
                     "stager_bytes": sizes["stager"], "mksquashfs_bytes": sizes["mksquashfs"]})
        rows[-1]["speed"] = rows[-1]["mksquashfs_s"] / rows[-1]["stager_s"]  # type: ignore[operator]
        rows[-1]["size"] = sizes["stager"] / sizes["mksquashfs"]
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def done(root: Path) -> Path:
    """The marker that a cached tree is complete (beside it: a file inside would be packed too)."""
    return root.with_name(root.name + ".done")


def text_tree(root: Path, n: int) -> Path:
    if done(root).exists():
        return root
    rng = random.Random(0)
    words = [f"w{k}" for k in range(500)]
    for i in range(n):
        p = root / f"c{i % 10}" / f"doc{i:05d}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(" ".join(rng.choice(words) for _ in range(rng.randrange(200, 8000))))
    done(root).touch()
    return root


def bench_list(image: Path, rounds: int) -> dict[str, object]:
    ours, ours_call, theirs, ours_cpu, theirs_cpu = [], [], [], [], []
    count = 0
    for _ in range(rounds):
        wall, cpu, out = run([sys.executable, "-c", LIST, str(image)], stdout=None)
        call, n = out.split()
        ours.append(wall)
        ours_call.append(float(call))
        ours_cpu.append(cpu)
        count = int(n)
        wall, cpu, _ = run(["unsquashfs", "-l", str(image)])
        theirs.append(wall)
        theirs_cpu.append(cpu)
    return {"entries": count, "stager_s": med(ours), "stager_listing_call_s": med(ours_call),
            "unsquashfs_s": med(theirs), "stager_cpu_s": med(ours_cpu), "unsquashfs_cpu_s": med(theirs_cpu),
            "ratio": med(ours) / med(theirs)}


def bench_read(src: Path, work: Path, rounds: int) -> list[dict[str, object]]:
    files = sorted(p for p in src.rglob("*") if p.is_file())
    tar = work / "r.tar"
    with tarfile.open(tar, "w") as t:
        for p in files:
            t.add(p, arcname=str(p.relative_to(src)))
    with tarfile.open(tar) as t:
        members = [m for m in t.getmembers() if m.isfile()]
    import numpy as np

    offs = np.asarray([m.offset_data for m in members], dtype=np.int64)
    sizes = np.asarray([m.size for m in members], dtype=np.int64)
    order = np.random.default_rng(0).permutation(len(members))
    images = {"mksquashfs none": ["mksquashfs", *MKSQUASHFS["none"]],
              "mksquashfs zstd": ["mksquashfs", "-comp", "zstd"], "stager zstd": [sys.executable, "-c", WRITE]}
    for name, cmd in images.items():
        img = work / f"r-{name.replace(' ', '-')}.sqfs"
        img.unlink(missing_ok=True)
        if cmd[0] == "mksquashfs":
            subprocess.run([cmd[0], str(src), str(img), "-noappend", "-quiet", "-no-progress", *cmd[1:]], check=True,
                           stdout=subprocess.DEVNULL)
        else:
            subprocess.run([*cmd, str(src), str(img), "zstd", "0"], check=True)
        images[name] = [str(img)]
    rows: dict[str, list[tuple[float, float]]] = {"tar": [], **{k: [] for k in images}}
    for _ in range(rounds):
        fd = os.open(tar, os.O_RDONLY)
        t, c = time.perf_counter(), time.process_time()
        for a in range(0, len(order), 256):
            pos = np.sort(order[a : a + 256])
            pread_runs(fd, offs[pos], sizes[pos])
        rows["tar"].append((time.perf_counter() - t, time.process_time() - c))
        os.close(fd)
        for name, (img,) in images.items():
            with SquashImage(img) as im:
                idx = im.listing().files()
                t, c = time.perf_counter(), time.process_time()
                for a in range(0, len(order), 256):
                    im.read_many(idx[np.sort(order[a : a + 256])])
                rows[name].append((time.perf_counter() - t, time.process_time() - c))
    n = len(order)
    return [{"source": k, "samples_per_s": n / med([w for w, _ in v]),
             "cpu_us_per_sample": 1e6 * med([c for _, c in v]) / n} for k, v in rows.items()]


def markdown(res: dict[str, object]) -> str:
    lines = ["## SquashFS codec (tools/bench/bench_squashfs_codec.py)", "",
             f"Trees: {res['jpeg_files']} ImageNet-like JPEGs ({res['jpeg_mb']:.0f} MB); {res['text_files']} text "
             f"files ({res['text_mb']:.0f} MB). Interleaved rounds, medians. Machine load (1, 5, 15 min): "
             f"{res['load']}.", ""]
    for title, key in (("JPEG tree, stager's defaults (JPEG stored as is)", "write_jpeg"),
                       ("JPEG tree, stager compressing the JPEGs too (`compress_precompressed=True`)",
                        "write_jpeg_forced"),
                       ("Text tree (everything compressed by both)", "write_text")):
        lines += [f"**Write: {title}**", "",
                  "| compression | stager s | mksquashfs s | speed (x mksquashfs) | stager CPU s | mksquashfs CPU s "
                  "| stager MB | mksquashfs MB | size (x) |", "|---|---|---|---|---|---|---|---|---|"]
        for r in res[key]:  # type: ignore[attr-defined]
            lines.append(f"| {r['compression']} | {r['stager_s']:.2f} | {r['mksquashfs_s']:.2f} | {r['speed']:.2f} | "
                         f"{r['stager_cpu_s']:.2f} | {r['mksquashfs_cpu_s']:.2f} | {r['stager_bytes'] / 1e6:.2f} | "
                         f"{r['mksquashfs_bytes'] / 1e6:.2f} | {r['size']:.4f} |")
        lines.append("")
    lst = res["list"]
    lines += ["**List** (an image of mksquashfs's defaults)", "",
              "| entries | stager process s | stager import + listing() s | unsquashfs -l s | ratio | stager CPU s | "
              "unsquashfs CPU s |", "|---|---|---|---|---|---|---|",
              f"| {lst['entries']} | {lst['stager_s']:.2f} | {lst['stager_listing_call_s']:.2f} | "  # type: ignore[index]
              f"{lst['unsquashfs_s']:.2f} | {lst['ratio']:.2f} | {lst['stager_cpu_s']:.2f} | "  # type: ignore[index]
              f"{lst['unsquashfs_cpu_s']:.2f} |", "",  # type: ignore[index]
              "**Read** (every JPEG, shuffled, 256 a batch, warm page cache; images of the JPEG tree: mksquashfs's "
              "with the JPEGs in fragments, stager's with them stored)", "",
              "| source | samples/s | CPU us/sample |", "|---|---|---|"]
    for r in res["read"]:  # type: ignore[attr-defined]
        lines.append(f"| {r['source']} | {r['samples_per_s']:.0f} | {r['cpu_us_per_sample']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, default=20)
    p.add_argument("--per-class", type=int, default=250)
    p.add_argument("--text", type=int, default=2000, help="files of the compressible tree")
    p.add_argument("--big-classes", type=int, default=1000)
    p.add_argument("--big-per-class", type=int, default=1281)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--work", default="/tmp/stager-bench-squashfs", help="cache of the trees and the big image")
    p.add_argument("--md", default=str(ROOT / "docs" / "bench" / "squashfs_codec.md"))
    a = p.parse_args(argv)
    if shutil.which("mksquashfs") is None:
        print("needs squashfs-tools: apt-get install squashfs-tools", file=sys.stderr)
        return 2
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    jpeg = work / f"jpeg-{a.classes}x{a.per_class}"
    if not done(jpeg).exists():
        shutil.rmtree(jpeg, ignore_errors=True)
        make_imagefolder(jpeg, a.classes, a.per_class)
        done(jpeg).touch()
    text = text_tree(work / f"text-{a.text}", a.text)
    big = work / f"tiny-{a.big_classes}x{a.big_per_class}"
    image = work / f"tiny-{a.big_classes}x{a.big_per_class}.sqfs"
    if not image.exists():
        if not done(big).exists():
            shutil.rmtree(big, ignore_errors=True)
            make_tiny_imagefolder(big, a.big_classes, a.big_per_class, jobs=os.cpu_count() or 1)
            done(big).touch()
        # -no-duplicates: duplicate detection compares every pair of same-sized files, and 1.28M files of
        # ~1 KB make it run for hours; the listing does not depend on it.
        subprocess.run(["mksquashfs", str(big), str(image) + ".partial", "-noappend", "-quiet", "-no-progress",
                        "-no-duplicates"],
                       check=True, stdout=subprocess.DEVNULL)
        os.replace(str(image) + ".partial", image)
    size = lambda root: sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) / 1e6  # noqa: E731
    res: dict[str, object] = {
        "jpeg_files": a.classes * a.per_class, "jpeg_mb": size(jpeg), "text_files": a.text, "text_mb": size(text),
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "write_jpeg": bench_write(jpeg, work, a.rounds, False),
        "write_jpeg_forced": bench_write(jpeg, work, max(1, a.rounds // 2), True),
        "write_text": bench_write(text, work, a.rounds, False),
        "list": bench_list(image, a.rounds),
        "read": bench_read(jpeg, work, a.rounds),
    }
    Path(a.md).parent.mkdir(parents=True, exist_ok=True)
    Path(a.md).write_text(markdown(res))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
