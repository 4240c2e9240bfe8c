"""Loader throughput: stager's loader (each format) against the peers' readers, same data, one run.

For a CIFAR-like set (32x32 PNGs) and an ImageNet-like set (~500x375 JPEGs), packed once per
reader's own format from the same ImageFolder tree, this measures samples/s for:

* ``raw``: the encoded bytes of every sample, in-process (one core) and through a torch DataLoader
  with 2 workers (batches of ``--batch``). The 2-worker rows report a fresh loader's *first epoch*
  (worker start included) and the *steady state* of the following epochs over the same loader, with
  persistent workers for every reader (stager's default; ``persistent_workers=True`` for the peers'
  DataLoader, whose worker keeps its peer dataset object across epochs);
* ``crops``: decoded 224x224 random-resized training crops (flip included), in-process, per core.

Readers: ``stager <fmt>`` (``make_loader``, default shuffle), webdataset ``WebDataset`` over
stager's tar shards (they are webdataset-compatible; ``shardshuffle=False``, no sample shuffle:
the fastest it can go), MosaicML ``StreamingDataset`` over an MDS copy, LitData
``StreamingDataset`` over a ``litdata.optimize`` copy, a per-file ImageFolder loop (``open`` +
``read`` per image: the small-file baseline), and ``cat`` of the stager tar shards to /dev/null as
the ceiling. Peers that cannot be imported are skipped with a note (``tools/bench/setup_peers.sh``
installs them). The peers' DataLoader path collates per-sample ``bytes`` (pickled through the
worker queue); stager's raw batches travel as one shared-memory tensor.

Crops: stager (``decode="uint8", transform="train"``: :mod:`stager.decode`, the whole loader path)
against "plain PIL" (the issue's baseline: full decode, crop, resize, torchvision's PIL path step for
step, via ``stager.decode``'s ``pil`` backend) and, for reference, PIL cropping and resizing in one
pass (``Image.resize(box=...)``).

The page cache is warm (the data was just written): this measures the reader, not the disk.
Usage: ``python -m tools.bench.bench_loader [--cifar 4000] [--imagenet 400] [--batch 64]``; prints
a JSON object and writes docs/bench/loader.md (with the shuffle-quality tables).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stager.loader import make_loader  # noqa: E402
from stager.pack import pack  # noqa: E402
from tools.datagen import make_cifar, make_imagefolder  # noqa: E402

FORMATS = ("tar", "record", "hdf5", "zarr")
SHARD_BYTES = 64 << 20


# ---- data ---------------------------------------------------------------------------------------
def make_sets(work: Path, n_cifar: int, n_imagenet: int, unique_imagenet: int = 200) -> dict[str, Path]:
    """CIFAR-like PNGs, and ImageNet-like JPEGs: ``unique_imagenet`` rendered images, each copied
    under several names up to ``n_imagenet`` (rendering is slow; readers only see bytes)."""
    sets = {}
    if n_cifar:
        make_cifar(work / "cifar", n_train=n_cifar, n_test=10, seed=1, png_folder=True)
        sets["cifar"] = work / "cifar" / "cifar-png" / "train"
    if n_imagenet:
        per = max(1, unique_imagenet // 10)
        uniq = make_imagefolder(work / "imagenet-unique", num_classes=10, per_class=per, seed=2)
        files = sorted(uniq.rglob("*.JPEG"))
        out = work / "imagenet"
        for i in range(n_imagenet):
            f = files[i % len(files)]
            d = out / f.parent.name
            d.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, d / f"{f.stem}_{i // len(files)}.JPEG")
        sets["imagenet"] = out
    return sets


def list_folder(src: Path) -> list[tuple[Path, int]]:
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    return [(f, i) for i, c in enumerate(classes) for f in sorted((src / c).iterdir())]


def pack_peers(src: Path, out: Path) -> dict[str, str]:
    """Write the MDS and LitData copies (not timed). Returns notes for peers that are unavailable."""
    notes = {}
    items = list_folder(src)
    try:
        from streaming import MDSWriter

        with MDSWriter(out=str(out / "mds"), columns={"image": "bytes", "label": "int"}, size_limit=SHARD_BYTES) as w:
            for path, label in items:
                w.write({"image": path.read_bytes(), "label": label})
    except Exception as exc:  # an optional peer: any import/setup failure means "skip with a note"
        notes["mosaicml"] = f"skipped: {type(exc).__name__}: {exc}"[:200]
    try:
        from litdata import optimize

        optimize(
            fn=_litdata_item,
            inputs=[(str(p), lab) for p, lab in items],
            output_dir=str(out / "litdata"),
            chunk_bytes=SHARD_BYTES,
            num_workers=1,
            mode="overwrite",
            verbose=False,
            reorder_files=False,
        )
    except Exception as exc:
        notes["litdata"] = f"skipped: {type(exc).__name__}: {exc}"[:200]
    return notes


def _litdata_item(item: tuple[str, int]) -> dict[str, Any]:
    with open(item[0], "rb") as f:
        return {"image": f.read(), "label": item[1]}


# ---- readers: each returns an iterable of samples (bytes-like) or of batches ----------------------
def _collate_bytes(samples: list[Any]) -> list[Any]:
    return samples


def wds_samples(tar_dir: Path) -> Iterable[bytes]:
    import webdataset as wds

    urls = sorted(str(p) for p in tar_dir.glob("*.tar"))
    for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        yield next(v for k, v in s.items() if k in ("jpg", "jpeg", "png"))


def mds_dataset(mds_dir: Path) -> Any:
    from streaming import StreamingDataset

    return StreamingDataset(local=str(mds_dir), shuffle=False, batch_size=1)


def litdata_dataset(lit_dir: Path) -> Any:
    from litdata import StreamingDataset

    return StreamingDataset(str(lit_dir))


class _Mapped:
    """An iterable dataset wrapper that yields ``sample["image"]`` (for the peers' datasets)."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __iter__(self) -> Any:
        for s in self.ds:
            img = s["image"]
            # LitData hands out memoryviews, which cannot cross a worker queue: what a user does.
            yield bytes(img) if isinstance(img, memoryview) else img


def per_file(src: Path) -> Iterable[bytes]:
    for path, _ in list_folder(src):
        with open(path, "rb") as f:
            yield f.read()


MIN_SECONDS = 1.0  # repeat whole passes (epochs) until this much time is measured
PAGE = 4096


def touch(x: Any) -> int:
    """What a consumer does at least: read the bytes. One byte per 4 KiB page, so that lazily
    mapped payloads (stager's zero-copy views) pay their page faults like copied ones did."""
    mv = memoryview(x)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")  # decoded arrays (zarr)
    n = len(mv)
    if n <= PAGE:
        return int(mv[0]) if n else 0
    return int(np.frombuffer(mv, dtype=np.uint8)[::PAGE].sum())


def _cpu() -> float:
    """CPU seconds of this process, its reaped children, and its live children (persistent workers).

    A child alive at the first reading and reaped by the second is counted in both, so the
    difference still covers exactly the interval.
    """
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + _live_children_cpu()


def _live_children_cpu() -> float:
    me, ticks, total = os.getpid(), os.sysconf("SC_CLK_TCK"), 0
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:  # fields[1]: ppid; [11], [12]: utime, stime in clock ticks
            total += int(fields[11]) + int(fields[12])
    return total / ticks


def _rate(make: Callable[[], Iterable[Any]], n_expect: int, count: Callable[[Any], int]) -> dict[str, float]:
    """Samples/s and CPU us/sample over whole passes after one untimed warm-up pass.

    ``count(item)`` touches the item's samples and returns how many it held.
    """
    passes = [0]

    def one() -> None:
        n = sum(count(x) for x in make())
        if n < n_expect:
            raise RuntimeError(f"reader yielded {n} samples, expected {n_expect}")
        passes[0] += 1

    one()
    passes[0] = 0
    t, c = time.perf_counter(), _cpu()
    while time.perf_counter() - t < MIN_SECONDS:
        one()
    wall, cpu = time.perf_counter() - t, _cpu() - c
    done = passes[0] * n_expect
    return {"sps": done / wall, "cpu_us": cpu / done * 1e6}


def _count_sample(x: Any) -> int:
    touch(x)
    return 1


def _count_list(xs: list[Any]) -> int:
    for x in xs:
        touch(x)
    return len(xs)


def _count_batch(b: dict[str, Any]) -> int:
    for x in b["image"]:
        touch(x)
    return len(b["key"])


def time_epochs(make: Callable[[], Any], n_expect: int, count: Callable[[Any], int]) -> dict[str, float]:
    """A 2-worker loader from ``make()``: its first epoch (worker start included), then the steady
    state of further epochs over the same loader (persistent workers), as :func:`_rate` measures."""
    t, c = time.perf_counter(), _cpu()
    loader = make()
    n = sum(count(x) for x in loader)
    if n < n_expect:
        raise RuntimeError(f"reader yielded {n} samples, expected {n_expect}")
    first_wall, first_cpu = time.perf_counter() - t, _cpu() - c
    try:
        steady = _rate(lambda: loader, n_expect, count)
    finally:
        _close(loader)
    return steady | {"first_sps": n_expect / first_wall, "first_cpu_us": first_cpu / n_expect * 1e6}


def _close(loader: Any) -> None:
    """Stop a loader's persistent workers (stager's Loader.close, or the torch DataLoader's iterator)."""
    if hasattr(loader, "close"):
        loader.close()
        return
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def time_samples(make: Callable[[], Iterable[Any]], n_expect: int) -> dict[str, float]:
    return _rate(make, n_expect, _count_sample)


def time_batches(make: Callable[[], Iterable[Any]], n_expect: int, count: Callable[[Any], int]) -> dict[str, float]:
    return _rate(make, n_expect, count)


class _Split:
    """IterableDataset over a sample iterable, dealing samples round-robin to DataLoader workers."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory

    def __iter__(self) -> Any:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        for i, s in enumerate(self.factory()):
            if info is None or i % info.num_workers == info.id:
                yield s


class _Whole:
    """IterableDataset over a peer's dataset, which splits its samples over workers itself.

    A persistent worker keeps the peer's dataset object across epochs (how one trains with it),
    unless the factory returns a one-shot iterator (a generator), which is made again each epoch.
    """

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory
        self._obj: Any = None

    def __iter__(self) -> Any:
        obj = self._obj if self._obj is not None else self.factory()
        it = iter(obj)
        self._obj = obj if it is not obj else None
        return it


def dataloader(iterable_factory: Callable[[], Any], batch: int, *, split: bool = True) -> Any:
    """The peers' path: per-sample ``bytes`` collated into lists and pickled through the queue.

    ``split``: deal samples to workers here (plain iterables); the peers' datasets (webdataset,
    MosaicML, LitData) split by worker themselves.
    """
    from torch.utils.data import DataLoader, IterableDataset

    ds = type("WorkerDS", (_Split if split else _Whole, IterableDataset), {})(iterable_factory)
    return DataLoader(
        ds,
        batch_size=batch,
        num_workers=2,
        collate_fn=_collate_bytes,
        multiprocessing_context="fork",
        timeout=60,
        persistent_workers=True,
    )


def bench_set(name: str, src: Path, work: Path, batch: int, *, crops: int, rounds: int = 3) -> dict[str, Any]:
    packed = {}
    for fmt in FORMATS:
        resize = (32, 32) if (fmt == "zarr" and name == "cifar") else (256, 256) if fmt == "zarr" else None
        packed[fmt] = work / f"{name}-{fmt}"
        pack(src, packed[fmt], fmt, shard_size=SHARD_BYTES, resize=resize)
    notes = pack_peers(src, work / f"{name}-peers")
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)  # litdata.optimize switches it to spawn
    items = list_folder(src)
    n = len(items)
    mean_bytes = sum(p.stat().st_size for p, _ in items) / n
    tasks: list[tuple[str, str, Callable[[], dict[str, float]]]] = []

    def add(reader: str, mode: str, fn: Callable[[], dict[str, float]]) -> None:
        tasks.append((reader, mode, fn))

    # Same semantics as the peers' readers below (no shuffle), then stager's default shuffle.
    for fmt, shuffle in [(f, False) for f in FORMATS] + [("tar", True)]:
        label = f"stager {fmt}" + (" (decoded arrays)" if fmt == "zarr" else "") + (" shuffled" if shuffle else "")

        def inproc(fmt: str = fmt, shuffle: bool = shuffle) -> dict[str, float]:
            ld = make_loader(packed[fmt], batch, rank=0, world_size=1, decode="raw", staged=False, shuffle=shuffle)
            return time_batches(lambda: ld, n, _count_batch)

        def dl2(fmt: str = fmt, shuffle: bool = shuffle) -> dict[str, float]:
            return time_epochs(
                lambda: make_loader(
                    packed[fmt],
                    batch,
                    rank=0,
                    world_size=1,
                    decode="raw",
                    num_workers=2,
                    staged=False,
                    shuffle=shuffle,
                    multiprocessing_context="fork",
                ),
                n,
                _count_batch,
            )

        add(label, "in-process", inproc)
        add(label, "2-worker DataLoader", dl2)
    tar_dir = packed["tar"]
    add("webdataset", "in-process", lambda: time_samples(lambda: wds_samples(tar_dir), n))
    add(
        "webdataset",
        "2-worker DataLoader",
        lambda: time_epochs(lambda: dataloader(lambda: wds_samples(tar_dir), batch, split=False), n, _count_list),
    )
    if "mosaicml" not in notes:
        mds = work / f"{name}-peers" / "mds"
        add("mosaicml streaming", "in-process", lambda: time_samples(lambda: _Mapped(mds_dataset(mds)), n))
        add(
            "mosaicml streaming",
            "2-worker DataLoader",
            lambda: time_epochs(
                lambda: dataloader(lambda: _Mapped(mds_dataset(mds)), batch, split=False), n, _count_list
            ),
        )
    if "litdata" not in notes:
        lit = work / f"{name}-peers" / "litdata"
        add("litdata", "in-process", lambda: time_samples(lambda: _Mapped(litdata_dataset(lit)), n))
        add(
            "litdata",
            "2-worker DataLoader",
            lambda: time_epochs(
                lambda: dataloader(lambda: _Mapped(litdata_dataset(lit)), batch, split=False), n, _count_list
            ),
        )
    add("ImageFolder per-file", "in-process", lambda: time_samples(lambda: per_file(src), n))
    add(
        "ImageFolder per-file",
        "2-worker DataLoader",
        lambda: time_epochs(lambda: dataloader(lambda: per_file(src), batch), n, _count_list),
    )
    files = sorted(str(p) for p in tar_dir.glob("*.tar"))
    tar_bytes = sum(os.path.getsize(f) for f in files)

    def cat() -> dict[str, float]:
        t, c = time.perf_counter(), _cpu()
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
        wall = time.perf_counter() - t
        # Samples/s at the tar files' bytes per sample (headers included): the copy ceiling.
        return {"sps": n / wall, "cpu_us": (_cpu() - c) / n * 1e6, "gbps": tar_bytes / wall / 1e9}

    add("cat (ceiling)", "in-process", cat)

    # Alternating rounds: every reader once per round, best of the rounds (the machine is shared).
    best: dict[str, dict[str, dict[str, float]]] = {}
    for _ in range(rounds):
        for reader, mode, fn in tasks:
            if f"{reader} {mode}" in notes:
                continue  # failed in an earlier round (e.g. a DataLoader timeout): do not wait again
            try:
                got = fn()
            except Exception as exc:
                notes[f"{reader} {mode}"] = f"failed: {type(exc).__name__}: {exc}"[:200]
                continue
            cur = best.setdefault(reader, {}).get(mode)
            if cur is None:
                best[reader][mode] = got
            else:  # best rate and lowest CPU per sample, each over the rounds
                cur["sps"] = max(cur["sps"], got["sps"])
                cur["cpu_us"] = min(cur["cpu_us"], got["cpu_us"])
                if "first_sps" in got:
                    cur["first_sps"] = max(cur["first_sps"], got["first_sps"])
                    cur["first_cpu_us"] = min(cur["first_cpu_us"], got["first_cpu_us"])
                if "gbps" in got:
                    cur["gbps"] = max(cur.get("gbps", 0.0), got["gbps"])
    raw: dict[str, dict[str, dict[str, float]]] = {}
    for reader, modes in best.items():
        for mode, v in modes.items():
            gbps = v.get("gbps", v["sps"] * mean_bytes / 1e9)
            raw.setdefault(reader, {})[mode] = {
                "samples_per_s": round(v["sps"], 1),
                "gb_per_s": round(gbps, 3),
                "cpu_us_per_sample": round(v["cpu_us"], 2),
            }
            if "first_sps" in v:
                raw[reader][mode]["first_epoch_samples_per_s"] = round(v["first_sps"], 1)
                raw[reader][mode]["first_epoch_cpu_us_per_sample"] = round(v["first_cpu_us"], 2)
    crop_rates = bench_crops(packed["tar"], src, n, crops, rounds)
    peers = [r for r in ("webdataset", "mosaicml streaming", "litdata") if r in raw]
    modes_all = ("in-process", "2-worker DataLoader")
    fastest = {}
    for mode in modes_all:
        cands = [(raw[r][mode]["samples_per_s"], r) for r in peers if mode in raw[r]]
        if cands:
            fastest[mode] = max(cands)
    firsts = [(raw[r][modes_all[1]]["first_epoch_samples_per_s"], r) for r in peers if modes_all[1] in raw[r]]
    fastest_first = max(firsts) if firsts else None
    cat_gbps = raw.get("cat (ceiling)", {}).get("in-process", {}).get("gb_per_s")
    ratios: dict[str, float] = {}
    for r, modes in raw.items():
        if not r.startswith("stager"):
            continue
        for mode, v in modes.items():
            if mode in fastest:
                v["vs_fastest_peer"] = round(v["samples_per_s"] / fastest[mode][0], 2)
                if "shuffled" not in r:
                    ratios[f"{r} {mode} / fastest peer ({fastest[mode][1]})"] = v["vs_fastest_peer"]
            if "first_epoch_samples_per_s" in v and fastest_first is not None:
                v["first_epoch_vs_fastest_peer"] = round(v["first_epoch_samples_per_s"] / fastest_first[0], 2)
                if "shuffled" not in r:
                    ratios[f"{r} {mode} first epoch / fastest peer's first epoch ({fastest_first[1]})"] = v[
                        "first_epoch_vs_fastest_peer"
                    ]
            if cat_gbps:
                v["vs_cat"] = round(v["gb_per_s"] / cat_gbps, 3)
    ratios["crops per CPU-second: stager / plain PIL"] = round(
        crop_rates["stager (stager.decode)"]["per_cpu_s"] / crop_rates["plain PIL"]["per_cpu_s"], 2
    )
    ratios["crops wall: stager / plain PIL"] = round(
        crop_rates["stager (stager.decode)"]["samples_per_s"] / crop_rates["plain PIL"]["samples_per_s"], 2
    )
    return {
        "samples": n,
        "mean_sample_bytes": round(mean_bytes),
        "raw": raw,
        "fastest_peer": {m: v[1] for m, v in fastest.items()}
        | ({"2-worker first epoch": fastest_first[1]} if fastest_first else {}),
        "crops": crop_rates,
        "ratios": ratios,
        "notes": notes,
    }


def bench_crops(tar_dir: Path, src: Path, n: int, crops: int, rounds: int) -> dict[str, dict[str, float]]:
    """Decoded 224x224 train crops on one core (OpenCV single-threaded): samples/s and per CPU-second.

    Both sides get an untimed warm-up (imports, first mappings) and alternate ``rounds`` times.
    """
    import cv2

    from stager.decode import decode_random_resized_crop, get_decoder
    from stager.loader.transforms import _random_resized_crop

    pil_decoder = get_decoder("pil")

    cv2.setNumThreads(1)
    k = min(n, crops)
    payloads = [p.read_bytes() for p, _ in list_folder(src)[:k]]

    def stager_crops(limit: int) -> int:
        ld = make_loader(tar_dir, 32, rank=0, world_size=1, decode="uint8", transform="train", staged=False)
        got = 0
        for b in ld:
            got += len(b["key"])
            if got >= limit:
                break
        return got

    def pil_crops(limit: int) -> int:
        # The baseline: PIL full decode, crop, resize (torchvision's PIL path, step for step).
        rng = np.random.default_rng(0)
        for data in payloads[:limit]:
            decode_random_resized_crop(data, 224, rng, decoder=pil_decoder)
        return min(limit, len(payloads))

    def pil_one_pass_crops(limit: int) -> int:
        # A stronger PIL variant for reference: crop and resize in one pass (resize(box=...)).
        from PIL import Image

        rng = np.random.default_rng(0)
        for data in payloads[:limit]:
            img = Image.open(io.BytesIO(data)).convert("RGB")
            _random_resized_crop(img, 224, rng)
        return min(limit, len(payloads))

    out: dict[str, dict[str, float]] = {}
    fns = {
        "stager (stager.decode)": stager_crops,
        "plain PIL": pil_crops,
        "PIL one-pass crop+resize": pil_one_pass_crops,
    }
    for fn in fns.values():
        fn(32)  # warm-up
    for _ in range(rounds):
        for name, fn in fns.items():
            t, c = time.perf_counter(), _cpu()
            m = fn(k)
            wall, cpu = time.perf_counter() - t, _cpu() - c
            cur = out.setdefault(name, {"samples_per_s": 0.0, "per_cpu_s": 0.0})
            cur["samples_per_s"] = round(max(cur["samples_per_s"], m / wall), 1)
            cur["per_cpu_s"] = round(max(cur["per_cpu_s"], m / cpu), 1)
    return out


def to_markdown(results: dict[str, Any], quality: list[dict[str, Any]]) -> str:
    from tools.bench.shuffle_quality import to_markdown as quality_md

    lines = [
        "# Loader throughput",
        "",
        f"Machine: {results['machine']}. Load average before/after: {results['load_before']} / "
        f"{results['load_after']} (2 cores shared with other jobs: figures are the best of "
        f"{results['rounds']} alternating rounds; CPU us/sample is the load-robust second metric). "
        "Page cache warm. Every consumer touches one byte per 4 KiB page of every sample. "
        "Generated by `python -m tools.bench.bench_loader`.",
        "",
    ]
    for name, res in results["sets"].items():
        fp = res.get("fastest_peer", {})
        lines += [
            f"## {name} ({res['samples']} samples, {res['mean_sample_bytes']} B/sample)",
            "",
            f"Fastest peer: in-process {fp.get('in-process', '-')}, 2 workers {fp.get('2-worker DataLoader', '-')} "
            f"(first epoch: {fp.get('2-worker first epoch', '-')}).",
            "",
            "2-worker rows: samples/s, CPU and ratios are the steady state (epochs after the first, "
            "persistent workers for every reader); *first epoch* is a fresh loader's first pass, worker "
            "start included.",
            "",
            "| reader | mode | samples/s | GB/s | CPU us/sample | vs fastest peer | vs cat "
            "| first epoch samples/s | first epoch CPU us/sample | first epoch vs fastest peer |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r, modes in res["raw"].items():
            for mode, v in modes.items():
                fe = v.get("first_epoch_samples_per_s")
                lines.append(
                    f"| {r} | {mode} | {v['samples_per_s']:,.0f} | {v['gb_per_s']:.2f} | {v['cpu_us_per_sample']} "
                    f"| {v.get('vs_fastest_peer', '-')} | {v.get('vs_cat', '-')} "
                    f"| {f'{fe:,.0f}' if fe is not None else '-'} | {v.get('first_epoch_cpu_us_per_sample', '-')} "
                    f"| {v.get('first_epoch_vs_fastest_peer', '-')} |"
                )
        lines += ["", "| decoded 224x224 train crops, 1 core | samples/s | samples per CPU-second |"]
        lines += ["| --- | --- | --- |"]
        for r, v in res["crops"].items():
            lines.append(f"| {r} | {v['samples_per_s']} | {v['per_cpu_s']} |")
        lines += ["", "Ratios: " + ", ".join(f"{k} = **{v}**" for k, v in res["ratios"].items()), ""]
        if res["notes"]:
            lines += ["Notes: " + "; ".join(f"{k}: {v}" for k, v in res["notes"].items()), ""]
    if quality:
        lines += ["## Shuffle quality", "", "See tools/bench/shuffle_quality.py for the metric.", quality_md(quality)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cifar", type=int, default=20000, help="CIFAR-like samples (0: skip)")
    ap.add_argument("--imagenet", type=int, default=4000, help="ImageNet-like samples (0: skip)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of them is reported")
    ap.add_argument("--no-quality", action="store_true", help="skip the shuffle-quality tables")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--crops", type=int, default=300, help="samples timed for decoded crops")
    ap.add_argument("--work", help="scratch directory (default: a temporary one)")
    ap.add_argument("--md", default=str(ROOT / "docs" / "bench" / "loader.md"))
    args = ap.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-loader-"))
    try:
        sets = make_sets(work, args.cifar, args.imagenet)
        results: dict[str, Any] = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "rounds": args.rounds,
            "load_before": [round(x, 2) for x in os.getloadavg()],
        }
        results["sets"] = {
            name: bench_set(name, src, work, args.batch, crops=args.crops, rounds=args.rounds)
            for name, src in sets.items()
        }
        results["load_after"] = [round(x, 2) for x in os.getloadavg()]
        quality: list[dict[str, Any]] = []
        if not args.no_quality:
            from tools.bench.shuffle_quality import measure

            quality = [measure("cifar"), measure("imagenet")]
        results["shuffle_quality"] = quality
        print(json.dumps(results, indent=1))
        if args.md:
            Path(args.md).parent.mkdir(parents=True, exist_ok=True)
            Path(args.md).write_text(to_markdown(results, quality))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
