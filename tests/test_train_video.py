"""tools/train_video.py (the guide's GAN case, small): the frame predictor's L1 falls on a real clip pack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from stager.pack import pack
from tools.datagen import make_videos

ROOT = Path(__file__).resolve().parents[1]


def test_video_gan_loss_falls(tmp_path: Path) -> None:
    make_videos(tmp_path / "src", sequences=4, frames=24, size=(40, 40), seed=2, mp4=False)
    pack(tmp_path / "src" / "frames", tmp_path / "p", "tar", clip_length=12)
    out = tmp_path / "summary.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "train_video.py"), "--data", str(tmp_path / "p"), "--image-size", "24",
         "--batch-size", "4", "--workers", "0", "--max-steps", "30", "--width", "8", "--log-every", "8",
         "--summary-json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["steps"] == 30
    assert s["l1_last"] < s["l1_first"]
