"""The node-local shard cache under real Slurm (``stage --cache``), with the bytes the storage host
served counted at its interface: a chain of jobs on one node reads the dataset from the shared file
system once; two jobs staging it at the same time on one node read it once together; every DEST is
checked against the manifest. No timings asserted (tools/bench/bench_cluster_cache.py measures them)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.manifest import load_manifest
from tools.cluster.client import Cluster

from .conftest import check_copy, expect, finish, results_of, stage_job

OVERHEAD = 0.06  # TCP/IP, SFTP framing, the manifest and index reads (tests/cluster/test_cluster_staging.py)
NODE = "node1"


@pytest.fixture
def cache(cluster: Cluster) -> Iterator[Path]:
    d = cluster.local / "pytest-cache"
    shutil.rmtree(cluster.node_path(NODE, d), ignore_errors=True)
    yield d
    shutil.rmtree(cluster.node_path(NODE, d), ignore_errors=True)
    for name in ("pytest-cache-d0", "pytest-cache-d1", "pytest-cache-d2"):
        shutil.rmtree(cluster.node_path(NODE, cluster.local / name), ignore_errors=True)


def test_a_chain_of_jobs_reads_the_source_once(cluster: Cluster, imagenet: Path, cache: Path, tmp_path: Path) -> None:
    m = load_manifest(imagenet)
    served = []
    for i in range(3):
        dest = cluster.local / f"pytest-cache-d{i}"
        before = cluster.served_bytes()
        job = stage_job(cluster, tmp_path, cluster.shared_path(imagenet), dest, "--cache", str(cache), nodes=1,
                        nodelist=NODE)
        expect(job)
        served.append((cluster.served_bytes() - before) / m.num_bytes)
        (res,) = results_of(job)
        assert res["cache"]["files_hit"] == (0 if i == 0 else len(list(m.files()))), res["cache"]
        check_copy(cluster, NODE, dest, imagenet)
        shutil.rmtree(cluster.node_path(NODE, dest))
    assert 1.0 <= served[0] <= 1 + OVERHEAD, served
    assert all(s <= OVERHEAD for s in served[1:]), served
    assert 1.0 <= sum(served) <= 1 + 3 * OVERHEAD, served


def test_two_concurrent_jobs_read_the_source_once(cluster: Cluster, imagenet: Path, cache: Path,
                                                  tmp_path: Path) -> None:
    m = load_manifest(imagenet)
    before = cluster.served_bytes()
    dests = [cluster.local / f"pytest-cache-d{i}" for i in range(2)]
    scripts = []
    ids = []
    for dest in dests:
        ids.append(stage_job(cluster, tmp_path, cluster.shared_path(imagenet), dest, "--cache", str(cache),
                             "--timeout", "300", nodes=1, nodelist=NODE, submit_only=True))
        scripts.append(sorted(tmp_path.glob("stage-*.sh"))[-1])
    jobs = [finish(cluster, j, s) for j, s in zip(ids, scripts, strict=True)]
    for job in jobs:
        expect(job)
    served = (cluster.served_bytes() - before) / m.num_bytes
    results = [results_of(j)[0]["cache"] for j in jobs]
    total = sum(b for _, b, _ in m.files())
    assert sum(r["bytes_filled"] for r in results) == total, results  # one copy between them
    assert 1.0 <= served <= 1 + 2 * OVERHEAD, served
    for dest in dests:
        check_copy(cluster, NODE, dest, imagenet)
