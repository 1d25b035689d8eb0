"""The rows of the state machine for in-place restarts: count what the gang's pods show in
``status.recovery`` (``recovery_count``), and rebuild the gang once the restarts of its attempt
exceed ``runPolicy.recovery.inPlaceLimit`` (the count starts again after the gang ran
``conditions.STEADY_SECONDS`` with no restart).  The rebuild counts against ``backoffLimit`` when
the job's own failures used the budget up; when the restarts without the disruptions among them
(lost pods and nodes) stay within the limit, it is a disruption (``runPolicy.disruptionRestartLimit``,
as a lost node without in-place recovery).  Pure.
"""

from __future__ import annotations

from meshtrain.operator.policy import (
    failure,
    job_actions,
    pod_failure,
    recovery_count,
    situation,
)


def _counted(seen: situation.Situation) -> recovery_count.Counted:
    return recovery_count.from_pods(
        seen.job.status, seen.attempt, seen.current, seen.spec, seen.now
    )


def _noted(seen: situation.Situation) -> tuple[job_actions.Action, ...]:
    counted = seen.once(_counted)
    if counted.recovery is None:
        return ()
    told = (job_actions.Emit("Warning", recovery_count.RESTARTED, m) for m in counted.events)
    return (job_actions.set_status(seen.job, recovery=counted.recovery), *told)


def _exhausted(seen: situation.Situation) -> bool:
    return seen.once(_counted).attempt_restarts > seen.spec.run_policy.recovery.in_place_limit


def _rebuild(seen: situation.Situation) -> job_actions.Decision:
    counted = seen.once(_counted)
    limit = seen.spec.run_policy.recovery.in_place_limit
    recovery = counted.recovery or recovery_count.book(seen.job.status, seen.attempt, seen.now)
    cause = (recovery["last"] or {}).get("cause")
    why = f"; the last after {cause}" if cause else ""
    disruptions = int(recovery["attemptDisruptions"])
    message = (
        f"{counted.attempt_restarts} in-place restarts of this gang exceed "
        f"runPolicy.recovery.inPlaceLimit={limit}{why}"
    )
    own = counted.attempt_restarts - disruptions
    if disruptions:
        message += f" ({disruptions} of them lost pods or nodes)"
    exhausted = pod_failure.Failure(
        "gang", False, message, disruption=own <= limit, reason=recovery_count.EXHAUSTED
    )
    return failure.restart_or_fail(seen, [exhausted])


COUNTED = situation.PLACED.note(
    "a trainer container the kubelet restarted in place: counted in status.recovery, an Event",
    _noted,
)
EXHAUSTED_REBUILD = situation.PLACED.rule(
    "in-place restarts of this gang past runPolicy.recovery.inPlaceLimit: rebuild the gang, or Failed",
    _exhausted,
    _rebuild,
)
