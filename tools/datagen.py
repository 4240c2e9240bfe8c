"""Realistic synthetic image datasets with a fixed seed (no downloads here).

* :func:`make_imagefolder`: an ImageFolder tree (``root/<class>/<name>.JPEG``) of ImageNet-like
  JPEGs: sizes varied around 500x375, quality ~90, structured content (gradients, shapes, textures
  at several scales) plus sensor-like noise, so files are ~80-150 KB like real photos and compress
  like them. Each class has its own palette and dominant orientation, so a small CNN learns it
  quickly (the demo's accuracy rises above chance within an epoch).
* :func:`make_cifar`: a CIFAR-10-like set of 32x32 images in CIFAR-10's true python on-disk format
  (``cifar-10-batches-py/data_batch_1..5``, ``test_batch``, ``batches.meta``: pickled dicts with
  ``data`` uint8 N x 3072 in channel-major RGB order and ``labels``), and optionally the same images
  as a PNG ImageFolder.
* :func:`make_tiny_imagefolder`: an ImageFolder tree at ImageNet's *count* (1,000 classes x 1,281
  files by default) of tiny (~1 KB) photo-like JPEGs, fast enough to write 1.28M files in a couple of
  minutes: each class renders a few dozen variants once, and every file is one of them with its own
  JPEG comment segment (its name), so no two files are byte-identical.

Command line: ``python -m tools.datagen imagenet OUT --classes 10 --per-class 50`` or
``python -m tools.datagen cifar OUT --train 5000 --test 1000 [--png]`` or
``python -m tools.datagen tiny OUT --classes 1000 --per-class 1281 [--jobs 2]``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
from pathlib import Path

import numpy as np
from PIL import Image

CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _class_style(label: int, num_classes: int) -> tuple[np.ndarray, float, float]:
    rng = np.random.default_rng((7919, label))
    palette = rng.uniform(30, 225, size=(3, 3))  # three RGB colours
    angle = np.pi * label / max(num_classes, 1)
    freq = 0.02 + 0.05 * ((label * 37) % 11) / 11
    return palette, angle, freq


def render_image(
    rng: np.random.Generator, label: int, num_classes: int, h: int, w: int, *, noise: float = 14.0
) -> np.ndarray:
    """An (h, w, 3) uint8 image: class-styled gradient, oriented texture, random shapes, noise."""
    palette, angle, freq = _class_style(label, num_classes)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    t = (xx * np.cos(angle) + yy * np.sin(angle)) / max(h, w)
    base = palette[0][None, None, :] * (1 - t[..., None]) + palette[1][None, None, :] * t[..., None]
    stripes = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * freq * 2 * np.pi + rng.uniform(0, 6.3))
    img = base + 28 * stripes[..., None]
    # Low-frequency "scene" variation: a coarse random field upsampled (illumination, clutter).
    coarse = rng.normal(0, 1, size=(max(h // 32, 2), max(w // 32, 2), 3)).astype(np.float32)
    field = np.asarray(
        Image.fromarray(((coarse - coarse.min()) / (np.ptp(coarse) + 1e-6) * 255).astype(np.uint8)).resize(
            (w, h), Image.Resampling.BICUBIC
        ),
        dtype=np.float32,
    )
    img += (field - 128) * 0.35
    # Mid-frequency texture (foliage, fabric, fur): a finer random field with its own amplitude.
    fine = rng.normal(0, 1, size=(max(h // 4, 2), max(w // 4, 2))).astype(np.float32)
    tex = np.asarray(
        Image.fromarray(((fine - fine.min()) / (np.ptp(fine) + 1e-6) * 255).astype(np.uint8)).resize(
            (w, h), Image.Resampling.BILINEAR
        ),
        dtype=np.float32,
    )
    img += (tex - 128)[..., None] * rng.uniform(0.35, 0.6)
    # Random objects in the class's third colour and in random colours.
    for k in range(int(rng.integers(3, 9))):
        cy, cx = rng.uniform(0, h), rng.uniform(0, w)
        ry, rx = rng.uniform(h * 0.04, h * 0.3), rng.uniform(w * 0.04, w * 0.3)
        mask = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1.0
        colour = palette[2] if k % 2 == 0 else rng.uniform(0, 255, 3)
        img[mask] = img[mask] * 0.3 + colour * 0.7
    img += rng.normal(0, noise, size=img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def jpeg_bytes(arr: np.ndarray, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def png_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def make_imagefolder(
    root: str | os.PathLike[str],
    num_classes: int = 10,
    per_class: int = 20,
    *,
    seed: int = 0,
    size: tuple[int, int] = (500, 375),
    jitter: float = 0.25,
    quality: int = 90,
    ext: str = "JPEG",
) -> Path:
    """Write ``num_classes * per_class`` JPEGs under ``root/<class>/``; return ``root``.

    Sizes are drawn around ``size`` (width, height) within +-``jitter``; class folders are named
    like ImageNet synsets (``n0000000c``) so sorted order equals label order.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    for c in range(num_classes):
        d = root / f"n{c:08d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w = int(size[0] * rng.uniform(1 - jitter, 1 + jitter))
            h = int(size[1] * rng.uniform(1 - jitter, 1 + jitter))
            arr = render_image(rng, c, num_classes, max(h, 8), max(w, 8))
            (d / f"n{c:08d}_{i:05d}.{ext}").write_bytes(jpeg_bytes(arr, quality))
    return root


def make_cifar(
    root: str | os.PathLike[str],
    n_train: int = 500,
    n_test: int = 100,
    *,
    seed: int = 0,
    png_folder: bool = False,
) -> Path:
    """Write ``root/cifar-10-batches-py`` in CIFAR-10's real format; return that directory.

    ``n_train`` images are split over the 5 ``data_batch_*`` files. With ``png_folder`` the same
    images are also written as ``root/cifar-png/{train,test}/<class>/<index>.png``.
    """
    root = Path(root)
    out = root / "cifar-10-batches-py"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def batch(n: int, name: str, split: str) -> None:
        labels = [int(x) for x in rng.integers(0, 10, size=n)]
        data = np.empty((n, 3072), dtype=np.uint8)
        filenames = []
        for i, lab in enumerate(labels):
            arr = render_image(rng, lab, 10, 32, 32, noise=10.0)
            data[i] = arr.transpose(2, 0, 1).reshape(-1)  # CIFAR rows: 1024 R, 1024 G, 1024 B
            filenames.append(f"{CIFAR_CLASSES[lab]}_s_{name}_{i:06d}.png".encode())
            if png_folder:
                d = root / "cifar-png" / split / CIFAR_CLASSES[lab]
                d.mkdir(parents=True, exist_ok=True)
                (d / f"{name}_{i:06d}.png").write_bytes(png_bytes(arr))
        blob = {b"batch_label": f"{name} of 5".encode(), b"labels": labels, b"data": data, b"filenames": filenames}
        with open(out / name, "wb") as f:
            pickle.dump(blob, f, protocol=2)

    sizes = [n_train // 5 + (1 if i < n_train % 5 else 0) for i in range(5)]
    for i, n in enumerate(sizes):
        batch(n, f"data_batch_{i + 1}", "train")
    batch(n_test, "test_batch", "test")
    meta = {b"label_names": [c.encode() for c in CIFAR_CLASSES], b"num_cases_per_batch": sizes[0], b"num_vis": 3072}
    with open(out / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return out


def _tiny_variant(rng: np.random.Generator, label: int, side: int) -> bytes:
    """A ``side`` x ``side`` JPEG (~1 KB at 36 px): a class-coloured gradient, sensor noise, one patch."""
    pal = np.random.default_rng((7919, label)).uniform(30, 225, size=(2, 3))
    t = np.linspace(0, 1, side)[None, :, None]
    img = np.broadcast_to(pal[0] * (1 - t) + pal[1] * t, (side, side, 3)) + rng.normal(0, 12, (side, side, 3))
    y, x = rng.integers(0, side - 8, size=2)
    img[y : y + 8, x : x + 8] = rng.uniform(0, 255, 3)
    return jpeg_bytes(np.clip(img, 0, 255).astype(np.uint8), quality=75)


def _tiny_classes(job: tuple[str, list[int], int, int, int]) -> int:
    """Write the files of classes ``labels`` (one job of :func:`make_tiny_imagefolder`); their bytes."""
    root, labels, per_class, side, seed = job
    total = 0
    for c in labels:
        rng = np.random.default_rng((seed, c))
        variants = [_tiny_variant(rng, c, side) for _ in range(32)]
        d = Path(root) / f"n{c:08d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            name = f"n{c:08d}_{i:05d}"
            v = variants[int(rng.integers(0, len(variants)))]
            comment = name.encode()
            # SOI, then a COM segment (0xFFFE, big-endian length counting itself) naming the file.
            data = v[:2] + b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment + v[2:]
            with open(d / f"{name}.JPEG", "wb") as f:
                f.write(data)
            total += len(data)
    return total


def make_tiny_imagefolder(
    root: str | os.PathLike[str], num_classes: int = 1000, per_class: int = 1281, *, seed: int = 0, side: int = 36,
    jobs: int = 1,
) -> Path:
    """Write ``num_classes * per_class`` tiny JPEGs (``side`` px square, ~1 KB at 36) under
    ``root/<class>/``, on ``jobs`` processes; return ``root``. Deterministic for a ``seed``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    work = [(str(root), list(range(k, num_classes, jobs)), per_class, side, seed) for k in range(jobs)]
    if jobs > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(jobs) as pool:
            pool.map(_tiny_classes, work)
    else:
        _tiny_classes(work[0])
    return root


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.datagen", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="kind", required=True)
    a = sub.add_parser("imagenet", help="ImageFolder tree of ~500x375 JPEGs")
    a.add_argument("out")
    a.add_argument("--classes", type=int, default=10)
    a.add_argument("--per-class", type=int, default=20)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--quality", type=int, default=90)
    c = sub.add_parser("cifar", help="CIFAR-10 python batches (+ PNG ImageFolder with --png)")
    c.add_argument("out")
    c.add_argument("--train", type=int, default=500)
    c.add_argument("--test", type=int, default=100)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--png", action="store_true")
    t = sub.add_parser("tiny", help="ImageFolder tree at ImageNet's count of ~1 KB JPEGs")
    t.add_argument("out")
    t.add_argument("--classes", type=int, default=1000)
    t.add_argument("--per-class", type=int, default=1281)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--jobs", type=int, default=1)
    args = p.parse_args(argv)
    if args.kind == "tiny":
        root = make_tiny_imagefolder(args.out, args.classes, args.per_class, seed=args.seed, jobs=args.jobs)
        print(json.dumps({"root": str(root), "files": args.classes * args.per_class}))
    elif args.kind == "imagenet":
        root = make_imagefolder(args.out, args.classes, args.per_class, seed=args.seed, quality=args.quality)
        files = list(root.rglob("*.JPEG"))
        total = sum(f.stat().st_size for f in files)
        print(json.dumps({"root": str(root), "files": len(files), "bytes": total, "mean_kb": total / len(files) / 1e3}))
    else:
        out = make_cifar(args.out, args.train, args.test, seed=args.seed, png_folder=args.png)
        print(json.dumps({"root": str(out), "train": args.train, "test": args.test}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
