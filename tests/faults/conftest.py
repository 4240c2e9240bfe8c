"""Fixtures of the fault suite: one shared scratch directory per session (datasets are reused)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.faults.kill import KillStats
from tools.faults.tally import record


@pytest.fixture(scope="session")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Scratch space shared by the session's fault trials (cached source datasets live here)."""
    return tmp_path_factory.mktemp("faults")


def record_kills(row: str, st: KillStats, *, minimum: int,
                 note: str = "rerun completes, `stager verify` passes, output equals a clean run") -> None:
    """Assert the invariants of a kill series, then record it as a table row."""
    assert st.kills >= minimum, f"{st.command}: only {st.kills} of {st.attempts} kills landed mid-run"
    assert st.failures == 0, st.errors
    assert st.lost == 0 and st.duplicated == 0 and st.diverged == 0, st.errors
    assert st.leftovers == 0, st.errors
    record(row, group="kill -9", trials=st.kills, handled=st.verified, lost=st.lost + st.duplicated,
           note=note,
           kills=st.kills, partials_after_kill=st.partials_after_kill,
           stale_locks_after_kill=st.stale_locks_after_kill, leftovers_after_rerun=st.leftovers,
           failures=st.failures, duplicated=st.duplicated)
