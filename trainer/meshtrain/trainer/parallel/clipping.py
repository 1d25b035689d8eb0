"""Global-norm gradient clipping over a model spread across ranks.

The norm is the whole model's: every shard counts once, a parameter replicated over tensor ranks
only on one of them, and data-parallel replicas (identical after the reduction) are not summed.
The scale rule is ``torch.nn.utils.clip_grad_norm_``'s, so one device gives the same result.
ZeRO-1/2 and ZeRO-3 count their owned elements with the same :func:`squared_norm` and
:func:`reduce_norm_and_clip`.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from meshtrain.trainer.parallel import zero3
from meshtrain.trainer.telemetry import clocks, recording

Counted = bool | tuple[int, int]
"""What a rank counts of a parameter in the global norm: all, nothing, or a flat range of it."""


def counted_part(tensor: torch.Tensor, counted: Counted, offset: int = 0) -> torch.Tensor | None:
    """The elements of ``tensor`` (a parameter's gradient) that ``counted`` selects, or None.

    ``tensor`` may be a shard whose first element is element ``offset`` of
    the parameter's flat order (ZeRO-3's rows).
    """
    if counted is True:
        return tensor
    if counted is False:
        return None
    return flat_slice(tensor, *counted, offset=offset)


def flat_slice(
    tensor: torch.Tensor, start: int, stop: int, *, offset: int = 0
) -> torch.Tensor | None:
    """The view of the flat range [start, stop) of a parameter inside ``tensor``, which holds its
    elements from ``offset`` on (all of it: 0); None when they do not overlap."""
    lo, hi = max(start - offset, 0), min(stop - offset, tensor.numel())
    return tensor.view(-1)[lo:hi] if lo < hi else None


def clip_grad_norm(
    params: list[torch.nn.Parameter],
    *,
    counted: list[Counted],
    max_norm: float,
    groups: list[tuple[recording.Group, dist.ProcessGroup]],
    recorder: recording.StepRecorder,
    clock: clocks.Clock,
) -> torch.Tensor:
    """Scale gradients so the global L2 norm is at most ``max_norm``; returns the norm before clipping.

    ``counted[i]`` says what this rank counts of ``params[i]`` in the norm;
    ``groups`` are the axes whose ranks hold different parts of the model
    (tensor and pipeline; data first under ZeRO-3), summed over in that order.  The
    norm stays on the device (a 0-dim fp64 tensor): reading it is the caller's one host sync.
    """
    # ZeRO-3's gradients are DTensor shards: each rank counts and scales its own rows
    grads = [zero3.local(p.grad) for p in params if p.grad is not None]
    parts = [
        counted_part(zero3.local(p.grad), c, zero3.flat_offset(p))
        for p, c in zip(params, counted)
        if p.grad is not None
    ]
    mine = [part for part in parts if part is not None]
    device = grads[0].device if grads else torch.device("cpu")
    return reduce_norm_and_clip(
        squared_norm(mine, device),
        grads,
        max_norm=max_norm,
        groups=groups,
        recorder=recorder,
        clock=clock,
    )


def squared_norm(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of every element of ``tensors`` (0-dim fp64), from one multi-tensor norm kernel.

    Per-tensor norms in fp32 (``torch._foreach_norm``: no big temporaries,
    as ``clip_grad_norm_`` computes them), their squares summed in fp64.
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm([t.detach() for t in tensors], 2, dtype=torch.float32)
    return torch.stack(norms).double().square().sum()


def reduce_norm_and_clip(
    square: torch.Tensor,
    grads: list[torch.Tensor],
    *,
    max_norm: float,
    groups: list[tuple[recording.Group, dist.ProcessGroup]],
    recorder: recording.StepRecorder,
    clock: clocks.Clock,
) -> torch.Tensor:
    """Sum this rank's squared-norm share over ``groups``, then scale ``grads`` as ``clip_grad_norm_`` would.

    ``square`` is the sum of squares of the gradient elements this rank owns;
    ``grads`` are the tensors this rank scales.  Returns the global norm as a
    0-dim tensor; nothing here waits for the device: the clip coefficient is
    a tensor (clamped at 1, as ``clip_grad_norm_``'s), applied by one
    ``_foreach_mul_`` (multiplying by exactly 1 when no clipping is needed).
    """
    for axis, group in groups:
        recording.blocking_collective(
            recorder,
            clock,
            axis,
            "all_reduce",
            square.element_size(),
            functools.partial(dist.all_reduce, square, group=group),
        )
    norm = square.sqrt()
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm
