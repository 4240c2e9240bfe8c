"""The loader's resume state: typed, versioned, validated on load.

The whole epoch order is a pure function of the plan inputs, so the position is just "how many of
this rank's batches of epoch ``epoch`` were handed out". The other fields identify the plan; a
state is refused (with what differs) if it would not describe the same order. In DDP every rank
consumes batches in lockstep, so ``batches_done`` is the same on every rank; that is what makes an
elastic resume (different world size, same global batch) possible: see ``Loader.load_state_dict``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from stager.errors import UsageError

STATE_VERSION = 1


@dataclass(frozen=True)
class LoaderState:
    """Position of one rank's loader. ``batches_done``: batches of ``epoch`` already yielded."""

    dataset_id: str
    epoch: int
    batches_done: int
    seed: int
    world_size: int
    num_workers: int
    batch_size: int
    mode: str
    drop_last: bool
    rank: int = 0
    # Per-worker shuffle buffer and a fingerprint of the run lengths: part of the order.
    buffer_samples: int = 0
    plan_key: str = ""
    # The state this epoch was re-planned from after an elastic resume (None: the plain plan).
    parent: dict[str, Any] | None = None
    version: int = STATE_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoaderState:
        if not isinstance(d, dict):
            raise UsageError(f"loader state must be a dict, got {type(d).__name__}")
        version = d.get("version")
        if version != STATE_VERSION:
            raise UsageError(f"loader state version {version!r} is not supported (expected {STATE_VERSION})")
        names = {f.name for f in fields(cls)}
        missing = names - set(d) - {"rank", "parent", "buffer_samples", "plan_key"}
        if missing:
            raise UsageError(f"loader state lacks {', '.join(sorted(missing))}")
        unknown = set(d) - names
        if unknown:
            raise UsageError(f"loader state has unknown fields {', '.join(sorted(unknown))}")
        st = cls(**{k: d[k] for k in names if k in d})
        for name in ("epoch", "batches_done", "seed", "world_size", "num_workers", "batch_size", "rank"):
            v = getattr(st, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UsageError(f"loader state field {name} must be a non-negative integer, got {v!r}")
        if st.parent is not None:
            cls.from_dict(st.parent)
        return st
