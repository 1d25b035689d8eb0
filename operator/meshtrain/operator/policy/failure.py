"""Failure policy: a gang with a failed pod restarts from its checkpoint, or the job fails.

A permanent failure, or a retryable one once ``runPolicy.backoffLimit`` restarts are used, fails
the job; a restart caused only by disruptions does not use the limit but a budget of its own
(``disruption_budget``).  A failure the kubelet names (ErrImagePull, OOMKilled, ...) gives the
condition and Event its reason.  What counts as a failure is ``pod_failure``'s.  The rows of
``lifecycle``'s table that fail or restart a job: an invalid spec, a passed deadline, a failed
gang, a gang too slow to start.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import (
    bad_gpus,
    conditions,
    container_reasons,
    device_errors,
    disruption_budget,
    job_actions,
    job_state,
    pod_failure,
    pod_state,
    queue_order,
    replacement,
    situation,
)

BROKEN_GANG_GRACE_SECONDS = 5
"""Grace period of the surviving pods of a failed gang: a checkpoint is collective, so with a rank gone they
cannot save and their full ``runPolicy.terminationGracePeriodSeconds`` would only delay the restart."""


def fail(
    seen: situation.Situation,
    pods: Sequence[pod_state.PodState],
    reason: str,
    message: str,
    grace_seconds: int | None = None,
) -> job_actions.Decision:
    """Failed for ``reason``: the live ``pods`` are deleted (with ``grace_seconds``)."""
    conds = situation.set_conditions(
        seen,
        reason,
        message,
        (conditions.FAILED, conditions.TRUE),
        (conditions.RUNNING, conditions.FALSE),
    )
    actions: list[job_actions.Action] = [
        job_actions.set_status(
            seen.job,
            phase=job_state.Phase.FAILED.value,
            conditions=conds,
            completionTime=conditions.timestamp(seen.now),
        ),
        job_actions.Emit("Warning", reason, message),
    ]
    if pod_state.live(pods):
        actions.append(job_actions.DeletePods(pod_state.live(pods), grace_seconds=grace_seconds))
    return job_actions.Decision(tuple(actions), requeue_after=0)


def restart_or_fail(
    seen: situation.Situation, failures: Sequence[pod_failure.Failure]
) -> job_actions.Decision:
    """Failed pods of the gang: fail the job (permanent, or backoff used up), else restart the gang.

    A restart counts in ``restarts`` (the new attempt: the old pods become stale) and, when
    only disruptions caused it, in ``disruptionRestarts``, which ``backoffLimit`` does not count.
    """
    job, current = seen.job, seen.current
    restarts = seen.attempt
    limit = seen.spec.run_policy.backoff_limit
    # a device error the gang left on is kept with its node: the next pod there is told; a node
    # with two within the window is as bad as one a supervisor took for bad
    errors = device_errors.recorded(
        job.status, device_errors.from_pods(job.status, seen.spec, current, seen.now), seen.now
    )
    kept = {"deviceErrors": errors} if errors is not None else {}
    # a node a pod left for a bad GPU is told, and excluded if the gang goes on, whatever else
    # failed with it
    bad = {
        **device_errors.exclusions({**job.status, **kept}, seen.now),
        **bad_gpus.newly_bad(job.status, current, seen.now),
    }
    told = bad_gpus.node_events(bad)
    permanent = [f for f in failures if f.permanent]
    if permanent:
        message = f"{permanent[0].message}; not retried"
        reason = permanent[0].reason or conditions.PERMANENT_FAILURE
        failed = fail(seen, current, reason, message, grace_seconds=BROKEN_GANG_GRACE_SECONDS)
        return bad_gpus.told_first(failed, told)
    message = "; ".join(f.message for f in failures[:3])
    disruptions = int(job.status.get("disruptionRestarts") or 0)
    disruption = all(f.disruption for f in failures)
    used = max(restarts - disruptions, 0)  # restarts the job's own failures caused
    budget = disruption_budget.judge(seen, failures, message) if disruption else None
    if budget is not None and budget.exceeded is not None:
        reason = disruption_budget.LIMIT_EXCEEDED
        failed = fail(seen, current, reason, budget.exceeded, BROKEN_GANG_GRACE_SECONDS)
        return bad_gpus.told_first(failed, told)
    if not disruption and used >= limit:
        failed = fail(
            seen,
            current,
            conditions.BACKOFF_LIMIT_EXCEEDED,
            f"{message}; backoffLimit={limit} restart(s) already used",
            grace_seconds=BROKEN_GANG_GRACE_SECONDS,
        )
        return bad_gpus.told_first(failed, told)
    note = (
        f"{message}; restarting the gang (a disruption: not counted against "
        f"backoffLimit={limit}, {used} used; {budget.note})"
        if budget is not None
        else f"{message}; restarting the gang (restart {used + 1} of {limit})"
    )
    # a disruption keeps the gang's place among the waiting jobs (queuedSince); its own failure
    # sends it behind the jobs waiting now
    counted: dict[str, Any] = (
        {"disruptionRestarts": disruptions + 1, **budget.status}
        if budget
        else dict(queue_order.CLEARED)
    )
    counted.update(kept)
    excluded = bad_gpus.excluded_after({**job.status, **counted}, bad)
    if excluded is not None:
        counted["excludedNodes"] = excluded
        note += bad_gpus.describe(current, also=bad)
    reason = next((f.reason for f in failures if f.reason), conditions.GANG_RESTARTING)
    conds = situation.set_conditions(
        seen,
        reason,
        note,
        (conditions.RUNNING, conditions.FALSE),
        (conditions.PLACED, conditions.FALSE),
    )
    restarted = job_actions.set_status(
        job,
        phase=job_state.Phase.RESTARTING.value,
        restarts=restarts + 1,
        **counted,
        placement=[],
        straggler=None,
        conditions=conds,
    )
    event = job_actions.Emit("Warning", reason, note)
    stopped = bad_gpus.told_first(
        situation.gang_stopped(seen, restarted, event, BROKEN_GANG_GRACE_SECONDS), told
    )
    if budget is not None and budget.wait > 0:  # a repeated disruption: look again when it is over
        return dataclasses.replace(stopped, requeue_after=budget.wait)
    return stopped


def _invalid_spec(seen: situation.Situation) -> job_actions.Decision:
    message = "spec breaks the rules: " + "; ".join(seen.job.problems)
    return fail(seen, seen.pods, conditions.INVALID_SPEC, message)


def deadline_left(
    spec: api_spec.TrainingJobSpec, status: Mapping[str, Any], now: datetime.datetime
) -> float | None:
    """Seconds of ``activeDeadlineSeconds`` left since ``startTime`` (None: no deadline, or not
    started): the reconciler passes again then, so a job ends at its deadline, not at a resync
    (a backfilled job's end bound counts on it, ``reservation.end_bound``)."""
    started = conditions.parse_time(status.get("startTime"))
    deadline = spec.run_policy.active_deadline_seconds
    ends = (
        []
        if deadline is None or started is None
        else [started + datetime.timedelta(seconds=deadline)]
    )
    if (kept := _backfill_deadline(status)) is not None:
        ends.append(kept)  # the deadline it backfilled with: a later edit does not move it
    return (min(ends) - now).total_seconds() if ends else None


def _backfill_deadline(status: Mapping[str, Any]) -> datetime.datetime | None:
    """``status.backfill.deadlineAt`` (None: not backfilled, or unreadable)."""
    try:
        kept = conditions.parse_time((status.get("backfill") or {}).get("deadlineAt"))
    except (TypeError, ValueError, AttributeError):
        return None
    return kept if kept is not None and kept.tzinfo is not None else None


def pass_at_deadline(job: job_state.JobState, phase: str, now: datetime.datetime) -> float | None:
    """Seconds until the pass that fails a job at its deadline is due (None: no deadline, not
    started, finished, or suspended: the deadline fails only a job that may run, and a resume
    clears ``startTime``)."""
    suspended = phase == job_state.Phase.SUSPENDED.value
    if phase in job_state.FINAL or suspended or job.spec is None or job.spec.run_policy.suspend:
        return None
    left = deadline_left(job.spec, job.status, now)
    return None if left is None else max(left, 0.0)


def _past_deadline(seen: situation.Situation) -> bool:
    left = deadline_left(seen.spec, seen.job.status, seen.now)
    return left is not None and left <= 0


def _deadline_exceeded(seen: situation.Situation) -> job_actions.Decision:
    deadline = seen.spec.run_policy.active_deadline_seconds
    message = f"job active for more than activeDeadlineSeconds={deadline}"
    kept = _backfill_deadline(seen.job.status)
    if kept is not None and kept <= seen.now:
        holder = (seen.job.status.get("backfill") or {}).get("holder") or "another job"
        message = (
            f"job ran to {conditions.timestamp(kept)}, the deadline it had when it was placed on "
            f"nodes reserved for {holder} (status.backfill.deadlineAt; a later change of "
            "runPolicy.activeDeadlineSeconds does not move it)"
        )
    return fail(seen, seen.current, conditions.DEADLINE_EXCEEDED, message)


def _too_slow_to_start(seen: situation.Situation) -> bool:
    return seen.startup_left is not None and seen.startup_left <= 0


def _startup_timed_out(seen: situation.Situation) -> job_actions.Decision:
    timeout, named_as = seen.spec.run_policy.startup_timeout_seconds, "startupTimeoutSeconds"
    if seen.phase == job_state.Phase.RUNNING.value and replacement.rejoins(seen.spec):
        timeout, named_as = (
            seen.spec.run_policy.recovery.rejoin_timeout_seconds,
            "rejoinTimeoutSeconds",
        )
    waiting = [p for p in seen.current if p.phase != "Running"]
    message = f"{len(waiting)} pod(s) not Running after {named_as}={timeout}"
    named = next((p for p in waiting if p.problem is not None), None)
    if named is not None and named.problem is not None:  # what the kubelet says keeps it waiting
        message += "; " + container_reasons.described(named.name, named.problem)
    else:
        unprepared = next((p for p in waiting if p.unprepared), None)
        if unprepared is not None:
            message += f"; pod {unprepared.name}: {container_reasons.UNPREPARED}"
    slow = pod_failure.Failure(
        waiting[0].name if waiting else "gang",
        False,
        message,
        reason=named.problem.reason if named is not None and named.problem is not None else None,
    )
    return restart_or_fail(seen, [slow])


INVALID_SPEC = situation.Rule(
    "not finished, the spec breaks a rule: Failed (InvalidSpec)",
    lambda seen: not seen.finished and seen.job.spec is None,
    _invalid_spec,
)
DEADLINE_EXCEEDED = situation.MAY_RUN.rule(
    "activeDeadlineSeconds passed since startTime: Failed, and nothing else this pass",
    _past_deadline,
    _deadline_exceeded,
    owed=False,
)
GANG_EXIT_SECONDS = 20.0
"""How long pods' exit 75 waits, from the last of them, for the exits of the gang's pods whose
built-in trainer still runs.  A halt sends every pod away at once, but the pod whose exit names
the cause may leave last: pod 0 hosting the store halts the gang when one of its GPUs is taken for
bad (79: a disruption by its node, which the rebuild must leave out), and a peer that lost a rank
may halt a gang past its in-place budget before the failed rank's own supervisor names its
device error (``deviceErrorRanks``: a disruption, the node's error kept)."""
CLOCK_SKEW_SECONDS = 5.0
"""A container's exit time (its node's clock) this far ahead of the operator's is not believed:
no wait is measured from it."""


def _gang_exit_due(seen: situation.Situation) -> float:
    """Seconds left to wait for the other pods' exits (0: decide now).

    Only while every failure is a pod whose supervisor gave up (75), a pod of the gang still runs
    the built-in trainer (it may name a device error of its own, beside one already named), and the
    last of those exits is less than :data:`GANG_EXIT_SECONDS` old.
    """
    failures = seen.failures
    if not failures or not all(f.gave_up for f in failures):
        return 0.0
    if seen.spec.trainer.type == "custom":
        return 0.0
    if not any(
        p.phase == "Running" and not p.deleting and p.exit_code is None for p in seen.current
    ):
        return 0.0
    failed = {f.pod for f in failures}
    exits = [p.finished_at for p in seen.current if p.name in failed and p.finished_at]
    if not exits or max(exits) > seen.now + datetime.timedelta(seconds=CLOCK_SKEW_SECONDS):
        return 0.0
    return GANG_EXIT_SECONDS - (seen.now - max(exits)).total_seconds()


GANG_EXITING = situation.PLACED.rule(
    "pods gave up (75) while others still run their trainer: wait for their own exits, one of "
    "which may name the cause, at most GANG_EXIT_SECONDS after the last 75",
    lambda seen: _gang_exit_due(seen) > 0,
    lambda seen: job_actions.Decision((), requeue_after=_gang_exit_due(seen)),
)
GANG_FAILED = situation.PLACED.rule(
    "a pod of the gang failed or vanished: restart the gang, or Failed",
    lambda seen: bool(seen.failures),
    lambda seen: restart_or_fail(seen, seen.failures),
)
STARTUP_TIMED_OUT = situation.GANG_STARTING.rule(
    "the gang is not running startupTimeoutSeconds after its first pod: restart, or Failed",
    _too_slow_to_start,
    _startup_timed_out,
)
