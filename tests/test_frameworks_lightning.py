"""PyTorch Lightning and Fabric over stager loaders, launched by their own launchers (2 CPU ranks, gloo).

The scripts in tests/frameworks/ are what a Lightning user writes: ``make_loader`` in a DataModule's
``setup()`` or ``__init__``, or at module level; ``Trainer(strategy="ddp" | "ddp_spawn")``; checkpoints
by ``ModelCheckpoint`` and ``ckpt_path``; ``limit_train_batches``; ``reload_dataloaders_every_n_epochs``;
``Fabric.launch`` with ``setup_dataloaders``, ``fabric.save`` and ``fabric.load``. Invariants: every
sample once per epoch across the ranks (one padding repeat declared), equal batches on both ranks, a
new order each epoch (the order stager's plan gives that epoch), and a resumed run's batches equal to
the uninterrupted run's, from an epoch's end and from mid-epoch. Lightning's false "Your
`IterableDataset` has `__len__` defined" warning is not raised.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.frameworks.common import PER_RANK_BATCHES, assert_epoch, free_port, load, python, run, script, stager_epoch

pytest.importorskip("lightning", reason="lightning is in the test extra: make venv (tools/setup_venv.sh)")

LEN_WARNING = "has `__len__` defined"
KW = {"decode": "raw", "seed": 3}


@pytest.fixture(scope="module")
def ddp_run(frameworks_pack: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``strategy="ddp"`` script run: Lightning's launcher starts rank 1 as a subprocess of the script."""
    out = tmp_path_factory.mktemp("lightning_ddp")
    run([python(), script("lightning_run.py"), "ddp", str(frameworks_pack), str(out)], cwd=out,
        env={"MASTER_PORT": str(free_port())})
    return out


def epochs(out: Path, phase: str) -> dict[str, list[list[list[int]]]]:
    """``{epoch: [rank 0's batches, rank 1's batches]}`` of one phase."""
    ranks = load(out, phase)
    return {e: [r["seen"][e] for r in ranks] for e in sorted(ranks[0]["seen"])}


@pytest.mark.timeout(400)
def test_ddp_loaders_in_setup_and_before_the_trainer_give_every_rank_its_share(ddp_run: Path,
                                                                                frameworks_pack: Path) -> None:
    early = load(ddp_run, "early")
    # Rank 0 built its loader before any launcher ran (a world of one), rank 1 from Lightning's
    # WORLD_SIZE/NODE_RANK/LOCAL_RANK without RANK; both iterate as rank r of 2.
    assert [r["early_world"] for r in early] == [[0, 1, "default"], [1, 2, "lightning"]]
    assert [r["world"] for r in early] == [[0, 2], [1, 2]]
    for phase, workers in (("early", 0), ("full", 2)):
        got = epochs(ddp_run, phase)
        assert len(got) == (2 if phase == "early" else 3)
        for e, per_rank in got.items():
            assert_epoch(per_rank)
            want = [stager_epoch(r, int(e), data=frameworks_pack, num_workers=workers, **KW) for r in range(2)]
            assert per_rank == want, f"{phase} epoch {e}: stager's plan of that epoch"
        orders = [tuple(per_rank[0][0]) for per_rank in got.values()]
        assert len(set(orders)) == len(orders), "a new order each epoch"
    for phase in ("early", "full", "limit", "reload"):
        warned = json.loads((ddp_run / f"{phase}-warnings.json").read_text())
        assert not [w for w in warned if LEN_WARNING in w], warned


@pytest.mark.timeout(400)
def test_ddp_resume_from_epoch_end_and_mid_epoch_checkpoints_continues_the_same_batches(ddp_run: Path) -> None:
    full = epochs(ddp_run, "full")
    end, mid = epochs(ddp_run, "resume_end"), epochs(ddp_run, "resume_mid")
    assert end == {e: full[e] for e in ("1", "2")}, "resumed from last epoch's checkpoint: epochs 1 and 2 as before"
    done = 19 - PER_RANK_BATCHES  # the mid-epoch checkpoint's step in epoch 1
    assert mid["1"] == [r[done:] for r in full["1"]], "the rest of epoch 1, none repeated or lost"
    assert mid["2"] == full["2"]


@pytest.mark.timeout(400)
def test_limit_train_batches_and_reloaded_dataloaders_move_on_every_epoch(ddp_run: Path) -> None:
    full = epochs(ddp_run, "full")
    limit = epochs(ddp_run, "limit")
    for e, per_rank in limit.items():
        assert [len(r) for r in per_rank] == [6, 6], "limit_train_batches=0.5 of 13"
        assert per_rank == [r[:6] for r in full[e]], f"epoch {e}: the first half of that epoch's order"
    assert len({tuple(r[0][0]) for r in limit.values()}) == 3, "a different half each epoch"
    assert epochs(ddp_run, "reload") == full, "a loader rebuilt every epoch still gets Lightning's epoch"


@pytest.mark.timeout(400)
def test_ddp_spawn_re_resolves_a_loader_built_in_the_parent(frameworks_pack: Path, tmp_path: Path) -> None:
    """``ddp_spawn`` pickles the DataModule, and the loader it built as rank 0 of 1, into both ranks."""
    run([python(), script("lightning_run.py"), "spawn", str(frameworks_pack), str(tmp_path)], cwd=tmp_path,
        env={"MASTER_PORT": str(free_port())})
    got = epochs(tmp_path, "spawn")
    assert [r["world"] for r in load(tmp_path, "spawn")] == [[0, 2], [1, 2]]
    for e, per_rank in got.items():
        assert_epoch(per_rank)
        assert per_rank == [stager_epoch(r, int(e), data=frameworks_pack, num_workers=1, **KW) for r in range(2)]


@pytest.mark.timeout(400)
def test_two_nodes_under_slurm(frameworks_pack: Path, tmp_path: Path) -> None:
    """``srun --nodes=2 --ntasks-per-node=1``'s variables, one task per node: Lightning's SLURMEnvironment."""
    import subprocess

    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {"SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": "0", "SLURM_NODEID": str(rank),
               "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1(x2)",
               "SLURM_JOB_NAME": "stager-test", "SLURM_NODELIST": "localhost", "SLURM_JOB_ID": "4242",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        log = (tmp_path / f"task{rank}.log").open("w")
        cmd = [python(), script("lightning_run.py"), "srun", str(frameworks_pack), str(tmp_path)]
        procs.append((subprocess.Popen(cmd, cwd=tmp_path, env={**_base_env(), **env}, stdout=log, stderr=log), log))
    for p, log in procs:
        rc = p.wait(timeout=300)
        log.close()
        assert rc == 0, (tmp_path / "task0.log").read_text()[-3000:] + (tmp_path / "task1.log").read_text()[-3000:]
    for phase in ("early", "full"):
        ranks = load(tmp_path, phase)
        assert [r["world"] for r in ranks] == [[0, 2], [1, 2]]
        if phase == "early":  # built before the Trainer: the rank came from Slurm's variables
            assert [r["early_world"] for r in ranks] == [[0, 2, "slurm"], [1, 2, "slurm"]]
        for per_rank in epochs(tmp_path, phase).values():
            assert_epoch(per_rank)


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}


@pytest.mark.timeout(400)
def test_fabric_setup_dataloaders_save_and_load(frameworks_pack: Path, tmp_path: Path) -> None:
    run([python(), script("fabric_run.py"), str(frameworks_pack), str(tmp_path)], cwd=tmp_path,
        env={"MASTER_PORT": str(free_port())})
    ranks = load(tmp_path, "fabric")
    full = {e: [r["full"][e] for r in ranks] for e in ("0", "1", "2")}
    for per_rank in full.values():
        assert_epoch(per_rank)
    assert len({tuple(p[0][0]) for p in full.values()}) == 3, "a new order each epoch"
    resumed = {e: [r["resumed"][e] for r in ranks] for e in ("1", "2")}
    assert resumed["1"] == [r[19 - PER_RANK_BATCHES:] for r in full["1"]], "fabric.load continues mid-epoch"
    assert resumed["2"] == full["2"]
