"""Staging strategies on 4 nodes reading the throttled shared file system, with the bytes the storage
host served counted at its interface (CLUSTER_SERVED_BYTES), independently of stager's own figures:
direct (every node copies: N x the dataset), collective (read once, exchanged between nodes: 1.0x),
--partition (each node its share: 1.0x in all), and --shared into the BeeOND stand-in (each shard
written once by some node: 1.0x). Every copy is checked against the manifest. No timings asserted."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.manifest import load_manifest
from stager.order.partition import assign_shards_to_nodes
from tools.cluster.client import Cluster

from .conftest import check_copy, expect, results_of, stage_job

# Protocol and metadata on top of the data: TCP/IP headers (~0.3% with segmentation offload), SFTP
# framing, each node's manifest read and directory lookups.
OVERHEAD = 0.06


@pytest.fixture
def dest(cluster: Cluster) -> Iterator[Path]:
    d = cluster.local / "pytest-staging"
    yield d
    for node in cluster.nodes:
        shutil.rmtree(cluster.node_path(node, d), ignore_errors=True)


def served_ratio(cluster: Cluster, tmp: Path, src: Path, dest: Path, *flags: str) -> tuple[float, list[dict]]:
    before = cluster.served_bytes()
    job = stage_job(cluster, tmp, cluster.shared_path(src), dest, *flags)
    expect(job)
    served = cluster.served_bytes() - before
    return served / load_manifest(src).num_bytes, results_of(job)


def test_direct_reads_the_dataset_once_per_node(cluster: Cluster, imagenet: Path, dest: Path, tmp_path: Path) -> None:
    ratio, results = served_ratio(cluster, tmp_path, imagenet, dest)
    assert len(results) == 4 and all(r["ok"] for r in results)
    assert 4.0 <= ratio <= 4 * (1 + OVERHEAD), ratio
    for node in cluster.nodes:
        check_copy(cluster, node, dest, imagenet)


def test_collective_reads_each_byte_once(cluster: Cluster, imagenet: Path, dest: Path, tmp_path: Path) -> None:
    ratio, results = served_ratio(cluster, tmp_path, imagenet, dest, "--collective", "--timeout", "120")
    m = load_manifest(imagenet)
    assert len(results) == 4 and all(r["collective"] and r["fallback"] is None for r in results), results
    assert sum(r["src_bytes"] for r in results) == m.num_bytes  # stager's own count agrees
    assert 1.0 <= ratio <= 1 + OVERHEAD, ratio
    for node in cluster.nodes:
        check_copy(cluster, node, dest, imagenet)


def test_partition_each_node_holds_its_share(cluster: Cluster, imagenet: Path, dest: Path, tmp_path: Path) -> None:
    ratio, results = served_ratio(cluster, tmp_path, imagenet, dest, "--partition", "--seed", "3")
    m = load_manifest(imagenet)
    shares = assign_shards_to_nodes(m.shard_bytes, 4, 3)
    assert 1.0 <= ratio <= 1 + OVERHEAD, ratio
    for r in results:
        assert r["mode"] == "partition"
    for i, node in enumerate(cluster.nodes):  # SLURM_NODEID follows the node list order
        check_copy(cluster, node, dest, imagenet, [m.shards[j].name for j in shares[i]])


def test_shared_beeond_dest_written_once(cluster: Cluster, imagenet: Path, tmp_path: Path) -> None:
    dest = cluster.beeond / "pytest-shared"
    try:
        ratio, results = served_ratio(cluster, tmp_path, imagenet, dest, "--shared", "--timeout", "120")
        m = load_manifest(imagenet)
        assert 1.0 <= ratio <= 1 + OVERHEAD, ratio
        assert sum(r["files_copied"] for r in results) == len(m.shards), results
        # One namespace: the host sees the BeeOND stand-in's backing directory.
        backing = cluster.cfg.beeond_backing / "pytest-shared"
        from stager.shardcheck import verify

        assert verify(backing, deep=True).ok
    finally:
        shutil.rmtree(cluster.cfg.beeond_backing / "pytest-shared", ignore_errors=True)
