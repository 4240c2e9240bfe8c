"""tools/train_video.py across 2 nodes of the cluster harness: staged clip pack, srun, DDP (gloo).

One Slurm job: ``srun`` one ``stager stage`` per node, then ``srun`` of 2 tasks (one per node)
running the GAN frame predictor for a few steps. Checked: the job completes, rank 0's summary says
world size 2 and the L1 fell. Skipped with one line where the harness cannot start (not root).
"""

from __future__ import annotations

import json
from pathlib import Path

from tools.cluster.client import Cluster

from .conftest import ROOT, expect

JOB = """#!/bin/bash
set -eu
source .venv/bin/activate
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=29561
export STAGER_DEST={dest}
srun --ntasks-per-node=1 stager stage {data} {dest}/video --quiet
srun python tools/train_video.py --data {data} --image-size 24 --batch-size 2 --workers 1 --max-steps 20 \
    --width 8 --log-every 5 --summary-json {out}/summary.json
"""


def test_video_gan_two_nodes(cluster: Cluster, shared_data: Path, tmp_path: Path) -> None:
    from stager.pack import pack
    from tools.datagen import make_videos

    src = make_videos(shared_data / "video-src", sequences=4, frames=24, size=(32, 32), seed=4, mp4=False)
    packed = pack(src / "frames", shared_data / "video-tar", "tar", clip_length=12, samples_per_shard=10).out
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "job.sh"
    script.write_text(JOB.format(data=cluster.shared_path(Path(packed)), dest=cluster.local / f"video-{tmp_path.name}",
                                 out=out))
    job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=15", str(script)],
                         output=tmp_path / "job.out", cwd=ROOT, timeout=400)
    expect(job)
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2 and s["steps"] == 20
    assert s["l1_last"] < s["l1_first"]
