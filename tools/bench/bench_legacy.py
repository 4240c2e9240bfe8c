"""MXNet RecordIO and LMDB in place: `stager index` vs DALI's rec2idx, and the loader vs the usual recipes.

    python tools/bench/bench_legacy.py [--rec 2000] [--lmdb 20000] [--rounds 3]
                                       [--dali-scripts DIR --mxnet-python PY]

Data (tools/datagen.py): ``--rec`` ImageNet-like JPEGs (~86 KB; 200 distinct, cycled) in ``.rec`` files
of ~64 MB written as ``im2rec`` does (IRHeader + JPEG per record), without ``.idx``; the same JPEGs
packed by ``stager pack --format tar``; a Caffe LMDB of ``--lmdb`` raw 32x32 Datums (CIFAR-sized,
planar BGR) and one of encoded JPEG Datums. Page cache warm; best of ``--rounds``.

Index: ``stager index`` of the ``.rec`` files (hashes every byte, walks every record's framing and
IRHeader, writes the ``.idx``) vs DALI's ``rec2idx.py`` (in the ``nvidia-dali-cuda120`` wheel; it
imports MXNet, which installs only beside numpy<1.24: give an interpreter of such a venv with
``--mxnet-python``), which reads every record through MXNet's reader and writes the ``.idx``.

Loader: seconds per epoch, best of ``--rounds`` rounds of 5 epochs, the contenders measured in
alternation after a warm-up epoch each (persistent workers everywhere; the consumer touches one byte
per 4 KiB page of raw payloads):

* ``.rec`` adopted in place vs the same JPEGs packed by stager (raw bytes, 1 process and 2 workers);
* LMDBs, 2 workers, vs the usual PyTorch recipe: a ``Dataset`` that opens py-lmdb in each worker
  (``readonly, lock=False, readahead=False, meminit=False``), ``txn.get`` key by key, parses the Datum
  with protobuf (a ``caffe.Datum`` class built from its descriptor: the C++/upb parser, as
  ``caffe_pb2`` would use), batched by torch's ``DataLoader(shuffle=True, num_workers=2)``.
  ``decode="raw"`` (the issue's "raw": no decoding) over encoded JPEG Datums and over raw Datums
  (the recipe returns ``datum.data``; stager returns the pixels already turned RGB ``(H, W, C)``), and
  decoded uint8 batches of raw Datums (the recipe: ``frombuffer``, BGR to RGB, ``(H, W, C)`` tensors).
"""

from __future__ import annotations

import argparse
import io
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stager.index import index_dataset  # noqa: E402
from stager.loader import make_loader  # noqa: E402
from tools.datagen import (  # noqa: E402
    caffe_datum,
    jpeg_bytes,
    recordio_pack,
    render_image,
    write_recordio,
)

SHARD = 64 << 20
EPOCHS = 5  # epochs per timed round: one epoch of a few thousand samples is tens of ms, noise on a busy host


def images(n: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    base = []
    for i in range(min(n, 200)):
        w, h = int(500 * rng.uniform(0.8, 1.2)), int(375 * rng.uniform(0.8, 1.2))
        base.append(jpeg_bytes(render_image(rng, i % 10, 10, h, w)))
    return [base[i % len(base)] for i in range(n)]


def write_rec(d: Path, imgs: list[bytes]) -> None:
    per = max(1, SHARD // (len(imgs[0]) + 40))
    for f in range(0, len(imgs), per):
        recs = [recordio_pack(imgs[i], float(i % 10), i) for i in range(f, min(f + per, len(imgs)))]
        write_recordio(d / f"train-{f // per:03d}.rec", recs, idx=False)


def write_folder(d: Path, imgs: list[bytes]) -> None:
    for i, b in enumerate(imgs):
        (d / f"c{i % 10}").mkdir(parents=True, exist_ok=True)
        (d / f"c{i % 10}" / f"{i}.jpg").write_bytes(b)


def write_lmdb(d: Path, n: int, *, raw: bool, imgs: list[bytes] | None = None) -> None:
    import lmdb

    rng = np.random.default_rng(1)
    tiles = [render_image(rng, i % 10, 10, 32, 32) for i in range(100)]
    env = lmdb.open(str(d), map_size=1 << 36)
    with env.begin(write=True) as txn:
        for i in range(n):
            if raw:
                value = caffe_datum(np.ascontiguousarray(tiles[i % 100][..., ::-1].transpose(2, 0, 1)).tobytes(),
                                    i % 10, (3, 32, 32))
            else:
                assert imgs is not None
                value = caffe_datum(imgs[i % len(imgs)], i % 10)
            txn.put(f"{i:08d}_c{i % 10}/{i}.JPEG".encode(), value)
    env.close()


def best(fn: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_index(d: Path, rounds: int, dali: Path | None, mx_python: str | None, tmp: Path) -> list[tuple[str, float]]:
    files = sorted(d.glob("*.rec"))
    rows = []

    def ours() -> None:
        for p in d.glob("*.idx"):
            p.unlink()
        (d / "manifest.json").unlink(missing_ok=True)
        index_dataset(d)

    rows.append(("stager index (hash, framing, IRHeaders, .idx)", best(ours, rounds)))
    script = next(iter(dali.rglob("rec2idx.py")), None) if dali is not None else None
    if script is not None and mx_python:
        def theirs() -> None:
            for p in files:
                subprocess.run([mx_python, str(script), str(p), str(tmp / f"{p.stem}.dali.idx")], check=True,
                               capture_output=True)

        rows.append(("DALI rec2idx.py (MXNet's reader, one process per file)", best(theirs, rounds)))
        for p in files:  # the same index, byte for byte
            same = (tmp / f"{p.stem}.dali.idx").read_bytes() == p.with_suffix(".idx").read_bytes()
            rows.append((f"  {p.name}: .idx identical to rec2idx's: {same}", float("nan")))
    return rows


def _touch(batch: dict[str, Any]) -> int:
    total = 0
    for x in batch["image"]:
        total += len(x)
        np.frombuffer(x, np.uint8)[::4096].sum()
    return total


def loader_epochs(path: Path, **kw: Any) -> Any:
    """A function running ``EPOCHS`` epochs of a stager loader over ``path``; returns samples per epoch."""
    loader = make_loader(str(path), staged=False, seed=0, **kw)

    def run() -> int:
        n = 0
        for e in range(EPOCHS):
            loader.set_epoch(e)
            for b in loader:
                if kw.get("decode") == "raw":
                    _touch(b)
                n += len(b["key"])
        return n // EPOCHS

    return run


def interleaved(runs: dict[str, Any], rounds: int) -> dict[str, tuple[int, float]]:
    """Best seconds per epoch of each run, measured in alternation (A B A B ...) after one warm-up each,
    so that a busy machine's drift hits every contender alike."""
    counts = {k: f() for k, f in runs.items()}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, f in runs.items():
            t = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t) / EPOCHS)
    return {k: (counts[k], min(v)) for k, v in times.items()}


def _datum_class() -> Any:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FileDescriptorProto(name="caffe_datum.proto", package="caffe", syntax="proto2")
    m = f.message_type.add(name="Datum")
    t = descriptor_pb2.FieldDescriptorProto
    for name, num, typ, lab in (("channels", 1, t.TYPE_INT32, t.LABEL_OPTIONAL),
                                ("height", 2, t.TYPE_INT32, t.LABEL_OPTIONAL),
                                ("width", 3, t.TYPE_INT32, t.LABEL_OPTIONAL),
                                ("data", 4, t.TYPE_BYTES, t.LABEL_OPTIONAL),
                                ("label", 5, t.TYPE_INT32, t.LABEL_OPTIONAL),
                                ("float_data", 6, t.TYPE_FLOAT, t.LABEL_REPEATED),
                                ("encoded", 7, t.TYPE_BOOL, t.LABEL_OPTIONAL)):
        m.field.add(name=name, number=num, type=typ, label=lab)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("caffe.Datum"))


class CaffeLmdbDataset:
    """The usual PyTorch recipe: py-lmdb opened lazily in each worker, one ``txn.get`` per sample."""

    def __init__(self, path: str, pixels: bool) -> None:
        import lmdb

        self.path, self.pixels = path, pixels
        env = lmdb.open(path, readonly=True, lock=False, readahead=False, meminit=False)
        with env.begin() as txn:
            self.keys = [k for k, _ in txn.cursor()]
        env.close()
        self.env: Any = None
        self.datum: Any = None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        if self.env is None:  # in the worker, after the fork
            import lmdb

            self.env = lmdb.open(self.path, readonly=True, lock=False, readahead=False, meminit=False)
            self.datum = _datum_class()
        with self.env.begin(write=False) as txn:
            value = txn.get(self.keys[i])
        d = self.datum()
        d.ParseFromString(value)
        if not self.pixels:  # the stored bytes: an encoded image, or a raw Datum's planar pixels
            return d.data, d.label
        import torch

        arr = np.frombuffer(d.data, np.uint8).reshape(d.channels, d.height, d.width)[::-1].transpose(1, 2, 0)
        return torch.from_numpy(np.ascontiguousarray(arr)), d.label


def recipe_epochs(path: Path, pixels: bool, batch: int) -> Any:
    import torch
    from torch.utils.data import DataLoader

    ds = CaffeLmdbDataset(str(path), pixels)
    collate = None if pixels else (lambda items: ([x for x, _ in items], torch.tensor([y for _, y in items])))
    dl = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=2, persistent_workers=True, collate_fn=collate)

    def run() -> int:
        n = 0
        for _ in range(EPOCHS):
            for images, _labels in dl:
                if not pixels:
                    _touch({"image": images})
                n += len(images)
        return n // EPOCHS

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rec", type=int, default=2000)
    ap.add_argument("--lmdb", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dali-scripts", type=Path, default=None, help="directory holding DALI's rec2idx.py")
    ap.add_argument("--mxnet-python", default=os.environ.get("STAGER_MXNET_PYTHON"),
                    help="python of a venv with mxnet==1.9.1 and numpy<1.24 (rec2idx imports MXNet)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "legacy.md")
    a = ap.parse_args(argv)
    from stager.pack import pack

    with tempfile.TemporaryDirectory(prefix="bench-legacy-", dir=os.environ.get("STAGER_BENCH_TMP")) as t:
        tmp = Path(t)
        imgs = images(a.rec)
        for sub in ("rec", "folder"):
            (tmp / sub).mkdir()
        write_rec(tmp / "rec", imgs)
        write_folder(tmp / "folder", imgs)
        rec_bytes = sum(p.stat().st_size for p in (tmp / "rec").glob("*.rec"))
        idx = bench_index(tmp / "rec", a.rounds, a.dali_scripts, a.mxnet_python, tmp)
        pack(tmp / "folder", tmp / "packed", "tar", shard_size=SHARD)
        shutil.rmtree(tmp / "folder")
        load = []
        for workers in (0, 2):
            what = f"raw bytes, {workers or 1} {'workers' if workers else 'process'}"
            got = interleaved({label: loader_epochs(path, batch_size=64, decode="raw", num_workers=workers)
                               for label, path in (("stager pack --format tar", tmp / "packed"),
                                                   (".rec adopted in place", tmp / "rec"))}, a.rounds)
            load += [(f"{label}, {what}", n, sec) for label, (n, sec) in got.items()]
        write_lmdb(tmp / "lmdb-raw", a.lmdb, raw=True)
        write_lmdb(tmp / "lmdb-jpeg", a.rec, raw=False, imgs=imgs)
        index_dataset(tmp / "lmdb-raw")
        index_dataset(tmp / "lmdb-jpeg")
        lm = []
        cases = (("encoded JPEG Datums, decode=\"raw\": image bytes (batch 64)", "lmdb-jpeg", 64,
                  {"decode": "raw"}, False),
                 ("raw 32x32 Datums, decode=\"raw\": pixel bytes (batch 256; stager's RGB HWC, the recipe's "
                  "planar BGR as stored)", "lmdb-raw", 256, {"decode": "raw"}, False),
                 ("raw 32x32 Datums, decoded: RGB uint8 batches (batch 256)", "lmdb-raw", 256, {"transform": None},
                  True))
        for label, sub, batch, kw, pixels in cases:
            got = interleaved({"stager": loader_epochs(tmp / sub, batch_size=batch, num_workers=2, **kw),
                               "recipe": recipe_epochs(tmp / sub, pixels, batch)}, a.rounds)
            lm.append((label, *got["stager"], *got["recipe"]))
    buf = io.StringIO()
    buf.write(f"# MXNet RecordIO and LMDB in place\n\nGenerated by `python tools/bench/bench_legacy.py "
              f"{' '.join(argv if argv is not None else sys.argv[1:])}` on {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f} at the end; warm page cache, best of {a.rounds}.\n\n")
    buf.write(f"Indexing {a.rec:,} JPEG records ({rec_bytes / 1e6:.0f} MB of .rec):\n\n| indexer | seconds | GB/s | "
              "records/s | vs stager |\n|---|---:|---:|---:|---:|\n")
    base = idx[0][1]
    for how, sec in idx:
        if math.isnan(sec):  # a note row
            buf.write(f"| {how} | | | | |\n")
            continue
        buf.write(f"| {how} | {sec:.3f} | {rec_bytes / sec / 1e9:.2f} | {a.rec / sec:,.0f} | {base / sec:.2f} |\n")
    if len(idx) == 1:
        buf.write("| DALI rec2idx.py | not run: pass --dali-scripts and --mxnet-python | | | |\n")
    buf.write("\n| loader over | samples | seconds | samples/s | vs packed |\n|---|---:|---:|---:|---:|\n")
    for i, (label, n, sec) in enumerate(load):
        ref = load[i - i % 2]
        buf.write(f"| {label} | {n:,} | {sec:.3f} | {n / sec:,.0f} | {(n / sec) / (ref[1] / ref[2]):.2f} |\n")
    buf.write("\n| LMDB, 2 workers | stager samples/s | PyTorch recipe samples/s | stager vs recipe |\n"
              "|---|---:|---:|---:|\n")
    for label, n, sec, n2, sec2 in lm:
        buf.write(f"| {label} | {n / sec:,.0f} | {n2 / sec2:,.0f} | {(n / sec) / (n2 / sec2):.2f} |\n")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(buf.getvalue())
    print(buf.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
