"""Several stagers and loaders on one node at once: one copy, no torn reads, lock takeover.

Invariants: every stager exits 0 and exactly one copies (no double copies); DEST verifies with no
.partial or lock left; every loader sees every key exactly once with the source's bytes, whether
it read SRC during staging or the staged copy after; with the lock holder killed mid-copy, a
waiter takes the lock over and finishes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.faults import concurrency
from tools.faults.tally import record


def _check(st: concurrency.ConcurrencyStats, *, kill_holder: bool) -> None:
    assert st.errors == []
    assert st.stager_ok == st.stagers and st.double_copies == 0 and st.leftovers == 0
    # Exactly one stager copies; after a holder kill the one that takes over may find nothing left to copy.
    assert all(c == 1 or (kill_holder and c == 0) for c in st.copiers_per_round), st.copiers_per_round
    assert st.loaders_exact == st.loaders and st.torn_reads == 0 and st.lost == 0
    record("concurrent `stager stage` on one DEST", group="concurrency", trials=st.stagers, handled=st.stager_ok,
           lost=st.double_copies, note="exactly one copies, the rest find the receipt; 0 double copies",
           rounds=st.rounds, double_copies=st.double_copies, leftovers=st.leftovers)
    record("concurrent loaders during and after staging", group="concurrency", trials=st.loaders,
           handled=st.loaders_exact, lost=st.lost, note="every key once with the source's bytes (0 torn reads)",
           torn_reads=st.torn_reads, read_staged_copy=st.read_staged)
    if kill_holder:
        assert st.holders_killed == st.takeovers == st.rounds
        record("lock holder killed mid-copy (waiters present)", group="concurrency", trials=st.holders_killed,
               handled=st.takeovers, note="a waiter takes the lock over and finishes the verified copy")


def test_stagers_and_loaders_fast(work: Path) -> None:
    _check(concurrency.rounds(work, 1, stagers=3, loaders=0), kill_holder=False)


@pytest.mark.faults
def test_stagers_and_loaders_full(work: Path) -> None:
    _check(concurrency.rounds(work, 2, stagers=6, loaders=4), kill_holder=False)


@pytest.mark.faults
def test_lock_holder_killed_full(work: Path) -> None:
    _check(concurrency.rounds(work, 3, stagers=4, loaders=2, kill_holder=True), kill_holder=True)
