"""Pipeline schedules as pure data: the ordered actions of one stage in one step.

:func:`actions` lists what stage ``s`` runs (gpipe, 1f1b, or interleaved-1f1b, where chunk ``c`` of
stage ``s`` is virtual stage ``c * p + s``: Megatron's interleaving); :func:`simulate` replays every
stage with unit-time actions to check that they can run together and idle for the theoretical
share ``(p - 1) / (v * m + p - 1)``.  No tensors, no processes.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from meshtrain.api.spec import parallelism as api_parallelism

SCHEDULES: tuple[str, ...] = typing.get_args(api_parallelism.Schedule)


@dataclasses.dataclass(frozen=True)
class Action:
    """One forward or backward of one micro-batch through one chunk of this stage."""

    kind: Literal["forward", "backward"]
    """Forward or backward pass."""
    microbatch: int
    """Micro-batch index, 0..m-1."""
    chunk: int = 0
    """Model chunk on this stage, 0..v-1."""

    def __str__(self) -> str:
        return f"{self.kind[0].upper()}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def Forward(microbatch: int, chunk: int = 0) -> Action:  # noqa: N802 - reads like a constructor
    """A forward action."""
    return Action("forward", microbatch, chunk)


def Backward(microbatch: int, chunk: int = 0) -> Action:  # noqa: N802
    """A backward action."""
    return Action("backward", microbatch, chunk)


def virtual_stage(stage: int, chunk: int, stages: int) -> int:
    """Global position in the model of ``chunk`` on ``stage``."""
    return chunk * stages + stage


def _gpipe(p: int, m: int, s: int) -> list[Action]:
    return [Forward(i) for i in range(m)] + [Backward(i) for i in range(m)]


def _one_f_one_b(p: int, m: int, s: int) -> list[Action]:
    warmup = min(p - s - 1, m)
    out = [Forward(i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        out += [Forward(warmup + i), Backward(i)]
    out += [Backward(i) for i in range(m - warmup, m)]
    return out


def _interleaved(p: int, v: int, m: int, s: int) -> list[Action]:
    # The k-th forward (and k-th backward) of every stage: micro-batches go in
    # rounds of p; within a round all chunks (backward: in reverse order).
    def forward_k(k: int) -> Action:
        return Forward((k // (p * v)) * p + k % p, (k // p) % v)

    def backward_k(k: int) -> Action:
        return Backward((k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    total = m * v
    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
    out = [forward_k(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [forward_k(warmup + k), backward_k(k)]
    out += [backward_k(k) for k in range(total - warmup, total)]
    return out


def actions(
    schedule: str, stages: int, micro_batches: int, stage: int, virtual_stages: int = 1
) -> list[Action]:
    """The ordered actions of ``stage`` for one optimizer step."""
    p, m, v, s = stages, micro_batches, virtual_stages, stage
    if not 0 <= s < p:
        raise ValueError(f"stage {s} outside 0..{p - 1}")
    if schedule == "gpipe":
        return _gpipe(p, m, s)
    if schedule == "1f1b":
        return _one_f_one_b(p, m, s)
    if schedule == "interleaved-1f1b":
        if v < 2 or m % p:
            raise ValueError(
                f"interleaved-1f1b needs virtual_stages >= 2 and micro_batches % stages == 0 (v={v}, m={m}, p={p})"
            )
        return _interleaved(p, v, m, s)
    raise ValueError(f"unknown schedule {schedule!r}; one of {', '.join(SCHEDULES)}")


def last_backward(stage_actions: list[Action]) -> dict[int, Action]:
    """The last backward of each chunk (where gradients are final and can be reduced)."""
    return {a.chunk: a for a in stage_actions if a.kind == "backward"}


def simulate(
    schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1
) -> list[list[tuple[int, Action]]]:
    """Run every stage's list with unit-time actions; returns per-stage (time, action).

    A forward of virtual stage ``j > 0`` waits for the forward of ``j - 1``;
    a backward waits for the backward of ``j + 1`` (or the forward of the
    last virtual stage) and its own forward.  Raises RuntimeError when no
    stage can proceed (a deadlock) or an action repeats.
    """
    p, v = stages, virtual_stages
    lists = [actions(schedule, p, micro_batches, s, v) for s in range(p)]
    last = p * v - 1
    done: dict[tuple[str, int, int], int] = {}  # (kind, mb, virtual stage) -> finish time
    cursor, clock = [0] * p, [0] * p
    timeline: list[list[tuple[int, Action]]] = [[] for _ in range(p)]
    while any(cursor[s] < len(lists[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if cursor[s] == len(lists[s]):
                continue
            a = lists[s][cursor[s]]
            j = virtual_stage(s, a.chunk, p)
            if a.kind == "forward":
                needs = [("forward", a.microbatch, j - 1)] if j > 0 else []
            else:
                needs = [("forward", a.microbatch, j)] + (
                    [("backward", a.microbatch, j + 1)] if j < last else []
                )
            if all(n in done for n in needs):
                key = (a.kind, a.microbatch, j)
                if key in done:
                    raise RuntimeError(f"stage {s} repeats {a}")
                start = max([clock[s]] + [done[n] for n in needs])
                done[key] = start + 1
                clock[s] = start + 1
                timeline[s].append((start, a))
                cursor[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: str(lists[s][cursor[s]]) for s in range(p) if cursor[s] < len(lists[s])}
            raise RuntimeError(f"deadlock: every stage waits ({stuck})")
    return timeline
