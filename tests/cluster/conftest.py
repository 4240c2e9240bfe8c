"""The cluster suite (marker ``cluster``): real sbatch, srun, slurmctld and slurmd on the one-machine
cluster of tools/cluster (``make cluster``), with the shared file system behind a tbf-capped link.

One session fixture brings the cluster up (or reuses one that is up and healthy) and takes it down at
the end of the session if it brought it up, on every way the session ends (tools/cluster/session.py:
Ctrl-C, SIGTERM, SIGHUP, and through a reaper process SIGKILL too). Where the machine cannot have a
cluster (not root, the kernel refuses namespaces, the packages cannot be installed, or
STAGER_CLUSTER_TESTS=0) every test of the suite is skipped for one reason, which the summary prints
as one line.
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
from tools.cluster.session import session

ROOT = Path(__file__).resolve().parents[2]
# The suite's cluster has 4 nodes; the teardown tests' inner sessions (test_cluster_teardown.py) ask for 1.
NODES = int(os.environ.get("STAGER_TEST_CLUSTER_NODES", "4"))


SKIPPED = pytest.StashKey[str]()


def _ours(item: pytest.Item) -> bool:
    return Path(__file__).parent in Path(str(item.fspath)).parents


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the suite ``cluster`` before -m selects (hence tryfirst). Under ``make test``'s xdist workers
    the whole suite runs in one of them (tests/conftest.py, ``SERIAL_GROUPS``)."""
    for item in items:
        if _ours(item):
            item.add_marker(pytest.mark.cluster)


class _DropWhenUnavailable:
    """Where the machine cannot have a cluster, drop the suite's tests after -m/-k selected (a run
    that deselected them checks nothing, installs nothing) and say why in one line at the end."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        mine = [i for i in items if _ours(i)]
        if not mine:
            return
        reason = unavailable()
        if reason is None:
            return
        config.hook.pytest_deselected(items=mine)
        items[:] = [i for i in items if not _ours(i)]
        config.stash[SKIPPED] = f"{len(mine)} cluster tests skipped: {reason}"

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        line = config.stash.get(SKIPPED, None)
        if line:
            terminalreporter.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_DropWhenUnavailable(), "stager-cluster-availability")


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
    with session(cfg):
        c = Cluster(cfg)
        yield c
        c.set_storage_rate(cfg.storage_mbit)


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


STAGE_SCRIPT = """#!/bin/bash
# One `stager stage` per node; each node's JSON result in its own file (srun relays output in pieces
# of at most 1 KiB, so long lines of several tasks sharing one stream can interleave).
source .venv/bin/activate
srun --ntasks-per-node=1 --output={tasks}/%N.out --error={tasks}/%N.err stager stage {src} {dest} --json {flags}
"""


def stage_job(cluster: Cluster, tmp: Path, src: Path, dest: Path, *flags: str, nodes: int = 4,
              nodelist: str | None = None, submit_only: bool = False, timeout: float = 300,
              env: dict[str, str] | None = None) -> Any:
    """Submit a job that stages ``src`` (a path on CLUSTER_SHARED) into ``dest`` on each of ``nodes``;
    wait for it unless ``submit_only`` (then return the job id)."""
    script = tmp / f"stage-{len(list(tmp.glob('stage-*.sh')))}.sh"
    tasks = script.with_suffix(".tasks")
    tasks.mkdir()
    script.write_text(STAGE_SCRIPT.format(src=src, dest=dest, flags=" ".join(flags), tasks=tasks))
    out = script.with_suffix(".out")
    args = [f"--nodes={nodes}", "--ntasks-per-node=1", "--cpus-per-task=1", f"--output={out}", str(script)]
    if nodelist:
        args.insert(0, f"--nodelist={nodelist}")
    job_id = cluster.submit(args, cwd=ROOT, env=env)
    if submit_only:
        return job_id
    return finish(cluster, job_id, script, timeout)


def finish(cluster: Cluster, job_id: int, script: Path, timeout: float = 300) -> Job:
    """Wait for a job of :func:`stage_job` (``script`` names its files)."""
    job = cluster.wait(job_id, timeout=timeout, output=script.with_suffix(".out"))
    job.tasks = script.with_suffix(".tasks")
    return job


def results_of(job: Job) -> list[dict[str, Any]]:
    """The JSON results of the job's tasks (one per node), or of its output file."""
    if job.tasks is not None:
        return [r for f in sorted(job.tasks.glob("*.out")) for r in read_json_lines(f)]
    return [json.loads(ln) for ln in job.output.splitlines() if ln.startswith("{")]


def node_dest(cluster: Cluster, node: str, dest: Path) -> Path:
    return cluster.node_path(node, dest)


def check_copy(cluster: Cluster, node: str, dest: Path, src_export: Path, shards: list[str] | None = None) -> None:
    """The node's DEST holds exactly the expected shards (default: all), each verified against the
    manifest (size and xxh3), with its receipt and no partial file."""
    from stager.checksum import hash_file
    from stager.manifest import load_manifest

    m = load_manifest(src_export)
    d = node_dest(cluster, node, dest)
    want = sorted(shards if shards is not None else [s.name for s in m.shards])
    have = sorted(p.name for p in d.iterdir() if p.name.startswith("shard-") and ".partial" not in p.name)
    assert have == want, (node, have, want)
    by_name = {s.name: s for s in m.shards}
    for name in have:
        info = by_name[name]
        assert (d / name).stat().st_size == info.bytes
        assert hash_file(d / name, m.hash_algo)[1] == info.hash, f"{node}: {name} differs from SRC"
    assert not list(d.glob("*.partial")), (node, list(d.glob("*.partial")))
    assert (d / "stager-receipt.json").exists()


def no_torn_files(cluster: Cluster, node: str, dest: Path, src_export: Path) -> int:
    """Every file under a final shard name in the node's DEST is complete and correct (a fault may
    leave .partial files and missing shards, never a wrong one); returns how many shards it holds."""
    from stager.checksum import hash_file
    from stager.manifest import load_manifest

    m = load_manifest(src_export)
    d = node_dest(cluster, node, dest)
    if not d.exists():
        return 0
    n = 0
    for s in m.shards:
        p = d / s.name
        if p.exists():
            assert p.stat().st_size == s.bytes and hash_file(p, m.hash_algo)[1] == s.hash, \
                f"{node}: torn {s.name} under its final name"
            n += 1
    return n
