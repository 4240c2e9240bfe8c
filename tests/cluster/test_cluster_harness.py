"""The cluster itself (tools/cluster): isolation, names, the three kinds of mounts, the served-bytes
counter, idempotent ``up`` and a ``down`` that removes a half-built cluster completely."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.cluster.client import Cluster
from tools.cluster.proc import mounts_under

ROOT = Path(__file__).resolve().parents[2]


def test_hosts_are_isolated_on_the_bridge(cluster: Cluster) -> None:
    addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert f" {cluster.cfg.subnet}." not in addrs, "the root namespace must get no cluster address"
    for host in cluster.cfg.hosts:
        res = cluster.on(host, ["ip", "route", "get", "1.1.1.1"])
        assert res.returncode != 0 and "unreachable" in res.stderr, f"{host} has a route off the bridge"
        assert cluster.on(host, ["ip", "route", "show", "default"]).stdout.strip() == ""


def test_names_resolve_both_ways_on_every_node(cluster: Cluster) -> None:
    for node in cluster.nodes:
        assert cluster.on(node, ["hostname"]).stdout.strip() == node
        for peer in ("ctl", "storage", *cluster.nodes):
            addr = cluster.cfg.addr(peer)
            fwd = cluster.on(node, ["getent", "ahostsv4", peer]).stdout.split()
            rev = cluster.on(node, ["getent", "hosts", addr]).stdout.split()
            assert fwd[:1] == [addr] and peer in rev[1:], (node, peer, fwd, rev)
            # As a dual-stack listener (torch's TCPStore) sees its peers: IPv4-mapped IPv6.
            mapped = cluster.on(node, ["getent", "hosts", f"::ffff:{addr}"]).stdout.split()
            assert peer in mapped[1:], (node, peer, mapped)
    hosts_here = Path("/etc/hosts").read_text()
    assert "node1" not in hosts_here.split(), "the machine's /etc/hosts must not change"


def test_mounts_shared_local_beeond_small(cluster: Cluster) -> None:
    marker = cluster.export / "pytest-marker"
    marker.write_text("served")
    try:
        for node in cluster.nodes:
            mounts = cluster.on(node, ["findmnt", "-n", "-o", "FSTYPE", str(cluster.shared)]).stdout.strip()
            assert mounts == "fuse.sshfs", (node, mounts)
            assert cluster.on(node, ["cat", str(cluster.shared / "pytest-marker")]).stdout == "served"
            # Node-local: each node writes its own file; no other node sees it.
            assert cluster.on(node, ["sh", "-c", f"echo {node} > {cluster.local}/pytest-who"]).returncode == 0
            # BeeOND stand-in: one namespace for all nodes.
            assert cluster.on(node, ["sh", "-c", f"echo {node} > {cluster.beeond}/pytest-{node}"]).returncode == 0
        for node in cluster.nodes:
            assert cluster.on(node, ["cat", f"{cluster.local}/pytest-who"]).stdout.strip() == node
            assert (cluster.cfg.node_dir(node) / "local" / "pytest-who").read_text().strip() == node
            seen = cluster.on(node, ["sh", "-c", f"cat {cluster.beeond}/pytest-*"]).stdout.split()
            assert sorted(seen) == sorted(cluster.nodes)
        small = cluster.env["CLUSTER_SMALL_NODE"]
        size = cluster.on(small, ["df", "-B1", "--output=size", cluster.env["CLUSTER_LOCAL_SMALL"]]).stdout.split()[-1]
        assert int(size) == int(cluster.env["CLUSTER_SMALL_MB"]) << 20
    finally:
        marker.unlink()
        for node in cluster.nodes:
            (cluster.cfg.node_dir(node) / "local" / "pytest-who").unlink(missing_ok=True)
            (cluster.cfg.beeond_backing / f"pytest-{node}").unlink(missing_ok=True)


def test_served_bytes_counts_what_nodes_read(cluster: Cluster) -> None:
    blob = cluster.export / "pytest-blob"
    blob.write_bytes(os.urandom(4 << 20))
    try:
        before = cluster.served_bytes()
        res = cluster.on("node2", ["sha256sum", str(cluster.shared / "pytest-blob")])
        served = cluster.served_bytes() - before
        assert res.returncode == 0, res.stderr
        assert (4 << 20) <= served < 1.1 * (4 << 20), served
    finally:
        blob.unlink()


def test_slurm_clients_work_from_this_shell(cluster: Cluster) -> None:
    assert sorted(cluster.node_states()) == cluster.nodes
    res = cluster.run(["srun", "-N", str(len(cluster.nodes)), "--ntasks-per-node=1", "sh", "-c",
                       'echo "$(hostname) $SLURMD_NODENAME $SLURM_TMPDIR"'])
    lines = sorted(res.stdout.split("\n")[:-1])
    assert [ln.split()[:2] for ln in lines] == [[n, n] for n in cluster.nodes]
    assert all(ln.split()[2].startswith(str(cluster.local) + "/job") for ln in lines)


def test_up_again_keeps_the_running_cluster(cluster: Cluster) -> None:
    before = cluster.cfg.record.read_text()
    res = subprocess.run([sys.executable, "-m", "tools.cluster", "up"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "CLUSTER_NODES": str(len(cluster.nodes))}, check=False)
    assert res.returncode == 0 and "already up" in res.stdout, res.stdout + res.stderr
    assert cluster.cfg.record.read_text() == before


@pytest.mark.parametrize("fail_after", ["network", "slurm"])
def test_down_removes_a_half_built_cluster(cluster: Cluster, tmp_path: Path, fail_after: str) -> None:
    """A second cluster (its own checkout root, hence its own names) breaks half-way through ``up``;
    ``down`` removes everything it made and leaves the first cluster alone."""
    root = tmp_path / "checkout"
    root.mkdir()
    env = {**os.environ, "CLUSTER_ROOT": str(root), "CLUSTER_NODES": "1", "CLUSTER_TEST_FAIL_AFTER": fail_after}
    cli = [sys.executable, "-m", "tools.cluster"]
    res = subprocess.run([*cli, "up"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert res.returncode == 1 and "CLUSTER_TEST_FAIL_AFTER" in res.stderr, res.stdout + res.stderr
    from tools.cluster.config import Config
    from tools.cluster.proc import netns_pids
    from tools.cluster.state import Record

    other = Config.from_env(root)
    made = set(Record(other.record).netns.values())
    assert mounts_under(root) and made
    res = subprocess.run([*cli, "down"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not netns_pids(made), "processes left in the removed cluster's namespaces"
    assert not mounts_under(root)
    assert not other.run_dir.exists()
    assert not (root / ".cluster").exists()
    assert list(root.iterdir()) == []
    leftovers = subprocess.run(["pgrep", "-f", str(root)], capture_output=True, text=True, check=False).stdout
    assert leftovers.strip() == ""
    # The session's cluster is untouched.
    assert sorted(cluster.node_states()) == cluster.nodes


def test_the_set_up_installs_the_library_slurms_pmix_plugin_opens(cluster: Cluster) -> None:
    """`srun --mpi=pmix` dlopens libpmix.so from the PMIx directory Slurm was built with: the set-up's
    package table names that file (so `make cluster` installs libpmix-dev), and where apt could
    install it, it is there."""
    import glob
    import re
    from fnmatch import fnmatch

    from tools.cluster import lifecycle

    plugins = glob.glob("/usr/lib/*/slurm-wlm/mpi_pmix*.so")
    assert plugins, "Slurm's mpi/pmix plugin is not installed (slurm-wlm-basic-plugins)"
    dirs = {d.decode() for p in plugins for d in re.findall(rb"(/usr/[\w/.+-]*pmix[\w/.+-]*)\0", Path(p).read_bytes())}
    wanted = [f"{d}/libpmix.so" for d in dirs if not d.endswith(".so")]
    assert wanted, dirs
    promised = {what for what, pkg in lifecycle.OPTIONAL.items() if pkg == "libpmix-dev"}
    assert all(any(fnmatch(w, g) for g in promised) for w in wanted), (wanted, promised)
    if not lifecycle.missing_packages(optional=True):
        assert any(os.path.exists(w) for w in wanted), wanted
