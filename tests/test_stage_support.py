"""Helpers for the stage tests (no tests here): synthetic packed datasets, running the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from stager.checksum import hash_file
from stager.manifest import Manifest, ShardInfo

ROOT = Path(__file__).resolve().parents[1]
LFS_BIN = ROOT / "tests" / "bin"


def make_dataset(out: Path, n: int = 6, size: int = 64 << 10, seed: int = 0, mode: int = 0o644) -> Manifest:
    """A packed directory of ``n`` random shard files (sizes around ``size``) with a valid manifest.

    Shards carry no per-sample index (copying does not need one).
    """
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards = []
    empty = np.zeros(0, np.int64)
    for i in range(n):
        data = rng.bytes(size + int(rng.integers(0, max(size // 4, 1))))
        p = out / f"shard-{i:06d}.tar"
        p.write_bytes(data)
        os.chmod(p, mode)
        nbytes, h = hash_file(p)
        shards.append(ShardInfo(p.name, nbytes, h, [], empty, empty, empty))
    m = Manifest(format="tar", classes=[], shards=shards)
    m.write(out)
    return m


def stager(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
           preexec_fn: Callable[[], None] | None = None) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "stager", *args], capture_output=True, text=True, env=e,
                          timeout=timeout, preexec_fn=preexec_fn, check=False)


def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "stager", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=e)


def last_json(stdout: str) -> dict[str, Any]:
    return dict(json.loads(stdout.strip().splitlines()[-1]))


def assert_verified_copy(m: Manifest, dest: Path, names: list[str] | None = None) -> None:
    """Every listed shard in ``dest`` has the manifest's size and hash; no partial files are left."""
    want = names if names is not None else [s.name for s in m.shards]
    by = {s.name: s for s in m.shards}
    for name in want:
        nbytes, h = hash_file(dest / name)
        assert (nbytes, h) == (by[name].bytes, by[name].hash), name
    assert not [p.name for p in dest.iterdir() if p.name.endswith(".partial")]
