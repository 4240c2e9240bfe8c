"""Bring the cluster up (named phases, each recorded as it goes) and take it down (by record and by name).

``up`` is idempotent: a complete, healthy cluster is left as it is; anything else (a half-finished
bring-up, a dead daemon) is taken down first and rebuilt. ``down`` removes what ``up`` made and
nothing else, also after a bring-up that failed half-way: processes inside this checkout's
namespaces, the namespace files and their private mount (unbound, the namespaces vanish with their
links and the bridge), munge's socket directory /run/stgr-<tag>, and .cluster/.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from . import hosts, net, sharedfs, slurm
from .config import Config
from .proc import ClusterError, alive, mounts_under, netns_pids, ns_inode, run, terminate
from .state import Record

# openmpi-bin: mpirun inside jobs (tests/cluster/test_cluster_mpi.py; tests/test_mpi.py on one machine).
APT_PACKAGES = ("slurm-wlm", "munge", "sshfs", "openssh-sftp-server", "openmpi-bin")
NEEDED = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-wlm", "munged": "munge",
          "sshfs": "sshfs", "/usr/lib/openssh/sftp-server": "openssh-sftp-server", "mpirun": "openmpi-bin"}
SYSTEM = ("ip", "tc", "nsenter", "unshare", "mount", "umount")


def log(msg: str) -> None:
    print(f"cluster: {msg}", flush=True)


def missing_packages() -> list[str]:
    return sorted({pkg for prog, pkg in NEEDED.items() if not (shutil.which(prog) or os.access(prog, os.X_OK))})


def preflight(install: bool = True) -> None:
    """Root, the kernel features and the packages (installed with apt when missing)."""
    if os.geteuid() != 0:
        raise ClusterError("needs root (network namespaces, mounts, daemons)")
    for prog in SYSTEM:
        if not shutil.which(prog):
            raise ClusterError(f"{prog} not found (iproute2/util-linux)")
    if not Path("/dev/fuse").exists():
        raise ClusterError("/dev/fuse is missing (the shared file system is FUSE)")
    probe = run(["unshare", "--net", "--mount", "--uts", "true"], check=False, timeout=30)
    if probe.returncode != 0:
        raise ClusterError(f"the kernel refuses new namespaces here ({probe.stderr.strip()})")
    missing = missing_packages()
    if missing and install:
        if not shutil.which("apt-get"):
            raise ClusterError(f"missing packages {', '.join(missing)} and no apt-get to install them")
        log(f"installing {' '.join(APT_PACKAGES)} (apt)")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]
        if run(cmd, check=False, timeout=600, env=env).returncode != 0:
            run(["apt-get", "update", "-q"], timeout=600, env=env)
            run(cmd, timeout=600, env=env)
        missing = missing_packages()
    if missing:
        raise ClusterError(f"missing packages: {', '.join(missing)}")


def healthy(cfg: Config, rec: Record) -> None:
    """ClusterError unless every namespace, daemon, mount and node is as ``up`` left it."""
    if not rec.data.get("complete"):
        raise ClusterError("the last bring-up did not complete")
    lost = [h for h, inode in rec.netns.items() if ns_inode(cfg.netns(h)) != inode]
    if lost:
        raise ClusterError(f"namespaces gone: {', '.join(lost)}")
    dead = [name for name, pid in rec.daemons.items() if not alive(pid)]
    if dead:
        raise ClusterError(f"daemons not running: {', '.join(sorted(dead))}")
    for node in cfg.node_names:
        if not sharedfs.mounted(cfg, node):
            raise ClusterError(f"{cfg.shared} not mounted on {node}")
    if not slurm.nodes_ready(cfg):
        raise ClusterError("not every node is known to slurmctld")


def up(cfg: Config) -> None:
    preflight()
    rec = Record(cfg.record)
    if cfg.record.exists() or net.bound(cfg) or cfg.run_dir.exists():
        try:
            healthy(cfg, rec)
            log(f"already up ({cfg.nodes} nodes); source {cfg.env_file}")
            return
        except ClusterError as exc:
            log(f"found a previous cluster that is not healthy ({exc}); taking it down first")
            down(cfg)
            rec = Record(cfg.record)
    t0 = time.monotonic()
    rec.set("tag", cfg.tag)
    rec.set("nodes", cfg.nodes)
    phases = [
        ("directories", lambda: (hosts.make_dirs(cfg), hosts.write_hosts_file(cfg), hosts.prepare_nsdir(cfg))),
        ("network (switch, links, tbf)", lambda: net.build(cfg, rec)),
        ("hosts (hostnames, /etc/hosts, local disks)", lambda: _hosts(cfg)),
        ("munge", lambda: slurm.start_munge(cfg, rec)),
        ("shared file system (sftp-server + sshfs)", lambda: sharedfs.mount_all(cfg, rec)),
        ("slurm (slurmctld, slurmd)", lambda: (slurm.write_config(cfg), slurm.start_daemons(cfg, rec))),
        ("clients and .cluster/env", lambda: (slurm.write_clients(cfg), slurm.write_env(cfg))),
    ]
    fail_after = os.environ.get("CLUSTER_TEST_FAIL_AFTER", "")  # test-only: a bring-up that breaks half-way
    for name, step in phases:
        log(name)
        try:
            step()
            if fail_after and name.startswith(fail_after):
                raise ClusterError(f"CLUSTER_TEST_FAIL_AFTER={fail_after}")
        except ClusterError as exc:
            raise ClusterError(f"{name}: {exc} (logs: {cfg.logs}; `make cluster-down` removes what was made)") \
                from exc
    net.check_isolated(cfg)
    rec.set("complete", True)
    log(f"up in {time.monotonic() - t0:.1f}s: {cfg.nodes} nodes, storage link {cfg.storage_mbit} Mbit/s; "
        f"source {cfg.env_file}")


def _hosts(cfg: Config) -> None:
    for host in cfg.hosts:
        hosts.create(cfg, host)
        hosts.check(cfg, host)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def down(cfg: Config) -> None:
    rec = Record(cfg.record)
    inodes = set(rec.netns.values())
    inodes |= {i for f in net.bound(cfg) if (i := ns_inode(f)) is not None}
    pids = [p for p in netns_pids(inodes) if p != os.getpid()]
    # Daemons outside those namespaces should not exist; the record is checked against each command
    # line so that a reused pid is never touched.
    markers = ("munged", "slurmctld", "slurmd", "sshfs", "sftpd", "sftp-server")
    for pid in rec.daemons.values():
        if alive(pid) and any(m in _cmdline(pid) for m in markers) and pid not in pids:
            pids.append(pid)
    if pids:
        log(f"stopping {len(pids)} processes in the cluster's namespaces")
        terminate(pids)
    # Unbinding the namespace files frees the namespaces (their links and the bridge go with them).
    for mp in mounts_under(cfg.state):
        if run(["umount", mp], check=False).returncode != 0:
            run(["umount", "-l", mp], check=False)
    left = mounts_under(cfg.state)
    if left:
        raise ClusterError(f"still mounted, not removing {cfg.state}: {', '.join(left)}")
    still = [p for p in netns_pids(inodes) if alive(p)]
    if still:
        raise ClusterError(f"processes still inside the cluster's namespaces: {still}")
    run_dir = Path(rec.data.get("run_dir") or cfg.run_dir)
    if run_dir.name.startswith("stgr-") and run_dir.is_dir():
        shutil.rmtree(run_dir)
    if cfg.state.exists():
        shutil.rmtree(cfg.state)
    log("down")
