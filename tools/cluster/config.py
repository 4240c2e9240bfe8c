"""The cluster's shape and names: one place for every path, namespace, address and environment variable."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SFTP_PORT = 7022
IFACE = "eth0"  # every host's link, inside its own namespace
DEFAULT_NODES = 4
DEFAULT_STORAGE_MBIT = 400
DEFAULT_SUBNET = "10.99.13"
DEFAULT_SMALL_MB = 48
# Client commands wrapped into .cluster/bin so that they reach the controller from this machine's shell.
SLURM_CLIENTS = ("sbatch", "srun", "salloc", "sinfo", "squeue", "scancel", "scontrol", "sacct", "sattach",
                 "sstat", "sbcast", "sdiag", "strigger")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise SystemExit(f"cluster: {name}={raw!r} is not an integer") from exc


@dataclass(frozen=True)
class Config:
    """Where everything is. ``tag`` (from the checkout's path) keeps two checkouts' clusters apart."""

    root: Path
    nodes: int
    storage_mbit: int
    subnet: str
    small_mb: int

    @classmethod
    def from_env(cls, root: Path | None = None) -> Config:
        """Read CLUSTER_* from the environment. CLUSTER_ROOT (default: this checkout) holds .cluster/."""
        root = root or Path(os.environ.get("CLUSTER_ROOT") or ROOT)
        nodes = _env_int("CLUSTER_NODES", DEFAULT_NODES)
        if not 1 <= nodes <= 64:
            raise SystemExit(f"cluster: CLUSTER_NODES={nodes}: expected 1..64")
        mbit = _env_int("CLUSTER_STORAGE_MBIT", DEFAULT_STORAGE_MBIT)
        if mbit < 1:
            raise SystemExit(f"cluster: CLUSTER_STORAGE_MBIT={mbit}: expected >= 1")
        subnet = os.environ.get("CLUSTER_SUBNET", DEFAULT_SUBNET).strip()
        parts = subnet.split(".")
        if len(parts) != 3 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
            raise SystemExit(f"cluster: CLUSTER_SUBNET={subnet!r}: expected the first three octets of a /24, "
                             "e.g. 10.99.13")
        return cls(root=root.resolve(), nodes=nodes, storage_mbit=mbit, subnet=subnet,
                   small_mb=_env_int("CLUSTER_SMALL_MB", DEFAULT_SMALL_MB))

    # --- names ---------------------------------------------------------------------------------
    @property
    def tag(self) -> str:
        return hashlib.sha1(str(self.root).encode()).hexdigest()[:4]

    @property
    def run_dir(self) -> Path:
        """munge's socket lives here: munged wants every directory above it searchable by all, which a
        checkout (or pytest's 0700 temporary directory) need not be."""
        return Path("/run") / f"stgr-{self.tag}"

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    @property
    def hosts(self) -> list[str]:
        """Every host with a namespace of its own (the switch is not a host)."""
        return ["ctl", "storage", *self.node_names]

    @property
    def small_node(self) -> str:
        return self.node_names[-1]

    def netns(self, host: str) -> Path:
        """A host's network namespace, kept by a bind mount on this file (no /run/netns entry)."""
        return self.ns_file(host, "net")

    def addr(self, host: str) -> str:
        if host == "ctl":
            return f"{self.subnet}.1"
        if host == "storage":
            return f"{self.subnet}.2"
        return f"{self.subnet}.{10 + int(host.removeprefix('node'))}"

    @staticmethod
    def port_name(host: str) -> str:
        """The switch-side end of a host's link (inside the switch namespace)."""
        return f"p-{host}"[:15]

    # --- paths -----------------------------------------------------------------------------------
    @property
    def state(self) -> Path:
        return self.root / ".cluster"

    @property
    def record(self) -> Path:
        return self.state / "state.json"

    @property
    def env_file(self) -> Path:
        return self.state / "env"

    @property
    def etc(self) -> Path:
        return self.state / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def nsdir(self) -> Path:
        return self.state / "ns"

    def ns_file(self, host: str, kind: str) -> Path:
        return self.nsdir / f"{host}.{kind}"

    @property
    def logs(self) -> Path:
        return self.state / "log"

    @property
    def munge_dir(self) -> Path:
        return self.state / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.run_dir / "munge.socket"

    @property
    def bin(self) -> Path:
        return self.state / "bin"

    @property
    def export(self) -> Path:
        """The served directory as the host sees it (CLUSTER_SHARED_EXPORT)."""
        return self.state / "export"

    @property
    def beeond_backing(self) -> Path:
        return self.state / "beeond"

    def node_dir(self, node: str) -> Path:
        """Host view of a node's private disk: ``local/`` and ``small/`` live here."""
        return self.state / "nodes" / node

    def mnt(self, name: str) -> Path:
        """Mount points, identical on every node (empty directories on the host)."""
        return self.state / "mnt" / name

    @property
    def shared(self) -> Path:
        return self.mnt("shared")

    @property
    def local(self) -> Path:
        return self.mnt("local")

    @property
    def local_small(self) -> Path:
        return self.mnt("small")

    @property
    def beeond(self) -> Path:
        return self.mnt("beeond")

    @property
    def prolog_root(self) -> Path:
        """Where tools/slurm/stager-prolog stages (node-local: a directory of CLUSTER_LOCAL)."""
        return self.local / "stager-prolog"

    @property
    def prolog_state(self) -> Path:
        """Root's own files of the prolog service (node-local: the nodes share the host's /run)."""
        return self.local / "stager-prolog-state"

    def served_bytes_command(self) -> str:
        """Transmitted bytes of the storage host's link (its /proc/net/dev, read inside its namespace)."""
        return (f"nsenter --net={self.netns('storage')} awk -F'[: ]+' "
                f"'$2 == \"{IFACE}\" {{ print $11 }}' /proc/net/dev")

    def environment(self) -> dict[str, str]:
        """What .cluster/env exports (values as strings)."""
        return {
            "SLURM_CONF": str(self.slurm_conf),
            "CLUSTER_NODES": str(self.nodes),
            "CLUSTER_NODE_NAMES": " ".join(self.node_names),
            "CLUSTER_SHARED": str(self.shared),
            "CLUSTER_SHARED_EXPORT": str(self.export),
            "CLUSTER_LOCAL": str(self.local),
            "CLUSTER_LOCAL_SMALL": str(self.local_small),
            "CLUSTER_SMALL_NODE": self.small_node,
            "CLUSTER_SMALL_MB": str(self.small_mb),
            "CLUSTER_BEEOND": str(self.beeond),
            "CLUSTER_NODE_DIRS": str(self.state / "nodes"),
            "CLUSTER_PROLOG_ROOT": str(self.prolog_root),
            "CLUSTER_PROLOG_STATE": str(self.prolog_state),
            "CLUSTER_STORAGE_MBIT": str(self.storage_mbit),
            "CLUSTER_NETNS_DIR": str(self.nsdir),
            "CLUSTER_SERVED_BYTES": self.served_bytes_command(),
            "CLUSTER_STATE": str(self.state),
        }
