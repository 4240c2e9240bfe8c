"""Clips/s side by side (docs/benchmarks.md, "Clips"; issue 22): T=12 windows, 128x128 train crops
(one random-resized crop and flip per clip), batches of 8, 2 workers, steady state.

Readers, each built once and measured in interleaved rounds (best of ``--rounds``):

* **stager**: the loader (``make_loader(..., num_workers=2, transform="train")``, persistent
  workers) on the clip pack of the videos (JPEG frames at quality 95, tar);
* **cv2 seek**: what a user writes without stager: a torch ``DataLoader`` (2 persistent workers)
  over a map-style dataset of random windows whose ``__getitem__`` sets ``cv2.VideoCapture`` to the
  window's first frame (``CAP_PROP_POS_FRAMES``) and reads T frames, then crops, resizes, flips;
* **PyAV seek**: the same with PyAV: ``container.seek`` to the keyframe before the window, decode
  forward to it, T frames (``to_ndarray("rgb24")``);
* **DALI** (when ``nvidia.dali`` imports): CPU ``fn.readers.sequence`` (``device_id=None``,
  ``num_threads=2``) over frame folders of the same frames as JPEG q95, then
  ``fn.random_resized_crop`` + ``fn.flip`` (one draw per sequence), batch 8, shuffled.

Both seeking readers keep each worker's open files (opening one per clip would cost them more).
Videos are H.264 (libx264 through PyAV) at the encoder's default keyframe interval (250: what
cameras, phones and ``ffmpeg -i x.avi x.mp4`` produce) and, for the best case of seeking, at a
keyframe every 12 frames (``--gop``). Start-up (worker start, first batch) is timed separately; each
round then drops the batches the readers prefetched while idle and times the next ``--batches``
(and at least ``--seconds``).

``python tools/bench/bench_clips.py [--sequences 16 --frames 300 --size 192x256 --rounds 3]``
prints one JSON line and writes docs/bench/clips.md.
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

if __package__ in (None, ""):  # run as a script (tools/bench/run_all.py): make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.datagen import video_frames

T, CROP, BATCH, WORKERS = 12, 128, 8, 2
FPS = 25
ROOT = Path(__file__).resolve().parents[2]


# -- data ----------------------------------------------------------------------------------------
def write_data(root: Path, sequences: int, frames: int, size: tuple[int, int], gops: list[int]) -> dict[str, Path]:
    """``root/gop<G>/seq_XXXX.mp4`` per keyframe interval (0: the encoder default) and
    ``root/frames/seq_XXXX/000000.jpg`` (q95) of the same synthetic frames."""
    import av
    import cv2

    h, w = size
    out = {f"gop{g}": root / f"gop{g}" for g in gops}
    for d in out.values():
        d.mkdir(parents=True)
    for s in range(sequences):
        clip = video_frames(s, frames, h, w, seed=0)
        for g in gops:
            with av.open(str(out[f"gop{g}"] / f"seq_{s:04d}.mp4"), "w") as c:
                st = c.add_stream("libx264", rate=FPS)
                st.width, st.height, st.pix_fmt = w, h, "yuv420p"
                if g:
                    st.codec_context.gop_size = g
                for f in clip:
                    for pkt in st.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                        c.mux(pkt)
                for pkt in st.encode():
                    c.mux(pkt)
        fd = root / "frames" / f"seq_{s:04d}"
        fd.mkdir(parents=True)
        for t, f in enumerate(clip):
            _ok, buf = cv2.imencode(".jpg", cv2.cvtColor(f, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 95])
            (fd / f"{t:06d}.jpg").write_bytes(buf.tobytes())
    out["frames"] = root / "frames"
    return out


# -- the seeking baseline (what a user writes without stager) -------------------------------------
def _crop_clip(frames: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """One torchvision-style random-resized crop + flip for the clip, applied to every frame."""
    import cv2

    from stager.decode.crop import random_resized_crop_box

    h, w = frames[0].shape[:2]
    top, left, ch, cw = random_resized_crop_box(h, w, rng)
    flip = rng.random() < 0.5
    out = np.empty((len(frames), CROP, CROP, 3), np.uint8)
    for i, f in enumerate(frames):
        r = cv2.resize(f[top : top + ch, left : left + cw], (CROP, CROP), interpolation=cv2.INTER_LINEAR)
        out[i] = r[:, ::-1] if flip else r
    return out


class SeekClips:
    """Map-style dataset: item i = a random window (video, first frame) decoded by seeking."""

    def __init__(self, videos: list[str], frames: int, how: str, n: int = 1 << 20) -> None:
        self.videos, self.frames, self.how, self.n = videos, frames, how, n
        self._open: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": {}}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng((7, i))
        path = self.videos[int(rng.integers(len(self.videos)))]
        start = int(rng.integers(0, self.frames - T + 1))
        frames = self._cv2(path, start) if self.how == "cv2" else self._pyav(path, start)
        return _crop_clip(frames, rng)

    def _cv2(self, path: str, start: int) -> list[np.ndarray]:
        import cv2

        cap = self._open.get(path)
        if cap is None:
            cv2.setNumThreads(1)
            cap = self._open[path] = cv2.VideoCapture(path)
        cap.set(cv2.CAP_PROP_POS_FRAMES, start)
        out: list[np.ndarray] = []
        for _ in range(T):
            ok, f = cap.read()
            if not ok:
                raise RuntimeError(f"{path}: frame {start + len(out)} did not decode")
            out.append(cv2.cvtColor(f, cv2.COLOR_BGR2RGB))
        return out

    def _pyav(self, path: str, start: int) -> list[np.ndarray]:
        import av

        c = self._open.get(path)
        if c is None:
            c = self._open[path] = av.open(path)
        s = c.streams.video[0]
        tb, rate, t0 = s.time_base, s.average_rate or FPS, s.start_time or 0
        assert tb is not None
        c.seek(t0 + int(start / rate / tb), stream=s, backward=True, any_frame=False)
        out: list[np.ndarray] = []
        for fr in c.decode(s):
            k = round(float((fr.pts - t0) * tb * rate))
            if k < start:
                continue
            out.append(fr.to_ndarray(format="rgb24"))
            if len(out) == T:
                break
        return out


def _forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def seek_reader(videos: list[str], frames: int, how: str) -> Iterator[Any]:
    from torch.utils.data import DataLoader

    ds = SeekClips(videos, frames, how)
    return _forever(DataLoader(ds, BATCH, shuffle=False, num_workers=WORKERS, persistent_workers=True))


def stager_reader(packed: Path) -> Iterator[Any]:
    from stager.loader import make_loader

    return _forever(make_loader(packed, BATCH, num_workers=WORKERS, transform="train", image_size=CROP, seed=0))


def dali_reader(frames_root: Path) -> Iterator[Any]:
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=BATCH, num_threads=WORKERS, device_id=None, seed=0, prefetch_queue_depth=2)
    def pipe() -> Any:
        seq = fn.readers.sequence(file_root=str(frames_root), sequence_length=T, random_shuffle=True,
                                  initial_fill=256, name="r")
        seq = fn.random_resized_crop(seq, size=(CROP, CROP))
        return fn.flip(seq, horizontal=fn.random.coin_flip())

    p = pipe()
    p.build()

    def gen() -> Iterator[Any]:
        while True:
            (out,) = p.run()
            yield out.as_array()

    return gen()


def _count(b: Any) -> int:
    if isinstance(b, dict):
        return len(b["index"])
    return len(b)


# -- measurement -----------------------------------------------------------------------------------
def measure(makers: dict[str, Callable[[], Iterator[Any]]], rounds: int, batches: int, skip: int,
            seconds: float) -> dict[str, Any]:
    """Start every reader (start-up = build + first batch), then ``rounds`` interleaved rounds: drop
    ``skip`` batches (prefetched while the others ran), time at least ``batches`` batches and
    ``seconds`` (a fast reader's short window would catch the neighbours' bursts). Clips/s per round."""
    its, startup = {}, {}
    for name, make in makers.items():
        t = time.perf_counter()
        its[name] = make()
        next(its[name])
        startup[name] = time.perf_counter() - t
    best: dict[str, float] = dict.fromkeys(makers, 0.0)
    every: dict[str, list[float]] = {n: [] for n in makers}
    names = list(makers)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            it = its[name]
            for _ in range(skip):
                next(it)
            t, n, k = time.perf_counter(), 0, 0
            while k < batches or time.perf_counter() - t < seconds:
                n += _count(next(it))
                k += 1
            cps = n / (time.perf_counter() - t)
            every[name].append(round(cps, 1))
            best[name] = max(best[name], cps)
    return {"startup_s": startup, "best": best, "every": every}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--frames", type=int, default=300)
    p.add_argument("--size", default="192x256", help="frame HxW")
    p.add_argument("--gop", type=int, nargs="+", default=[0, 12], help="keyframe intervals (0: encoder default, 250)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=40, help="timed batches of 8 clips per reader per round")
    p.add_argument("--seconds", type=float, default=4.0, help="at least this long per reader per round")
    p.add_argument("--skip", type=int, default=6, help="batches dropped at the start of each round (>= 2 workers x 2)")
    p.add_argument("--no-dali", action="store_true")
    p.add_argument("--md", default=str(ROOT / "docs" / "bench" / "clips.md"), help="'' to skip writing")
    args = p.parse_args(argv)
    h, w = (int(x) for x in args.size.split("x"))
    from stager.pack import pack

    try:
        import nvidia.dali  # noqa: F401
        have_dali = not args.no_dali
    except ImportError:
        have_dali = False
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        data = write_data(Path(d), args.sequences, args.frames, (h, w), args.gop)
        gen_s = time.perf_counter() - t
        t = time.perf_counter()
        packed = pack(data[f"gop{args.gop[0]}"], Path(d) / "p", "tar", clip_length=T).out
        pack_s = time.perf_counter() - t
        makers: dict[str, Callable[[], Iterator[Any]]] = {"stager": lambda: stager_reader(packed)}
        for g in args.gop:
            vids = sorted(str(v) for v in data[f"gop{g}"].glob("*.mp4"))
            for how in ("cv2", "pyav"):
                makers[f"{how}_gop{g or 250}"] = (lambda v=vids, hw=how: seek_reader(v, args.frames, hw))
        if have_dali:
            makers["dali"] = lambda: dali_reader(data["frames"])
        res = measure(makers, args.rounds, args.batches, args.skip, args.seconds)
    best = res["best"]
    out = {
        "bench": "clips", "T": T, "crop": CROP, "batch": BATCH, "workers": WORKERS, "frame_hw": [h, w],
        "sequences": args.sequences, "frames": args.frames, "gops": args.gop, "rounds": args.rounds,
        "batches": args.batches, "seconds": args.seconds, "clips_per_s": {k: round(v, 1) for k, v in best.items()},
        "stager_vs": {k: round(best["stager"] / v, 2) for k, v in best.items() if k != "stager"},
        "median_clips_per_s": {k: round(float(np.median(v)), 1) for k, v in res["every"].items()},
        "every_round": res["every"], "startup_s": {k: round(v, 2) for k, v in res["startup_s"].items()},
        "data_s": round(gen_s, 1), "pack_s": round(pack_s, 1), "load_avg_end": os.getloadavg(),
        "dali": "measured" if have_dali else "not installed (pip install nvidia-dali-cuda120)",
    }
    print(json.dumps(out))
    if args.md:
        Path(args.md).write_text(_markdown(out, argv if argv is not None else sys.argv[1:]))
    return 0


_LABELS = {
    "stager": "stager loader on the clip pack (JPEG q95 frames, tar)",
    "cv2": "OpenCV: `VideoCapture` set to the window, read {T} frames",
    "pyav": "PyAV: `seek` to the keyframe before the window, decode to it, {T} frames",
    "dali": "DALI CPU `fn.readers.sequence` over JPEG frame folders + `random_resized_crop` + `flip`",
}


_FAIRNESS = (
    'Conditions and fairness. Videos are H.264 (libx264 via PyAV, B-frames, yuv420p, 25 fps) at the '
    "encoder's default keyframe interval, what cameras and `ffmpeg -i in out.mp4` produce; the GOP-12 "
    "rows are the best case for seeking (OpenCV's own `mp4v` writer uses 12). The seeking baselines are "
    'what a user writes without stager: a map-style dataset through a `DataLoader` with 2 persistent '
    'workers, each worker keeping its files open (reopening per clip would cost them more), the same '
    'torchvision-style crop box (`stager.decode.crop.random_resized_crop_box`), `cv2.resize` and flip per '
    'frame; their cost is the frames decoded from the keyframe before each window (~10x the 12 returned '
    'at interval 250). DALI 2.4.0 (`nvidia-dali-cuda120`, CPU pipeline, `device_id=None`, '
    '`num_threads=2`) reads frame folders of the same synthetic frames as JPEG q95 (one directory per '
    'sequence under `file_root`, as `readers.sequence` requires), shuffled, then `fn.random_resized_crop` '
    'and `fn.flip`; `readers.sequence` is marked deprecated in that release. Start-up (workers, first '
    "batch) is timed apart: stager's 1.4-1.8 s is torch's worker start plus the epoch plan, the "
    "baselines' 0.2-0.6 s."
)


def _markdown(o: dict[str, Any], argv: list[str]) -> str:
    h, w = o["frame_hw"]
    lines = [
        "# Clips (issue 22)", "",
        f"Generated by `python tools/bench/bench_clips.py {' '.join(argv)}`: {o['sequences']} synthetic "
        f"moving-object sequences x {o['frames']} frames of {h}x{w}, T={o['T']}, {o['crop']}x{o['crop']} "
        f"train crops (one per clip), batches of {o['batch']}, {o['workers']} workers, steady state (persistent "
        f"workers; start-up timed apart), {o['rounds']} interleaved rounds of at least {o['batches']} batches "
        f"and {o['seconds']:g} s per reader (best and median); "
        f"load average at the end {tuple(round(x, 1) for x in o['load_avg_end'])}.", "",
        "| reader | keyframe interval | clips/s (best) | stager vs it (best) | clips/s (median) "
        "| stager vs it (median) | start-up s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for k, v in o["clips_per_s"].items():
        how, _, gop = k.partition("_gop")
        label = _LABELS[how].format(T=o["T"])
        med, smed = o["median_clips_per_s"][k], o["median_clips_per_s"]["stager"]
        ratio = "1.00" if k == "stager" else f"**{o['stager_vs'][k]:.2f}x**"
        mratio = "1.00" if k == "stager" else f"**{smed / med:.2f}x**"
        lines.append(f"| {label} | {gop or '-'} | {v:,.0f} | {ratio} | {med:,.0f} | {mratio} "
                     f"| {o['startup_s'][k]:.2f} |")
    lines += ["", f"Every round (clips/s): {json.dumps(o['every_round'])}. DALI: {o['dali']}.", "", _FAIRNESS, ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
