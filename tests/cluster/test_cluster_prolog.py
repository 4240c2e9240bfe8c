"""The prolog service (tools/slurm/stager-prolog, -taskprolog, -epilog) under the real slurmctld and
slurmd: a job asks for datasets with ``sbatch --comment=stager:SRC[,SRC]``; the prolog stages them on
every allocated node before the first task (PrologFlags=Alloc,DeferBatch); a failure on any node fails the job
with stage's exit code and a message in the job's output, draining nothing; the epilog removes the
copies whether the job completed, failed or was cancelled."""

from __future__ import annotations

import json
import time
from pathlib import Path

from stager.manifest import load_manifest
from tools.cluster.client import Cluster

from .conftest import ROOT, expect

CHECK_COPIES = """#!/bin/bash
# The first task of the job: the copies must already be there, on every node.
set -euo pipefail
source .venv/bin/activate
echo "STAGER_DEST=$STAGER_DEST"
srun --ntasks-per-node=1 bash -c 'for d in "$STAGER_DEST"/stager-*; do
    stager verify "$d" --json | sed "s/^/$(hostname) /"; done'
export OMP_NUM_THREADS=1
srun python tools/train.py --data "$DATA" --val "$VAL" --arch resnet18 --width 4 --image-size 32 --batch-size 8 \\
    --epochs 1 --threads 1 --workers 0 --log-every 0 --out "$OUT" --summary-json "$OUT/summary.json"
"""


def prolog_dirs(cluster: Cluster, job_id: int) -> list[Path]:
    root = Path(cluster.env["CLUSTER_PROLOG_ROOT"])
    return [cluster.node_path(n, root / f"job{job_id}") for n in cluster.nodes]


def test_prolog_stages_before_the_first_task_and_epilog_cleans(cluster: Cluster, cifar: dict[str, Path],
                                                                tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(CHECK_COPIES)
    train, test = (cluster.shared_path(cifar[k]) for k in ("train", "test"))
    job = cluster.sbatch(["--nodes=4", "--ntasks-per-node=1", "--cpus-per-task=1", f"--comment=stager:{train},{test}",
                          str(script)], output=tmp_path / "job.out", cwd=ROOT,
                         env={"DATA": str(train), "VAL": str(test), "OUT": str(tmp_path / "out")})
    expect(job)
    verified = [ln.split(" ", 1) for ln in job.output.splitlines() if ln.startswith("node")]
    hosts = sorted(h for h, _ in verified)
    assert hosts == sorted(cluster.nodes * 2), job.output  # both datasets on all four nodes
    assert all(json.loads(v)["ok"] for _, v in verified)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    src = summary["data_source"]
    assert src["staged"] and src["reading_from"].startswith(str(cluster.env["CLUSTER_PROLOG_ROOT"])), src
    assert not any(d.exists() for d in prolog_dirs(cluster, job.id)), "the epilog must remove the copies"
    assert set(cluster.node_states().values()) == {"idle"}


def test_failed_stage_on_one_node_fails_the_job_and_drains_nothing(cluster: Cluster, cifar: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    """node2's destination is taken (a file where the copy's directory goes); node1 stages fine. The
    batch script (on node1) never runs; the job fails with stage's exit code; both nodes stay idle."""
    script = tmp_path / "job.sh"
    marker = tmp_path / "batch-script-ran"
    script.write_text(f"#!/bin/bash\ntouch {marker}\n")
    train = cluster.shared_path(cifar["train"])
    job_id = cluster.submit(["--hold", "--nodes=2", "--nodelist=node1,node2", f"--comment=stager:{train}",
                             f"--output={tmp_path / 'job.out'}", str(script)])
    blocker = cluster.node_path("node2", Path(cluster.env["CLUSTER_PROLOG_ROOT"]) / f"job{job_id}" /
                                f"stager-{load_manifest(cifar['train']).dataset_id}")
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a directory\n")
    cluster.run(["scontrol", "release", str(job_id)])
    job = cluster.wait(job_id, output=tmp_path / "job.out", timeout=180)
    assert job.state == "FAILED" and job.exit_code != 0, job.describe()
    line = next((ln for ln in job.output.splitlines() if ln.startswith("stager-prolog exit")), "")
    assert line.startswith(f"stager-prolog exit {job.exit_code}: node2: stager stage {train} failed"), job.output
    assert job.info["AdminComment"].startswith(f"stager-prolog exit {job.exit_code}: node2"), job.describe()
    assert not marker.exists(), "the batch script must not run after a failed stage"
    assert not any(d.exists() for d in prolog_dirs(cluster, job_id))
    states = cluster.node_states()
    assert states["node1"] == states["node2"] == "idle", states


def test_missing_dataset_is_a_usage_error_for_the_job(cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\necho ran\n")
    job = cluster.sbatch(["--nodes=2", f"--comment=stager:{cluster.shared}/no-such-dataset", str(script)],
                         output=tmp_path / "job.out")
    expect(job, "FAILED", 2)
    assert "no such packed dataset" in job.output and "ran" not in job.output.split(), job.output
    assert set(cluster.node_states().values()) == {"idle"}


def test_cancel_during_prolog_stage_then_resubmit(cluster: Cluster, imagenet: Path, tmp_path: Path) -> None:
    """scancel while the prolog is copying (storage link slowed down): the prolog stops its stage,
    the epilog removes the partial copy on both nodes; the same job submitted again completes."""
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nsource .venv/bin/activate\n"
                      "srun --ntasks-per-node=1 bash -c 'stager verify \"$STAGER_DEST\"/stager-* --json'\n")
    src = cluster.shared_path(imagenet)
    args = ["--nodes=2", "--nodelist=node1,node2", f"--comment=stager:{src}", str(script)]
    cluster.set_storage_rate(8)
    try:
        job_id = cluster.submit([f"--output={tmp_path / 'first.out'}", *args], cwd=ROOT)
        dirs = prolog_dirs(cluster, job_id)[:2]
        deadline = time.monotonic() + 120
        while not any(d.is_dir() and any(d.glob("stager-*/*.partial")) for d in dirs):
            assert time.monotonic() < deadline, "the prolog never started copying"
            time.sleep(0.05)
        cluster.run(["scancel", str(job_id)])
        first = cluster.wait(job_id, timeout=120)
        assert first.state == "CANCELLED", first.describe()
        assert not any(d.exists() for d in dirs), "the epilog must remove the cancelled job's partial copies"
        assert not cluster.processes("node1", "stager stage") and not cluster.processes("node2", "stager stage")
    finally:
        cluster.set_storage_rate(400)
    job = cluster.sbatch(args, output=tmp_path / "second.out", cwd=ROOT)
    expect(job)
    results = [json.loads(ln) for ln in job.output.splitlines() if ln.startswith("{")]
    assert len(results) == 2 and all(r["ok"] for r in results), job.output
    assert set(cluster.node_states().values()) == {"idle"}
