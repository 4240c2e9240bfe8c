"""Windows of consecutive frames (docs/clips.md): items of T frames, derived from two index columns.

A clip pack stores frames as samples, each sequence's frames contiguous and in frame order
(possibly continuing into the next shard), with per-sample ``seq`` and ``frame`` numbers. Window
``w`` is the frames ``first[w] + D * t`` for ``t = 0 .. T-1``: all of one sequence, with no frame
missing between them (a frame skipped at pack time removes the windows over it), starting at a
frame number divisible by the stride K. Windows are ordered by their first frame and grouped by the
shard of their first frame (``starts``), so the epoch plan's runs and shard shuffles work on them
unchanged. A window may end in the next shard: its reads are then two segments, one per shard.

:meth:`Windows.reading_plan` turns a worker's window plan into a frame plan for the read schedule:
the frames of its windows, each once, in the order the windows first need them (overlapping
windows share frames: with stride 1 a run of windows reads each frame once, not T times), and an
emission order that lists each window's T frames (positions repeat where windows overlap).
"""

from __future__ import annotations

import numpy as np

from stager.order.epoch import WorkerPlan
from stager.order.items import ItemSpace


class Windows(ItemSpace):
    """The windows of a clip pack (an :class:`~stager.order.items.ItemSpace`).

    ``first``: int64 (M,), ascending: each window's first frame (global sample id). ``length`` T,
    ``step`` D. ``starts``: int64 (shards + 1,), first window id per shard of first frame, then M.
    """

    def __init__(self, first: np.ndarray, length: int, step: int, sample_starts: np.ndarray) -> None:
        self.first = np.asarray(first, dtype=np.int64)
        self.per_item = self.length = int(length)
        self.step = int(step)
        self.sample_starts = np.asarray(sample_starts, dtype=np.int64)
        self.starts = np.searchsorted(self.first, self.sample_starts, side="left").astype(np.int64)
        self.starts[-1] = len(self.first)

    @property
    def count(self) -> int:
        return len(self.first)

    def samples_of(self, items: np.ndarray) -> np.ndarray:
        offs = np.arange(self.length, dtype=np.int64) * self.step
        return self.first[np.asarray(items, dtype=np.int64)][:, None] + offs[None, :]

    def shard_bytes(self, sizes: np.ndarray) -> np.ndarray:
        # The frames' bytes, not T times them: a run of consecutive windows reads each frame once,
        # so a run of ~run_bytes covers about run_bytes / (frame bytes * stride) windows.
        csum = np.concatenate([[0], np.cumsum(sizes)])
        st = self.sample_starts
        return (csum[st[1:]] - csum[st[:-1]]).astype(np.int64)

    def item_mask(self, sample_mask: np.ndarray) -> np.ndarray:
        return np.asarray(sample_mask, dtype=bool)[self.samples_of(np.arange(self.count))].all(axis=1)

    def reading_plan(self, wp: WorkerPlan) -> WorkerPlan:
        t = self.length
        frames = self.samples_of(wp.stream).ravel()
        if len(frames) == 0:
            empty = np.zeros(0, np.int64)
            return WorkerPlan(wp.worker, empty, empty, wp.batches, wp.sizes * t, np.zeros(0, bool))
        uniq, first_at, inverse = np.unique(frames, return_index=True, return_inverse=True)
        order = np.argsort(first_at, kind="stable")  # unique frames in order of first need
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order), dtype=np.int64)
        pos = rank[inverse].reshape(-1, t)  # frame stream position of each window's frames
        emit = pos[wp.emit].ravel()
        is_pad = wp.is_pad[first_at[order] // t]
        return WorkerPlan(wp.worker, uniq[order], emit, wp.batches, wp.sizes * t, is_pad)


def find_windows(
    seq: np.ndarray, frame: np.ndarray, sample_starts: np.ndarray, *, length: int, stride: int, step: int
) -> Windows:
    """Every window of ``length`` frames ``step`` apart starting at frame numbers divisible by ``stride``.

    ``seq``/``frame``: int (N,), per sample, sequences contiguous and frames ascending within each.
    A window is ``[i, i + step, ..., i + (length - 1) * step]`` where frame numbers rise by exactly
    ``(length - 1) * step`` over that stretch inside one sequence (so no frame is missing).
    """
    seq = np.asarray(seq)
    frame = np.asarray(frame, dtype=np.int64)
    span = (length - 1) * step
    n = len(seq)
    if n <= span:
        return Windows(np.zeros(0, np.int64), length, step, sample_starts)
    i = np.arange(n - span, dtype=np.int64)
    j = i + span
    ok = (seq[i] == seq[j]) & (frame[j] - frame[i] == span) & (frame[i] % stride == 0)
    return Windows(i[ok], length, step, sample_starts)
