"""Bring the cluster up (named phases, each recorded as it goes) and take it down (by record and by name).

``up`` is idempotent: a complete, healthy cluster is left as it is; anything else (a half-finished
bring-up, a dead daemon) is taken down first and rebuilt. So is a cluster that a test session left
when it died (killed, or out of time: its recorded owner is gone): nobody else would take it down,
and its queue may hold that session's jobs. Before that, ``up`` clears such dead sessions' clusters
of other checkouts too, found by their namespace files in the mount table (a CI clone whose run was
killed; its directory cannot be removed while they are mounted). ``down`` removes what ``up`` made
and nothing else, also after a bring-up that failed half-way: processes inside this checkout's
namespaces, the namespace files and their private mount (unbound, the namespaces vanish with their
links and the bridge), munge's socket directory /run/stgr-<tag>, and .cluster/.
"""

from __future__ import annotations

import fcntl
import glob
import os
import re
import shutil
import time
from pathlib import Path

from . import hosts, net, sharedfs, slurm
from .config import Config
from .proc import ClusterError, alive, mounts_under, netns_pids, ns_inode, run, terminate
from .state import Owner, Record

# What the cluster needs (program or file -> the Debian package that provides it).
NEEDED = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-wlm", "munged": "munge",
          "sshfs": "sshfs", "/usr/lib/openssh/sftp-server": "openssh-sftp-server"}
# What some of its tests need, installed with the rest; without them only those tests skip, saying so
# (tests/cluster/test_cluster_mpi.py). mpirun: Open MPI inside jobs (and tests/test_mpi.py on one
# machine). libpmix.so: Slurm's mpi/pmix plugin dlopens it from PMIx's directory, and only
# libpmix-dev has it (libpmix2, which Open MPI pulls in, has libpmix.so.2 alone).
OPTIONAL = {"mpirun": "openmpi-bin", "/usr/lib/*/pmix2/lib/libpmix.so": "libpmix-dev"}
APT_PACKAGES = tuple(dict.fromkeys([*NEEDED.values(), *OPTIONAL.values()]))
SYSTEM = ("ip", "tc", "nsenter", "unshare", "mount", "umount")


def log(msg: str) -> None:
    print(f"cluster: {msg}", flush=True)


def _present(what: str) -> bool:
    if not what.startswith("/"):
        return shutil.which(what) is not None
    return any(os.access(p, os.R_OK) for p in glob.glob(what))


def missing_packages(optional: bool = False) -> list[str]:
    """Debian packages of :data:`NEEDED` (with ``optional``: of :data:`OPTIONAL`) whose files are absent."""
    table = OPTIONAL if optional else NEEDED
    return sorted({pkg for what, pkg in table.items() if not _present(what)})


def preflight(install: bool = True) -> None:
    """Root, the kernel features and the packages (installed with apt when missing: every package of
    :data:`APT_PACKAGES`, so that a fresh machine runs every cluster test). ClusterError when the
    cluster cannot run; a missing optional package only says which tests will skip."""
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
    if install and missing_packages() + missing_packages(optional=True):
        _install_missing()
    missing = missing_packages()
    if missing:
        raise ClusterError(f"missing packages: {', '.join(missing)} (apt-get install -y {' '.join(missing)})")
    optional = missing_packages(optional=True)
    if optional:
        log(f"not installed: {', '.join(optional)}; the cluster tests that need them will be skipped")


def _install_missing() -> None:
    """apt-get install the missing packages, one process of this machine at a time: the suite's two xdist
    workers both collect the cluster tests, so on a fresh machine both get here at once (and ``make
    cluster`` may run beside); the second finds them installed. dpkg's lock, held by another apt, is waited for."""
    with open("/run/lock/stager-cluster-apt.lock" if os.path.isdir("/run/lock") else "/tmp/stager-cluster-apt.lock",
              "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        missing = missing_packages() + missing_packages(optional=True)
        if not missing:
            return
        if not shutil.which("apt-get"):
            raise ClusterError(f"missing packages {', '.join(missing)} and no apt-get to install them")
        log(f"installing {' '.join(missing)} (apt)")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        wait = ["-o", "DPkg::Lock::Timeout=540"]
        cmd = ["apt-get", *wait, "install", "-y", "-q", "--no-install-recommends", *missing]
        if run(cmd, check=False, timeout=600, env=env).returncode != 0:
            run(["apt-get", *wait, "update", "-q"], timeout=600, env=env)
            run(cmd, check=False, timeout=600, env=env)


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


def exists(cfg: Config) -> bool:
    """Anything of a cluster of this checkout is there (a record, a bound namespace, munge's directory)."""
    return cfg.record.exists() or bool(net.bound(cfg)) or cfg.run_dir.exists()


def up(cfg: Config, owner: Owner | None = None) -> None:
    """Bring the cluster up for ``owner`` (default: this process, ``manual``); see the module docstring."""
    preflight()
    sweep(keep=cfg.root)
    rec = Record(cfg.record)
    if exists(cfg):
        left = rec.owner
        try:
            if left is not None and left.dead_session:
                raise ClusterError(f"left by a test session that ended without taking it down ({left.describe()})")
            healthy(cfg, rec)
            log(f"already up ({cfg.nodes} nodes); source {cfg.env_file}")
            return
        except ClusterError as exc:
            log(f"found a previous cluster that is not healthy ({exc}); taking it down first")
            down(cfg)
            rec = Record(cfg.record)
    t0 = time.monotonic()
    rec.set_owner(owner or Owner.this_process("manual"))
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


_NS_FILE = re.compile(r"^(/.+)/\.cluster/ns/[^/]+\.(?:net|mnt|uts)$")


def abandoned_roots(keep: Path | None = None) -> list[Path]:
    """Checkouts (other than ``keep``) whose cluster namespaces are still bound although nobody will
    take them down: their record names a test session that is gone, or the record itself is gone
    (the checkout was deleted around its busy mounts). A cluster brought up by hand, or whose
    session is alive, is never listed."""
    roots = set()
    for mp in mounts_under(Path("/")):
        m = _NS_FILE.match(mp)
        if m and Path(m.group(1)) != keep:
            roots.add(Path(m.group(1)))
    out = []
    for root in sorted(roots):
        record = root / ".cluster" / "state.json"
        owner = Record(record).owner if record.exists() else None
        if not record.exists() or (owner is not None and owner.dead_session):
            out.append(root)
    return out


def sweep(keep: Path | None = None) -> list[Path]:
    """Take down the clusters :func:`abandoned_roots` finds; return their checkouts."""
    roots = abandoned_roots(keep)
    for root in roots:
        log(f"clearing the cluster a dead test session left in {root}")
        down(Config.from_env(root))
    return roots
