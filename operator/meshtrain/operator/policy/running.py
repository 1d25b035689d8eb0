"""The running gang: Running once every pod runs, rank 0's progress polled, room to grow looked for.

The straggler policy acts in between (``stragglers``); growing an elastic gang
is ``resizing``'s arithmetic, checked here once the gang has checkpointed since
it was placed.  Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from meshtrain.operator.policy import (
    conditions,
    job_actions,
    job_state,
    naming,
    resizing,
    situation,
)


def conditions_now(seen: situation.Situation) -> list[dict[str, Any]]:
    """The conditions as this pass leaves a running gang: what it shows, and Running=True once."""
    if seen.phase == job_state.Phase.RUNNING.value:
        return seen.observed.conditions
    spec = seen.spec
    message = f"all {spec.pods} pod(s) of {spec.parallelism.layout_string} running"
    return conditions.set(
        seen.observed.conditions,
        conditions.RUNNING,
        conditions.TRUE,
        conditions.ALL_PODS_RUNNING,
        message,
        seen.now,
    )


def _entered(seen: situation.Situation) -> tuple[job_actions.Action, ...]:
    if seen.phase != job_state.Phase.RUNNING.value:
        running = job_state.Phase.RUNNING.value
        conds = seen.once(conditions_now)
        return (job_actions.set_status(seen.job, phase=running, conditions=conds),)
    return seen.observation_unwritten


def _progress_polled(seen: situation.Situation) -> tuple[job_actions.Action, ...]:
    rank0 = next(p for p in seen.current if p.index == 0)
    port = naming.progress_port(seen.spec)
    if rank0.ip and rank0.phase == "Running" and port is not None:
        return (job_actions.PollProgress(rank0.name, rank0.ip, port),)
    return ()


def _grow(seen: situation.Situation) -> resizing.Grow | None:
    return resizing.grow_due(seen.job.declared or seen.spec, seen.job.status)


def _grow_check(seen: situation.Situation) -> job_actions.Decision:
    grow = seen.once(_grow)
    assert grow is not None
    return job_actions.Decision((grow,), requeue_after=resizing.GROW_CHECK_SECONDS)


ENTERED = situation.GANG_RUNNING.note("Running (once), else what the gang shows", _entered)
PROGRESS_POLLED = situation.GANG_RUNNING.note("rank 0 runs: its /progress read", _progress_polled)
GROW_CHECK = situation.GANG_RUNNING.rule(
    "below its largest elastic size, checkpointed since placed: look for room to grow",
    lambda seen: seen.once(_grow) is not None,
    _grow_check,
)
RUNNING = situation.GANG_RUNNING.rule(
    "every pod runs: nothing more",
    lambda seen: True,
    lambda seen: job_actions.Decision(),
)
