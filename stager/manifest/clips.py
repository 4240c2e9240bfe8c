"""The ``clips`` entry of manifest.json: a pack whose samples are video frames, read as windows.

A clip pack stores every frame once, as one sample (row of the sample index); consecutive frames of
a sequence are consecutive rows, in frame order, possibly continuing from one shard into the next.
Two extra int32 columns say where each frame belongs: :data:`SEQ_COLUMN` (the sequence's number,
0-based in the pack's sequence order) and :data:`FRAME_COLUMN` (the frame's number inside its
sequence, 0-based in decoded/name order). Keys are ``[<class>/]<sequence>/<frame>``.

The manifest's ``clips`` object (:class:`ClipSpec`) holds the window parameters: ``length`` (T
frames per window), ``stride`` (K: a window starts at every frame number divisible by K),
``frame_step`` (D: frames of a window are D apart), ``frame_format`` (``jpg``, ``png`` or ``source``:
the frame files as they were), plus counts. Windows themselves are never stored: readers derive them
from the two columns (:mod:`stager.order.windows`). docs/clips.md is normative.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stager.errors import ManifestError, UsageError
from stager.lazy import on_first_use

if TYPE_CHECKING:
    import numpy as np
else:  # the index is numpy columns; a plain stage never opens it: no numpy (stager/lazy.py)
    np = on_first_use("numpy", globals(), "np")

if TYPE_CHECKING:
    from stager.manifest.document import Manifest

SEQ_COLUMN = "clip/seq"
FRAME_COLUMN = "clip/frame"
FRAME_FORMATS = ("jpg", "png", "source")


@dataclass(frozen=True)
class ClipSpec:
    """Window parameters: ``length`` T >= 1, ``stride`` K >= 1, ``frame_step`` D >= 1.

    ``span`` = (T - 1) * D + 1 frames: the shortest sequence that holds one window.
    """

    length: int
    stride: int = 1
    frame_step: int = 1
    frame_format: str = "source"
    sequences: int = 0
    windows: int = 0

    def __post_init__(self) -> None:
        for name in ("length", "stride", "frame_step"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UsageError(f"clip {name.replace('_', ' ')} must be a positive integer, got {v!r}")
        if self.frame_format not in FRAME_FORMATS:
            raise UsageError(f"frame format must be one of {', '.join(FRAME_FORMATS)}, got {self.frame_format!r}")

    @property
    def span(self) -> int:
        return (self.length - 1) * self.frame_step + 1

    def to_json(self) -> dict[str, Any]:
        return {
            "length": self.length,
            "stride": self.stride,
            "frame_step": self.frame_step,
            "frame_format": self.frame_format,
            "sequences": self.sequences,
            "windows": self.windows,
            "columns": {"seq": SEQ_COLUMN, "frame": FRAME_COLUMN},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "manifest") -> ClipSpec:
        try:
            return cls(
                int(d["length"]),
                int(d.get("stride", 1)),
                int(d.get("frame_step", 1)),
                str(d.get("frame_format", "source")),
                int(d.get("sequences", 0)),
                int(d.get("windows", 0)),
            )
        except (KeyError, TypeError, ValueError, UsageError) as exc:
            raise ManifestError(f"{where}: bad clips entry ({exc})") from exc


def clip_spec(m: Manifest) -> ClipSpec | None:
    """The manifest's window parameters, or None for a pack of single images."""
    return ClipSpec.from_json(m.clips) if m.clips else None


def clip_columns(m: Manifest) -> tuple[np.ndarray, np.ndarray]:
    """``(seq, frame)``: int32 arrays (N,) over all samples (mapped views for a loaded v2 manifest)."""
    cols = m.extra_columns()
    if SEQ_COLUMN not in cols or FRAME_COLUMN not in cols:
        raise ManifestError(f"clip pack lacks the {SEQ_COLUMN}/{FRAME_COLUMN} columns in its sample index")
    return np.asarray(cols[SEQ_COLUMN]), np.asarray(cols[FRAME_COLUMN])


def sequence_shard_groups(seq: np.ndarray, shard_starts: np.ndarray) -> np.ndarray:
    """Per shard (int64, (shards,)): a group id shared by shards a sequence continues across.

    Shard ``s`` joins shard ``s - 1``'s group when its first frame belongs to the same sequence as
    the frame before it. Staging a node-partitioned copy places whole groups on one node, so every
    window (which never crosses sequences) is local to exactly one node.
    """
    starts = np.asarray(shard_starts, dtype=np.int64)
    n_shards = len(starts) - 1
    joins = np.zeros(n_shards, dtype=bool)
    for s in range(1, n_shards):
        a = int(starts[s])
        if int(starts[s + 1]) > a > 0 and seq[a] == seq[a - 1]:
            joins[s] = True
    return np.cumsum(~joins).astype(np.int64) - 1


def shard_groups(m: Manifest) -> np.ndarray | None:
    """:func:`sequence_shard_groups` of a clip pack; None for other packs (every shard is its own group)."""
    if not m.clips:
        return None
    counts = np.array([s.samples for s in m.shards], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    seq, _ = clip_columns(m)
    return sequence_shard_groups(seq, starts)
