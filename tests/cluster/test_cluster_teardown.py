"""A test run that is stopped from outside tears its cluster down, and the next ``up`` clears what a run
killed outright left behind (tools/cluster/session.py, tools/cluster/lifecycle.py).

Each case starts a real inner run, ``make test TESTS=tests/cluster/hold_session.py`` (or ``.ci/run``
with TESTS in its environment; a one-node cluster in a checkout root of its own, so the suite's cluster
is untouched), waits until its cluster is up, and stops it as a user or CI would: SIGTERM to make
(``kill``), SIGTERM to ``.ci/run`` (a CI time limit), SIGINT to the process group (Ctrl-C in a
terminal), SIGKILL to pytest (its reaper takes over), SIGKILL to pytest and its reaper (nothing can
clean up: the next ``up`` of the same checkout, or of any other, must). Afterwards
nothing of that cluster may remain: no process in its namespaces, no recorded daemon, no mount under
the checkout (a busy ``node1.net`` is what kept a killed CI clone from being removed), no /run
directory, no .cluster/.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tools.cluster.client import Cluster
from tools.cluster.config import Config
from tools.cluster.proc import alive, mounts_under, netns_pids

from .conftest import ROOT


def wait_until(what: str, probe: Any, timeout: float = 300) -> None:
    """Wait for an event (a file, a process ending); fail naming it after a generous ``timeout``."""
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f}s")
        time.sleep(0.2)


def inner_env(root: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "CLUSTER_ROOT": str(root), "STAGER_TEST_CLUSTER_NODES": "1", **extra}


def start_inner_run(tmp: Path, root: Path, via: str = "make") -> tuple[subprocess.Popen[bytes], int, dict[str, Any]]:
    """``make test`` (or ``.ci/run``) of the hold session with its cluster in ``root``; returns the
    process, the pytest pid and the cluster's record once it is up."""
    ready = tmp / "ready"
    tests = f"-p no:cacheprovider --basetemp={tmp / 'basetemp'} tests/cluster/hold_session.py"
    cmd = (["make", "-C", str(ROOT), "-o", ".venv/.stager-installed", "test"] if via == "make"
           else ["bash", str(ROOT / ".ci" / "run")])
    # As started from a terminal, where Ctrl-C reaches the job: this suite may itself run with SIGINT
    # ignored (.ci/run starts make in the background), and children inherit that. env execs: same pid.
    cmd = ["env", "--default-signal=INT", *cmd]
    log = open(tmp / "inner.log", "wb")  # noqa: SIM115 (the run outlives this function)
    make = subprocess.Popen(cmd, env=inner_env(root, STAGER_HOLD_READY=str(ready), TESTS=tests), stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    wait_until("the inner run's cluster", lambda: ready.exists() or make.poll() is not None)
    assert ready.exists(), (tmp / "inner.log").read_text()[-4000:]
    record = json.loads((root / ".cluster" / "state.json").read_text())
    assert record["owner"]["kind"] == "session" and record["complete"], record
    return make, int(ready.read_text()), record


def assert_nothing_left(root: Path, record: dict[str, Any]) -> None:
    assert not netns_pids(set(record["netns"].values())), "processes left in the cluster's namespaces"
    assert not [n for n, pid in record["daemons"].items() if alive(pid)], "daemons left running"
    assert not mounts_under(root), mounts_under(root)
    assert not Config.from_env(root).run_dir.exists()
    assert not (root / ".cluster").exists()
    leftovers = subprocess.run(["pgrep", "-f", str(root)], capture_output=True, text=True, check=False).stdout
    assert leftovers.strip() == "", leftovers


def cluster_cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.cluster", *args], cwd=ROOT, env=inner_env(
        root, CLUSTER_NODES="1"), capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize("stop", ["sigterm-to-make", "sigterm-to-ci-run", "ctrl-c", "sigkill-to-pytest"])
def test_a_stopped_run_takes_its_cluster_down(cluster: Cluster, tmp_path: Path, stop: str) -> None:
    root = tmp_path / "checkout"
    root.mkdir()
    make, pytest_pid, record = start_inner_run(tmp_path, root, via="ci" if stop == "sigterm-to-ci-run" else "make")
    reaper = int(record["reaper"])
    try:
        if stop.startswith("sigterm"):
            os.kill(make.pid, signal.SIGTERM)
        elif stop == "ctrl-c":
            os.killpg(make.pid, signal.SIGINT)
        else:
            os.kill(pytest_pid, signal.SIGKILL)
        assert make.wait(timeout=240) != 0
    finally:
        if make.poll() is None:  # a failed case must not leave its run (and cluster) behind: the reaper's turn
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
    wait_until("the reaper's end", lambda: not alive(reaper))
    log = (tmp_path / "inner.log").read_text()
    if stop != "sigkill-to-pytest":
        assert "KeyboardInterrupt" in log or "Interrupted" in log, log[-3000:]
    assert_nothing_left(root, record)
    assert sorted(cluster.node_states()) == cluster.nodes  # the suite's cluster is untouched


def test_the_next_up_clears_what_a_killed_run_left(cluster: Cluster, tmp_path: Path) -> None:
    """pytest and its reaper killed at once: the daemons and the mounts stay. ``up`` in the same checkout
    rebuilds; after another such kill, the checkout cannot be removed (busy mounts) until ``up`` in
    another checkout clears it, record or not."""
    root = tmp_path / "checkout"
    root.mkdir()
    for round_ in ("same checkout", "another checkout"):
        make, pytest_pid, record = start_inner_run(tmp_path, root)
        for pid in (pytest_pid, int(record["reaper"])):
            os.kill(pid, signal.SIGKILL)
        make.wait(timeout=300)
        assert [p for p in record["daemons"].values() if alive(p)] and mounts_under(root), "nothing was left"
        (tmp_path / "ready").unlink()
        if round_ == "same checkout":
            res = cluster_cli(root, "up")
            assert res.returncode == 0 and "left by a test session" in res.stdout, res.stdout + res.stderr
            assert not [p for p in record["daemons"].values() if alive(p)]
            assert cluster_cli(root, "status").returncode == 0
            assert "owner: manual" in cluster_cli(root, "status").stdout
            assert cluster_cli(root, "down").returncode == 0
            assert_nothing_left(root, record)
            continue
        with pytest.raises(OSError):  # what removing a killed CI clone ran into
            shutil.rmtree(root)
        other = tmp_path / "other-checkout"
        other.mkdir()
        res = cluster_cli(other, "up")
        assert res.returncode == 0 and f"clearing the cluster a dead test session left in {root}" in res.stdout, \
            res.stdout + res.stderr
        try:
            assert cluster_cli(other, "status").returncode == 0
        finally:
            assert cluster_cli(other, "down").returncode == 0
        assert_nothing_left(root, record)
        shutil.rmtree(root)
    assert sorted(cluster.node_states()) == cluster.nodes
