"""Rank detection under every launcher stager knows (stager/world.py), on the environments the
launchers really set, for every rank of several layouts.

Invariants: over the environments of one job, the detected ranks are exactly ``range(world)``, each
node holds ``local size`` ranks whose local ranks are ``range(local size)``, node indices are
``range(num_nodes)``, and the loader's epoch plans of those ranks partition the samples (every sample
exactly once, no padding when the world divides them). Contradictions are one-line UsageErrors that
name the variables to fix.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from stager.errors import UsageError
from stager.order.epoch import PlanConfig, plan_rank
from stager.world import World, env_topology, resolve_node

Env = dict[str, str]


def _layout(nodes: int, per_node: int) -> list[tuple[int, int, int]]:
    """(rank, node, local rank) of a block layout (Open MPI's --map-by slot, Slurm's block)."""
    return [(n * per_node + lr, n, lr) for n in range(nodes) for lr in range(per_node)]


def openmpi(rank: int, node: int, lr: int, nodes: int, per: int) -> Env:
    # mpirun inside an sbatch script, as seen on the test cluster (tests/cluster/test_cluster_mpi.py):
    # Open MPI 4+ also sets PMIX_RANK; the first node's ranks inherit the batch step's Slurm variables
    # (task 0 of all), the other nodes' those of the srun step that started the MPI daemons (task
    # node-1 of nodes-1, SLURM_NODEID node-1). Outer numbers that must not win, for ranks or nodes.
    w = nodes * per
    if node == 0:
        outer = {"SLURM_PROCID": "0", "SLURM_NTASKS": str(w), "SLURM_NODEID": "0", "SLURM_NNODES": str(nodes),
                 "SLURM_TASKS_PER_NODE": f"{per}(x{nodes})"}
    else:
        outer = {"SLURM_PROCID": str(node - 1), "SLURM_NTASKS": str(nodes - 1), "SLURM_NODEID": str(node - 1),
                 "SLURM_NNODES": str(nodes - 1), "SLURM_TASKS_PER_NODE": f"1(x{nodes - 1})"}
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(w), "OMPI_COMM_WORLD_LOCAL_RANK": str(lr),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(per), "OMPI_COMM_WORLD_NODE_RANK": str(lr), "PMIX_RANK": str(rank),
            **outer}


def hydra(rank: int, node: int, lr: int, nodes: int, per: int) -> Env:
    # MPICH / Intel MPI's mpiexec.hydra.
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(nodes * per), "MPI_LOCALRANKID": str(lr),
            "MPI_LOCALNRANKS": str(per)}


def srun_pmi2(rank: int, node: int, lr: int, nodes: int, per: int) -> Env:
    # srun --mpi=pmi2: Slurm's variables and PMI's describe the same ranks.
    return {**slurm(rank, node, lr, nodes, per), "PMI_RANK": str(rank), "PMI_SIZE": str(nodes * per)}


def srun_pmix(rank: int, node: int, lr: int, nodes: int, per: int) -> Env:
    return {**slurm(rank, node, lr, nodes, per), "PMIX_RANK": str(rank)}


def slurm(rank: int, node: int, lr: int, nodes: int, per: int) -> Env:
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(nodes * per), "SLURM_LOCALID": str(lr),
            "SLURM_NODEID": str(node), "SLURM_NNODES": str(nodes), "SLURM_TASKS_PER_NODE": f"{per}(x{nodes})"}


def horovod(rank: int, node: int, lr: int, nodes: int, per: int) -> Env:
    # horovodrun's gloo launcher, started inside one srun task per node (whose Slurm ids are the node's).
    return {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(nodes * per), "HOROVOD_LOCAL_RANK": str(lr),
            "HOROVOD_LOCAL_SIZE": str(per), "HOROVOD_CROSS_RANK": str(node), "HOROVOD_CROSS_SIZE": str(nodes),
            "SLURM_PROCID": str(node), "SLURM_NTASKS": str(nodes), "PMIX_RANK": str(node)}


def torchrun_in_mpirun(rank: int, node: int, lr: int, nodes: int, per: int) -> Env:
    # `mpirun -N 1 torchrun --nproc-per-node P`: Open MPI numbers the torchrun agents, torchrun the ranks.
    return {"RANK": str(rank), "WORLD_SIZE": str(nodes * per), "LOCAL_RANK": str(lr), "LOCAL_WORLD_SIZE": str(per),
            "GROUP_RANK": str(node), "OMPI_COMM_WORLD_RANK": str(node), "OMPI_COMM_WORLD_SIZE": str(nodes),
            "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}


def lightning(rank: int, node: int, lr: int, nodes: int, per: int) -> Env:
    # Lightning's and Fabric's own launcher (strategy="ddp"): no RANK. On one node that is all it takes;
    # across nodes the ranks per node must be said (LOCAL_WORLD_SIZE), or the process group awaited.
    env = {"WORLD_SIZE": str(nodes * per), "NODE_RANK": str(node), "LOCAL_RANK": str(lr),
           "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    return env | ({"LOCAL_WORLD_SIZE": str(per)} if nodes > 1 else {})


LAUNCHERS: dict[str, tuple[Callable[..., Env], str]] = {
    "openmpi": (openmpi, "openmpi"), "hydra": (hydra, "mpich"), "srun-pmi2": (srun_pmi2, "mpich"),
    "srun-pmix": (srun_pmix, "pmix"), "slurm": (slurm, "slurm"), "horovod": (horovod, "horovod"),
    "torchrun-in-mpirun": (torchrun_in_mpirun, "torchrun"), "lightning": (lightning, "lightning"),
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
@pytest.mark.parametrize(("nodes", "per"), [(1, 1), (1, 3), (2, 2), (3, 4)])
def test_detected_ranks_partition_the_world(launcher: str, nodes: int, per: int) -> None:
    make_env, source = LAUNCHERS[launcher]
    world = nodes * per
    seen = []
    for rank, node, lr in _layout(nodes, per):
        env = make_env(rank, node, lr, nodes, per)
        w = World.detect(env=env)
        assert (w.world_size, w.local_world_size, w.num_nodes) == (world, per, nodes), env
        assert w.source == source
        seen.append((w.rank, w.node, w.local_rank))
        assert resolve_node(env=env)[:3] == (w.node, nodes, per)
    assert sorted(r for r, _, _ in seen) == list(range(world))
    for n in range(nodes):
        assert sorted(lr for _, node, lr in seen if node == n) == list(range(per))
    # The loader's plans of the detected ranks: every sample exactly once per epoch.
    n_samples = world * 10
    starts = np.array([0, n_samples // 2, n_samples], dtype=np.int64)
    cfg = PlanConfig(batch_size=3, world_size=world, num_workers=2, seed=5, mode="runs", buffer_samples=7)
    run_len = np.full(2, 4, dtype=np.int64)
    ids = np.concatenate([plan_rank(starts, run_len, cfg, r, epoch=1).ids for r, _, _ in seen])
    assert np.array_equal(np.sort(ids), np.arange(n_samples))


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"OMPI_COMM_WORLD_SIZE": "3"}, ["OMPI_COMM_WORLD_SIZE=3", "OMPI_COMM_WORLD_RANK"]),
        ({"PMI_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, ["PMI_SIZE=4", "PMI_RANK"]),
        ({"HOROVOD_SIZE": "2"}, ["HOROVOD_SIZE=2", "HOROVOD_RANK"]),
        ({"WORLD_SIZE": "4"}, ["WORLD_SIZE=4", "RANK"]),
        ({"WORLD_SIZE": "4", "NODE_RANK": "1", "LOCAL_RANK": "0"}, ["WORLD_SIZE=4", "NODE_RANK=1", "LOCAL_WORLD_SIZE"]),
        ({"PMIX_RANK": "2"}, ["PMIX_RANK=2", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]),
        ({"OMPI_COMM_WORLD_RANK": "1"}, ["OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE"]),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "PMI_RANK": "2", "PMI_SIZE": "3"},
         ["OMPI_COMM_WORLD_RANK=1", "PMI_RANK=2", "disagree"]),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "PMIX_RANK": "0"},
         ["OMPI_COMM_WORLD_RANK=1", "PMIX_RANK=0"]),
        ({"PMI_RANK": "x", "PMI_SIZE": "2"}, ["PMI_RANK='x'"]),
    ],
)
def test_contradictions_and_missing_ranks_are_one_line_errors(env: Env, names: list[str]) -> None:
    for detect in (lambda: World.detect(env=env), lambda: resolve_node(env=env)):
        with pytest.raises(UsageError) as e:
            detect()
        msg = str(e.value)
        assert "\n" not in msg and all(n in msg for n in names), msg


def test_a_world_size_that_disagrees_with_the_launchers_is_refused() -> None:
    env = openmpi(1, 0, 1, 1, 3)
    with pytest.raises(UsageError) as e:
        World.detect(world_size=2, env=env)
    msg = str(e.value)
    assert "\n" not in msg and "world_size=2" in msg and "OMPI_COMM_WORLD_SIZE=3" in msg
    assert World.detect(world_size=3, env=env).rank == 1  # agreeing: fine
    assert World.detect(0, 2, env=env).world_size == 2  # rank and size both explicit: the caller's own world
    assert World.detect(1, 2, env={"PMIX_RANK": "3"}).rank == 1  # and the environment's contradictions are not its


def test_unequal_ranks_per_node_leave_the_node_to_the_flags() -> None:
    # 3 ranks as 2 + 1, seen from the first node: Open MPI says nothing of the node index, and a local
    # size of 2 does not divide 3 (the second node's rank, local size 1, cannot tell: docs/training.md).
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    topo = env_topology(env)
    assert topo is not None and topo.node is None and World.detect(env=env).rank == 1
    with pytest.raises(UsageError, match="--node and --num-nodes"):
        resolve_node(env=env)
    assert resolve_node(1, 2, env=env)[:2] == (1, 2)


def test_no_launcher_is_one_process() -> None:
    assert env_topology({}) is None
    assert World.detect(env={}) == World(source="default")
    assert resolve_node(env={"PMI_SIZE": "1"}) == (0, 1, 1, "default")


# ---- a launcher that does not say how many ranks run per node (issue 38.13) ---------------------------------
def custom(rank: int, node: int, lr: int, nodes: int, per: int, *, slurm_node: int | None = None) -> Env:
    """A job script's own launcher inside an allocation: RANK, WORLD_SIZE and LOCAL_RANK but no
    LOCAL_WORLD_SIZE; Slurm's node variables of the step (``slurm_node``: a wrong one)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(nodes * per), "LOCAL_RANK": str(lr),
            "SLURM_NODEID": str(node if slurm_node is None else slurm_node), "SLURM_NNODES": str(nodes)}


@pytest.mark.parametrize(("nodes", "per"), [(4, 1), (2, 3), (3, 2)])
def test_the_node_variables_that_agree_place_each_rank(nodes: int, per: int) -> None:
    places = []
    for rank, node, lr in _layout(nodes, per):
        env = custom(rank, node, lr, nodes, per)
        got = resolve_node(env=env)
        assert (got.node, got.num_nodes, got.ranks_per_node) == (node, nodes, per), (env, got)
        w = World.detect(env=env)
        assert (w.rank, w.node, w.num_nodes, w.local_rank, w.local_world_size) == (rank, node, nodes, lr, per)
        places.append((w.node, w.local_rank))
    assert sorted(places) == sorted((n, lr) for n in range(nodes) for lr in range(per))


def test_node_variables_that_contradict_the_ranks_are_one_line_errors() -> None:
    env = custom(2, 2, 0, 4, 1, slurm_node=1)  # rank 2 at local rank 0 cannot be on node 1 of 4
    with pytest.raises(UsageError) as e:
        resolve_node(env=env)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in ("RANK=2", "LOCAL_RANK=0", "SLURM_NODEID=1", "LOCAL_WORLD_SIZE"))
    assert World.detect(env=env).rank == 2  # the loader does not need the node: ranks still resolve
    assert resolve_node(2, 4, env=env)[:2] == (2, 4)  # the flags win


def test_stage_partition_under_such_a_launcher_gives_each_node_its_share(imagenet_tiny_tar: Path,
                                                                         tmp_path: Path) -> None:
    """The real CLI, one process per node of a 4-node job: the shares are disjoint and cover the pack."""
    from stager.manifest import load_manifest
    from tests.cli_support import assert_error_contract, clean_env, stager

    held: list[str] = []
    for rank in range(4):
        r = stager("stage", imagenet_tiny_tar, tmp_path / f"node{rank}", "--partition", "--json",
                   env=clean_env(**custom(rank, rank, 0, 4, 1)))
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert (res["partition"]["node"], res["partition"]["num_nodes"]) == (rank, 4), res["partition"]
        held += [p.name for p in (tmp_path / f"node{rank}").glob("shard-*")]
    assert sorted(held) == sorted(s.name for s in load_manifest(imagenet_tiny_tar).shards)
    r = stager("stage", imagenet_tiny_tar, tmp_path / "bad", "--partition", "--json",
               env=clean_env(**custom(2, 2, 0, 4, 1, slurm_node=1)))
    assert_error_contract(r, 2, "stager stage", as_json=True)
    assert "SLURM_NODEID=1" in r.stderr and not (tmp_path / "bad").exists()


def test_no_module_but_world_reads_the_launchers_variables() -> None:
    """Node identity (and rank) come from stager/world.py only: no other module names a launcher variable."""
    pkg = Path(__file__).resolve().parents[1] / "stager"
    world = ast.parse((pkg / "world.py").read_text())
    names = {n.value for n in ast.walk(world) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and re.fullmatch(r"[A-Z][A-Z0-9_]+", n.value)}
    assert {"SLURM_NODEID", "GROUP_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_NNODES"} <= names
    readers = {}
    for path in pkg.rglob("*.py"):
        if path.name == "world.py" and path.parent == pkg:
            continue
        found = {n.value for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Constant) and n.value in names}
        if found:
            readers[str(path.relative_to(pkg))] = sorted(found)
    assert not readers, f"launcher variables read outside stager/world.py: {readers}"
