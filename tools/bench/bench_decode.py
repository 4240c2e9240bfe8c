"""How fast can one core turn an ImageNet-like JPEG into a 224x224 training crop, and at what quality?

Every variant decodes the same JPEGs (tools.datagen, ~500x375, ~100 KB) with the same crop draws
(RandomResizedCrop(224) + flip from ``default_rng(0)``), single-threaded (``cv2.setNumThreads(1)``).
Reported: samples/s per core, the ratio to the PIL baseline (torchvision's path: full decode,
``crop``, ``resize(BILINEAR)``), and the mean absolute pixel difference to that baseline's output.

Variants (train transform):

* ``pil_baseline``: stager's ``pil`` backend = torchvision's PIL RandomResizedCrop;
* ``pil_box``: full decode, then crop+resize in one pass (``Image.resize(size, box=...)``);
* ``pil_draft_box``: ``Image.draft`` (libjpeg DCT scaling) + one-pass resize with ``reducing_gap``;
* ``pil_decode+cv2``: Pillow decode, ``cv2.resize`` of the crop view;
* ``cv2_imdecode``/``cv2_reduced``: OpenCV decode (full / ``IMREAD_REDUCED_*``), cv2 resize.
  Listed for reference only: cv2 returns gray-filled images for truncated files instead of failing;
* ``sj_full``: simplejpeg full decode + cv2 resize;
* ``sj_anyscale``: simplejpeg choosing any N/8 DCT scale that keeps the crop >= 224;
* ``sj_pow2``: only 1/2, 1/4, 1/8 scales (stager ``fast`` without row truncation);
* ``fast``: stager's ``fast`` backend default (power-of-two scales + row truncation);
* ``fast+fastdct``: the same with libjpeg-turbo's IFAST IDCT and fast upsampling;
* ``fast_no_cv2``: stager ``fast`` when OpenCV is absent (Pillow resize);
* ``turbojpeg``: PyTurboJPEG with scaling, when its libjpeg-turbo >= 3 loads.

Also reported: how often each DCT scale engages for RandomResizedCrop's scale distribution, the
mean fraction of rows row truncation decodes, and eval (Resize 256 + CenterCrop 224) and full
decode throughput for ``pil`` and ``fast``.

Usage: ``python -m tools.bench.bench_decode [--n 64] [--seconds 1.0] [--rounds 3] [--out DIR]``.
Prints one JSON object; writes docs/bench/decode.md.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import stager.decode as dc  # noqa: E402
from stager.decode.crop import random_resized_crop_box  # noqa: E402
from stager.decode.jpeg_header import parse_jpeg_header  # noqa: E402
from tools.datagen import make_imagefolder  # noqa: E402

SIZE = 224
SHAPES = [(375, 500), (600, 800), (768, 1024), (1080, 1440), (1500, 2000), (3000, 4000)]  # HxW
Fn = Callable[[bytes, np.random.Generator], np.ndarray]


def load_jpegs(n: int, work: Path) -> list[bytes]:
    """``n`` ImageNet-like JPEGs (default ~500x375, quality 90), generated once per work dir."""
    root = work / f"jpegs-{n}"
    if not root.exists():
        make_imagefolder(root, num_classes=8, per_class=-(-n // 8), seed=0)
    return [p.read_bytes() for p in sorted(root.rglob("*.JPEG"))[:n]]


def _draw(h: int, w: int, rng: np.random.Generator) -> tuple[tuple[int, int, int, int], bool]:
    box = random_resized_crop_box(h, w, rng)
    return box, bool(rng.random() < 0.5)


def variants() -> dict[str, Fn]:
    """name -> fn(jpeg, rng) giving the (224, 224, 3) crop; every fn draws the same box and flip."""
    import cv2

    cv2.setNumThreads(1)
    bil = Image.Resampling.BILINEAR
    out: dict[str, Fn] = {}
    pil = dc.get_decoder("pil")

    def via(decoder: dc.Decoder) -> Fn:
        return lambda data, rng: dc.decode_random_resized_crop(data, SIZE, rng, decoder=decoder)

    out["pil_baseline"] = via(pil)

    def pil_box(data: bytes, rng: np.random.Generator) -> np.ndarray:
        im = Image.open(io.BytesIO(data)).convert("RGB")
        (t, x, h, w), f = _draw(im.height, im.width, rng)
        im = im.resize((SIZE, SIZE), bil, box=(x, t, x + w, t + h))
        return np.asarray(im.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if f else im)

    def pil_draft_box(data: bytes, rng: np.random.Generator) -> np.ndarray:
        im = Image.open(io.BytesIO(data))
        W, H = im.size  # noqa: N806
        (t, x, h, w), f = _draw(H, W, rng)
        k = max(1, min(8, min(h, w) // SIZE))
        im.draft("RGB", (W // k, H // k))
        sx, sy = im.width / W, im.height / H
        im = im.convert("RGB").resize(
            (SIZE, SIZE), bil, box=(x * sx, t * sy, (x + w) * sx, (t + h) * sy), reducing_gap=2.0
        )
        return np.asarray(im.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if f else im)

    def crop_cv2(arr: np.ndarray, box: tuple[int, int, int, int], f: bool, k: float = 1.0) -> np.ndarray:
        t, x, h, w = box
        y0, x0 = int(t / k), int(x / k)
        y1, x1 = max(y0 + 1, math.ceil((t + h) / k)), max(x0 + 1, math.ceil((x + w) / k))
        r = cv2.resize(arr[y0:y1, x0:x1], (SIZE, SIZE), interpolation=cv2.INTER_LINEAR)
        return cv2.flip(r, 1) if f else r

    def pil_cv2(data: bytes, rng: np.random.Generator) -> np.ndarray:
        arr = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        box, f = _draw(arr.shape[0], arr.shape[1], rng)
        return crop_cv2(arr, box, f)

    flags = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION

    def cv2_full(data: bytes, rng: np.random.Generator) -> np.ndarray:
        arr = cv2.imdecode(np.frombuffer(data, np.uint8), flags)
        box, f = _draw(arr.shape[0], arr.shape[1], rng)
        return crop_cv2(arr, box, f)

    reduced = {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}

    def cv2_reduced(data: bytes, rng: np.random.Generator) -> np.ndarray:
        hdr = parse_jpeg_header(data)
        box, f = _draw(hdr.height, hdr.width, rng)
        k = next((d for d in (8, 4, 2) if box[2] / d >= SIZE and box[3] / d >= SIZE), 1)
        mode = reduced[k] | cv2.IMREAD_IGNORE_ORIENTATION if k > 1 else cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION
        arr = cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), mode), cv2.COLOR_BGR2RGB)
        return crop_cv2(arr, box, f, k)

    out.update({"pil_box": pil_box, "pil_draft_box": pil_draft_box, "pil_decode+cv2": pil_cv2})
    out.update({"cv2_imdecode": cv2_full, "cv2_reduced": cv2_reduced})

    try:
        import simplejpeg

        from stager.decode.fast_backend import FastJpegDecoder
    except ImportError:
        return out

    def sj_anyscale(data: bytes, rng: np.random.Generator) -> np.ndarray:
        h0, w0, _, _ = simplejpeg.decode_jpeg_header(data)
        box, f = _draw(h0, w0, rng)
        arr = simplejpeg.decode_jpeg(
            data, "RGB", min_height=math.ceil(h0 * SIZE / box[2]), min_width=math.ceil(w0 * SIZE / box[3])
        )
        return crop_cv2(arr, box, f, h0 / arr.shape[0])

    out["sj_full"] = via(FastJpegDecoder(dct_scale=False, truncate=False))
    out["sj_anyscale"] = sj_anyscale
    out["sj_pow2"] = via(FastJpegDecoder(truncate=False))
    out["fast"] = via(FastJpegDecoder())
    out["fast+fastdct"] = via(FastJpegDecoder(fast_dct=True, fast_upsample=True))
    out["fast_no_cv2"] = via(FastJpegDecoder(use_cv2=False))
    try:
        import turbojpeg

        tj = turbojpeg.TurboJPEG()

        def tj_scaled(data: bytes, rng: np.random.Generator) -> np.ndarray:
            w0, h0, _, _ = tj.decode_header(data)
            box, f = _draw(h0, w0, rng)
            k = next((d for d in (8, 4, 2) if box[2] / d >= SIZE and box[3] / d >= SIZE), 1)
            arr = tj.decode(data, pixel_format=turbojpeg.TJPF_RGB, scaling_factor=(1, k) if k > 1 else None)
            return crop_cv2(arr, box, f, k)

        out["turbojpeg"] = tj_scaled
    except Exception as e:  # library missing or libjpeg-turbo < 3: reported, not fatal
        print(f"turbojpeg unavailable: {str(e).splitlines()[0]}", file=sys.stderr)
    return out


def throughput(fn: Callable[[bytes], Any], data: list[bytes], seconds: float) -> float:
    """Samples per CPU-second of ``fn`` over ``data`` repeated for at least ``seconds`` of CPU time.

    CPU time, not wall time: on a shared node, time spent descheduled says nothing about the
    decoder, and every variant here is single-threaded, so CPU-seconds are core-seconds.
    """
    n, t0 = 0, time.process_time()
    while True:
        for d in data:
            fn(d)
        n += len(data)
        dt = time.process_time() - t0
        if dt >= seconds:
            return n / dt


def engagement(data: list[bytes], draws: int = 20) -> dict[str, float]:
    """Share of RandomResizedCrop(224) draws per DCT scale; mean share of rows truncation decodes."""
    rng = np.random.default_rng(0)
    counts = {1: 0, 2: 0, 4: 0, 8: 0}
    rows, area_interp = [], 0
    for d in data:
        hdr = parse_jpeg_header(d)
        for _ in range(draws):
            t, _, h, w = random_resized_crop_box(hdr.height, hdr.width, rng)
            k = next((s for s in (8, 4, 2) if h / s >= SIZE and w / s >= SIZE), 1)
            counts[k] += 1
            area_interp += (h / k) > 2 * SIZE or (w / k) > 2 * SIZE
            keep = (math.ceil((t + h) / hdr.mcu_height) + 1) * hdr.mcu_height if hdr.single_scan else hdr.height
            rows.append(min(keep, hdr.height) / hdr.height)
    total = len(data) * draws
    res = {f"scale_1/{k}": c / total for k, c in counts.items()}
    res["rows_decoded_fraction"] = float(np.mean(rows))
    res["area_interp_fraction"] = area_interp / total
    return res


def scale_shares(h: int, w: int, draws: int = 20000) -> dict[str, float]:
    """Share of RandomResizedCrop(224) draws on an ``h x w`` image per DCT scale (geometry only)."""
    rng = np.random.default_rng(1)
    counts = {1: 0, 2: 0, 4: 0, 8: 0}
    for _ in range(draws):
        _, _, bh, bw = random_resized_crop_box(h, w, rng)
        counts[next((s for s in (8, 4, 2) if bh / s >= SIZE and bw / s >= SIZE), 1)] += 1
    return {f"1/{k}": round(c / draws, 4) for k, c in counts.items()}


def run(n: int, seconds: float, rounds: int, work: Path) -> dict[str, Any]:
    data = load_jpegs(n, work)
    shapes = [parse_jpeg_header(d) for d in data]
    fns = variants()
    # Quality: every variant's crops against the baseline's, same draws.
    ref = [fns["pil_baseline"](d, np.random.default_rng((0, i))) for i, d in enumerate(data)]
    mad = {}
    for name, fn in fns.items():
        diffs = [
            np.abs(fn(d, np.random.default_rng((0, i))).astype(np.int16) - ref[i]).mean() for i, d in enumerate(data)
        ]
        mad[name] = float(np.mean(diffs))
    # Speed: rounds interleave the variants so background load hits them alike; best round counts.
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            rng = np.random.default_rng(0)
            best[name] = max(best.get(name, 0.0), throughput(lambda d, fn=fn, rng=rng: fn(d, rng), data, seconds))
    base = best["pil_baseline"]
    train = {
        k: {"samples_per_s": round(v, 1), "vs_baseline": round(v / base, 3), "mean_abs_diff": round(mad[k], 3)}
        for k, v in best.items()
    }
    other: dict[str, float] = {}
    for name in ("pil", "fast"):
        if name == "fast" and "fast" not in fns:
            continue
        dec = dc.get_decoder(name)
        for _ in range(rounds):
            ev = throughput(lambda d, dec=dec: dc.decode_center_crop(d, SIZE, decoder=dec), data, seconds)
            full = throughput(lambda d, dec=dec: dc.decode_rgb(d, decoder=dec), data, seconds)
            other[f"eval_center_crop_{name}"] = max(other.get(f"eval_center_crop_{name}", 0.0), ev)
            other[f"decode_rgb_{name}"] = max(other.get(f"decode_rgb_{name}", 0.0), full)
    return {
        "images": len(data),
        "mean_bytes": round(float(np.mean([len(d) for d in data]))),
        "mean_shape_hw": [
            round(float(np.mean([s.height for s in shapes]))),
            round(float(np.mean([s.width for s in shapes]))),
        ],
        "single_scan_fraction": float(np.mean([s.single_scan for s in shapes])),
        "default_backend": dc.backend(),
        "train_rrc224_per_core": train,
        "engagement": {k: round(v, 4) for k, v in engagement(data).items()},
        "dct_scale_share_by_image_size": {f"{h}x{w}": scale_shares(h, w) for h, w in SHAPES},
        "eval_and_full_decode_per_core": {k: round(v, 1) for k, v in other.items()},
        "machine": {
            "cpu_count": os.cpu_count(),
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
        },
        "seconds_per_measure": seconds,
        "rounds": rounds,
    }


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "# Decode benchmark: RandomResizedCrop(224) + flip, one core",
        "",
        f"{res['images']} synthetic ImageNet-like JPEGs (tools.datagen, mean {res['mean_shape_hw'][0]}x"
        f"{res['mean_shape_hw'][1]} HxW, {res['mean_bytes'] // 1000} KB, quality 90, "
        f"{res['single_scan_fraction']:.0%} single-scan); same crop draws for every variant; "
        f"samples per CPU-second, best of "
        f"{res['rounds']} interleaved rounds of {res['seconds_per_measure']} s. Machine: {res['machine']['cpu_count']} "
        f"cores, load average {res['machine']['loadavg_1m']} during the run (shared: figures are provisional).",
        "Produced by `python -m tools.bench.bench_decode`.",
        "",
        "| variant | samples/s per core | vs PIL baseline | mean abs diff vs baseline (0-255) |",
        "|---|---:|---:|---:|",
    ]
    for name, r in res["train_rrc224_per_core"].items():
        lines.append(f"| {name} | {r['samples_per_s']:.0f} | {r['vs_baseline']:.2f}x | {r['mean_abs_diff']:.2f} |")
    lines += ["", "How often the partial-decode techniques engage (RandomResizedCrop(224), default scale/ratio):", ""]
    lines += ["| measure | value |", "|---|---:|"]
    for k, v in res["engagement"].items():
        lines.append(f"| {k} | {v:.3f} |")
    lines += ["", "Share of draws per DCT scale by image size (HxW; geometry only, no decoding):", ""]
    lines += ["| image | 1/1 | 1/2 | 1/4 | 1/8 |", "|---|---:|---:|---:|---:|"]
    for shape, sh in res["dct_scale_share_by_image_size"].items():
        lines.append(f"| {shape} | {sh['1/1']:.3f} | {sh['1/2']:.3f} | {sh['1/4']:.3f} | {sh['1/8']:.3f} |")
    lines += ["", "Eval transform (Resize 256 + CenterCrop 224) and full decode, samples/s per core:", ""]
    lines += ["| measure | samples/s |", "|---|---:|"]
    for k, v in res["eval_and_full_decode_per_core"].items():
        lines.append(f"| {k} | {v:.0f} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="number of JPEGs (default 64)")
    ap.add_argument("--seconds", type=float, default=1.0, help="minimum seconds per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best counts")
    ap.add_argument("--work", type=Path, default=None, help="where to cache the generated JPEGs")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench", help="directory for decode.md")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.gettempdir()) / "stager-bench-decode"
    work.mkdir(parents=True, exist_ok=True)
    res = run(args.n, args.seconds, args.rounds, work)
    print(json.dumps(res, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.md").write_text(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
