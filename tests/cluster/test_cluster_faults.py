"""Faults on the cluster, each ending in a clean state: the command exits with the code the docs
promise (or completes, where the fault is transparent), nothing partial sits under a final name, and
a rerun completes with every copy verified. The storage link is slowed down (tc tbf) so that the
fault lands mid-transfer; each fault is injected when the first ``.partial`` file appears on a node.

Recorded as rows of docs/reliability.md when run by ``make faults`` (tools/faults/tally.py)."""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.manifest import load_manifest
from tools.cluster.client import Cluster
from tools.faults.tally import record

from .conftest import check_copy, expect, finish, no_torn_files, results_of, stage_job

SLOW_MBIT = 16  # 2 MB/s: the test set takes seconds to stage, so a fault lands mid-copy
# Small exchange chunks: a share of a few MB then takes many ring steps, and .partial files exist
# on every node for most of the transfer (with the default 8 MiB it is a single step).
COLLECTIVE = ("--collective", "--timeout", "60", "--chunk-size", "131072")
GROUP = "cluster"


@pytest.fixture
def slow(cluster: Cluster) -> Iterator[None]:
    cluster.set_storage_rate(SLOW_MBIT)
    yield
    cluster.set_storage_rate(400)


@pytest.fixture
def dest(cluster: Cluster) -> Iterator[Path]:
    d = cluster.local / "pytest-fault"
    yield d
    for node in cluster.nodes:
        shutil.rmtree(cluster.node_path(node, d), ignore_errors=True)


def wait_partial(cluster: Cluster, node: str, dest: Path, timeout: float = 120) -> None:
    d = cluster.node_path(node, dest)
    deadline = time.monotonic() + timeout
    while not (d.is_dir() and any(d.glob("*.partial"))):
        assert time.monotonic() < deadline, f"no copy started on {node}"
        time.sleep(0.02)


def wait_no_stager(cluster: Cluster, nodes: list[str], timeout: float = 180, needle: str = "stager stage") -> None:
    """Until no process of ``nodes`` has ``needle`` in its command line (the default also matches the
    batch host's ``srun ... stager stage``; ``bin/stager stage`` only the stager processes)."""
    deadline = time.monotonic() + timeout
    while any(cluster.processes(n, needle) for n in nodes):
        assert time.monotonic() < deadline, "stager processes outlived their job"
        time.sleep(0.1)


def rerun_completes(cluster: Cluster, tmp: Path, src: Path, dest: Path, nodes: list[str], *flags: str) -> int:
    """Stage again without the fault: exit 0 and every node's copy verified; returns files kept."""
    job = stage_job(cluster, tmp, cluster.shared_path(src), dest, *flags, nodes=len(nodes), nodelist=",".join(nodes))
    expect(job)
    for node in nodes:
        check_copy(cluster, node, dest, src)
    return sum(r.get("files_kept", 0) for r in results_of(job))


def test_kill9_one_node_mid_collective(cluster: Cluster, imagenet: Path, dest: Path, tmp_path: Path,
                                       slow: None) -> None:
    src = cluster.shared_path(imagenet)
    job_id = stage_job(cluster, tmp_path, src, dest, *COLLECTIVE, submit_only=True)
    wait_partial(cluster, "node3", dest)
    killed = cluster.kill("node3", "stager stage", signal.SIGKILL)
    assert killed, "no stager on node3 to kill"
    job = finish(cluster, job_id, tmp_path / "stage-0.sh", timeout=180)
    assert job.state == "FAILED", job.describe()
    survivors = results_of(job)
    assert len(survivors) == 3 and all(not r["ok"] and r["type"] == "StagerTimeoutError" for r in survivors), \
        job.output
    assert all("node 2" in r["error"] for r in survivors), survivors  # node3 is SLURM_NODEID 2
    wait_no_stager(cluster, cluster.nodes)
    held = sum(no_torn_files(cluster, n, dest, imagenet) for n in cluster.nodes)
    kept = rerun_completes(cluster, tmp_path, imagenet, dest, cluster.nodes, *COLLECTIVE)
    record("kill -9 of one node's stager mid-collective (4 nodes)", group=GROUP, trials=1, handled=1,
           note="peers exit 5 naming the node; no torn shard; rerun completes, all 4 copies verified",
           survivors_exit_5=len(survivors), shards_held_after_kill=held, files_kept_by_rerun=kept)


def test_node_link_down_mid_collective(cluster: Cluster, imagenet: Path, dest: Path, tmp_path: Path,
                                       slow: None) -> None:
    src = cluster.shared_path(imagenet)
    job_id = stage_job(cluster, tmp_path, src, dest, *COLLECTIVE, submit_only=True)
    wait_partial(cluster, "node2", dest)
    cluster.set_link("node2", False)
    down = time.monotonic()
    try:
        # Down until the stagers of the connected nodes have given up (a silent neighbour counts as
        # stopped after 10 s and 6 of the watcher's own beats): an event, not a duration, so a busy
        # machine cannot end the fault before it is noticed. The stager processes, not srun (which
        # waits for node2's task on node1); node2's own stager may be blocked writing its result
        # through the cut link and ends after the link is back. The bound only catches a hang.
        wait_no_stager(cluster, [n for n in cluster.nodes if n != "node2"], timeout=300, needle="bin/stager stage")
    finally:
        cluster.set_link("node2", True)
    link_down_s = time.monotonic() - down
    job = finish(cluster, job_id, tmp_path / "stage-0.sh", timeout=240)
    assert job.state == "FAILED" and job.exit_code == 5, job.describe()
    assert job.tasks is not None
    errors = {f.stem: f.read_text() for f in job.tasks.glob("*.err")}
    assert len(errors) == 4 and all("exit 5" in e for e in errors.values()), job.describe()
    assert sum("node 1 (node2" in e for e in errors.values()) >= 3, errors  # node2 is SLURM_NODEID 1
    results = results_of(job)
    assert len(results) == 4 and all(not r["ok"] and r["type"] == "StagerTimeoutError" for r in results), \
        job.describe()  # --json: one JSON object per node, also when the watchdog ends a stuck node
    wait_no_stager(cluster, cluster.nodes)
    held = sum(no_torn_files(cluster, n, dest, imagenet) for n in cluster.nodes)
    kept = rerun_completes(cluster, tmp_path, imagenet, dest, cluster.nodes, *COLLECTIVE)
    record("one node's link down mid-collective until every stager gives up (4 nodes)", group=GROUP, trials=1,
           handled=1, note="every stager exits 5 naming the cut-off node; no torn shard; rerun completes",
           failed_stagers=len(errors), shards_held_after_fault=held, files_kept_by_rerun=kept,
           link_down_s=round(link_down_s, 1))


def test_storage_link_down_during_direct_stage(cluster: Cluster, imagenet: Path, dest: Path, tmp_path: Path,
                                               slow: None) -> None:
    """The shared file system vanishes for 4 s: reads stall and resume (TCP retransmits), the stage
    completes, every copy is verified."""
    src = cluster.shared_path(imagenet)
    before = cluster.served_bytes()
    job_id = stage_job(cluster, tmp_path, src, dest, nodes=2, nodelist="node1,node2", submit_only=True)
    wait_partial(cluster, "node1", dest)
    cluster.set_link("storage", False)
    try:
        time.sleep(4)
    finally:
        cluster.set_link("storage", True)
    job = finish(cluster, job_id, tmp_path / "stage-0.sh", timeout=240)
    expect(job)
    for node in ("node1", "node2"):
        check_copy(cluster, node, dest, imagenet)
    ratio = (cluster.served_bytes() - before) / load_manifest(imagenet).num_bytes
    assert 2.0 <= ratio < 2.2, ratio
    record("storage link down 4 s during a direct stage (2 nodes)", group=GROUP, trials=1, handled=1,
           note="reads stall and resume; stage exits 0, both copies verified, no byte served twice",
           served_percent_of_2x=round(ratio / 2 * 100))


def test_scancel_mid_stage_then_resubmit(cluster: Cluster, imagenet: Path, dest: Path, tmp_path: Path,
                                         slow: None) -> None:
    """A job staging into a job-independent DEST is cancelled mid-copy (Slurm signals the step); the
    resubmitted job resumes: verified files are kept, stale .partial files removed."""
    src = cluster.shared_path(imagenet)
    nodes = ["node1", "node2"]
    job_id = stage_job(cluster, tmp_path, src, dest, nodes=2, nodelist=",".join(nodes), submit_only=True)
    wait_partial(cluster, "node2", dest)
    cluster.run(["scancel", str(job_id)])
    job = finish(cluster, job_id, tmp_path / "stage-0.sh", timeout=120)
    assert job.state == "CANCELLED", job.describe()
    wait_no_stager(cluster, nodes)
    held = sum(no_torn_files(cluster, n, dest, imagenet) for n in nodes)
    partials = sum(len(list(cluster.node_path(n, dest).glob("*.partial"))) for n in nodes)
    cluster.set_storage_rate(400)
    kept = rerun_completes(cluster, tmp_path, imagenet, dest, nodes)
    record("scancel mid-stage, then the job resubmitted (2 nodes)", group=GROUP, trials=1, handled=1,
           note="no torn shard after the cancel; the resubmitted job resumes and verifies",
           partials_after_cancel=partials, shards_held_after_cancel=held, files_kept_by_rerun=kept)


TORN_CHECK = """
import sys
from pathlib import Path
from stager.checksum import hash_file
from stager.manifest import load_manifest
m, d = load_manifest(sys.argv[1]), Path(sys.argv[2])
torn = [s.name for s in m.shards if (d / s.name).exists()
        and ((d / s.name).stat().st_size != s.bytes or hash_file(d / s.name, m.hash_algo)[1] != s.hash)]
partial = [p.name for p in d.glob("*.partial")] if d.exists() else []
print(len(torn), len(partial), int((d / "stager-receipt.json").exists()))
"""


def test_one_nodes_local_disk_full(cluster: Cluster, imagenet: Path, tmp_path: Path) -> None:
    """node4's small disk (a size-limited tmpfs, only in node4's mount namespace) is nearly full: stage
    refuses up front with exit 4; with the free-space check bypassed it meets ENOSPC mid-copy and exits
    4, nothing torn; node3 stages fine in the same job; after space is freed the rerun completes."""
    small_node, other = cluster.env["CLUSTER_SMALL_NODE"], "node3"
    small = Path(cluster.env["CLUSTER_LOCAL_SMALL"])
    dest, filler = small / "pytest-full", small / "pytest-filler"
    python = str(cluster.cfg.root / ".venv" / "bin" / "python")
    m = load_manifest(imagenet)
    free = int(cluster.on(small_node, ["df", "-B1", "--output=avail", str(small)]).stdout.split()[-1])
    assert cluster.on(small_node, ["fallocate", "-l", str(free - m.num_bytes // 2), str(filler)]).returncode == 0
    src = cluster.shared_path(imagenet)
    nodelist = f"{other},{small_node}"

    def state_on_small() -> list[int]:
        res = cluster.on(small_node, [python, "-c", TORN_CHECK, str(src), str(dest)])
        assert res.returncode == 0, res.stderr
        return [int(x) for x in res.stdout.split()]

    try:
        outcomes = []
        for env in ({}, {"STAGER_TEST_FREE_BYTES": str(1 << 40)}):  # up-front check, then ENOSPC mid-copy
            job = stage_job(cluster, tmp_path, src, dest, nodes=2, nodelist=nodelist, env=env)
            assert job.state == "FAILED" and job.exit_code == 4, job.describe()
            failed = [r for r in results_of(job) if not r["ok"]]
            assert len(failed) == 1 and failed[0]["type"] == "OutOfSpaceError", job.output
            assert str(dest) in failed[0]["error"] or "space" in failed[0]["error"], failed
            torn, partial, receipt = state_on_small()
            assert (torn, partial, receipt) == (0, 0, 0), (torn, partial, receipt)
            check_copy(cluster, other, dest, imagenet)
            outcomes.append(failed[0]["error"])
        cluster.on(small_node, ["rm", "-f", str(filler)])
        job = stage_job(cluster, tmp_path, src, dest, nodes=2, nodelist=nodelist)
        expect(job)
        verified = cluster.on(small_node, [python, "-m", "stager", "verify", str(dest)])
        assert verified.returncode == 0, verified.stdout + verified.stderr
        record("one node's local disk full (2 nodes): free-space check, then ENOSPC mid-copy", group=GROUP,
               trials=2, handled=2, note="the full node exits 4 with one line, nothing torn, no .partial; the "
                                         "other node completes; the rerun after freeing space completes")
    finally:
        cluster.on(small_node, ["rm", "-rf", str(dest), str(filler)])
        shutil.rmtree(cluster.cfg.node_dir(other) / "small" / "pytest-full", ignore_errors=True)
