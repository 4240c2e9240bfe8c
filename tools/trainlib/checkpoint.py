"""Checkpoints: written atomically by rank 0, restorable mid-epoch on every rank.

A checkpoint is one ``torch.save`` file holding::

    {"version": 1, "model": state_dict (unwrapped, no "module." prefix), "optimizer": ..., "scaler": ... or None,
     "epoch": int, "step_in_epoch": int (optimizer steps done in that epoch), "step": int (global
     optimizer steps done), "rng": [per-rank RNG states], "loader": [per-rank loader state_dicts],
     "world_size": int, "config": {...}, "stats": {...}}

Per-rank pieces (RNG, loader position) are gathered to rank 0 so a single file restores every rank;
a run resumed with a different world size falls back to rank 0's loader state (the loader
re-partitions). The file is written through :func:`stager.fs.atomic.atomic_write`
(``<name>.<uuid>.partial`` in the same directory, fsync, rename, directory fsync): a job killed
while saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stager.errors import SourceNotFoundError
from stager.fs.atomic import atomic_write, remove_partials

CHECKPOINT_VERSION = 1
LATEST = "checkpoint.pt"


def rng_state() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, and CUDA when present)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(path: str | os.PathLike[str], payload: dict[str, Any]) -> Path:
    """Atomically write ``payload`` (see module docstring) to ``path``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_partials(path.parent)
    buf = io.BytesIO()
    torch.save({"version": CHECKPOINT_VERSION, **payload}, buf)
    with atomic_write(path) as f:
        f.write(buf.getbuffer())
    return path


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` onto the CPU."""
    path = Path(path)
    if not path.is_file():
        raise SourceNotFoundError(f"{path}: no checkpoint there; pass --resume without a path to start fresh")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(ckpt, dict) or ckpt.get("version") != CHECKPOINT_VERSION:
        raise SourceNotFoundError(f"{path}: not a stager training checkpoint (version {CHECKPOINT_VERSION})")
    return ckpt


def resolve_resume(resume: str | None, out_dir: Path) -> Path | None:
    """``--resume`` alone (``"auto"``) means ``OUT/checkpoint.pt`` if it exists, else a fresh start."""
    if resume is None:
        return None
    if resume == "auto":
        p = out_dir / LATEST
        return p if p.is_file() else None
    return Path(resume)
