"""The cluster suite (marker ``cluster``): real sbatch, srun, slurmctld and slurmd on the one-machine
cluster of tools/cluster (``make cluster``), with the shared file system behind a tbf-capped link.

One session fixture brings the cluster up (or reuses one that is up and healthy) and takes it down at
the end of the session if it brought it up. Where the machine cannot have a cluster (not root, the
kernel refuses namespaces, the packages cannot be installed, or STAGER_CLUSTER_TESTS=0) every test of
the suite is skipped for one reason, which ``pytest -ra`` prints as one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.cluster import lifecycle
from tools.cluster.client import Cluster, Job
from tools.cluster.config import Config
from tools.cluster.proc import ClusterError
from tools.cluster.state import Record

ROOT = Path(__file__).resolve().parents[2]
NODES = 4


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cluster)


def unavailable() -> str | None:
    """Why this machine cannot run the cluster suite, or None."""
    if os.environ.get("STAGER_CLUSTER_TESTS", "1") == "0":
        return "disabled by STAGER_CLUSTER_TESTS=0"
    if os.geteuid() != 0:
        return "not root (the cluster needs network namespaces, mounts and daemons)"
    try:
        lifecycle.preflight()
    except ClusterError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    reason = unavailable()
    if reason:
        pytest.skip(f"cluster tests skipped: {reason}")
    cfg = dataclasses.replace(Config.from_env(), nodes=NODES, storage_mbit=400)
    was_up = False
    try:
        lifecycle.healthy(cfg, Record(cfg.record))
        was_up = True
    except ClusterError:
        pass
    lifecycle.up(cfg)
    c = Cluster(cfg)
    yield c
    c.set_storage_rate(cfg.storage_mbit)
    if not was_up:
        lifecycle.down(cfg)


@pytest.fixture(scope="session")
def shared_data(cluster: Cluster) -> Iterator[Path]:
    """A directory of the served file system for this session's datasets (removed at the end)."""
    d = cluster.export / "pytest-data"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def cifar(shared_data: Path) -> dict[str, Path]:
    """96 train / 25 test 32x32 images in tar shards of 16, on the shared file system (export paths)."""
    from stager.pack import pack
    from tools.datagen import make_cifar

    src = make_cifar(shared_data / "cifar-src", n_train=96, n_test=25, seed=5)
    train = pack(src, shared_data / "cifar-train", "tar", samples_per_shard=16, split="train").out
    test = pack(src, shared_data / "cifar-test", "tar", samples_per_shard=16, split="test").out
    return {"train": Path(train), "test": Path(test)}


@pytest.fixture(scope="session")
def imagenet(shared_data: Path) -> Path:
    """ImageNet-like JPEGs (~500x375) packed into 12 tar shards: several MB, so the link is what counts."""
    from stager.pack import pack
    from tools.datagen import make_imagefolder

    src = make_imagefolder(shared_data / "inet-src", num_classes=4, per_class=24, seed=3)
    return Path(pack(src, shared_data / "inet-tar", "tar", samples_per_shard=8).out)


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.startswith("{")]


def expect(job: Job, state: str = "COMPLETED", code: int = 0) -> None:
    assert (job.state, job.exit_code) == (state, code), job.describe()
