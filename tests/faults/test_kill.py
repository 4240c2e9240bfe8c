"""kill -9 at seeded random points during pack / stage / stage --unpack / training, then rerun.

Invariant per kill: the rerun (or ``--resume``) completes, ``stager verify`` passes, the result
equals a clean run (same shards and keys; every unpacked file with the right bytes; every
training key exactly once per epoch), and no ``.partial`` file or lock is left. The fast subset
runs a few kill points per command; ``-m faults`` runs the full counts (>= 50 kill points).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.conftest import record_kills
from tools.faults import kill

FULL_PACK = {"tar": 6, "record": 4, "hdf5": 3, "zarr": 3}
TRAIN_ROW = "kill -9 during training (tools/train.py, checkpoint + --resume)"
TRAIN_NOTE = "--resume completes; every key exactly once per epoch; replayed steps repeat the same keys"
CACHE_ROW = "kill -9 during `stager stage --cache` (and during `stager cache gc`)"
CACHE_NOTE = ("rerun completes, DEST and `stager cache verify` pass, no partial file anywhere, a second stage "
              "copies nothing")


def test_kill_pack_fast(work: Path) -> None:
    st = kill.pack_trials(work, 3, seed=11, fmt="tar")
    record_kills("kill -9 during `stager pack`", st, minimum=3)


def test_kill_stage_fast(work: Path) -> None:
    st = kill.stage_trials(work, 3, seed=12)
    record_kills("kill -9 during `stager stage`", st, minimum=3)


def test_kill_stage_unpack_fast(work: Path) -> None:
    st = kill.stage_trials(work, 3, seed=13, unpack="also")
    record_kills("kill -9 during `stager stage --unpack`", st, minimum=3)


def test_kill_stage_no_fsync_fast(work: Path) -> None:
    st = kill.stage_trials(work, 2, seed=15, flags=("--no-fsync",))
    record_kills("kill -9 during `stager stage --no-fsync` (rerun in the same boot)", st, minimum=2)


def test_kill_stage_cache_fast(work: Path) -> None:
    st = kill.cache_trials(work, 3, seed=16)
    record_kills(CACHE_ROW, st, minimum=3, note=CACHE_NOTE)


def test_kill_train_fast(work: Path) -> None:
    st = kill.train_trials(work, 1, seed=14)
    record_kills(TRAIN_ROW, st, minimum=1, note=TRAIN_NOTE)


@pytest.mark.faults
@pytest.mark.parametrize("fmt", sorted(FULL_PACK))
def test_kill_pack_full(work: Path, fmt: str) -> None:
    st = kill.pack_trials(work, FULL_PACK[fmt], seed=21, fmt=fmt)
    record_kills("kill -9 during `stager pack`", st, minimum=FULL_PACK[fmt])


@pytest.mark.faults
def test_kill_stage_full(work: Path) -> None:
    st = kill.stage_trials(work, 14, seed=22)
    record_kills("kill -9 during `stager stage`", st, minimum=14)


@pytest.mark.faults
@pytest.mark.parametrize(("mode", "n"), [("also", 8), ("only", 6)])
def test_kill_stage_unpack_full(work: Path, mode: str, n: int) -> None:
    st = kill.stage_trials(work, n, seed=23, unpack=mode)
    record_kills("kill -9 during `stager stage --unpack`", st, minimum=n)


@pytest.mark.faults
def test_kill_stage_no_fsync_full(work: Path) -> None:
    st = kill.stage_trials(work, 6, seed=25, flags=("--no-fsync",))
    record_kills("kill -9 during `stager stage --no-fsync` (rerun in the same boot)", st, minimum=6)


@pytest.mark.faults
def test_kill_stage_cache_full(work: Path) -> None:
    st = kill.cache_trials(work, 12, seed=26)
    record_kills(CACHE_ROW, st, minimum=12, note=CACHE_NOTE)


@pytest.mark.faults
def test_kill_train_full(work: Path) -> None:
    st = kill.train_trials(work, 8, seed=24)
    record_kills(TRAIN_ROW, st, minimum=8, note=TRAIN_NOTE)
