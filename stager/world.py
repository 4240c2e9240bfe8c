"""Who am I in the job? Rank, world size, node and worker, detected in one place.

:class:`World` (a training rank's place): explicit arguments, then an initialised
``torch.distributed`` group, then the launcher's environment (:func:`env_topology`), else a
single process.

The launchers' variables, innermost launcher first (a process started by torchrun inside an
``srun`` step sees both; the inner one numbers the ranks, the outer one its own launcher tasks):

1. torchrun: RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/GROUP_RANK; Lightning's and Fabric's own launcher
   (``strategy="ddp"``) set WORLD_SIZE/NODE_RANK/LOCAL_RANK but no RANK: the rank is NODE_RANK times the
   ranks per node (LOCAL_WORLD_SIZE; not needed on node 0) plus LOCAL_RANK;
2. Horovod (horovodrun's gloo launcher): HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE/CROSS_RANK/CROSS_SIZE;
3. MPI, whose variables must agree with one another: Open MPI (OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/
   LOCAL_SIZE), MPICH and Intel MPI's Hydra (PMI_RANK/PMI_SIZE, MPI_LOCALRANKID/MPI_LOCALNRANKS),
   PMIx (PMIX_RANK; the size from OMPI_COMM_WORLD_SIZE or PMI_SIZE, or Slurm's when ``srun --mpi=pmix``
   set it and SLURM_PROCID is the same rank);
4. Slurm: SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NODEID/SLURM_NNODES/SLURM_NTASKS_PER_NODE.

An outer launcher's differing numbers are expected (``mpirun`` in a batch script: SLURM_PROCID is the
batch step's 0 in every rank) and are not errors. Errors (:class:`UsageError`, one line naming the
variables): two MPI sources in one process that disagree, or a launcher that says there are several
ranks but gives no rank (OMPI_COMM_WORLD_SIZE=3 without OMPI_COMM_WORLD_RANK, PMIX_RANK without a size,
WORLD_SIZE=4 without RANK), which would otherwise make every rank read the whole dataset. An explicit
``world_size`` (without an explicit ``rank``) that differs from the launcher's is one too. An initialised
process group wins over the environment, whose gaps and contradictions then do not matter.

:func:`resolve_node` (a node's place, for ``stager stage``, which runs once per node rather than
once per rank): the ``--node/--num-nodes`` flags, then the topology above when its innermost
launcher is not Slurm itself, then Slurm's node variables (the node index is the launcher's, else
``rank // local size`` when every node runs as many ranks).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from stager.errors import UsageError

MAX_NODES = 1_000_000  # more nodes than the largest machine has: a typo (and an entry per node in memory)


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
        """Resolve the topology; every explicit argument wins over detection.

        Raises :class:`UsageError` when the launchers' variables contradict each other, when a
        launcher of several ranks gives no rank, or when ``world_size`` alone is given and differs
        from the launcher's world size (the detected rank would then index another world).
        """
        env = os.environ if env is None else env
        src = "explicit" if rank is not None or world_size is not None else "default"
        d_rank, d_world, d_lrank, d_lworld, d_node, d_nnodes = 0, 1, 0, 1, 0, 1
        detected = process_group_world() if env is os.environ else None
        try:
            env_topo = env_topology(env)
        except UsageError:
            if (rank is None or world_size is None) and detected is None:
                raise
            # The caller named its own world, or an initialised process group says it (Lightning's launcher
            # exports WORLD_SIZE without RANK): the environment's gaps and contradictions are not this world's.
            env_topo = None
        if detected is not None:
            d_rank, d_world = detected
            src = "torch.distributed" if src == "default" else src
            if env_topo is not None and env_topo[:2] == (d_rank, d_world):
                d_lrank, d_lworld, d_node, d_nnodes = env_topo.local_rank, env_topo.local_world_size, *env_topo.place
            else:
                d_lworld, d_nnodes = d_world, 1
                d_lrank = d_rank
        elif env_topo is not None:
            d_rank, d_world, d_lrank, d_lworld = env_topo[:4]
            d_node, d_nnodes = env_topo.place
            src = env_topo.source if src == "default" else src
        if rank is None and world_size is not None and world_size != d_world and (detected or env_topo):
            said = "torch.distributed" if detected is not None else env_topo.variables if env_topo else ""
            raise UsageError(
                f"world_size={world_size} disagrees with the launcher's world of {d_world} ranks ({said}): "
                f"drop world_size (or pass rank too), or start {world_size} ranks"
            )
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


def process_group_world() -> tuple[int, int] | None:
    """An initialised ``torch.distributed`` process group's (rank, size); None: none is initialised. torch is
    never imported for this: a process that initialised a group has imported ``torch.distributed`` already
    (so the numpy loader stays torch-free)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
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


# ---- the launchers' variables ------------------------------------------------------------------


class Claim(NamedTuple):
    """What one launcher's variables say: ``rank`` of ``world_size``, and what they know of the node
    (None: not said). ``variables``: the names and values it was read from, for error messages."""

    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    node: int | None
    num_nodes: int | None
    source: str
    variables: str


class Topology(NamedTuple):
    """The launcher's topology: ``rank`` of ``world_size``, ``local_rank`` of ``local_world_size`` on
    this node, ``node`` of ``num_nodes`` (None when the launcher does not say and nodes run unequal
    numbers of ranks), ``source`` (``"torchrun"``, ``"horovod"``, ``"openmpi"``, ``"mpich"``,
    ``"pmix"``, ``"slurm"``), ``variables`` (the names and values it came from) and ``node_problem``
    (when the node is unknown because the variables contradict each other: what, and what to do)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int | None
    num_nodes: int | None
    source: str
    variables: str
    node_problem: str = ""  # why ``node`` is None when the variables contradict each other (resolve_node raises it)

    @property
    def place(self) -> tuple[int, int]:
        """``(node, num_nodes)``, or ``(0, 1)`` when the node is unknown (the loader does not need it)."""
        if self.node is None or self.num_nodes is None:
            return 0, 1
        return self.node, self.num_nodes


def _shown(env: Mapping[str, str], *names: str) -> str:
    return ", ".join(f"{n}={env[n]}" for n in names if env.get(n))


def _claim(env: Mapping[str, str], source: str, rank_var: str, size_var: str, local: tuple[str, str],
           *, node: tuple[str, str] | None = None) -> Claim | None:
    """The claim of a launcher that sets ``rank_var``/``size_var``; a size over 1 without a rank is an error."""
    rank, size = _int(env, rank_var), _int(env, size_var)
    if rank is None:
        if size is not None and size > 1:
            raise UsageError(
                f"{size_var}={size} says this process is one of {size} {source} ranks, but {rank_var} is not set: "
                f"export {rank_var} (or unset {size_var}) so that the ranks do not all read the whole dataset"
            )
        return None
    if size is None:
        raise UsageError(f"{rank_var}={rank} is set but {size_var} is not: export {size_var} (the number of ranks)")
    names = (rank_var, size_var, *local, *(node or ()))
    n, nn = (_int(env, node[0]), _int(env, node[1])) if node else (None, None)
    return _checked(Claim(rank, size, _int(env, local[0]), _int(env, local[1]), n, nn, source, _shown(env, *names)))


def _checked(c: Claim) -> Claim:
    """``c`` if what it says can be true: a rank of the world, a local rank of the node's ranks (no more of
    them than the world has), a node of the nodes; else a one-line :class:`UsageError` naming the variables
    (a negative, or out-of-range value would otherwise pick another rank's share, or none)."""
    problem = None
    if c.world_size < 1:
        problem = f"a world of {c.world_size} ranks has none"
    elif not 0 <= c.rank < c.world_size:
        problem = f"rank {c.rank} is not one of {c.world_size} ranks (0 to {c.world_size - 1})"
    elif c.local_world_size is not None and not 1 <= c.local_world_size <= c.world_size:
        problem = f"{c.local_world_size} ranks on a node is not between 1 and the world's {c.world_size}"
    elif c.local_rank is not None and not 0 <= c.local_rank < (c.local_world_size or c.world_size):
        problem = f"local rank {c.local_rank} is not one of the node's {c.local_world_size or c.world_size} ranks"
    elif c.num_nodes is not None and not 1 <= c.num_nodes <= MAX_NODES:
        problem = f"{c.num_nodes} nodes is not between 1 and {MAX_NODES:,}"
    elif c.node is not None and c.num_nodes is not None and not 0 <= c.node < c.num_nodes:
        problem = f"node {c.node} is not one of {c.num_nodes} nodes"
    if problem:
        raise UsageError(f"{c.variables}: {problem}; check the launcher's variables (or unset the ones left over "
                         "from another launcher)")
    return c


def _torchrun(env: Mapping[str, str]) -> Claim | None:
    if _int(env, "RANK") is None and _int(env, "LOCAL_RANK") is not None and _int(env, "WORLD_SIZE") is not None:
        return _node_local(env)
    c = _claim(env, "torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    group = _int(env, "GROUP_RANK")
    if c is not None and group is not None:
        lworld = c.local_world_size or c.world_size
        c = _checked(c._replace(node=group, num_nodes=max(1, c.world_size // lworld),
                                variables=_shown(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                 "GROUP_RANK")))
        # torchrun numbers the ranks node by node: RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK (equal
        # nodes). Variables that break it come from different runs; any node derived from them would be a guess.
        if c.world_size % lworld == 0 and c.local_rank is not None and c.rank != group * lworld + c.local_rank:
            raise UsageError(f"{c.variables}: rank {c.rank} is not GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK "
                             f"({group} x {lworld} + {c.local_rank}), as torchrun sets them; check the launcher's "
                             "variables (or unset the ones left over from another launcher)")
    return c


def _node_local(env: Mapping[str, str]) -> Claim:
    """WORLD_SIZE and LOCAL_RANK without RANK: Lightning's and Fabric's own launcher (``strategy="ddp"``), which
    start one process per device and export WORLD_SIZE, NODE_RANK and LOCAL_RANK. The rank is
    ``NODE_RANK * ranks per node + LOCAL_RANK`` (ranks per node: LOCAL_WORLD_SIZE; on node 0 it is not needed)."""
    world, lrank = int(_int(env, "WORLD_SIZE") or 0), int(_int(env, "LOCAL_RANK") or 0)
    node = _int(env, "NODE_RANK")
    node = _int(env, "GROUP_RANK") if node is None else node
    lworld = _int(env, "LOCAL_WORLD_SIZE")
    shown = _shown(env, "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if node and lworld is None:
        raise UsageError(
            f"{shown} (a launcher that sets no RANK, such as Lightning's) do not say how many ranks run per node: "
            "export LOCAL_WORLD_SIZE, or build the loader once the process group is initialised (Lightning: in "
            "setup() or train_dataloader())"
        )
    rank = (node or 0) * (lworld or 0) + lrank
    if not 0 <= rank < world or (lworld is not None and lrank >= lworld):
        raise UsageError(f"{shown}: rank {rank} is not one of the {world} ranks; check the launcher's variables")
    nnodes = world // lworld if lworld and world % lworld == 0 else None
    return _checked(Claim(rank, world, lrank, lworld, node if nnodes else None, nnodes, "lightning", shown))


def _horovod(env: Mapping[str, str]) -> Claim | None:
    return _claim(env, "horovod", "HOROVOD_RANK", "HOROVOD_SIZE", ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
                  node=("HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE"))


def _openmpi(env: Mapping[str, str]) -> Claim | None:
    return _claim(env, "openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                  ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"))


def _mpich(env: Mapping[str, str]) -> Claim | None:
    return _claim(env, "mpich", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"))


def _pmix(env: Mapping[str, str]) -> Claim | None:
    """PMIx gives a rank only; the size is Open MPI's or PMI's, or Slurm's under ``srun --mpi=pmix``."""
    rank = _int(env, "PMIX_RANK")
    if rank is None:
        return None
    for size_var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if (size := _int(env, size_var)) is not None:
            return _checked(Claim(rank, size, None, None, None, None, "pmix", _shown(env, "PMIX_RANK", size_var)))
    if _int(env, "SLURM_PROCID") == rank and (size := _int(env, "SLURM_NTASKS")) is not None:
        return _checked(Claim(rank, size, None, None, None, None, "pmix", _shown(env, "PMIX_RANK", "SLURM_NTASKS")))
    raise UsageError(
        f"PMIX_RANK={rank} is set but no world size (OMPI_COMM_WORLD_SIZE, PMI_SIZE, or SLURM_NTASKS with "
        "SLURM_PROCID equal to it): export one of them, or unset PMIX_RANK"
    )


def _slurm(env: Mapping[str, str]) -> Claim | None:
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    if rank is None or world is None:
        return None
    node, nnodes = _slurm_node(env)
    lrank = _int(env, "SLURM_LOCALID")
    tpn = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
    if tpn:
        counts = parse_tasks_per_node(tpn)
        n = node or 0
        lworld = counts[n] if n < len(counts) else counts[-1]
    else:
        lworld = max(1, world // (nnodes or 1))
    shown = _shown(env, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NNODES",
                   "SLURM_TASKS_PER_NODE")
    # SLURM_NODEID unset: the node is derived (rank // ranks per node) where the counts allow, not taken as 0.
    return _checked(Claim(rank, world, 0 if lrank is None else lrank, lworld, node,
                          nnodes if node is not None else None, "slurm", shown))


def _slurm_node(env: Mapping[str, str]) -> tuple[int | None, int | None]:
    """``(SLURM_NODEID, SLURM_NNODES or SLURM_JOB_NUM_NODES)`` as given (None: unset). A node count below 1,
    or a node outside it, is a one-line :class:`UsageError`."""
    node = _int(env, "SLURM_NODEID")
    nnodes = _int(env, "SLURM_NNODES")
    nnodes = _int(env, "SLURM_JOB_NUM_NODES") if nnodes is None else nnodes
    shown = _shown(env, "SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if nnodes is not None and not 1 <= nnodes <= MAX_NODES:
        raise UsageError(f"{shown}: a job has 1 to {MAX_NODES:,} nodes; check the Slurm variables")
    if node is not None and nnodes is not None and not 0 <= node < nnodes:
        raise UsageError(f"SLURM_NODEID={node} out of range for {nnodes} nodes; check the Slurm variables")
    return node, nnodes


# Innermost launcher first. The claims within one level describe the same processes and must agree.
LAUNCHER_LEVELS: tuple[tuple[Callable[[Mapping[str, str]], Claim | None], ...], ...] = (
    (_torchrun,),
    (_horovod,),
    (_openmpi, _mpich, _pmix),
    (_slurm,),
)


def env_topology(env: Mapping[str, str] | None = None) -> Topology | None:
    """The innermost launcher's topology from ``env`` (default ``os.environ``); None: no launcher.

    Local rank and size come from the winning claim, else from an outer claim that numbers the same
    ranks (``srun --mpi=pmix``: PMIx's rank, Slurm's node), else the whole world is taken for one node.
    Raises :class:`UsageError` (one line, naming the variables) for disagreeing MPI variables or a
    multi-rank launcher without a rank.
    """
    env = os.environ if env is None else env
    claims: list[list[Claim]] = [[c for fn in level if (c := fn(env)) is not None] for level in LAUNCHER_LEVELS]
    inner = next((level for level in claims if level), None)
    if inner is None:
        return None
    first = inner[0]
    for other in inner[1:]:
        if (other.rank, other.world_size) != (first.rank, first.world_size):
            raise UsageError(
                f"launcher variables disagree: {first.variables} vs {other.variables}; "
                "unset the ones left over from another launcher"
            )
    return _merge(first, [c for level in claims for c in level if (c.rank, c.world_size) == first[:2]], env)


def _merge(first: Claim, same: list[Claim], env: Mapping[str, str]) -> Topology:
    """``first``'s rank and size, with the local and node facts of the first claim (of ``same``) that has them."""
    local = next(((c.local_rank, c.local_world_size) for c in same if c.local_world_size is not None), None)
    node, nnodes = next(((c.node, c.num_nodes) for c in same if c.node is not None and c.num_nodes), (None, None))
    if local is None:
        return _without_local_size(first, (node, nnodes), env)
    lrank, lworld = local
    lrank = first.rank if lrank is None else lrank
    if node is None and first.world_size % max(lworld, 1) == 0:
        node, nnodes = first.rank // max(lworld, 1), first.world_size // max(lworld, 1)
    return Topology(first.rank, first.world_size, lrank, lworld, node, nnodes, first.source, first.variables)


def _without_local_size(first: Claim, claimed: tuple[int | None, int | None], env: Mapping[str, str]) -> Topology:
    """No launcher says how many ranks run per node (RANK/WORLD_SIZE/LOCAL_RANK without LOCAL_WORLD_SIZE).

    The node is taken from the first account that agrees with the rank (and the local rank, when given),
    at an equal number of ranks per node: a launcher claim's node variables, then Slurm's
    (SLURM_NODEID of SLURM_NNODES), then one node holding every rank. With ``RANK=2 WORLD_SIZE=4
    LOCAL_RANK=0`` and ``SLURM_NODEID=2 SLURM_NNODES=4`` that is node 2 of 4 at one rank per node; the
    one-node guess would contradict LOCAL_RANK=0. When none agrees the node is unknown (None) and
    ``node_problem`` says why: :func:`resolve_node` raises it, the loader (which does not need the node)
    carries on.
    """
    rank, world, lrank = first.rank, first.world_size, first.local_rank
    slurm = (_int(env, "SLURM_NODEID"), _int(env, "SLURM_NNODES") or _int(env, "SLURM_JOB_NUM_NODES"))
    for node, nnodes in (claimed, slurm, (0, 1)):
        if node is None or not nnodes or world % nnodes:
            continue
        per = world // nnodes
        if rank // per == node and lrank in (None, rank % per):
            return Topology(rank, world, rank % per, per, node, nnodes, first.source, first.variables)
    shown = ", ".join(v for v in (first.variables, _shown(env, "SLURM_NODEID", "SLURM_NNODES",
                                                          "SLURM_JOB_NUM_NODES")) if v)
    problem = (f"{shown}: no launcher variable says how many ranks run per node (LOCAL_WORLD_SIZE), and no node "
               f"count puts rank {rank} of {world} at local rank {lrank}; export LOCAL_WORLD_SIZE (or unset the "
               "variables left over from another launcher), or pass --node and --num-nodes")
    return Topology(rank, world, rank if lrank is None else lrank, world, None, None, first.source, first.variables,
                    problem)


def local_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank among its node's (the innermost launcher's LOCAL_RANK, SLURM_LOCALID, ...; 0 without
    a launcher): which GPU of the node it uses."""
    topo = env_topology(env)
    return topo.local_rank if topo is not None else 0


def allocated_nodes(env: Mapping[str, str] | None = None) -> int | None:
    """How many nodes the job was given (Slurm: ``SLURM_NNODES``, else ``SLURM_JOB_NUM_NODES``); None outside
    a job. For advice sized to the job (``stager hints``); a node's own place is :func:`resolve_node`'s."""
    env = os.environ if env is None else env
    return _int(env, "SLURM_NNODES") or _int(env, "SLURM_JOB_NUM_NODES")


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


def _no_half_slurm(s_node: int | None, s_nodes: int | None) -> None:
    """Slurm's node variables without a launcher: half of them is not one node of one (every node would
    then take the whole share of node 0); a one-line :class:`UsageError` says what is missing."""
    if s_node is not None and s_nodes is None:
        raise UsageError(f"SLURM_NODEID={s_node} is set but SLURM_NNODES (and SLURM_JOB_NUM_NODES) is not: "
                         "run it as a task of a Slurm step (srun), or pass --node and --num-nodes")
    if s_node is None and s_nodes is not None and s_nodes > 1:
        raise UsageError(f"SLURM_NNODES={s_nodes} but SLURM_NODEID is not set (not a task of a Slurm step, e.g. an "
                         "salloc shell): run it with `srun --ntasks-per-node=1`, or pass --node and --num-nodes")


class NodeIdentity(NamedTuple):
    """This node's place in the job: ``node`` of ``num_nodes``, ``ranks_per_node`` training ranks on it,
    and ``origin``, where that came from (``"flags"``, ``"slurm"``, ``"default"``, or
    :attr:`Topology.source`).

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
    """Node identity: the flags (``node`` and ``num_nodes`` together), else the launcher's topology
    (:func:`env_topology`) when a launcher inside Slurm started this process (torchrun, Horovod, MPI),
    else Slurm (``SLURM_NODEID`` of ``SLURM_NNODES``, also without a task rank), else one node.
    ``ranks_per_node``, when not given, comes from ``SLURM_NTASKS_PER_NODE``/``SLURM_TASKS_PER_NODE``
    (this node's entry), else ``LOCAL_WORLD_SIZE``, else the launcher's local size, else 1. Raises
    :class:`UsageError` for half-given flags, an index out of range, non-integer or contradictory
    variables, or an MPI layout with unequal ranks per node (pass the flags).
    """
    env = os.environ if env is None else env

    def ranks_on(n: int) -> int:
        if ranks_per_node is not None:
            return ranks_per_node
        tpn = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if tpn:
            counts = parse_tasks_per_node(tpn)
            return counts[n] if n < len(counts) else counts[-1]
        if (local := _int(env, "LOCAL_WORLD_SIZE")) is not None:
            return local
        topo = env_topology(env)  # e.g. mpirun inside the allocation: Open MPI's local size
        return topo.local_world_size if topo is not None else 1

    if node is not None or num_nodes is not None:
        if node is None or num_nodes is None:
            raise UsageError("--node and --num-nodes must be given together")
        if not 0 <= node < num_nodes:
            raise UsageError(f"--node {node} out of range for --num-nodes {num_nodes}")
        return NodeIdentity(node, num_nodes, ranks_on(node), "flags")
    topo = env_topology(env)
    s_node, s_nodes = _slurm_node(env)
    # Slurm's node variables count only when Slurm started this process (or agrees with the launcher
    # that did): under `mpirun` in a batch script they are the batch step's or the MPI daemons' step's,
    # e.g. SLURM_NODEID=0 of SLURM_NNODES=1 on every node but the first (seen on the test cluster).
    inner = topo is not None and topo.source != "slurm"
    if s_node is not None and s_nodes is not None and not inner:
        return NodeIdentity(s_node, s_nodes, ranks_on(s_node), "slurm")
    if topo is None:
        _no_half_slurm(s_node, s_nodes)
        return NodeIdentity(0, 1, ranks_per_node or 1, "default")
    if topo.node is None or topo.num_nodes is None:
        raise UsageError(topo.node_problem or (
            f"{topo.variables}: the nodes run unequal numbers of ranks, so this node's index cannot be derived; "
            "pass --node and --num-nodes"
        ))
    return NodeIdentity(topo.node, topo.num_nodes, ranks_per_node or topo.local_world_size, topo.source)
