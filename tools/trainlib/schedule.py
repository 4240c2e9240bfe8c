"""Learning-rate recipe of Goyal et al. 2017 ("Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour").

* Linear scaling: ``peak_lr = base_lr * global_batch / 256``.
* Gradual warmup: over the first ``warmup_epochs`` the LR rises linearly, per optimizer step, from
  ``min(base_lr, peak_lr)`` (the LR that works for a 256 batch) to ``peak_lr``.
* Decay after warmup: ``"step"`` multiplies by ``gamma`` at each milestone epoch (30/60/80 for 90
  epochs in the paper), ``"cosine"`` follows half a cosine from ``peak_lr`` to 0 at the last step.

Everything is a pure function of the optimizer step, so a resumed run gets exactly the LR the
uninterrupted run would have had.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def scaled_lr(base_lr: float, global_batch: int, reference_batch: int = 256) -> float:
    """Linear scaling rule: the peak LR for ``global_batch`` images per optimizer step."""
    return base_lr * global_batch / reference_batch


@dataclass(frozen=True)
class LRSchedule:
    """LR as a function of the optimizer step (0-based) for a run of ``epochs * steps_per_epoch`` steps."""

    base_lr: float
    peak_lr: float
    steps_per_epoch: int
    epochs: int
    warmup_epochs: float = 0.0
    decay: str = "step"
    milestones: Sequence[float] = (30, 60, 80)
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if self.decay not in ("step", "cosine", "none"):
            raise ValueError(f"unknown LR decay {self.decay!r}: expected step, cosine or none")
        if self.steps_per_epoch < 1:
            raise ValueError("steps_per_epoch must be >= 1")

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    @property
    def warmup_steps(self) -> int:
        return round(self.warmup_epochs * self.steps_per_epoch)

    def __call__(self, step: int) -> float:
        warm = self.warmup_steps
        if step < warm:
            start = min(self.base_lr, self.peak_lr)
            return start + (self.peak_lr - start) * step / warm
        if self.decay == "cosine":
            span = max(self.total_steps - warm, 1)
            progress = min((step - warm) / span, 1.0)
            return 0.5 * self.peak_lr * (1.0 + math.cos(math.pi * progress))
        if self.decay == "step":
            epoch = step / self.steps_per_epoch
            return self.peak_lr * self.gamma ** sum(1 for m in self.milestones if epoch >= m)
        return self.peak_lr
