"""Success and the end of a job: Succeeded when every pod exited 0, and what is left to do once finished.

A finished job keeps no pod running, and ``runPolicy.ttlSecondsAfterFinished``
after ``completionTime`` the job itself is deleted.  Pure: no I/O.
"""

from __future__ import annotations

import datetime

from meshtrain.operator.policy import (
    conditions,
    job_actions,
    job_state,
    pod_state,
    progress_status,
    situation,
)


def finished(seen: situation.Situation) -> job_actions.Decision:
    """A Succeeded or Failed job: delete its live pods, and the job once its TTL passed."""
    job = seen.job
    actions: list[job_actions.Action] = []
    if pod_state.live(seen.pods):
        actions.append(job_actions.DeletePods(pod_state.live(seen.pods)))
    completion = conditions.parse_time(job.status.get("completionTime"))
    ttl = job.ttl_seconds_after_finished
    if ttl is None or completion is None:
        return job_actions.Decision(tuple(actions))
    remaining = (completion + datetime.timedelta(seconds=ttl) - seen.now).total_seconds()
    if remaining <= 0:
        return job_actions.Decision((*actions, job_actions.DeleteJob()))
    return job_actions.Decision(tuple(actions), requeue_after=remaining)


def succeeded(seen: situation.Situation) -> job_actions.Decision:
    """Every pod of the gang exited 0: Succeeded, with rank 0's final progress."""
    gang = seen.current
    message = f"all {len(gang)} pod(s) exited 0"
    conds = situation.set_conditions(
        seen,
        conditions.COMPLETED,
        message,
        (conditions.SUCCEEDED, conditions.TRUE),
        (conditions.RUNNING, conditions.FALSE),
    )
    rank0 = next(p for p in gang if p.index == 0)
    final = progress_status.from_termination_message(
        rank0.termination_message
    )  # the step /progress never saw
    return job_actions.Decision(
        (
            job_actions.set_status(
                seen.job,
                **final,
                phase=job_state.Phase.SUCCEEDED.value,
                conditions=conds,
                completionTime=conditions.timestamp(seen.now),
            ),
            job_actions.Emit("Normal", conditions.COMPLETED, message),
        ),
        requeue_after=0,
    )


FINISHED = situation.FINISHED.rule(
    "no Workload left open: delete what still runs; delete the job after ttlSecondsAfterFinished",
    lambda seen: not seen.workload_open,
    finished,
)
SUCCEEDED = situation.GANG_EXISTS.rule(
    "every pod of the gang exited 0: Succeeded",
    lambda seen: all(p.phase == "Succeeded" for p in seen.current),
    succeeded,
)
