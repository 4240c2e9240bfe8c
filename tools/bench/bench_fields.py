"""Samples with fields: segmentation (image + mask) and detection (image + boxes + labels) batches per core.

Side by side in one process (one core), one pass over the same synthetic shapes set
(tools/datagen.py ``make_shapes``, JPEGs of ~``--size`` px with class-id PNG masks and boxes), 224-px
random-resized train crops with a flip, batches of ``--batch``:

* **stager**: ``make_loader(packed tar, fields=[...], transform="train", num_workers=0)``: the fields
  loader's one joint geometry (image through the fast decoder's crop-aware path, mask sampled
  nearest, boxes mapped and clipped);
* **plain baseline**: the list file's files read one by one, PIL decode of image and mask, the same
  crop box (``random_resized_crop_box``) cut in numpy, PIL resize (bilinear / nearest), flip, boxes
  mapped in numpy, ``np.stack``;
* **webdataset**: ``wds.WebDataset(tar).decode("rgb8")`` (masks decoded with PIL via ``l8`` would
  need a second pipeline, so PIL decodes the ``mask.png`` member in the hand-written joint crop) and
  the same hand-written joint crop as the baseline.

Rounds are interleaved and each reader's best round counts, both in wall-clock samples/s and in
samples per CPU second of the process (one core's throughput, which other jobs on a shared machine
disturb far less). Prints one JSON object; writes docs/bench/fields.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stager.decode.crop import random_resized_crop_box  # noqa: E402
from stager.pack.api import pack  # noqa: E402
from tools.datagen import make_shapes  # noqa: E402

SIZE = 224


def joint_crop(img: np.ndarray, mask: np.ndarray | None, boxes: np.ndarray | None,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The hand-written joint augmentation: one crop box and flip for image, mask and boxes."""
    h, w = img.shape[:2]
    top, left, bh, bw = random_resized_crop_box(h, w, rng)
    flip = rng.random() < 0.5
    out = np.asarray(Image.fromarray(img[top:top + bh, left:left + bw]).resize((SIZE, SIZE), Image.Resampling.BILINEAR))
    m = None
    if mask is not None:
        crop = Image.fromarray(mask[top:top + bh, left:left + bw])
        m = np.asarray(crop.resize((SIZE, SIZE), Image.Resampling.NEAREST))
    b = None
    if boxes is not None:
        b = (boxes - [left, top, left, top]) * [SIZE / bw, SIZE / bh, SIZE / bw, SIZE / bh]
        b = b.clip(0, SIZE)
        b = b[(b[:, 2] - b[:, 0] >= 1) & (b[:, 3] - b[:, 1] >= 1)]
        if flip:
            b = np.stack([SIZE - b[:, 2], b[:, 1], SIZE - b[:, 0], b[:, 3]], axis=1)
    if flip:
        out = out[:, ::-1]
        m = m[:, ::-1] if m is not None else None
    return out, m, b


def _batches(samples: Iterator[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]], batch: int) -> int:
    n, imgs, masks = 0, [], []
    for img, m, _ in samples:
        imgs.append(img)
        if m is not None:
            masks.append(m)
        if len(imgs) == batch:
            np.stack(imgs)
            if masks:
                np.stack(masks)
            n += len(imgs)
            imgs, masks = [], []
    return n + len(imgs)


def baseline(src: Path, task: str, batch: int) -> int:
    rows = [json.loads(ln) for ln in (src / "train.jsonl").read_text().splitlines()]
    rng = np.random.default_rng(0)

    def gen() -> Iterator[Any]:
        for r in rows:
            img = np.asarray(Image.open(src / r["path"]).convert("RGB"))
            mask = np.asarray(Image.open(src / r["mask"])) if task == "seg" else None
            boxes = np.asarray(r["boxes"], np.float32).reshape(-1, 4) if task == "det" else None
            yield joint_crop(img, mask, boxes, rng)

    return _batches(gen(), batch)


def webdataset_run(packed: Path, task: str, batch: int) -> int:
    import webdataset as wds

    urls = sorted(str(p) for p in packed.glob("*.tar"))
    rng = np.random.default_rng(0)
    if task == "seg":
        ds = wds.WebDataset(urls, shardshuffle=False).decode("rgb8").to_tuple("jpg", "mask.png")
        # decode("rgb8") gives the mask as RGB too: take one channel (class ids are grey levels)
        gen = (joint_crop(img, m[..., 0], None, rng) for img, m in ds)
    else:
        ds = wds.WebDataset(urls, shardshuffle=False).decode("rgb8").to_tuple("jpg", "boxes.json", "box_labels.json")
        gen = (joint_crop(img, None, np.asarray(b, np.float32).reshape(-1, 4), rng) for img, b, _ in ds)
    return _batches(gen, batch)


def stager_run(packed: Path, task: str, batch: int) -> int:
    from stager.loader import make_loader

    fields = ["mask"] if task == "seg" else ["boxes", "box_labels"]
    n = 0
    for b in make_loader(packed, batch, fields=fields, transform="train", image_size=SIZE, num_workers=0):
        n += len(b["key"])
    return n


def timed(fns: dict[str, Callable[[], int]], rounds: int) -> dict[str, dict[str, float]]:
    """Best samples/s (wall) and samples per CPU second (this process's user + system time: what one
    core delivers, robust to other jobs on a shared machine) of each reader, rounds interleaved so that
    a change in the machine's load hits every reader alike."""
    best = {k: {"wall": 0.0, "cpu": 0.0} for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t, c = time.perf_counter(), time.process_time()
            n = fn()
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            best[k]["wall"] = max(best[k]["wall"], n / wall)
            best[k]["cpu"] = max(best[k]["cpu"], n / max(cpu, 1e-9))
    return best


def markdown(res: dict[str, Any]) -> str:
    lines = ["# Samples with fields (segmentation, detection)", "",
             f"One core, {res['n']} shapes images of ~{res['size']} px (JPEG q92, PNG masks), 224-px train crops "
             f"with flip, batch {res['batch']}, best of {res['rounds']} interleaved passes "
             "(tools/bench/bench_fields.py). Samples per CPU second of the process (what one core delivers, "
             "robust to other jobs on the machine); wall-clock samples/s in brackets. Ratios are stager over "
             "each peer, per CPU second.", "",
             "| task | stager | plain PIL + numpy | webdataset + hand-written crop | vs plain | vs webdataset |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for task in ("seg", "det"):
        r = res[task]
        cells = " | ".join(f"{r[k]['cpu']:.0f} ({r[k]['wall']:.0f})" for k in ("stager", "plain", "webdataset"))
        lines.append(f"| {'segmentation (image + mask)' if task == 'seg' else 'detection (image + boxes + labels)'} "
                     f"| {cells} | {r['ratio_plain']:.2f}x | {r['ratio_webdataset']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--size", type=int, default=384, help="source image size (px, +-15%%)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import cv2

    cv2.setNumThreads(1)
    with tempfile.TemporaryDirectory(prefix="stager-bench-fields-") as tmp:
        src = make_shapes(Path(tmp) / "shapes", train=args.n, val=0, size=args.size, seed=0)
        packed = Path(tmp) / "packed"
        pack(src / "train.jsonl", packed, "tar", fields="mask:mask,boxes:boxes,box_labels:box_labels")
        import webdataset  # noqa: F401

        import stager.loader.torch_dataset  # noqa: F401 (torch's import, ~3 s, is not a per-sample cost)

        res: dict[str, Any] = {"n": args.n, "size": args.size, "batch": args.batch, "rounds": args.rounds}
        for task in ("seg", "det"):
            r: dict[str, Any] = dict(timed({
                "stager": lambda t=task: stager_run(packed, t, args.batch),
                "plain": lambda t=task: baseline(src, t, args.batch),
                "webdataset": lambda t=task: webdataset_run(packed, t, args.batch),
            }, args.rounds))
            r["ratio_plain"] = round(r["stager"]["cpu"] / r["plain"]["cpu"], 2)
            r["ratio_webdataset"] = round(r["stager"]["cpu"] / r["webdataset"]["cpu"], 2)
            r["ratio_plain_wall"] = round(r["stager"]["wall"] / r["plain"]["wall"], 2)
            res[task] = r
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fields.md").write_text(markdown(res))
    print(json.dumps(res, default=lambda x: round(float(x), 1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
