"""Fault injection for testing failure handling.

``MESHTRAIN_FAULT_INJECT=rank:step``: :func:`maybe_fail`, called by the
worker before each step; when the variable names this rank and step, the
process dies at once (exit code :data:`EXIT_CODE`, no cleanup), as a crashed
GPU or a killed pod would.

``MESHTRAIN_FAULT_SLOW=rank:factor[:step]``: :func:`slow_down` makes that
rank's forward and backward compute about ``factor`` times as long (from
``step`` on, default 1), as a throttled GPU would: the straggler detector's
test input.  The sleeps sit inside the model chunks (a forward hook, and a
hook on the output's gradient at the start of backward, sized at twice the
forward), so they count as compute, not as waiting.

Not a chaos framework; one rank, one step, one way to die or drag.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

ENV = "MESHTRAIN_FAULT_INJECT"
EXIT_CODE = 17
SLOW_ENV = "MESHTRAIN_FAULT_SLOW"
BACKWARD_OVER_FORWARD = 2.0
"""Backward costs about twice the forward (two matmuls per forward matmul)."""


def parse(value: str | None) -> tuple[int, int] | None:
    """``"3:2"`` -> (rank 3, step 2); empty -> None."""
    if not value:
        return None
    try:
        rank, step = (int(part) for part in value.split(":"))
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: expected RANK:STEP, e.g. 3:2") from None
    return rank, step


def maybe_fail(rank: int, step: int) -> None:
    """Die here if the fault-injection variable says so."""
    target = parse(os.environ.get(ENV))
    if target == (rank, step):
        sys.stderr.write(f"{ENV}: rank {rank} dies before step {step}\n")
        sys.stderr.flush()
        os._exit(EXIT_CODE)


def parse_slow(value: str | None) -> tuple[int, float, int] | None:
    """``"1:1.5"`` -> (rank 1, factor 1.5, from step 1); ``"1:1.5:40"`` from step 40; empty -> None."""
    if not value:
        return None
    try:
        parts = value.split(":")
        if len(parts) not in (2, 3):
            raise ValueError
        rank, factor = int(parts[0]), float(parts[1])
        start = int(parts[2]) if len(parts) == 3 else 1
    except ValueError:
        raise ValueError(f"{SLOW_ENV}={value!r}: expected RANK:FACTOR[:STEP], e.g. 1:1.5") from None
    if factor < 1:
        raise ValueError(f"{SLOW_ENV}={value!r}: the factor must be at least 1")
    return rank, factor, start


def slow_down(
    chunks: Sequence[torch.nn.Module], rank: int, current_step: Callable[[], int]
) -> bool:
    """Hook this rank's model chunks when the slow-down variable names it; whether it did."""
    target = parse_slow(os.environ.get(SLOW_ENV))
    if target is None or target[0] != rank:
        return False
    _, factor, start = target
    extra = factor - 1.0
    started: dict[int, float] = {}  # chunk id -> start of its forward

    def before(module: torch.nn.Module, args: Any) -> None:
        started[id(module)] = time.perf_counter()

    def after(module: torch.nn.Module, args: Any, output: Any) -> None:
        if current_step() < start:
            return
        forward = time.perf_counter() - started[id(module)]
        time.sleep(extra * forward)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            backward = extra * BACKWARD_OVER_FORWARD * forward
            output.register_hook(lambda grad: _sleep_then(backward, grad))

    for chunk in chunks:
        chunk.register_forward_pre_hook(before)
        chunk.register_forward_hook(after)
    sys.stderr.write(f"{SLOW_ENV}: rank {rank} computes {factor}x slower from step {start}\n")
    return True


def _sleep_then(seconds: float, grad: torch.Tensor) -> torch.Tensor:
    time.sleep(seconds)
    return grad
