"""PyTorch Lightning across two nodes of the cluster, started by ``srun`` as Lightning's Slurm docs show.

One job, ``--nodes=2 --ntasks-per-node=1``: ``srun python tests/frameworks/lightning_run.py srun ...``
(``Trainer(num_nodes=2, devices=1, strategy="ddp")``; Lightning's SLURMEnvironment takes the ranks
from srun and the rendezvous from the node list). A loader built at module level, before the Trainer,
takes its rank from Slurm's variables; one built in ``setup()`` from the process group. Checked: the
two ranks ran on the two nodes, each iterated as rank r of 2, and every sample of the set is read
exactly once per epoch across them, equal batches on both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stager.manifest import load_manifest
from tools.cluster.client import Cluster

from .conftest import ROOT, expect

JOB = """#!/bin/bash
set -eu
source .venv/bin/activate
export MASTER_PORT={port} OMP_NUM_THREADS=1
srun python tests/frameworks/lightning_run.py srun {data} {out}
"""


def test_lightning_trainer_on_two_nodes_under_srun(cluster: Cluster, cifar: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="lightning is in the test extra: make venv (tools/setup_venv.sh)")
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "job.sh"
    script.write_text(JOB.format(port=29731, data=cluster.shared_path(cifar["train"]), out=out))
    job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=15", str(script)],
                         output=tmp_path / "job.out", cwd=ROOT, timeout=500)
    expect(job)
    n = sum(s.samples for s in load_manifest(cifar["train"]).shards)
    for phase in ("early", "full"):
        ranks = [json.loads((out / f"{phase}-rank{r}.json").read_text()) for r in range(2)]
        assert sorted(r["host"] for r in ranks) == sorted(cluster.nodes[:2]), "one rank per node"
        assert [r["world"] for r in ranks] == [[0, 2], [1, 2]]
        if phase == "early":
            assert [r["early_world"] for r in ranks] == [[0, 2, "slurm"], [1, 2, "slurm"]]
        for epoch in ("0", "1"):
            per_rank = [r["seen"][epoch] for r in ranks]
            assert [len(b) for b in per_rank[0]] == [len(b) for b in per_rank[1]], "equal batches"
            ids = [i for batches in per_rank for b in batches for i in b]
            assert sorted(ids) == list(range(n)), (phase, epoch)
