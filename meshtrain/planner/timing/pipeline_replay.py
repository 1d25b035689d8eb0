"""The pipeline window when the stages' ranks share a host's cores: a replay with processor sharing.

On a CPU host the Linux scheduler shares the cores among the runnable threads (CFS/EEVDF fair
share): a stage that waits in the fill or drain needs no core, so the others run faster meanwhile,
and the window and stage 0's idle share differ from the closed form of :mod:`.pipeline_window`
(docs/planner.md, "Pipelines on shared cores").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshtrain.planner.timing import pipeline_window

_EPSILON = 1e-12


@dataclasses.dataclass(frozen=True)
class Sharing:
    """The cores a job's ranks share and the threads each runs.

    With ``R T <= A`` (``R`` ranks) every rank has its own cores and the replay is the dedicated
    window; with ``R T > A`` a waiting stage's share goes to the running ones and the job's cores
    stay busy while any rank can run (on a host shared with other tenants, the scheduler's sleeper
    credit returns most of a waiting rank's share to it later, so the job keeps about ``A`` over
    the step).
    """

    cores: float
    """Cores the job's ranks receive together (A): what calibration and the host sampler measure; the
    host's cores on a quiet host."""
    threads: int
    """Threads each rank runs (T)."""

    def rate(self, runnable: int) -> float:
        """CPU seconds per second of one rank while ``runnable`` (``k``) of the job's ranks are runnable.

        The scheduler splits the cores evenly among the runnable threads: ``T x min(1, A / (k T))``.
        """
        demand = runnable * self.threads
        return self.threads * min(1.0, self.cores / demand) if demand > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Messages:
    """Wall seconds from an action's end to the neighbour that waits for its output holding it.

    Activations and gradients apart, as calibration measures them.
    """

    activations: float
    """A forward's output, on its way to the next stage."""
    gradients: float
    """A backward's input gradients, on their way to the stage before."""


def stage_actions(
    schedule: str, stages: int, micro_batches: int, stage: int
) -> list[tuple[str, int]]:
    """``("F", i)`` and ``("B", i)`` in the order ``stage`` runs them.

    GPipe: every forward, then every backward; 1F1B: ``p - s - 1`` warm-up
    forwards, then one forward one backward, then the remaining backwards.
    """
    m = micro_batches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(stages - stage - 1, m)
    out = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [("F", warmup + i), ("B", i)]
    return out + [("B", i) for i in range(m - warmup, m)]


def replay(
    schedule: str,
    micro_batches: int,
    stages: Sequence[pipeline_window.StageDurations],
    messages: Messages,
    sharing: Sharing,
    replicas: int = 1,
    between: float = 0.0,
) -> pipeline_window.Window:
    """The window of one step; ``stages`` hold CPU seconds per micro-batch, ``replicas`` ranks per stage.

    Each stage runs its actions in the trainer's order (:func:`stage_actions`); a
    forward of stage ``s > 0`` waits for the same micro-batch's forward of
    ``s - 1`` and a backward of ``s < p - 1`` for the backward of ``s + 1``, each
    plus that message's latency (``messages``).  All ranks of one stage (its
    data- and tensor-parallel replicas) run in step.  ``between``: CPU seconds of
    the rank's own loop before each action, once its input is there (posting its
    messages, bookkeeping): runnable, but not compute.  A stage counts as busy
    from the start to the end of each action, as the trainer's compute intervals
    do (descheduled time included).
    """
    p = len(stages)
    orders = [stage_actions(schedule, p, micro_batches, s) for s in range(p)]
    cursor = [0] * p
    overhead = [between] * p  # loop work still to run before the current action
    left = [_work(stages[s], orders[s][0]) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, stage) -> finish time
    busy = [0.0] * p
    now = 0.0
    while any(cursor[s] < len(orders[s]) for s in range(p)):
        ready = [_ready_at(orders, cursor, done, s, p, messages) for s in range(p)]
        runnable = [s for s, t in enumerate(ready) if t is not None and t <= now + _EPSILON]
        waiting = [t for t in ready if t is not None and t > now + _EPSILON]
        if not runnable:
            if not waiting:
                raise RuntimeError("pipeline replay deadlocked")  # an order the trainer never runs
            now = min(waiting)
            continue
        rate = sharing.rate(len(runnable) * replicas)
        step = min((overhead[s] if overhead[s] > _EPSILON else left[s]) / rate for s in runnable)
        if waiting:
            step = min(step, min(waiting) - now)
        now += step
        for s in runnable:
            if overhead[s] > _EPSILON:
                overhead[s] -= step * rate
                continue
            busy[s] += step
            left[s] -= step * rate
            if left[s] <= _EPSILON:
                overhead[s] = between
                kind, index = orders[s][cursor[s]]
                done[(kind, index, s)] = now
                cursor[s] += 1
                if cursor[s] < len(orders[s]):
                    left[s] = _work(stages[s], orders[s][cursor[s]])
    return pipeline_window.Window(seconds=now, busy=tuple(busy))


def _work(stage: pipeline_window.StageDurations, action: tuple[str, int]) -> float:
    return stage.forward if action[0] == "F" else stage.backward


def _ready_at(
    orders: list[list[tuple[str, int]]],
    cursor: list[int],
    done: dict[tuple[str, int, int], float],
    s: int,
    p: int,
    messages: Messages,
) -> float | None:
    """When stage ``s``'s next action may start (None: finished, or its input not yet produced)."""
    if cursor[s] == len(orders[s]):
        return None
    kind, index = orders[s][cursor[s]]
    source = (kind, index, s - 1) if kind == "F" else (kind, index, s + 1)
    if (kind == "F" and s == 0) or (kind == "B" and s == p - 1):
        return 0.0
    finished = done.get(source)
    if finished is None:
        return None
    return finished + (messages.activations if kind == "F" else messages.gradients)
