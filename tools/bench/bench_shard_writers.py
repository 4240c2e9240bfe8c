"""How fast do stager's tar and record shard writers go, against the writers people use today?

Single process, in-memory samples (no source reading, no decoding), each run ends with the file
hashed (stager's xxh3-128 ``hash_file``) so "samples/s" includes the checksum a shard needs:

* ``stager_tar`` vs ``webdataset.TarWriter`` (what ``wds.ShardWriter`` writes through) with the same
  members (image, ``cls``, ``json`` metadata);
* ``stager_record`` vs ``tfrecord.writer.TFRecordWriter`` (protobuf per example) with the same
  five ImageNet features;
* ``mosaicml MDSWriter`` (columns ``image: bytes``, ``label: int``) when ``streaming`` is installed.

Workloads: ``png32`` (CIFAR-like 32x32 PNGs, ~3 KB) and ``jpeg100k`` (ImageNet-like JPEGs from
tools.datagen, ~100 KB). Reported: best-of-``--rounds`` samples/s (rounds interleaved across
writers, so load from other processes hits all of them alike) and ours/peer ratios.

Usage: ``python -m tools.bench.bench_shard_writers [--n-small 20000] [--n-large 2000] [--rounds 5]
[--out DIR]``. Prints one JSON object; writes docs/bench/shard_writers.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from stager.checksum import hash_file
from stager.formats import get_format
from stager.formats.base import Sample
from tools.datagen import jpeg_bytes, render_image

CLASSES = [f"n{i:08d}" for i in range(10)]
ROOT = Path(__file__).resolve().parents[2]
STUBBED = ("transformers", "torchvision")  # optional imports of streaming that MDSWriter never uses


def make_payloads(kind: str, count: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    if kind == "png32":
        out = []
        for i in range(count):
            buf = io.BytesIO()
            Image.fromarray(render_image(rng, i % 10, 10, 32, 32)).save(buf, "PNG")
            out.append(buf.getvalue())
        return out
    return [jpeg_bytes(render_image(rng, i % 10, 10, 375, 500)) for i in range(count)]


def samples_of(payloads: list[bytes], n: int, ext: str) -> list[Sample]:
    return [
        Sample(f"n{i % 10:08d}_{i:08d}", i % 10, payloads[i % len(payloads)], ext, {"source": f"train/{i}.{ext}"})
        for i in range(n)
    ]


def run_stager(fmt: str, samples: list[Sample], d: str) -> None:
    f = get_format(fmt)
    path = os.path.join(d, f.shard_name(0))
    w = f.open_writer(path, shard_name=f.shard_name(0), classes=CLASSES)
    for s in samples:
        w.write(s)
    for _, tmp in w.close():
        hash_file(tmp)
    hash_file(path)


def run_wds(samples: list[Sample], d: str) -> None:
    import webdataset as wds

    path = os.path.join(d, "wds.tar")
    with wds.TarWriter(path) as w:
        for s in samples:
            w.write({"__key__": s.key, s.ext: s.data, "cls": s.label, "json": {**s.meta, "label": s.label}})
    hash_file(path)


def run_tfrecord(samples: list[Sample], d: str) -> None:
    from tfrecord.writer import TFRecordWriter

    path = os.path.join(d, "peer.tfrecord")
    w = TFRecordWriter(path)
    for s in samples:
        w.write(
            {
                "image/encoded": (s.data, "byte"),
                "image/class/label": (s.label, "int"),
                "image/class/text": (CLASSES[s.label].encode(), "byte"),
                "image/filename": (s.key.encode(), "byte"),
                "image/format": (b"PNG" if s.ext == "png" else b"JPEG", "byte"),
            }
        )
    w.close()
    hash_file(path)


def run_mds(samples: list[Sample], d: str) -> None:
    from streaming import MDSWriter  # type: ignore[import-not-found]

    out = os.path.join(d, "mds")
    with MDSWriter(out=out, columns={"image": "bytes", "label": "int"}, size_limit=1 << 30) as w:
        for s in samples:
            w.write({"image": s.data, "label": s.label})
    for p in Path(out).iterdir():
        hash_file(p)


def import_streaming() -> bool:
    """Import MosaicML streaming if installed. Its package ``__init__`` imports ``transformers`` and
    ``torchvision`` (DataLoader isinstance checks, text/vision dataset classes); where those are
    absent we serve stub modules for them so that ``MDSWriter``, which never uses them, can be
    measured (we must not install torchvision: it would replace the cluster's torch)."""
    import importlib.abc
    import importlib.util
    import sys
    import types

    try:
        import streaming  # type: ignore[import-not-found]

        return True
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".", maxsplit=1)[0] not in STUBBED:
            return False
    except ImportError:
        return False

    class Stub(types.ModuleType):
        __path__: list[str] = []

        def __getattr__(self, name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname: str, path: object, target: object = None) -> object:
            if fullname.split(".", maxsplit=1)[0] in STUBBED:
                return importlib.util.spec_from_loader(fullname, self, is_package=True)
            return None

        def create_module(self, spec: object) -> types.ModuleType:
            return Stub(spec.name)  # type: ignore[attr-defined]

        def exec_module(self, module: types.ModuleType) -> None:
            return None

    for name in [m for m in sys.modules if m.split(".", maxsplit=1)[0] in (*STUBBED, "streaming")]:
        del sys.modules[name]
    sys.meta_path.insert(0, StubFinder())
    try:
        import streaming  # type: ignore[import-not-found]  # noqa: F401

        return True
    except ImportError:
        return False


def best_rates(fns: dict[str, Callable[[list[Sample], str], None]], samples: list[Sample], rounds: int) -> dict:
    """Best samples/s of each writer; rounds are interleaved so every writer sees the same load."""
    best = dict.fromkeys(fns, 0.0)
    for _ in range(rounds):
        for name, fn in fns.items():
            d = tempfile.mkdtemp(prefix="bench-writers-")
            try:
                t = time.perf_counter()
                fn(samples, d)
                best[name] = max(best[name], len(samples) / (time.perf_counter() - t))
            finally:
                shutil.rmtree(d, ignore_errors=True)
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n-small", type=int, default=20000)
    ap.add_argument("--n-large", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    args = ap.parse_args(argv)
    have_mds = import_streaming()
    results: dict = {"host": platform.node(), "cpus": os.cpu_count(), "rounds": args.rounds, "workloads": {}}
    for kind, n, ext in (("png32", args.n_small, "png"), ("jpeg100k", args.n_large, "jpg")):
        payloads = make_payloads(kind, 64 if kind == "png32" else 16)
        samples = samples_of(payloads, n, ext)
        fns: dict[str, Callable[[list[Sample], str], None]] = {
            "stager_tar": lambda s, d: run_stager("tar", s, d),
            "webdataset_tarwriter": run_wds,
            "stager_record": lambda s, d: run_stager("record", s, d),
            "tfrecord_writer": run_tfrecord,
        }
        if have_mds:
            fns["mosaicml_mdswriter"] = run_mds
        rates = best_rates(fns, samples, args.rounds)
        w: dict = {
            "samples": n,
            "mean_payload_bytes": int(np.mean([len(p) for p in payloads])),
            "samples_per_s": {k: round(v) for k, v in rates.items()},
            "ratio_tar_vs_webdataset": round(rates["stager_tar"] / rates["webdataset_tarwriter"], 2),
            "ratio_record_vs_tfrecord": round(rates["stager_record"] / rates["tfrecord_writer"], 2),
        }
        if have_mds:
            w["ratio_tar_vs_mds"] = round(rates["stager_tar"] / rates["mosaicml_mdswriter"], 2)
        results["workloads"][kind] = w
    results["mosaicml_streaming"] = "installed" if have_mds else "not installed (MDSWriter column skipped)"
    print(json.dumps(results, indent=2))
    write_markdown(results, Path(args.out))
    return results


def write_markdown(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Shard writers: stager tar/record vs webdataset, tfrecord, MosaicML MDS",
        "",
        "Generated by `python -m tools.bench.bench_shard_writers`. Single process, samples in memory, "
        "each run includes hashing the finished file (xxh3-128). Best of "
        f"{results['rounds']} rounds on `{results['host']}` ({results['cpus']} CPUs). MosaicML streaming: "
        f"{results['mosaicml_streaming']}.",
        "",
        "| workload | samples | mean bytes | writer | samples/s |",
        "|---|---:|---:|---|---:|",
    ]
    for kind, w in results["workloads"].items():
        for name, rate in w["samples_per_s"].items():
            lines.append(f"| {kind} | {w['samples']} | {w['mean_payload_bytes']} | {name} | {rate} |")
    lines += [
        "",
        "| workload | stager tar / webdataset | stager record / tfrecord | stager tar / MDS |",
        "|---|---:|---:|---:|",
    ]
    for kind, w in results["workloads"].items():
        mds = w.get("ratio_tar_vs_mds", "n/a")
        lines.append(f"| {kind} | {w['ratio_tar_vs_webdataset']}x | {w['ratio_record_vs_tfrecord']}x | {mds} |")
    lines += [
        "",
        "Why stager is faster: ustar headers are assembled from constant pieces with the checksum "
        "computed from precomputed sums (no `tarfile.TarInfo`), metadata JSON is built from a cached "
        "sorted field plan, records are serialised by a specialised protobuf encoder, and output is "
        "buffered into multi-MB writes instead of several small writes per sample.",
        "",
        "Reading the MDS column: a webdataset tar sample is three 512-byte-aligned members (image, "
        "`.cls`, `.json` with key/class/source), about twice the bytes of an MDS sample holding only "
        "image and label, so on tiny images the tar writer moves ~2x the data for the same work. "
        "Figures from a shared, busy machine are provisional; rerun on an idle node.",
        "",
    ]
    (out / "shard_writers.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
