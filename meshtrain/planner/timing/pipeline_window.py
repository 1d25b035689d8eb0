"""The pipeline part of a step with each stage's own durations, on a device per rank.

The closed-form bubble (:func:`bubble_ratio`) assumes equal stages and free sends; :func:`window`
walks the fill and drain through every stage and runs the steady state at the pace of the slowest.
Stage 0's idle share of the window is what the trainer's telemetry measures as the bubble.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


def bubble_ratio(pipeline: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Theoretical idle share of a stage: ``(p - 1) / (v m + p - 1)`` (GPipe and 1F1B: v = 1).

    Huang et al. 2019; Narayanan et al. 2021.  Reported as the theoretical bubble.
    """
    return (pipeline - 1) / (virtual_stages * micro_batches + pipeline - 1)


@dataclasses.dataclass(frozen=True)
class StageDurations:
    """Seconds of one micro-batch through all of one stage's chunks."""

    forward: float
    backward: float


@dataclasses.dataclass(frozen=True)
class Window:
    """The pipeline window of one step."""

    seconds: float
    """From the step's start until the last stage finishes its last backward."""
    busy: tuple[float, ...]
    """Seconds each stage spends computing in it."""

    def idle_share(self, stage: int, closing: float = 0.0, exposed: float = 0.0) -> float:
        """Share of the span ``stage`` neither computes nor reduces gradients, as the trainer measures it.

        After the window, ``exposed`` seconds of the data-parallel reduction
        (not idle) and ``closing`` seconds of the stage's closing all-reduces
        (tied embeddings: not compute, so idle) lengthen the span.
        """
        span = self.seconds + closing + exposed
        idle = self.seconds - self.busy[stage] + closing
        return max(0.0, idle / span) if span > 0 else 0.0


def window(
    micro_batches: int,
    stages: Sequence[StageDurations],
    send_seconds: float,
    virtual_stages: int = 1,
) -> Window:
    """The window of ``micro_batches`` through ``stages`` (GPipe, 1F1B and interleaved 1F1B alike).

    The fill and drain walk every stage once and the steady state runs at the
    pace of the slowest stage (Narayanan et al. 2021, sec. 2.2; Huang et al.
    2019): a stage's chunk slot lasts ``c_s = (f_s + b_s) / v`` and the window is
    ``(v m - 1) x max_s c_s + sum_s c_s + 2 (p - 1) x send`` (the forward message
    crosses ``p - 1`` boundaries in the fill, the gradient ``p - 1`` in the
    drain).  With equal stages and free sends this is ``(v m + p - 1) c``, the
    closed form.
    """
    p, v, m = len(stages), virtual_stages, micro_batches
    slots = [(st.forward + st.backward) / v for st in stages]
    busy = tuple(m * (st.forward + st.backward) for st in stages)
    if p == 1:
        return Window(seconds=busy[0], busy=busy)
    seconds = (v * m - 1) * max(slots) + sum(slots) + 2 * (p - 1) * send_seconds
    return Window(seconds=seconds, busy=busy)
