"""Suspend policy (``spec.runPolicy.suspend``): the gang goes, the status stays; resume places it again.

Suspending deletes every pod with its own grace period (the ranks checkpoint the step they stop
at); nothing counts as a failure.  Resuming waits until the suspended gang is gone, so that its
pods are not taken for a failed gang, and resets ``startTime``: time suspended is not active.
"""

from __future__ import annotations

from meshtrain.operator.policy import (
    conditions,
    job_actions,
    job_state,
    pod_state,
    queue_order,
    situation,
)


def suspended(seen: situation.Situation) -> job_actions.Decision:
    """Delete every pod; Suspended (once) with Suspended=True and the placement dropped."""
    job, pods = seen.job, seen.pods
    actions: list[job_actions.Action] = []
    if pod_state.live(pods) or any(not p.deleting for p in pods):
        actions.append(job_actions.DeletePods(pod_state.undeleted(pods)))
    if seen.phase != job_state.Phase.SUSPENDED.value:
        message = "spec.runPolicy.suspend is true: pods removed, status kept"
        conds = situation.set_conditions(
            seen,
            conditions.SUSPENDED_BY_USER,
            message,
            (conditions.SUSPENDED, conditions.TRUE),
            (conditions.RUNNING, conditions.FALSE),
            (conditions.PLACED, conditions.FALSE),
        )
        actions += [
            job_actions.set_status(
                job, phase=job_state.Phase.SUSPENDED.value, conditions=conds, placement=[]
            ),
            job_actions.Emit("Normal", conditions.SUSPENDED_BY_USER, message),
        ]
    return job_actions.Decision(tuple(actions))


def _resumed(seen: situation.Situation) -> job_actions.Decision:
    pods = seen.pods
    if pods:  # the suspended gang is still going away: wait, so it is not mistaken for a failure
        return job_actions.Decision(
            (job_actions.DeletePods(pod_state.undeleted(pods)),) if pod_state.live(pods) else (),
            requeue_after=1.0,
        )
    message = "spec.runPolicy.suspend is false: placing the job again"
    conds = situation.set_conditions(
        seen, conditions.RESUMED, message, (conditions.SUSPENDED, conditions.FALSE)
    )
    return job_actions.Decision(
        (
            job_actions.set_status(
                seen.job,
                phase=job_state.Phase.PENDING.value,
                conditions=conds,
                startTime=None,
                backfill=None,  # a new run: a new deadline, backfilled or not
                **queue_order.CLEARED,  # and a new place among the waiting jobs
            ),
            job_actions.Emit("Normal", conditions.RESUMED, message),
        ),
        requeue_after=0,
    )


SUSPEND = situation.VALID.rule(
    "spec.runPolicy.suspend: delete the pods, Suspended",
    lambda seen: seen.spec.run_policy.suspend,
    suspended,
)
RESUME = situation.VALID.rule(
    "Suspended and suspend is false again: once the pods are gone, Pending",
    lambda seen: seen.phase == job_state.Phase.SUSPENDED.value and not seen.spec.run_policy.suspend,
    _resumed,
)
