"""Damaged shards (every format), damaged manifests, and the loader's on_error policies.

Invariants: 100% of damaged files are detected by `stager verify` (API and CLI, exit 3, the file
named) and refused by `stager stage` (exit 3, one line naming it, no copy of it and no .partial in
DEST); a damaged manifest is refused by both with exit 3; on_error="raise" names shard and key,
on_error="skip" delivers every other sample exactly once and counts each skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.faults import corrupt
from tools.faults.tally import record

FORMATS = ["tar", "record", "hdf5", "zarr"]


def _shards(work: Path, fmt: str, n: int, seed: int) -> None:
    st = corrupt.shard_trials(work, fmt, n, seed=seed)
    assert st.errors == [] and st.detected == st.trials == n and st.lost == 0
    record(f"damaged shard: random byte flips or truncation ({fmt})", group="corruption", trials=st.trials,
           handled=st.detected, lost=st.lost, note="`stager verify` lists the file; `stager stage` exits 3 naming it")


def _manifest(work: Path, n: int, seed: int) -> None:
    st = corrupt.manifest_trials(work, n, seed=seed)
    assert st.errors == [] and st.detected == st.trials == n
    record("damaged manifest: flipped digit, truncated JSON, other schema", group="corruption", trials=st.trials,
           handled=st.detected, lost=st.lost, note="verify and stage exit 3 with one line; nothing copied")


def _loader(work: Path, fmt: str, n: int, seed: int) -> None:
    st = corrupt.loader_trials(work, fmt, n, seed=seed)
    assert st.errors == []
    assert st.raise_named == st.raise_trials == n and st.skip_exact == st.skip_trials == n and st.lost == 0
    record("undecodable samples, loader on_error='raise'", group="corruption", trials=st.raise_trials,
           handled=st.raise_named, note="CorruptSampleError names the shard and the key", damaged_samples=st.damaged)
    record("undecodable samples, loader on_error='skip'", group="corruption", trials=st.skip_trials,
           handled=st.skip_exact, lost=st.lost, note="every other sample exactly once; skips counted",
           damaged_samples=st.damaged)


@pytest.mark.parametrize("fmt", FORMATS)
def test_damaged_shards_fast(work: Path, fmt: str) -> None:
    _shards(work, fmt, 2, seed=51)


def test_damaged_manifest_fast(work: Path) -> None:
    _manifest(work, 3, seed=52)


@pytest.mark.parametrize("fmt", ["tar", "record", "hdf5"])
def test_loader_on_error_fast(work: Path, fmt: str) -> None:
    _loader(work, fmt, 1, seed=53)


@pytest.mark.faults
@pytest.mark.parametrize("fmt", FORMATS)
def test_damaged_shards_full(work: Path, fmt: str) -> None:
    _shards(work, fmt, 25, seed=61)


@pytest.mark.faults
def test_damaged_manifest_full(work: Path) -> None:
    _manifest(work, 30, seed=62)


@pytest.mark.faults
@pytest.mark.parametrize("fmt", ["tar", "record", "hdf5"])
def test_loader_on_error_full(work: Path, fmt: str) -> None:
    _loader(work, fmt, 6, seed=63)
