#!/usr/bin/env python3
"""End-to-end demo (``make demo``): generate -> pack -> stage -> 2-rank DDP training, interrupted and resumed.

1. Generate a small ImageNet-like ImageFolder with :mod:`tools.datagen` (10 classes, JPEGs around
   160x120; each class has its own palette and texture orientation) and a separate validation set.
2. ``stager pack`` both into verified tar shards (a manifest with per-sample offsets and hashes).
3. ``stager stage`` them into a scratch directory standing in for the node-local SSD; the loader
   finds the staged copies through their receipts ($STAGER_DEST) although train.py is given the
   packed (i.e. "Lustre") paths.
4. Train a narrow ResNet-18 at 64 px on 2 CPU processes (``python -m torch.distributed.run
   --nproc-per-node 2 tools/train.py``, gloo DDP), stop it mid-epoch with ``--max-steps`` (a
   simulated preemption; the checkpoint is written atomically), then resume with ``--resume``.
5. Print what happened: accuracy per epoch vs chance, images/s, data-wait share, pack/stage figures.

Runs in about 2-3 minutes on 2 CPU cores. ``--keep DIR`` keeps the data and checkpoints there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.datagen import make_imagefolder  # noqa: E402

CLASSES = 10


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def stager(*args: str, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``stager <args> --json`` (this checkout's CLI) and return its JSON result."""
    cmd = [sys.executable, "-m", "stager", *args, "--json"]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, env={**env(), **(extra_env or {})})
    if res.returncode != 0:
        sys.stderr.write(res.stderr)
        raise SystemExit(f"demo: `stager {' '.join(args)}` failed with exit code {res.returncode}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def train(args: list[str], staging_root: Path, log_path: Path) -> dict[str, Any]:
    """2 CPU ranks with gloo; the training log streams to the terminal and to ``log_path``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tools" / "train.py"), *args]
    summary: dict[str, Any] | None = None
    with open(log_path, "a") as log, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**env(), "STAGER_DEST": str(staging_root)}, cwd=ROOT,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.startswith('{"event": "summary"'):
                summary = json.loads(line)
            elif line.startswith("[train]") and '"event": "config"' not in line:
                print("  " + line.rstrip(), flush=True)
        rc = proc.wait()
    if rc != 0 or summary is None:
        raise SystemExit(f"demo: training failed (exit {rc}); full log: {log_path}")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/demo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temporary directory)")
    p.add_argument("--per-class", type=int, default=60, help="training images per class")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--interrupt-at", type=int, default=14, help="optimizer step where the first run stops")
    a = p.parse_args(argv)

    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="stager-demo-"))
    if a.keep and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    try:
        # 1. data ---------------------------------------------------------------------------------
        t = time.perf_counter()
        src = make_imagefolder(work / "src" / "train", CLASSES, a.per_class, seed=0, size=(160, 120))
        val_src = make_imagefolder(work / "src" / "val", CLASSES, 10, seed=1, size=(160, 120))
        n_files = sum(1 for _ in src.rglob("*.JPEG"))
        src_bytes = sum(f.stat().st_size for f in src.rglob("*.JPEG"))
        say(f"generated {n_files} training JPEGs ({src_bytes / 1e6:.1f} MB, {CLASSES} classes) and "
            f"{CLASSES * 10} validation JPEGs in {time.perf_counter() - t:.1f} s")

        # 2. pack ---------------------------------------------------------------------------------
        packed, packed_val = work / "lustre" / "train-tar", work / "lustre" / "val-tar"
        pk = stager("pack", str(src), str(packed), "--format", "tar", "--samples-per-shard", "100")
        stager("pack", str(val_src), str(packed_val), "--format", "tar", "--samples-per-shard", "100")
        say(f"stager pack: {pk['samples']} samples -> {pk['shards']} tar shards, {pk['bytes'] / 1e6:.1f} MB in "
            f"{pk['seconds']:.2f} s ({pk['samples_per_s']:.0f} samples/s)")

        # 3. stage --------------------------------------------------------------------------------
        local = work / "node-local"
        st = stager("stage", str(packed), str(local / "train"))
        stager("stage", str(packed_val), str(local / "val"))
        say(f"stager stage: {_stage_figures(st)}")

        # 4. train, interrupted and resumed --------------------------------------------------------
        out, log_path = work / "run", work / "train.log"
        common = [
            "--data", str(packed), "--val", str(packed_val),
            "--arch", "resnet18", "--width", "16", "--image-size", "64", "--stem", "imagenet",
            "--batch-size", "32", "--epochs", str(a.epochs), "--lr", "0.4", "--warmup-epochs", "1",
            "--lr-decay", "cosine", "--label-smoothing", "0.1", "--zero-init-residual", "--no-bn-decay",
            "--workers", "1", "--threads", "1", "--log-every", "3", "--checkpoint-every", "10",
            "--out", str(out), "--summary-json", str(out / "summary.json"),
        ]
        say(f"training: 2 ranks (gloo), stopping at step {a.interrupt_at} to simulate a preemption")
        first = train([*common, "--max-steps", str(a.interrupt_at)], local, log_path)
        say(f"interrupted at global step {first['global_step']} (epoch {first['epoch']}); "
            f"checkpoint {out / 'checkpoint.pt'}")
        say("resuming from the checkpoint (same next batch, same LR schedule)")
        final = train([*common, "--resume"], local, log_path)

        # The same model on random tensors made on the device: the throughput gap is the input cost.
        say("same model on --data synthetic (no input pipeline) for comparison")
        model_args = common[common.index("--arch"): common.index("--epochs")]
        synth = train(["--data", "synthetic", "--num-classes", str(CLASSES), "--synthetic-images", "1024",
                       *model_args, "--epochs", "1", "--max-steps", "12", "--eval-every", "0", "--threads", "1",
                       "--log-every", "6", "--out", str(work / "synthetic")], local, log_path)

        # 5. report ---------------------------------------------------------------------------------
        acc = final["accuracy"]
        best = max(x["top1"] for x in acc)
        chance = 1.0 / CLASSES
        print()
        say("summary")
        for x in acc:
            print(f"  epoch {x['epoch']}: top-1 {x['top1']:6.1%}  top-5 {x['top5']:6.1%}  "
                  f"(eval over {x['samples']} validation images, chance {chance:.0%})")
        losses = ", ".join(f"{e['loss']:.3f}" for e in final["epoch_loss"])
        print(f"  training loss per epoch: {losses}")
        print(f"  throughput after resume: {final['images_per_s']:.0f} images/s total "
              f"({final['images_per_s_per_rank']:.0f} per rank), data wait {final['data_wait_share']:.0%} of step time")
        cost = 1 - final["images_per_s"] / synth["images_per_s"] if synth["images_per_s"] else 0.0
        print(f"  synthetic data, same model: {synth['images_per_s']:.0f} images/s total -> the input pipeline "
              f"costs {cost:.0%} of throughput here (2 busy cores decode JPEGs and train)")
        src_info = final.get("data_source", {})
        print(f"  the loader read from: {src_info.get('reading_from')} (staged copy: {src_info.get('staged')})")
        print(f"  pack: {pk['samples']} samples in {pk['seconds']:.2f} s ({pk['samples_per_s']:.0f} samples/s); "
              f"stage: {_stage_figures(st)}")
        print(f"  total demo time {time.perf_counter() - t_start:.0f} s; log {log_path}")
        ok = best > chance + 0.1 and final["completed"]
        print(f"  result: {'OK' if ok else 'NOT LEARNING'}: best top-1 {best:.1%} vs chance {chance:.0%}")
        return 0 if ok else 1
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


def _stage_figures(st: dict[str, Any]) -> str:
    """One line from a ``stager stage --json`` result."""
    mb = st.get("bytes_copied", 0) / 1e6
    secs = st.get("seconds", 0.0)
    return (f"{st.get('files_copied', '?')} files, {mb:.1f} MB in {secs:.2f} s "
            f"({mb / secs if secs else 0:.0f} MB/s, {st.get('workers', '?')} streams, verified while copying) "
            f"{st.get('source_fs', '?')} -> {st.get('dest_fs', '?')} {st.get('dest')}")


if __name__ == "__main__":
    raise SystemExit(main())
