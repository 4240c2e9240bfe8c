"""What the framework tests share: running a launcher on a script of tests/frameworks/, and the invariants."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stager.loader import make_loader

HERE = Path(__file__).resolve().parent
N, BATCH, PER_RANK_BATCHES = 203, 8, 13  # tests/conftest.py::frameworks_pack; 102 per rank, 1 padding repeat


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(cmd: Sequence[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> None:
    """Run a launcher command; its output (last lines) becomes the failure message."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    p = subprocess.run(list(cmd), check=False, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[:4])}... exited {p.returncode}:\n{(p.stdout + p.stderr)[-6000:]}")


def script(name: str) -> str:
    return str(HERE / name)


def python() -> str:
    return sys.executable


def load(out: Path, name: str) -> list[dict[str, Any]]:
    """Both ranks' ``<name>-rank<r>.json``."""
    return [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(2)]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def assert_epoch(per_rank: list[list[list[int]]], *, padding: int = 1, batch: int = BATCH) -> None:
    """One epoch over both ranks: every sample at least once, ``padding`` repeats declared, equal batch counts
    and sizes on both ranks, full batches but the last."""
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1, f"unequal batch counts {counts}"
    assert [len(x) for x in per_rank[0]] == [len(x) for x in per_rank[1]], "unequal batch sizes"
    assert all(len(x) == batch for x in per_rank[0][:-1])
    ids = [i for r in per_rank for i in flat(r)]
    assert sorted(set(ids)) == list(range(N)), "every sample each epoch"
    assert len(ids) == N + padding, f"{len(ids) - N} repeats, {padding} declared"


def stager_epoch(rank: int, epoch: int, **kw: Any) -> list[list[int]]:
    """What stager's plan gives rank ``rank`` of 2 in ``epoch`` (explicit world, in this process)."""
    data = kw.pop("data")
    loader = make_loader(data, BATCH, rank=rank, world_size=2, **{"staged": False, **kw})
    loader.set_epoch(epoch)
    return [b["index"].tolist() for b in loader]
