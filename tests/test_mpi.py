"""Ranks under a real ``mpirun`` (Debian's openmpi-bin): the issue this fixes was every rank of
``mpirun -np 3 python train.py`` reading the whole dataset.

Invariant: under ``mpirun -np 3`` the ranks detect themselves as 0, 1, 2 of 3 (from OMPI_COMM_WORLD_*),
and over the three ranks every sample is read exactly once per epoch, by the torch loader and by the
numpy loader alike, which give each rank the same batches. Contradicting launcher variables stop the
affected ranks with one line. Horovod's gloo launcher environment (HOROVOD_*; horovod itself does not
build against torch 2.13 here, docs/training.md) is exercised by setting it from Open MPI's per rank.
Without ``mpirun`` the tests skip with one line saying how to install it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stager.pack import pack
from tools.datagen import make_cifar

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("mpi_rank_script.py")
N, RANKS = 120, 3
needs_mpirun = pytest.mark.skipif(
    shutil.which("mpirun") is None,
    reason="mpirun not found: install Open MPI (`apt-get install -y openmpi-bin`; `make cluster` does) to run",
)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mpi")
    src = make_cifar(root, n_train=N, n_test=4, seed=4)
    pack(src, root / "packed", samples_per_shard=16, split="train")
    return root / "packed"


def mpirun(*args: str, np: int = RANKS, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(np),
           "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS=1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


def _each_sample_once(records: list[dict[str, Any]], loader: str) -> None:
    for epoch in range(2):
        ids = [i for rec in records for batch in rec[loader][epoch] for i in batch]
        assert sorted(ids) == list(range(N)), (loader, epoch)
        counts = {len(rec[loader][epoch]) for rec in records}
        assert len(counts) == 1  # equal batch counts on every rank (DDP's lockstep)


@needs_mpirun
def test_mpirun_ranks_read_each_sample_once(packed: Path, tmp_path: Path) -> None:
    r = mpirun(sys.executable, str(SCRIPT), str(packed), str(tmp_path), "both")
    assert r.returncode == 0, r.stderr[-3000:]
    records = _records(tmp_path)
    assert [(x["rank"], x["world_size"], x["local_rank"], x["source"]) for x in records] == [
        (k, RANKS, k, "openmpi") for k in range(RANKS)]
    for loader in ("torch", "numpy"):
        _each_sample_once(records, loader)
    for rec in records:
        assert rec["numpy"] == rec["torch"]  # same seed and settings: the same batches, in the same order
        assert rec["numpy"][0] != rec["numpy"][1]  # and a fresh shuffle per epoch


@needs_mpirun
def test_horovod_launcher_environment_under_mpirun(packed: Path, tmp_path: Path) -> None:
    """horovodrun's gloo launcher sets HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE per process; here each
    Open MPI rank sets them (reversed, so the HOROVOD_* numbering, the inner one, must be what wins)."""
    wrapper = ('export HOROVOD_RANK=$((2 - OMPI_COMM_WORLD_RANK)) HOROVOD_SIZE=3 '
               'HOROVOD_LOCAL_RANK=$((2 - OMPI_COMM_WORLD_RANK)) HOROVOD_LOCAL_SIZE=3; exec "$@"')
    r = mpirun("bash", "-c", wrapper, "hvd", sys.executable, str(SCRIPT), str(packed), str(tmp_path), "numpy")
    assert r.returncode == 0, r.stderr[-3000:]
    records = _records(tmp_path)
    assert {x["source"] for x in records} == {"horovod"} and not any(x["torch_imported"] for x in records)
    _each_sample_once(records, "numpy")


@needs_mpirun
def test_contradicting_launcher_variables_stop_the_ranks_with_one_line() -> None:
    # A stale MPICH PMI_RANK=0 of 3 exported into an Open MPI job: ranks 1 and 2 disagree with it.
    code = "from stager.world import World; World.detect()"
    r = mpirun("-x", "PMI_RANK=0", "-x", "PMI_SIZE=3", sys.executable, "-c", code)
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if x.startswith("stager.errors.UsageError")]
    # mpirun aborts the others when the first rank fails: one or both of ranks 1 and 2 get to say it.
    assert 1 <= len(lines) <= 2, r.stderr[-3000:]
    for line in lines:
        assert "launcher variables disagree" in line and "PMI_RANK=0" in line
        assert "OMPI_COMM_WORLD_RANK=1" in line or "OMPI_COMM_WORLD_RANK=2" in line
    # A world size given to the loader that is not the launcher's.
    code = "from stager.world import World; World.detect(world_size=2)"
    r = mpirun(sys.executable, "-c", code)
    lines = [x for x in r.stderr.splitlines() if x.startswith("stager.errors.UsageError")]
    assert r.returncode != 0 and lines, r.stderr[-3000:]
    assert all("world_size=2" in x and "OMPI_COMM_WORLD_SIZE=3" in x for x in lines)


def test_stage_partition_takes_the_node_from_open_mpi(packed: Path, tmp_path: Path) -> None:
    """`stager stage --partition` started by `mpirun -N 1` (one process per node, here the variables Open
    MPI sets on 2 nodes): node k of 2 from OMPI_COMM_WORLD_*, and the two nodes' shards partition the set."""
    import os

    shards: list[set[str]] = []
    for node in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
        env.update({"OMPI_COMM_WORLD_RANK": str(node), "OMPI_COMM_WORLD_SIZE": "2",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})
        dest = tmp_path / f"node{node}"
        r = subprocess.run([sys.executable, "-m", "stager", "stage", str(packed), str(dest), "--partition",
                            "--ranks-per-node", "2", "--json", "--quiet"],
                           capture_output=True, text=True, env=env, timeout=120, check=False)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["partition"]["node"] == node and out["partition"]["num_nodes"] == 2
        assert out["node_source"] == "openmpi"
        shards.append({p.name for p in dest.iterdir() if p.name.startswith("shard")})
    manifest = json.loads((packed / "manifest.json").read_text())
    assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == {s["name"] for s in manifest["shards"]}
