"""tools/train_seg.py end to end: 2 gloo ranks (torch.distributed.run) train a small U-Net on the
shapes set's masks through the fields loader; mIoU must end far above chance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from stager.pack.api import pack
from tools.datagen import make_shapes

ROOT = Path(__file__).resolve().parents[1]


def test_unet_ddp_learns_the_shapes(tmp_path: Path) -> None:
    src = make_shapes(tmp_path / "shapes", train=192, val=48, size=64, seed=4)
    for split in ("train", "val"):
        pack(src / f"{split}.jsonl", tmp_path / split, "tar", fields="mask:mask")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tools" / "train_seg.py"), "--train", str(tmp_path / "train"), "--val", str(tmp_path / "val"),
           "--epochs", "8", "--batch-size", "16", "--image-size", "48", "--width", "8", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    epochs = [ln for ln in lines if ln["event"] == "epoch"]
    summary = next(ln for ln in lines if ln["event"] == "summary")
    assert len(epochs) == 8 and summary["world_size"] == 2
    assert summary["miou"] > max(0.4, 2 * summary["chance_miou"]), summary
