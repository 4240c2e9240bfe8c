"""Open MPI inside Slurm jobs on the cluster (2 nodes x 2 ranks), as Horovod-style jobs start.

One job, three steps: ``mpirun -N 1 stager stage --partition`` (one stager per node), ``mpirun`` of
4 ranks, ``srun --mpi=pmix`` of 4 ranks. On every node but the first, Open MPI's ranks inherit the
Slurm variables of the srun step that started its daemon (SLURM_NODEID=0 of SLURM_NNODES=1): the
launcher's OMPI_COMM_WORLD_* must win, for the loader's rank and for stage's node.

Checked: each stager got node k of 2 from Open MPI and the two nodes' shards partition the set; the
4 ranks of each launcher, on their real hosts, read every sample exactly once per epoch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stager.manifest import load_manifest
from tools.cluster import lifecycle
from tools.cluster.client import Cluster

from .conftest import ROOT, expect

JOB = """#!/bin/bash
set -eu
source .venv/bin/activate
MPIRUN="mpirun --allow-run-as-root --bind-to none -x PATH -x PYTHONPATH"
$MPIRUN -N 1 bash -c 'stager stage {data} {dest} --partition --ranks-per-node 2 --json --quiet \
    > {out}/stage.$OMPI_COMM_WORLD_RANK.json'
mkdir -p {out}/mpirun {out}/pmix
$MPIRUN python tests/mpi_rank_script.py {data} {out}/mpirun numpy
srun --mpi=pmix python tests/mpi_rank_script.py {data} {out}/pmix numpy
"""


def test_mpirun_and_srun_pmix_across_nodes(cluster: Cluster, cifar: dict[str, Path], tmp_path: Path) -> None:
    missing = lifecycle.missing_packages(optional=True)
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (Open MPI's mpirun; libpmix.so for srun --mpi=pmix): "
                    f"apt-get install -y {' '.join(missing)}, as `make cluster` does")
    out = tmp_path / "out"
    out.mkdir()
    data = cluster.shared_path(cifar["train"])
    dest = cluster.local / f"mpi-{tmp_path.name}"
    script = tmp_path / "job.sh"
    script.write_text(JOB.format(data=data, dest=dest, out=out))
    job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=15", str(script)],
                         output=tmp_path / "job.out", cwd=ROOT, timeout=400)
    expect(job)
    manifest = load_manifest(cifar["train"])
    nodes = sorted(cluster.nodes[:2])
    stages = [json.loads((out / f"stage.{k}.json").read_text().strip().splitlines()[-1]) for k in range(2)]
    assert [(s["partition"]["node"], s["partition"]["num_nodes"], s["node_source"]) for s in stages] == [
        (0, 2, "openmpi"), (1, 2, "openmpi")]
    held = [{p.name for p in cluster.node_path(n, dest).iterdir() if p.name.startswith("shard-")} for n in nodes]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == {s.name for s in manifest.shards}
    n = sum(s.samples for s in manifest.shards)
    for launcher, source in (("mpirun", "openmpi"), ("pmix", "pmix")):
        recs = [json.loads((out / launcher / f"rank{r}.json").read_text()) for r in range(4)]
        assert [(x["rank"], x["world_size"], x["source"]) for x in recs] == [(r, 4, source) for r in range(4)]
        assert [x["host"] for x in recs] == [nodes[0], nodes[0], nodes[1], nodes[1]]  # block placement
        assert [x["node"] for x in recs] == [0, 0, 1, 1]
        for epoch in range(2):
            ids = [i for x in recs for batch in x["numpy"][epoch] for i in batch]
            assert sorted(ids) == list(range(n)), (launcher, epoch)
    for node in nodes:
        shutil.rmtree(cluster.node_path(node, dest), ignore_errors=True)
