"""`stager index` throughput against DALI's index scripts, and loader read rates over indexed sets.

    python tools/bench/bench_index.py [--n 2000] [--rounds 3] [--dali-scripts DIR]

Data: ``--n`` ImageNet-like JPEGs (tools/datagen.py, ~86 KB each; 200 distinct images, cycled) written
by the real writers: webdataset ``ShardWriter`` tars, the ``tfrecord`` package's ``TFRecordWriter``
(TensorFlow's framing), pyarrow parquet (Hugging Face's ``{bytes, path}`` struct, uncompressed as
``datasets`` writes it, and snappy-compressed), ~64 MB per shard; and the same images packed by
``stager pack --format tar``. Page cache warm (caches cannot be dropped here); best of ``--rounds``.

Index: ``stager index`` (one process and ``--workers 2``; it hashes every byte, checks every tar
header / both TFRecord CRCs and parses every Example) vs DALI's ``tfrecord2idx`` and ``wds2idx.py``
(pure-Python scripts from the ``nvidia-dali-cuda120`` wheel; they need no GPU: extract them with
``unzip nvidia_dali_cuda120-*.whl 'nvidia_dali_cuda120-*.data/scripts/tfrecord2idx' wds2idx.py``
and pass ``--dali-scripts DIR``), one file at a time as DALI documents, and the ``tfrecord``
package's ``create_index`` (the same algorithm as DALI's ``tfrecord2idx``, in-process). Neither
checks CRCs nor hashes; ``wds2idx`` runs GNU ``tar --list`` twice per file. For scale, one xxh3 pass
over every file through ``read()`` (what ``stager verify`` does; ``stager index`` hashes a mapping,
which saves the copy into a buffer, so it can beat this figure when it has little else to do).

Loader: one epoch of raw bytes in one process (``decode="raw"``, default shuffle), after a warm-up
epoch, over each indexed set vs the stager pack of the same images; the consumer touches one byte per
4 KiB page of every payload (as in bench_loader), so zero-copy views pay their page faults.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stager.checksum import hash_file  # noqa: E402
from stager.index import IndexOptions, index_dataset  # noqa: E402
from stager.loader import make_loader  # noqa: E402
from tools.datagen import jpeg_bytes, render_image  # noqa: E402

SHARD = 64 << 20
EPOCHS = 20  # loader epochs per timed round (one for the slow compressed-parquet path)


def images(n: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    base = []
    for i in range(min(n, 200)):
        w, h = int(500 * rng.uniform(0.8, 1.2)), int(375 * rng.uniform(0.8, 1.2))
        base.append(jpeg_bytes(render_image(rng, i % 10, 10, h, w)))
    return [base[i % len(base)] for i in range(n)]


def write_sets(d: Path, imgs: list[bytes]) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds
    from tfrecord import TFRecordWriter

    out = {k: d / k for k in ("wds", "tfrecord", "parquet", "parquet-snappy", "folder")}
    for p in out.values():
        p.mkdir(parents=True)
    with wds.ShardWriter(str(out["wds"] / "train-%06d.tar"), maxsize=SHARD, verbose=0) as w:
        for i, b in enumerate(imgs):
            w.write({"__key__": f"n{i % 10:08d}_{i}.JPEG", "jpg": b, "cls": i % 10})
    per = max(1, SHARD // (len(imgs[0]) + 200))
    for f in range(0, len(imgs), per):
        w = TFRecordWriter(str(out["tfrecord"] / f"train-{f // per:05d}"))
        for i in range(f, min(f + per, len(imgs))):
            w.write({"image/encoded": (imgs[i], "byte"), "image/class/label": (i % 10 + 1, "int"),
                     "image/filename": (f"n{i % 10:08d}_{i}.JPEG".encode(), "byte")})
        w.close()
    for f in range(0, len(imgs), per):
        rows = range(f, min(f + per, len(imgs)))
        t = pa.table({"image": [{"bytes": imgs[i], "path": f"{i}.jpg"} for i in rows], "label": [i % 10 for i in rows]})
        pq.write_table(t, out["parquet"] / f"train-{f // per:05d}.parquet", compression="none", use_dictionary=False,
                       row_group_size=100)
        pq.write_table(t, out["parquet-snappy"] / f"train-{f // per:05d}.parquet", row_group_size=100)
    for i, b in enumerate(imgs):
        (out["folder"] / f"c{i % 10}").mkdir(exist_ok=True)
        (out["folder"] / f"c{i % 10}" / f"{i}.jpg").write_bytes(b)
    return out


def shards(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file() and not p.name.endswith((".json", ".idx")))


def best(fn, rounds: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_index(sets: dict[str, Path], n: int, rounds: int, dali: Path | None, tmp: Path) -> list[tuple]:
    from tfrecord.tools.tfrecord2idx import create_index

    rows = []
    for name in ("wds", "tfrecord", "parquet", "parquet-snappy"):
        d = sets[name]
        files = shards(d)
        nbytes = sum(p.stat().st_size for p in files)
        rows.append((name, "xxh3 of every file through read() (what verify does)", nbytes,
                     best(lambda files=files: [hash_file(p) for p in files], rounds)))
        for workers in (1, 2):
            out = tmp / f"idx-{name}-{workers}"

            def run(d: Path = d, out: Path = out, workers: int = workers, off: int = -1 if "tf" in name else 0) -> None:
                shutil.rmtree(out, ignore_errors=True)
                index_dataset(d, out, IndexOptions(workers=workers, label_offset=off))

            rows.append((name, f"stager index --workers {workers}", nbytes, best(run, rounds)))
        if name == "tfrecord":
            rows.append((name, "tfrecord.create_index (DALI's algorithm, in-process)", nbytes,
                         best(lambda files=files: [create_index(str(p), str(tmp / f"{p.name}.ref")) for p in files],
                              rounds)))
        script = {"tfrecord": "tfrecord2idx", "wds": "wds2idx.py"}.get(name)
        found = list(dali.rglob(script)) if dali is not None and script else []
        if found:
            def dali_run(files: list[Path] = files, s: Path = found[0]) -> None:
                for p in files:
                    subprocess.run([sys.executable, str(s), str(p), str(tmp / f"{p.name}.dali")], check=True,
                                   capture_output=True)

            rows.append((name, f"DALI {script} (one process per file, as documented)", nbytes, best(dali_run, rounds)))
    return [(a, b, c, t, n) for a, b, c, t in rows]


def bench_loader(sets: dict[str, Path], tmp: Path, rounds: int) -> list[tuple]:
    from stager.pack import pack

    pack(sets["folder"], tmp / "packed-tar", "tar", shard_size=SHARD)
    targets = [("stager pack --format tar", tmp / "packed-tar"), ("indexed webdataset tars", sets["wds"]),
               ("indexed TFRecords", sets["tfrecord"]), ("indexed parquet, uncompressed (zero-copy)", sets["parquet"]),
               ("indexed parquet, snappy (rows via pyarrow)", sets["parquet-snappy"])]
    for name in ("wds", "tfrecord", "parquet", "parquet-snappy"):
        index_dataset(sets[name], options=IndexOptions(label_offset=-1 if name == "tfrecord" else 0))
    rows = []
    for label, path in targets:
        loader = make_loader(str(path), batch_size=64, decode="raw", staged=False, seed=0)
        counts: list[int] = []

        reps = 1 if "snappy" in label else EPOCHS  # a timing of a few ms would be noise

        def epoch(loader=loader, counts=counts, reps=reps) -> None:  # type: ignore[no-untyped-def]
            total = 0
            for e in range(reps):
                loader.set_epoch(e)
                for b in loader:
                    total += sum(len(x) for x in b["image"])
                    for x in b["image"]:  # touch one byte per 4 KiB page, as bench_loader's consumers do
                        np.frombuffer(x, np.uint8)[::4096].sum()
            counts.append(total)

        epoch()  # warm-up: page cache, mappings
        t = best(epoch, rounds) / reps
        rows.append((label, loader.stats()["samples"] // (rounds * reps + reps), counts[-1] // reps, t))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dali-scripts", type=Path, default=None, help="directory holding tfrecord2idx and wds2idx.py")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "index.md")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-index-", dir=os.environ.get("STAGER_BENCH_TMP")) as t:
        tmp = Path(t)
        imgs = images(a.n)
        sets = write_sets(tmp / "data", imgs)
        idx = bench_index(sets, a.n, a.rounds, a.dali_scripts, tmp)
        load = bench_loader(sets, tmp, a.rounds)
    buf = io.StringIO()
    mean = sum(map(len, imgs)) / len(imgs)
    buf.write(f"# `stager index` and reading indexed sets\n\nGenerated by `python tools/bench/bench_index.py "
              f"{' '.join(argv if argv is not None else sys.argv[1:])}` on {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f} at the end: {a.n:,} ImageNet-like JPEGs (mean {mean / 1e3:.1f} KB), ~64 MB "
              f"shards, warm page cache, best of {a.rounds}.\n\n")
    buf.write("| input | indexer | GB | seconds | GB/s | samples/s |\n|---|---|---:|---:|---:|---:|\n")
    for name, how, nbytes, sec, n in idx:
        buf.write(f"| {name} | {how} | {nbytes / 1e9:.3f} | {sec:.3f} | {nbytes / sec / 1e9:.2f} | {n / sec:,.0f} |\n")
    buf.write("\n| loader over (raw bytes, 1 process) | samples | MB | seconds | samples/s | MB/s | vs packed |\n"
              "|---|---:|---:|---:|---:|---:|---:|\n")
    base = load[0][1] / load[0][3]
    for label, n, nbytes, sec in load:
        buf.write(f"| {label} | {n:,} | {nbytes / 1e6:.0f} | {sec:.3f} | {n / sec:,.0f} | {nbytes / sec / 1e6:,.0f} | "
                  f"{n / sec / base:.2f} |\n")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(buf.getvalue())
    print(buf.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
