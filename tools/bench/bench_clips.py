"""Clips/s side by side (docs/benchmarks.md, "Clips"): stager's loader on a clip pack vs decoding each
clip from its mp4 on the fly with OpenCV (seek to the window's first frame, read T frames), both with
2 worker processes, T=12, 128x128 train crops (one crop per clip).

``python -m tools.bench.bench_clips [--sequences 8 --frames 60 --clips 128]``: prints one JSON line.
DALI's CPU ``fn.readers.sequence`` is not measured here (not installed in this environment).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np

from stager.loader import make_loader
from stager.pack import pack
from tools.datagen import make_videos

T, SIZE = 12, 128


def _decode_clip(job: tuple[str, int, int]) -> np.ndarray:
    import cv2

    cv2.setNumThreads(1)
    path, start, seed = job
    rng = np.random.default_rng(seed)
    cap = cv2.VideoCapture(path)
    cap.set(cv2.CAP_PROP_POS_FRAMES, start)
    frames = []
    for _ in range(T):
        ok, f = cap.read()
        if not ok:
            break
        frames.append(f)
    cap.release()
    h, w = frames[0].shape[:2]
    s = int(rng.integers(h // 2, h + 1))
    y, x = int(rng.integers(0, h - s + 1)), int(rng.integers(0, w - s + 1))
    flip = rng.random() < 0.5
    out = [cv2.resize(f[y : y + s, x : x + s], (SIZE, SIZE)) for f in frames]
    return np.stack([o[:, ::-1] if flip else o for o in out])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--frames", type=int, default=60)
    p.add_argument("--clips", type=int, default=128)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        root = make_videos(Path(d) / "src", args.sequences, args.frames, (160, 160), seed=0)
        packed = pack(root / "videos", Path(d) / "p", "tar", clip_length=T).out
        ld = make_loader(packed, 8, num_workers=2, transform="train", image_size=SIZE, seed=0)
        t, n = time.perf_counter(), 0
        for b in ld:
            n += len(b["index"])
            if n >= args.clips:
                break
        stager_cps = n / (time.perf_counter() - t)
        vids = sorted((root / "videos").glob("*.mp4"))
        rng = np.random.default_rng(1)
        jobs = [(str(vids[int(rng.integers(len(vids)))]), int(rng.integers(0, args.frames - T + 1)), i)
                for i in range(args.clips)]
        with Pool(2) as pool:
            t = time.perf_counter()
            for _ in pool.imap(_decode_clip, jobs, chunksize=1):
                pass
            video_cps = args.clips / (time.perf_counter() - t)
    print(json.dumps({"bench": "clips", "T": T, "crop": SIZE, "workers": 2, "stager_clips_per_s": round(stager_cps, 1),
                      "cv2_seek_clips_per_s": round(video_cps, 1), "ratio": round(stager_cps / video_cps, 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
