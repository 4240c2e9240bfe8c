"""Accuracy counts, step timing (data-wait vs compute) and the run summary.

Timing model of one optimizer step on one rank::

    |--- data wait ---|------------ compute ------------|
    next(loader) + H2D  forward/backward/optimizer step, ended by torch.cuda.synchronize()

Data wait is the time the accelerator could have been busy but had no batch; a share above
:data:`INPUT_BOUND_SHARE` means the input pipeline, not the model, sets the pace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

INPUT_BOUND_SHARE = 0.10
INPUT_BOUND_HINT = "input-bound: stage the data, add workers, use zarr/draft decode"


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> torch.Tensor:
    """Per-sample hits: bool tensor ``(len(ks), N)``, row ``i`` true where the label is in the top ``ks[i]``.

    ``k`` is clipped to the number of classes (top-5 of a 3-class problem is top-3).
    """
    kmax = min(max(ks), logits.shape[1])
    top = logits.topk(kmax, dim=1).indices  # (N, kmax)
    hit = top.eq(labels.view(-1, 1))  # (N, kmax)
    return torch.stack([hit[:, : min(k, kmax)].any(dim=1) for k in ks])


class StepTimer:
    """Accumulates data-wait and compute seconds between :meth:`reset` calls.

    ``sync`` is called before every clock read (``torch.cuda.synchronize`` on GPU) so asynchronous
    kernels are charged to the phase that launched them.
    """

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self._sync = sync or (lambda: None)
        self.reset()
        self._t = time.perf_counter()

    def reset(self) -> None:
        self.data_s = 0.0
        self.compute_s = 0.0
        self.steps = 0
        self.images = 0

    def mark(self) -> None:
        """Start of a step (or of the data phase)."""
        self._sync()
        self._t = time.perf_counter()

    def data_done(self) -> None:
        self._sync()
        now = time.perf_counter()
        self.data_s += now - self._t
        self._t = now

    def compute_done(self, images: int) -> None:
        self._sync()
        now = time.perf_counter()
        self.compute_s += now - self._t
        self._t = now
        self.images += images

    def step_done(self) -> None:
        """One optimizer step finished (after its accumulation micro-steps)."""
        self.steps += 1

    @property
    def total_s(self) -> float:
        return self.data_s + self.compute_s

    @property
    def data_share(self) -> float:
        return self.data_s / self.total_s if self.total_s > 0 else 0.0


@dataclass
class RunStats:
    """Whole-run accumulators on one rank, plus the histories rank 0 prints in the summary."""

    data_s: float = 0.0
    compute_s: float = 0.0
    images: int = 0
    steps: int = 0
    loss_history: list[dict[str, float]] = field(default_factory=list)  # {"step", "epoch", "loss", "lr"}
    epoch_loss: list[dict[str, float]] = field(default_factory=list)  # {"epoch", "loss"}
    accuracy: list[dict[str, float]] = field(default_factory=list)  # {"epoch", "top1", "top5", "samples"}
    warnings: int = 0

    def add(self, timer: StepTimer) -> None:
        self.data_s += timer.data_s
        self.compute_s += timer.compute_s
        self.images += timer.images
        self.steps += timer.steps


def summarize(
    stats: RunStats,
    *,
    world_size: int,
    global_ips: float,
    data_share: float,
    baseline_ips: float | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The final JSON summary (rank 0). ``global_ips`` is the sum of per-rank images/s.

    Scaling efficiency = ``global_ips / (world_size * baseline_ips)`` where ``baseline_ips`` is the
    images/s of a 1-rank run of the same configuration.
    """
    out: dict[str, Any] = {
        "event": "summary",
        "world_size": world_size,
        "steps": stats.steps,
        "images_per_s": round(global_ips, 2),
        "images_per_s_per_rank": round(global_ips / max(world_size, 1), 2),
        "data_wait_share": round(data_share, 4),
        "input_bound": data_share > INPUT_BOUND_SHARE,
        "accuracy": stats.accuracy,
        "epoch_loss": stats.epoch_loss,
        "loss_history": stats.loss_history,
    }
    if baseline_ips:
        out["baseline_images_per_s"] = baseline_ips
        out["scaling_efficiency"] = round(global_ips / (world_size * baseline_ips), 4)
    out.update(extra)
    return out
