"""The optimizer: ``torch.optim.AdamW`` with weight decay on matrices only.

ZeRO-1/2 shard its state (:class:`meshtrain.trainer.parallel.zero.ZeroAdamW`,
the same arithmetic); clipping by the global gradient norm is parallelism's
(:mod:`meshtrain.trainer.parallel.clipping`).
"""

from __future__ import annotations

import torch


def build_adamw(
    named_params: list[tuple[str, torch.nn.Parameter]],
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW with decay on matrices only; beta2 0.95 as in GPT-3 (steadier for large batches)."""
    decay = [p for _, p in named_params if p.dim() >= 2]
    no_decay = [p for _, p in named_params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = bool(decay) and decay[0].is_cuda  # one kernel for all tensors on GPU
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)
