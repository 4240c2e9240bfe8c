"""Who am I in the job? Rank, world size, node and worker, detected in one place.

:class:`World` (a training rank's place): explicit arguments, then an initialised
``torch.distributed`` group, then the launcher's environment (torchrun:
RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/GROUP_RANK; Slurm:
SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NODEID/SLURM_NNODES/SLURM_NTASKS_PER_NODE), else a
single process.

:func:`resolve_node` (a node's place, for ``stager stage``, which runs once per node rather than
once per rank): the ``--node/--num-nodes`` flags, then Slurm's node variables, then the torchrun
topology of :class:`World`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from stager.errors import UsageError


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node: int = 0
    num_nodes: int = 1
    source: str = "default"

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world_size):
            raise UsageError(f"rank {self.rank} out of range for world size {self.world_size}")
        if not (0 <= self.node < self.num_nodes):
            raise UsageError(f"node {self.node} out of range for {self.num_nodes} nodes")

    @property
    def is_local_leader(self) -> bool:
        return self.local_rank == 0

    @property
    def ranks_per_node(self) -> int:
        return self.local_world_size

    @classmethod
    def detect(
        cls,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        node: int | None = None,
        num_nodes: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> World:
        """Resolve the topology; every explicit argument wins over detection."""
        env = os.environ if env is None else env
        src = "explicit" if rank is not None or world_size is not None else "default"
        d_rank, d_world, d_lrank, d_lworld, d_node, d_nnodes = 0, 1, 0, 1, 0, 1
        detected = _from_torch() if env is os.environ else None
        if detected is not None:
            d_rank, d_world = detected
            src = "torch.distributed" if src == "default" else src
            env_topo = _from_env(env)
            if env_topo is not None and env_topo[1] == d_world:
                _, _, d_lrank, d_lworld, d_node, d_nnodes, _ = env_topo
            else:
                d_lworld, d_nnodes = d_world, 1
                d_lrank = d_rank
        else:
            env_topo = _from_env(env)
            if env_topo is not None:
                d_rank, d_world, d_lrank, d_lworld, d_node, d_nnodes, name = env_topo
                src = name if src == "default" else src
        r = d_rank if rank is None else rank
        w = d_world if world_size is None else world_size
        if (rank is not None or world_size is not None) and (local_world_size is None and d_world != w):
            # Explicit global topology that differs from the environment: treat as one node.
            d_lrank, d_lworld, d_node, d_nnodes = r, w, 0, 1
        return cls(
            rank=r,
            world_size=w,
            local_rank=d_lrank if local_rank is None else local_rank,
            local_world_size=d_lworld if local_world_size is None else local_world_size,
            node=d_node if node is None else node,
            num_nodes=d_nnodes if num_nodes is None else num_nodes,
            source=src,
        )


def _from_torch() -> tuple[int, int] | None:
    try:
        import torch.distributed as dist  # noqa: PLC0415 (torch is imported only where a process group is used)
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError as exc:
        raise UsageError(f"environment variable {name}={v!r} is not an integer") from exc


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE syntax, e.g. ``"4(x2),3"``."""
    out: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise UsageError(f"cannot parse Slurm tasks-per-node value {value!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _from_env(env: Mapping[str, str]) -> tuple[int, int, int, int, int, int, str] | None:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None and world is not None:
        lrank = _int(env, "LOCAL_RANK")
        lworld = _int(env, "LOCAL_WORLD_SIZE")
        lrank = rank if lrank is None else lrank
        lworld = world if lworld is None else lworld
        nnodes = max(1, world // max(lworld, 1))
        node = _int(env, "GROUP_RANK")
        node = rank // max(lworld, 1) if node is None else node
        return rank, world, lrank, lworld, node, nnodes, "torchrun"
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    if rank is not None and world is not None:
        node = _int(env, "SLURM_NODEID") or 0
        nnodes = _int(env, "SLURM_NNODES") or _int(env, "SLURM_JOB_NUM_NODES") or 1
        lrank = _int(env, "SLURM_LOCALID")
        lrank = 0 if lrank is None else lrank
        tpn = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
        if tpn:
            counts = parse_tasks_per_node(tpn)
            lworld = counts[node] if node < len(counts) else counts[-1]
        else:
            lworld = max(1, world // nnodes)
        return rank, world, lrank, lworld, node, nnodes, "slurm"
    return None


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist such as ``"gpu[01-03,07],login1"`` (what `scontrol show hostnames` does)."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", expr):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if not prefix and not ranges:
            continue
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for r in ranges.split(","):
            if "-" in r:
                lo, hi = r.split("-", 1)
                width = len(lo)
                hosts += [f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1)]
            else:
                hosts.append(prefix + r + suffix)
    return hosts


class NodeIdentity(NamedTuple):
    """This node's place in the job: ``node`` of ``num_nodes``, ``ranks_per_node`` training ranks on it,
    and ``origin``, where that came from (``"flags"``, ``"slurm"``, or :attr:`World.source`).

    A tuple, so ``node, num_nodes, ranks_per_node, origin = resolve_node(...)`` keeps working.
    """

    node: int
    num_nodes: int
    ranks_per_node: int
    origin: str


def resolve_node(
    node: int | None = None,
    num_nodes: int | None = None,
    ranks_per_node: int | None = None,
    env: Mapping[str, str] | None = None,
) -> NodeIdentity:
    """Node identity: the flags (``node`` and ``num_nodes`` together), else Slurm (``SLURM_NODEID`` of
    ``SLURM_NNODES``), else torchrun (:meth:`World.detect`). ``ranks_per_node``, when not given, comes
    from ``SLURM_NTASKS_PER_NODE``/``SLURM_TASKS_PER_NODE`` (this node's entry), else ``LOCAL_WORLD_SIZE``,
    else 1. Raises :class:`UsageError` for half-given flags, an index out of range, or non-integer
    variables.
    """
    env = dict(os.environ if env is None else env)  # a copy: World.detect then skips importing torch

    def ranks_on(n: int) -> int:
        if ranks_per_node is not None:
            return ranks_per_node
        tpn = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if tpn:
            counts = parse_tasks_per_node(tpn)
            return counts[n] if n < len(counts) else counts[-1]
        return _int(env, "LOCAL_WORLD_SIZE") or 1

    if node is not None or num_nodes is not None:
        if node is None or num_nodes is None:
            raise UsageError("--node and --num-nodes must be given together")
        if not 0 <= node < num_nodes:
            raise UsageError(f"--node {node} out of range for --num-nodes {num_nodes}")
        return NodeIdentity(node, num_nodes, ranks_on(node), "flags")
    s_node, s_nodes = _int(env, "SLURM_NODEID"), _int(env, "SLURM_NNODES") or _int(env, "SLURM_JOB_NUM_NODES")
    if s_node is not None and s_nodes is not None:
        if not 0 <= s_node < s_nodes:
            raise UsageError(f"SLURM_NODEID={s_node} out of range for {s_nodes} nodes")
        return NodeIdentity(s_node, s_nodes, ranks_on(s_node), "slurm")
    w = World.detect(env=env)
    return NodeIdentity(w.node, w.num_nodes, ranks_per_node or w.local_world_size, w.source)
