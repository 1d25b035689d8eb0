"""The rows of the state machine for in-place restarts: count what the gang's pods show in
``status.recovery`` (``recovery_count``), and rebuild the gang once the restarts of its attempt
exceed ``runPolicy.recovery.inPlaceLimit`` (counted against ``backoffLimit`` as any rebuild).
Pure.
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
    return recovery_count.from_pods(seen.job.status, seen.attempt, seen.current, seen.spec)


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
    recovery = counted.recovery or recovery_count.book(seen.job.status, seen.attempt)
    cause = (recovery["last"] or {}).get("cause")
    why = f"; the last after {cause}" if cause else ""
    message = (
        f"{counted.attempt_restarts} in-place restarts of this gang exceed "
        f"runPolicy.recovery.inPlaceLimit={limit}{why}"
    )
    return failure.restart_or_fail(
        seen, [pod_failure.Failure("gang", False, message, reason=recovery_count.EXHAUSTED)]
    )


COUNTED = situation.PLACED.note(
    "a trainer container the kubelet restarted in place: counted in status.recovery, an Event",
    _noted,
)
EXHAUSTED_REBUILD = situation.PLACED.rule(
    "in-place restarts of this gang past runPolicy.recovery.inPlaceLimit: rebuild the gang, or Failed",
    _exhausted,
    _rebuild,
)
