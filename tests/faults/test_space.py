"""Out of space: RLIMIT_FSIZE at seeded random limits and a real full tmpfs (root only).

Invariant per trial: exit 4 with one error line naming a path, no file under a final name that is
incomplete or wrong, no ``.partial`` left, no receipt for a failed stage, and a rerun without the
limit (or after growing the tmpfs) that completes and verifies with nothing lost.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.faults import space
from tools.faults.tally import record


def _check(row: str, st: space.SpaceStats, minimum: int) -> None:
    # Recorded before asserting, so a known failure (xfail) shows in the table as not handled.
    record(row, group="out of space", trials=st.trials, handled=st.handled, lost=st.lost,
           note="exit 4 + one line naming the file; nothing torn under a final name; rerun completes",
           torn_final=st.torn_final, leftovers=st.leftovers, no_fault_runs=st.no_fault,
           clean_errors=st.clean_errors, reruns_ok=st.rerun_ok)
    assert st.trials >= minimum, f"{st.command}: only {st.trials} limits were hit ({st.no_fault} runs fit)"
    assert st.errors == [], st.errors
    assert st.clean_errors == st.trials and st.rerun_ok == st.trials
    assert st.torn_final == 0 and st.leftovers == 0 and st.lost == 0


@pytest.fixture(scope="module")
def mountable(work: Path) -> bool:
    return space.can_mount_tmpfs(work)


def test_fsize_pack_fast(work: Path) -> None:
    _check("RLIMIT_FSIZE (random limit) during `stager pack` (tar)", space.pack_fsize_trials(work, 1, seed=31), 1)


def test_fsize_stage_fast(work: Path) -> None:
    _check("RLIMIT_FSIZE (random limit) during `stager stage`", space.stage_fsize_trials(work, 1, seed=32), 1)


def test_fsize_unpack_fast(work: Path) -> None:
    st = space.stage_fsize_trials(work, 1, seed=33, unpack="only")
    _check("RLIMIT_FSIZE (random limit) during `stager stage --unpack`", st, 1)


def test_enospc_stage_fast(work: Path, mountable: bool) -> None:
    if not mountable:
        pytest.skip("mounting a tmpfs is not permitted here (needs root)")
    _check("ENOSPC (full tmpfs, random size)", space.enospc_trials(work, 1, seed=34, command="stage"), 1)


@pytest.mark.faults
@pytest.mark.parametrize("fmt", ["tar", "record", "hdf5", "zarr"])
def test_fsize_pack_full(work: Path, fmt: str) -> None:
    st = space.pack_fsize_trials(work, 4, seed=41, fmt=fmt)
    _check(f"RLIMIT_FSIZE (random limit) during `stager pack` ({fmt})", st, 4)


@pytest.mark.faults
def test_fsize_stage_full(work: Path) -> None:
    _check("RLIMIT_FSIZE (random limit) during `stager stage`", space.stage_fsize_trials(work, 10, seed=42), 10)


@pytest.mark.faults
@pytest.mark.parametrize("mode", ["also", "only"])
def test_fsize_unpack_full(work: Path, mode: str) -> None:
    st = space.stage_fsize_trials(work, 5, seed=43, unpack=mode)
    _check("RLIMIT_FSIZE (random limit) during `stager stage --unpack`", st, 5)


@pytest.mark.faults
@pytest.mark.parametrize("command", ["pack", "stage", "stage-unpack"])
def test_enospc_full(work: Path, mountable: bool, command: str) -> None:
    if not mountable:
        pytest.skip("mounting a tmpfs is not permitted here (needs root)")
    _check("ENOSPC (full tmpfs, random size)", space.enospc_trials(work, 5, seed=44, command=command), 5)
