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

* :func:`make_shapes`: a segmentation/detection set of JPEGs with 1-3 filled shapes (class 1
  rectangle, 2 ellipse, 3 triangle) over a noisy background, with per-pixel class-id PNG masks,
  boxes and box labels, listed in ``train.jsonl``/``val.jsonl`` (``path, mask, boxes, box_labels``)
  and as COCO ``annotations/instances_images.json`` (docs/fields.md).

* Legacy containers, written by hand from their documented layouts (no Caffe, no MXNet):
  :func:`make_caffe_lmdb` (Caffe ``convert_imageset``: keys ``%08d_<path>``, ``Datum`` values, encoded
  JPEG/PNG bytes or raw planar BGR pixels), :func:`make_folder2lmdb` (pickled ``(image bytes, label)``
  values with ``__keys__``/``__len__``, the Efficient-PyTorch style) and :func:`make_recordio`
  (``im2rec``: ``.rec`` of IRHeader + image records, and its ``.idx``). LMDBs need py-lmdb.

* :func:`make_videos`: moving-object videos (coloured discs and squares bouncing over a textured,
  slowly panning background; positions are a deterministic function of time, so the future is
  predictable from the past) as mp4 files (``cv2.VideoWriter``, fourcc ``mp4v``) in
  ``root/videos/<seq>.mp4`` and/or PNG frame folders ``root/frames/<seq>/000000.png`` (KITTI's layout).

Command line: ``python -m tools.datagen imagenet OUT --classes 10 --per-class 50``,
``python -m tools.datagen cifar OUT --train 5000 --test 1000 [--png]``,
``python -m tools.datagen caffe-lmdb|folder2lmdb|recordio OUT --n 1000 [--raw] [--size 32]``,
``python -m tools.datagen video OUT --sequences 8 --frames 60 --size 128``,
``python -m tools.datagen shapes OUT --train 400 --val 100 --size 96`` or
``python -m tools.datagen tiny OUT --classes 1000 --per-class 1281 [--jobs 2]``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import struct
from collections.abc import Iterator
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


SHAPE_CLASSES = ["background", "rectangle", "ellipse", "triangle"]


def render_shapes(
    rng: np.random.Generator, h: int, w: int
) -> tuple[np.ndarray, np.ndarray, list[list[float]], list[int]]:
    """One image (H, W, 3) uint8 with 1-3 shapes, its class-id mask (H, W) uint8, boxes (xyxy) and labels.

    Later shapes are drawn over earlier ones; a box is the extent of the shape's visible pixels
    (shapes hidden entirely are left out)."""
    base = rng.integers(20, 90, 3)
    img = np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255)
    mask = np.zeros((h, w), np.uint8)
    yy, xx = np.mgrid[0:h, 0:w]
    ids = np.zeros((h, w), np.int16) - 1
    labels = []
    for k in range(int(rng.integers(1, 4))):
        cls = int(rng.integers(1, 4))
        cy, cx = rng.uniform(0.2, 0.8) * h, rng.uniform(0.2, 0.8) * w
        ry, rx = rng.uniform(0.1, 0.3) * h, rng.uniform(0.1, 0.3) * w
        if cls == 1:
            inside = (abs(yy - cy) <= ry) & (abs(xx - cx) <= rx)
        elif cls == 2:
            inside = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1
        else:
            inside = (yy <= cy + ry) & (yy >= cy - ry) & (abs(xx - cx) <= rx * (yy - (cy - ry)) / (2 * ry))
        img[inside] = rng.integers(140, 256, 3)
        mask[inside] = cls
        ids[inside] = k
        labels.append(cls)
    boxes, box_labels = [], []
    for k, cls in enumerate(labels):
        ys, xs = np.nonzero(ids == k)
        if len(ys):
            boxes.append([float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)])
            box_labels.append(cls)
    return img.astype(np.uint8), mask, boxes, box_labels


def make_shapes(
    root: str | os.PathLike[str], train: int = 200, val: int = 50, *, size: int = 96, seed: int = 0, quality: int = 92
) -> Path:
    """Write the shapes set under ``root`` (see the module docstring); return ``root``."""
    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "annotations").mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    images, anns = [], []
    for split, n, first in (("train", train, 0), ("val", val, train)):
        rows = []
        for i in range(first, first + n):
            h = int(size * rng.uniform(0.85, 1.15))
            w = int(size * rng.uniform(0.85, 1.15))
            img, mask, boxes, labels = render_shapes(rng, h, w)
            name = f"{i:06d}"
            (root / "images" / f"{name}.jpg").write_bytes(jpeg_bytes(img, quality))
            (root / "images" / f"{name}.mask.png").write_bytes(png_bytes(mask))
            rows.append({"path": f"images/{name}.jpg", "mask": f"images/{name}.mask.png", "boxes": boxes,
                         "box_labels": labels})
            images.append({"id": i, "file_name": f"{name}.jpg", "height": h, "width": w})
            for b, c in zip(boxes, labels, strict=True):
                anns.append({"id": len(anns) + 1, "image_id": i, "category_id": c, "iscrowd": 0,
                             "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]], "area": (b[2] - b[0]) * (b[3] - b[1])})
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cats = [{"id": i, "name": n} for i, n in enumerate(SHAPE_CLASSES) if i]
    (root / "annotations" / "instances_images.json").write_text(
        json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return root


def _pb_varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def caffe_datum(data: bytes, label: int, shape: tuple[int, int, int] | None = None) -> bytes:
    """A serialised ``caffe.Datum`` as protobuf writes it (fields in number order): ``channels = 1``,
    ``height = 2``, ``width = 3`` (raw only), ``data = 4``, ``label = 5``, ``encoded = 7`` (encoded only).
    ``shape`` is ``(C, H, W)`` for raw planar data, None for encoded image bytes."""
    out = bytearray()
    if shape is not None:
        for num, v in zip((1, 2, 3), shape, strict=True):
            out += _pb_varint(num << 3) + _pb_varint(v)
    out += _pb_varint(4 << 3 | 2) + _pb_varint(len(data)) + data
    out += _pb_varint(5 << 3) + _pb_varint(label)
    if shape is None:
        out += _pb_varint(7 << 3) + _pb_varint(1)
    return bytes(out)


def _samples(n: int, num_classes: int, size: int, seed: int, jitter: float) -> Iterator[tuple[int, np.ndarray]]:
    rng = np.random.default_rng(seed)
    for i in range(n):
        lab = i % num_classes
        h = max(8, int(size * rng.uniform(1 - jitter, 1 + jitter)))
        w = max(8, int(size * 4 / 3 * rng.uniform(1 - jitter, 1 + jitter))) if jitter else size
        yield lab, render_image(rng, lab, num_classes, h, w, noise=10.0)


def make_caffe_lmdb(root: str | os.PathLike[str], n: int = 1000, *, num_classes: int = 10, size: int = 32,
                    raw: bool = False, png: bool = False, seed: int = 0, quality: int = 90) -> Path:
    """A Caffe ``convert_imageset`` LMDB at ``root`` (``data.mdb`` + ``lock.mdb``); return ``root``.

    Keys ``%08d_<class>/<name>.JPEG``; values ``Datum``: ``raw`` planar BGR ``(3, size, size)`` uint8
    (what ``convert_imageset`` without ``--encoded`` stores), else the encoded JPEG (or PNG) bytes with
    ``encoded = true``, images ~``size`` x ``4/3 size``."""
    import lmdb

    root = Path(root)
    env = lmdb.open(str(root), map_size=1 << 36)
    with env.begin(write=True) as txn:
        for i, (lab, arr) in enumerate(_samples(n, num_classes, size, seed, 0.0 if raw else 0.25)):
            key = f"{i:08d}_n{lab:08d}/n{lab:08d}_{i:05d}.JPEG".encode()
            if raw:
                value = caffe_datum(np.ascontiguousarray(arr[..., ::-1].transpose(2, 0, 1)).tobytes(), lab,
                                    (3, arr.shape[0], arr.shape[1]))
            else:
                value = caffe_datum(png_bytes(arr) if png else jpeg_bytes(arr, quality), lab)
            txn.put(key, value)
    env.close()
    return root


def make_folder2lmdb(root: str | os.PathLike[str], n: int = 1000, *, num_classes: int = 10, size: int = 64,
                     seed: int = 0, protocol: int = pickle.DEFAULT_PROTOCOL) -> Path:
    """An LMDB as Efficient-PyTorch's ``folder2lmdb`` writes it: keys ``b"0"``, ``b"1"``, ...; values
    ``pickle.dumps((jpeg bytes, label))``; plus ``__keys__`` (the pickled key list) and ``__len__``."""
    import lmdb

    root = Path(root)
    env = lmdb.open(str(root), map_size=1 << 36)
    keys = []
    with env.begin(write=True) as txn:
        for i, (lab, arr) in enumerate(_samples(n, num_classes, size, seed, 0.25)):
            key = f"{i}".encode("ascii")
            txn.put(key, pickle.dumps((jpeg_bytes(arr), lab), protocol=protocol))
            keys.append(key)
        txn.put(b"__keys__", pickle.dumps(keys))
        txn.put(b"__len__", pickle.dumps(len(keys)))
    env.close()
    return root


RECORDIO_MAGIC = 0xCED7230A


def recordio_frame(data: bytes) -> bytes:
    """One record as dmlc's ``RecordIOWriter`` frames it: split where ``data`` holds the magic at a
    4-byte-aligned offset (that magic becomes the next part's header: cflag 1 start, 2 middle, 3 end),
    each part ``magic | lrecord = cflag << 29 | length | bytes``, the last padded to 4 bytes."""
    magic = struct.pack("<I", RECORDIO_MAGIC)
    out = bytearray()
    start = 0
    for i in range(0, len(data) - len(data) % 4, 4):
        if data[i : i + 4] == magic:
            out += magic + struct.pack("<I", (1 if start == 0 else 2) << 29 | (i - start)) + data[start:i]
            start = i + 4
    out += magic + struct.pack("<I", (3 if start else 0) << 29 | (len(data) - start)) + data[start:]
    out += b"\0" * (-len(data) % 4)
    return bytes(out)


def recordio_pack(payload: bytes, label: float | list[float], rid: int, rid2: int = 0) -> bytes:
    """``mx.recordio.pack``: IRHeader ``IfQQ`` (flag, label, id, id2), array labels, payload."""
    if isinstance(label, (list, tuple)):
        return struct.pack("<IfQQ", len(label), 0.0, rid, rid2) + np.asarray(label, "<f4").tobytes() + payload
    return struct.pack("<IfQQ", 0, float(label), rid, rid2) + payload


def write_recordio(rec: str | os.PathLike[str], records: list[bytes], keys: list[int] | None = None,
                   *, idx: bool = True) -> Path:
    """Write framed ``records`` (packed data) to ``rec`` and, with ``idx``, MXNet's ``.idx``
    (``key\toffset`` per record, as ``MXIndexedRecordIO.write_idx`` writes it)."""
    rec = Path(rec)
    rec.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    # 8 MiB writes: the page cache then holds the file in large folios, as after a copy (`stager stage`)
    # or a cold read's readahead; record-sized writes leave 4 KiB pages whose mapping faults ~10x more.
    with open(rec, "wb", buffering=8 << 20) as f:
        for i, r in enumerate(records):
            lines.append(f"{keys[i] if keys else i}\t{f.tell()}\n")
            f.write(recordio_frame(r))
    if idx:
        rec.with_suffix(".idx").write_text("".join(lines))
    return rec


def make_recordio(rec: str | os.PathLike[str], n: int = 1000, *, num_classes: int = 10, size: int = 96,
                  seed: int = 0, array_labels: bool = False, idx: bool = True) -> Path:
    """An ``im2rec``-style ``.rec`` (+ ``.idx``): IRHeader id = the list index, label the class (or, with
    ``array_labels``, ``[class, 0.5, index]`` as float32 array labels), payload a JPEG."""
    records = []
    for i, (lab, arr) in enumerate(_samples(n, num_classes, size, seed, 0.25)):
        label: float | list[float] = [float(lab), 0.5, float(i)] if array_labels else float(lab)
        records.append(recordio_pack(jpeg_bytes(arr), label, i))
    return write_recordio(rec, records, idx=idx)
def video_frames(seq: int, frames: int, h: int, w: int, *, seed: int = 0) -> np.ndarray:
    """Frames (frames, h, w, 3) uint8 RGB of synthetic sequence ``seq``: 2-4 objects moving at
    constant velocity, bouncing off the borders, over a textured background that pans slowly."""
    rng = np.random.default_rng((seed, 0x71DE0, seq))
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = rng.uniform(40, 120, size=3).astype(np.float32)
    kx, ky = rng.uniform(0.03, 0.12, size=2)
    n_obj = int(rng.integers(2, 5))
    pos = rng.uniform(0.2, 0.8, size=(n_obj, 2)) * [h, w]
    vel = rng.uniform(-3.0, 3.0, size=(n_obj, 2)) * (max(h, w) / 128)
    rad = rng.uniform(0.06, 0.14, size=n_obj) * min(h, w)
    col = rng.uniform(130, 255, size=(n_obj, 3))
    square = rng.random(n_obj) < 0.5
    out = np.empty((frames, h, w, 3), dtype=np.uint8)
    for t in range(frames):
        tex = 20 * np.sin(kx * (xx + 0.7 * t)) * np.cos(ky * yy)
        img = base[None, None, :] + tex[..., None]
        for k in range(n_obj):
            p = pos[k] + vel[k] * t
            for d, lim in ((0, h), (1, w)):  # bounce: reflect into [0, lim)
                period = 2 * lim
                q = p[d] % period
                p[d] = q if q < lim else period - q
            if square[k]:
                m = (np.abs(yy - p[0]) < rad[k]) & (np.abs(xx - p[1]) < rad[k])
            else:
                m = (yy - p[0]) ** 2 + (xx - p[1]) ** 2 < rad[k] ** 2
            img[m] = col[k]
        out[t] = np.clip(img, 0, 255).astype(np.uint8)
    return out


def make_videos(
    root: str | os.PathLike[str],
    sequences: int = 8,
    frames: int = 60,
    size: tuple[int, int] = (128, 128),
    *,
    seed: int = 0,
    mp4: bool = True,
    folders: bool = True,
    fps: float = 10.0,
) -> Path:
    """Write ``sequences`` synthetic moving-object sequences of ``frames`` frames of ``size`` (H, W):
    ``root/videos/seq_XXXX.mp4`` (``mp4``) and ``root/frames/seq_XXXX/000000.png`` (``folders``)."""
    import cv2

    out = Path(root)
    h, w = size
    for s in range(sequences):
        clip = video_frames(s, frames, h, w, seed=seed)
        name = f"seq_{s:04d}"
        if mp4:
            (out / "videos").mkdir(parents=True, exist_ok=True)
            vw = cv2.VideoWriter(str(out / "videos" / f"{name}.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
            for f in clip:
                vw.write(cv2.cvtColor(f, cv2.COLOR_RGB2BGR))
            vw.release()
        if folders:
            d = out / "frames" / name
            d.mkdir(parents=True, exist_ok=True)
            for t, f in enumerate(clip):
                Image.fromarray(f).save(d / f"{t:06d}.png", compress_level=1)
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
    sh = sub.add_parser("shapes", help="segmentation/detection shapes: JPEGs, class-id PNG masks, boxes, COCO JSON")
    sh.add_argument("out")
    sh.add_argument("--train", type=int, default=200)
    sh.add_argument("--val", type=int, default=50)
    sh.add_argument("--size", type=int, default=96)
    sh.add_argument("--seed", type=int, default=0)
    for kind in ("caffe-lmdb", "folder2lmdb", "recordio"):
        x = sub.add_parser(kind, help="legacy container (see the module docstring)")
        x.add_argument("out")
        x.add_argument("--n", type=int, default=1000)
        x.add_argument("--size", type=int, default=32 if kind == "caffe-lmdb" else 96)
        x.add_argument("--raw", action="store_true", help="caffe-lmdb: raw planar BGR Datums")
        x.add_argument("--seed", type=int, default=0)
    v = sub.add_parser("video", help="moving-object videos (mp4) and PNG frame folders")
    v.add_argument("out")
    v.add_argument("--sequences", type=int, default=8)
    v.add_argument("--frames", type=int, default=60)
    v.add_argument("--size", type=int, default=128)
    v.add_argument("--seed", type=int, default=0)
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
    elif args.kind == "shapes":
        out = make_shapes(args.out, args.train, args.val, size=args.size, seed=args.seed)
        print(json.dumps({"root": str(out), "train": args.train, "val": args.val}))
    elif args.kind == "video":
        root = make_videos(args.out, args.sequences, args.frames, (args.size, args.size), seed=args.seed)
        print(json.dumps({"root": str(root), "sequences": args.sequences, "frames": args.frames}))
    elif args.kind == "caffe-lmdb":
        root = make_caffe_lmdb(args.out, args.n, size=args.size, raw=args.raw, seed=args.seed)
        print(json.dumps({"root": str(root)}))
    elif args.kind == "folder2lmdb":
        print(json.dumps({"root": str(make_folder2lmdb(args.out, args.n, size=args.size, seed=args.seed))}))
    elif args.kind == "recordio":
        print(json.dumps({"rec": str(make_recordio(args.out, args.n, size=args.size, seed=args.seed))}))
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
