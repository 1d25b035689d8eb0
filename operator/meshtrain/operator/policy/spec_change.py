"""Spec change policy: a placed gang whose spec changed is rebuilt for the new spec.

When the spec no longer hashes as ``status.specHash`` (``runPolicy`` aside), the placement and
the old pods are dropped and the next pass places the new spec.  Not a restart: the pods get
their full grace period to checkpoint the step they stop at, and the checkpoint, being
layout-independent, resumes under the new layout.  Pure.
"""

from __future__ import annotations

from meshtrain.operator.policy import (
    conditions,
    finish,
    job_actions,
    job_state,
    queue_order,
    situation,
)


def _gang_done(seen: situation.Situation) -> bool:
    """Whether every recorded pod of the gang exists and exited 0."""
    recorded = len(seen.job.status["placement"])
    return len(seen.current) == recorded and all(p.phase == "Succeeded" for p in seen.current)


def _rebuilt(seen: situation.Situation) -> job_actions.Decision:
    """Drop the placement and the old pods; the next pass places the new spec."""
    job, spec = seen.job, seen.spec
    step = job.status.get("lastCheckpointStep")
    since = f" (last checkpoint so far: step {step})" if step else ""
    message = (
        f"spec changed (generation {job.generation}): rebuilding the gang as {spec.parallelism.layout_string} "
        f"({spec.pods} pod(s)); the old pods checkpoint the step they stop at and training resumes there{since}"
    )
    conds = situation.set_conditions(
        seen,
        conditions.SPEC_CHANGED,
        message,
        (conditions.PLACED, conditions.FALSE),
        (conditions.RUNNING, conditions.FALSE),
    )
    dropped = job_actions.set_status(
        job,
        phase=job_state.Phase.RESTARTING.value,
        placement=[],
        specHash=None,
        elastic=None,
        **queue_order.CLEARED,  # a new spec waits from now, behind the jobs waiting
        conditions=conds,
    )
    event = job_actions.Emit("Normal", conditions.SPEC_CHANGED, message)
    return situation.gang_stopped(seen, dropped, event)


DONE_BEFORE_REBUILD = situation.SPEC_CHANGED.rule(
    "the old gang already exited 0: Succeeded",
    _gang_done,
    finish.succeeded,
)
REBUILD = situation.SPEC_CHANGED.rule(
    "drop the old gang (SpecChanged), the next pass places the new spec",
    lambda seen: not _gang_done(seen),
    _rebuilt,
)
