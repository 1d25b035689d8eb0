"""The learning-rate schedule: linear warmup to the peak, then cosine decay to the minimum."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schedule itself is arithmetic: `meshtrain report` uses it without torch
    import torch


def lr_at(step: int, *, peak: float, minimum: float, warmup: int, total: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based): warmup to ``peak``, cosine to ``minimum``."""
    if warmup and step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return minimum + 0.5 * (peak - minimum) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate."""
    for group in optimizer.param_groups:
        group["lr"] = lr
