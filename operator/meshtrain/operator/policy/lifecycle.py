"""The TrainingJob state machine: observed job + pods + time -> actions.

:func:`decide` maps what the operator observes (the job object and its pods)
and the current time to the actions that move the job towards its desired
state (the actions: ``job_actions``; a placement answer's status fields:
``placement_status``; the job as read: ``jobstate``).

States (``status.phase``)::

    Pending --place--> Placing --all pods Running--> Running --all pods exit 0--> Succeeded
       ^  (unschedulable: stays Pending, condition Placed=False with the reason)
       |                  |                            |
       |                  +------ a pod fails ---------+--> Restarting --place--> Placing
       |                         (retryable, restarts < backoffLimit)
       |                  permanent exit code / backoff exhausted / deadline --> Failed
    Suspended <--- spec.runPolicy.suspend (any non-final phase); resume -> Pending
    Pending/Restarting --place: the planner says a rank needs more GPU memory than there is--> Failed (WontFit)
    Placing/Running --spec changed (runPolicy aside)--> Restarting (SpecChanged: old pods deleted, restarts unchanged) --place--> Placing
    Running --straggler under stragglerPolicy replace--> Restarting (StragglerReplaced: node excluded, pods deleted, restarts unchanged) --place--> Placing

The gang attempt is ``status.restarts``: pods carry it as a label, so pods of
an older attempt are recognised (and deleted) after any crash, and a failure
is counted exactly once — the restart increments ``restarts`` before the old
pods are deleted, which makes them stale.  ``status.placement`` is written
before the pods are created; pods missing from a still-gated gang are
re-created on the recorded nodes (crash recovery), while a pod missing from a
released gang is a failure.  ``status.specHash`` records the spec a placement
was made for; when the spec no longer hashes the same, the gang is rebuilt.
Every decision is idempotent: applying it twice, or crashing between its
actions, leads to the same next decision.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.operator.policy import (
    conditions,
    failure,
    gang_status,
    identity,
    placement_status,
    progress_status,
    queueing,
    rescheduling,
    resizing,
    stragglers,
)
from meshtrain.operator.policy.job_actions import (
    Action,
    Decision,
    DeleteJob,
    DeletePods,
    Emit,
    LiftGates,
    Place,
    PollProgress,
    ReplaceStraggler,
    SetStatus,
)
from meshtrain.operator.policy.job_state import FINAL, JobState, Phase, conditions_of, job_state

__all__ = [
    "FINAL",
    "Action",
    "Decision",
    "DeleteJob",
    "DeletePods",
    "Emit",
    "JobState",
    "LiftGates",
    "Phase",
    "Place",
    "PollProgress",
    "ReplaceStraggler",
    "SetStatus",
    "decide",
    "holding",
    "job_state",
]
"""Callers name the actions and the job through this module, the state machine's face."""

BROKEN_GANG_GRACE_SECONDS = 5
"""Grace period of the surviving pods of a failed gang: a checkpoint is collective, so with a rank gone they
cannot save and their full ``runPolicy.terminationGracePeriodSeconds`` would only delay the restart."""


LEAVING_RECHECK_SECONDS = 30.0
"""Safety recheck while a dropped placement's pods are still there (their deletion wakes the job)."""


def _changes(job: JobState, **fields: Any) -> SetStatus:
    return SetStatus({**fields, "observedGeneration": job.generation})


def holding(pods: Sequence[failure.PodState]) -> bool:
    """Whether a pod still holds its node's resources (:attr:`failure.PodState.holds_resources`).

    A Succeeded or Failed pod holds nothing, even while a finalizer keeps the object.
    """
    return any(p.holds_resources for p in pods)


def _quota_free(job: JobState, pods: Sequence[failure.PodState]) -> bool:
    """Whether a stopped gang's quota may go back to Kueue (eviction, outdated Workload, suspend).

    Pod names are reused (an eviction, an outdated Workload or a suspend keeps the attempt), so
    every pod object of the attempt must be gone, terminal or not: a kept one would block the
    re-admitted gang's creation while it holds the quota.
    """
    attempt = int(job.status.get("restarts") or 0)
    return not holding(pods) and not any(p.attempt == attempt for p in pods)


def _live(pods: Sequence[failure.PodState]) -> tuple[str, ...]:
    """Names of pods to delete when freeing the job's GPUs (not already finished or going)."""
    return tuple(p.name for p in pods if not p.deleting and not p.terminal)


def _fail(
    job: JobState,
    pods: Sequence[failure.PodState],
    reason: str,
    message: str,
    now: datetime.datetime,
    grace_seconds: int | None = None,
) -> Decision:
    conds = conditions.set(
        conditions_of(job), conditions.FAILED, conditions.TRUE, reason, message, now
    )
    conds = conditions.set(conds, conditions.RUNNING, conditions.FALSE, reason, message, now)
    actions: list[Action] = [
        _changes(
            job,
            phase=Phase.FAILED.value,
            conditions=conds,
            completionTime=conditions.timestamp(now),
        ),
        Emit("Warning", reason, message),
    ]
    if _live(pods):
        actions.append(DeletePods(_live(pods), grace_seconds=grace_seconds))
    return Decision(tuple(actions), requeue_after=0)


def _finished(job: JobState, pods: Sequence[failure.PodState], now: datetime.datetime) -> Decision:
    actions: list[Action] = []
    if _live(pods):
        actions.append(DeletePods(_live(pods)))
    completion = conditions.parse_time(job.status.get("completionTime"))
    ttl = job.ttl_seconds_after_finished
    if ttl is None or completion is None:
        return Decision(tuple(actions))
    remaining = (completion + datetime.timedelta(seconds=ttl) - now).total_seconds()
    if remaining <= 0:
        return Decision((*actions, DeleteJob()))
    return Decision(tuple(actions), requeue_after=remaining)


def _suspend(job: JobState, pods: Sequence[failure.PodState], now: datetime.datetime) -> Decision:
    actions: list[Action] = []
    if _live(pods) or any(not p.deleting for p in pods):
        actions.append(DeletePods(tuple(p.name for p in pods if not p.deleting)))
    if job.status.get("phase") != Phase.SUSPENDED.value:
        message = "spec.runPolicy.suspend is true: pods removed, status kept"
        conds = conditions.set(
            conditions_of(job),
            conditions.SUSPENDED,
            conditions.TRUE,
            conditions.SUSPENDED_BY_USER,
            message,
            now,
        )
        conds = conditions.set(
            conds, conditions.RUNNING, conditions.FALSE, conditions.SUSPENDED_BY_USER, message, now
        )
        conds = conditions.set(
            conds, conditions.PLACED, conditions.FALSE, conditions.SUSPENDED_BY_USER, message, now
        )
        actions += [
            _changes(job, phase=Phase.SUSPENDED.value, conditions=conds, placement=[]),
            Emit("Normal", conditions.SUSPENDED_BY_USER, message),
        ]
    return Decision(tuple(actions))


def _resume(job: JobState, pods: Sequence[failure.PodState], now: datetime.datetime) -> Decision:
    if pods:  # the suspended gang is still going away: wait, so it is not mistaken for a failure
        return Decision(
            (DeletePods(tuple(p.name for p in pods if not p.deleting)),) if _live(pods) else (),
            requeue_after=1.0,
        )
    message = "spec.runPolicy.suspend is false: placing the job again"
    conds = conditions.set(
        conditions_of(job), conditions.SUSPENDED, conditions.FALSE, conditions.RESUMED, message, now
    )
    return Decision(
        (
            _changes(job, phase=Phase.PENDING.value, conditions=conds, startTime=None),
            Emit("Normal", conditions.RESUMED, message),
        ),
        requeue_after=0,
    )


def _on_failure(
    job: JobState,
    current: Sequence[failure.PodState],
    failures: Sequence[failure.Failure],
    now: datetime.datetime,
) -> Decision:
    assert job.spec is not None
    restarts = int(job.status.get("restarts") or 0)
    limit = job.spec.run_policy.backoff_limit
    permanent = [f for f in failures if f.permanent]
    if permanent:
        return _fail(
            job,
            current,
            conditions.PERMANENT_FAILURE,
            f"{permanent[0].message}; not retried",
            now,
            grace_seconds=BROKEN_GANG_GRACE_SECONDS,
        )
    message = "; ".join(f.message for f in failures[:3])
    disruptions = int(job.status.get("disruptionRestarts") or 0)
    disruption = all(f.disruption for f in failures)
    used = max(restarts - disruptions, 0)  # restarts the job's own failures caused
    if not disruption and used >= limit:
        return _fail(
            job,
            current,
            conditions.BACKOFF_LIMIT_EXCEEDED,
            f"{message}; backoffLimit={limit} restart(s) already used",
            now,
            grace_seconds=BROKEN_GANG_GRACE_SECONDS,
        )
    note = (
        f"{message}; restarting the gang (a disruption: not counted against "
        f"backoffLimit={limit}, {used} used)"
        if disruption
        else f"{message}; restarting the gang (restart {used + 1} of {limit})"
    )
    conds = conditions.set(
        conditions_of(job),
        conditions.RUNNING,
        conditions.FALSE,
        conditions.GANG_RESTARTING,
        note,
        now,
    )
    conds = conditions.set(
        conds, conditions.PLACED, conditions.FALSE, conditions.GANG_RESTARTING, note, now
    )
    actions: list[Action] = [
        _changes(
            job,
            phase=Phase.RESTARTING.value,
            restarts=restarts + 1,
            **({"disruptionRestarts": disruptions + 1} if disruption else {}),
            placement=[],
            straggler=None,
            conditions=conds,
        ),
        Emit("Warning", conditions.GANG_RESTARTING, note),
    ]
    doomed = tuple(p.name for p in current if not p.deleting)
    if doomed:
        actions.append(DeletePods(doomed, grace_seconds=BROKEN_GANG_GRACE_SECONDS))
    return Decision(tuple(actions), requeue_after=0)


def _succeeded(
    job: JobState, gang: Sequence[failure.PodState], actions: list[Action], now: datetime.datetime
) -> Decision:
    """Every pod of the gang exited 0: Succeeded, with rank 0's final progress."""
    message = f"all {len(gang)} pod(s) exited 0"
    conds = conditions.set(
        conditions_of(job),
        conditions.SUCCEEDED,
        conditions.TRUE,
        conditions.COMPLETED,
        message,
        now,
    )
    conds = conditions.set(
        conds, conditions.RUNNING, conditions.FALSE, conditions.COMPLETED, message, now
    )
    rank0 = next(p for p in gang if p.index == 0)
    final = progress_status.from_termination_message(
        rank0.termination_message
    )  # the step /progress never saw
    return Decision(
        (
            *actions,
            _changes(
                job,
                **final,
                phase=Phase.SUCCEEDED.value,
                conditions=conds,
                completionTime=conditions.timestamp(now),
            ),
            Emit("Normal", conditions.COMPLETED, message),
        ),
        requeue_after=0,
    )


def _rebuild_for_new_spec(
    job: JobState, current: Sequence[failure.PodState], now: datetime.datetime
) -> Decision:
    """The spec changed under a placed gang: drop the placement and the old pods; the next pass places the new spec.

    Not a restart (``restarts`` is unchanged): the pods are not at fault, and
    they get their full grace period to checkpoint the step they stop at.
    The checkpoint format is layout-independent, so a new parallel layout
    resumes from it; the CRD refuses changes to ``spec.model``, which no
    checkpoint could survive.
    """
    assert job.spec is not None
    spec = job.spec
    step = job.status.get("lastCheckpointStep")
    since = f" (last checkpoint so far: step {step})" if step else ""
    message = (
        f"spec changed (generation {job.generation}): rebuilding the gang as {spec.parallelism.layout_string} "
        f"({spec.pods} pod(s)); the old pods checkpoint the step they stop at and training resumes there{since}"
    )
    conds = conditions.set(
        conditions_of(job),
        conditions.PLACED,
        conditions.FALSE,
        conditions.SPEC_CHANGED,
        message,
        now,
    )
    conds = conditions.set(
        conds, conditions.RUNNING, conditions.FALSE, conditions.SPEC_CHANGED, message, now
    )
    actions: list[Action] = [
        _changes(
            job,
            phase=Phase.RESTARTING.value,
            placement=[],
            specHash=None,
            elastic=None,
            conditions=conds,
        ),
        Emit("Normal", conditions.SPEC_CHANGED, message),
    ]
    doomed = tuple(p.name for p in current if not p.deleting)
    if doomed:
        actions.append(DeletePods(doomed))
    return Decision(tuple(actions), requeue_after=0)


def _all_running(pods: Sequence[failure.PodState]) -> bool:
    return all(not p.gated and p.phase in ("Running", "Succeeded") for p in pods)


def _disappeared(job: JobState, index: int, nodes_gone: frozenset[str]) -> failure.Failure:
    """The failure of a pod of the gang that no longer exists: a disruption when its node is gone too."""
    node = next(
        (
            p.get("node")
            for p in job.status.get("placement") or []
            if isinstance(p, Mapping) and p.get("podIndex") == index
        ),
        None,
    )
    if node in nodes_gone:
        message = f"pod of node rank {index} disappeared with its node {node} (deleted)"
        return failure.Failure(f"index {index}", False, message, disruption=True)
    return failure.Failure(f"index {index}", False, f"pod of node rank {index} disappeared")


def decide(
    job: JobState,
    pods: Sequence[failure.PodState],
    now: datetime.datetime,
    kueue: queueing.Gate | None = None,
    nodes_gone: frozenset[str] = frozenset(),
) -> Decision:
    """The next actions for ``job`` given its pods (every pod labelled with the job) at ``now``.

    ``kueue`` is given for a job Kueue queues: the gang exists only while Kueue admits it.
    ``nodes_gone``: nodes of ``status.placement`` that no longer exist (a pod that vanished with
    its node, as PodGC force-deletes it, is a disruption).
    """
    phase = job.status.get("phase") or Phase.PENDING.value
    if phase in FINAL:
        finished = _finished(job, pods, now)
        if kueue is None or kueue.state is None or isinstance(kueue.state, queueing.Finished):
            return finished
        if holding(pods):  # Kueue would admit another job onto GPUs the stopping ranks still use
            wait = 1.0 if finished.requeue_after is None else min(finished.requeue_after, 1.0)
            return Decision(finished.actions, requeue_after=wait)
        done = queueing.FinishWorkload(
            phase == Phase.SUCCEEDED.value, f"TrainingJob {job.ref.name} {phase.lower()}"
        )
        return Decision((*finished.actions, done), finished.requeue_after)
    if job.spec is None:
        return _fail(
            job,
            pods,
            conditions.INVALID_SPEC,
            "spec breaks the rules: " + "; ".join(job.problems),
            now,
        )
    spec = job.spec
    if spec.run_policy.suspend:
        suspended = _suspend(job, pods, now)
        if not _quota_free(job, pods) or kueue is None or kueue.state is None:
            return suspended
        # A suspended job keeps no quota: its Workload goes, and is created again on resume.
        return Decision((*suspended.actions, queueing.DeleteWorkload()), suspended.requeue_after)
    if phase == Phase.SUSPENDED.value:
        return _resume(job, pods, now)
    admitted: tuple[Action, ...] = ()
    if kueue is None and queueing.was_queued(job.status):
        return _left_kueue(job, now)
    if kueue is not None:
        held = _held_by_kueue(job, pods, kueue, now)
        if isinstance(held, Decision):
            return held
        admitted = held

    attempt = int(job.status.get("restarts") or 0)
    actions: list[Action] = list(admitted)
    stale = tuple(p.name for p in pods if p.attempt != attempt and not p.deleting)
    if stale:
        actions.append(DeletePods(stale))
    current = [p for p in pods if p.attempt == attempt]
    flavors: tuple[str, ...] = ()
    if kueue is not None and isinstance(kueue.state, queueing.Admitted):
        flavors = kueue.state.flavors
        ready = len(current) == spec.pods and _all_running(current)
        if queueing.pods_ready_condition(kueue.state.pods_ready, ready) is not None:
            actions.append(queueing.ReportPodsReady(ready))

    started = conditions.parse_time(job.status.get("startTime"))
    deadline = spec.run_policy.active_deadline_seconds
    if deadline is not None and started is not None:
        left = (started + datetime.timedelta(seconds=deadline) - now).total_seconds()
        if left <= 0:
            return _fail(
                job,
                current,
                conditions.DEADLINE_EXCEEDED,
                f"job active for more than activeDeadlineSeconds={deadline}",
                now,
            )

    if not job.status.get("placement"):
        # Pods without a recorded placement: after a lost status write (rebuild cleanly), or a
        # dropped placement whose pods still terminate (wait for them, woken by their deletion).
        if current:
            return Decision(
                (*actions, *_old_pods_leaving(job, current, now)), LEAVING_RECHECK_SECONDS
            )
        return Decision((*actions, Place(attempt, flavors=flavors)))

    built_from = job.status.get("specHash")
    if built_from and not identity.same_spec(built_from, spec):
        recorded = len(job.status["placement"])
        if len(current) == recorded and all(
            p.phase == "Succeeded" for p in current
        ):  # too late: the old gang is done
            return _succeeded(job, current, actions, now)
        decision = _rebuild_for_new_spec(job, current, now)
        return Decision((*actions, *decision.actions), decision.requeue_after)

    failures = [f for f in (failure.classify(p) for p in current) if f is not None]
    present = {p.index for p in current}
    missing = tuple(i for i in range(spec.pods) if i not in present)
    if missing and not failures and any(not p.gated for p in current):
        failures = [_disappeared(job, missing[0], nodes_gone)]
    if failures:
        decision = _on_failure(job, current, failures, now)
        return Decision((*actions, *decision.actions), decision.requeue_after)
    if missing:
        return Decision((*actions, Place(attempt, missing, flavors)))

    if all(p.phase == "Succeeded" for p in current):
        return _succeeded(job, current, actions, now)

    observed = gang_status.observe(conditions_of(job), current, spec.pods, now)
    actions += [Emit(*event) for event in observed.events]
    seen: list[Action] = (
        [_changes(job, conditions=observed.conditions)]
        if observed.conditions != conditions_of(job)
        else []
    )
    gated = tuple(p.name for p in current if p.gated)
    if gated:  # Placed=True first: lifting may find a planned node changed and unplace the gang
        actions += [*seen, LiftGates(gated)]
        seen = []
    refusals = rescheduling.refused(current, now)
    if refusals.nodes:  # PodsScheduled=False first: the reconciler may have to wait out a backoff
        return Decision((*actions, *seen, rescheduling.ReplaceRefused(refusals.nodes)))
    if _all_running(current):
        if phase != Phase.RUNNING.value:
            message = f"all {spec.pods} pod(s) of {spec.parallelism.layout_string} running"
            conds = conditions.set(
                observed.conditions,
                conditions.RUNNING,
                conditions.TRUE,
                conditions.ALL_PODS_RUNNING,
                message,
                now,
            )
            actions.append(_changes(job, phase=Phase.RUNNING.value, conditions=conds))
        else:
            conds = observed.conditions
            actions += seen
        reaction = stragglers.react(spec.run_policy.straggler_policy, job.status, conds, now)
        if reaction.replace:  # the next pass places the gang again, without the node
            assert reaction.nodes and reaction.otherwise is not None
            doomed = tuple(p.name for p in current if not p.deleting)
            fallback = reaction.otherwise
            replace = ReplaceStraggler(
                reaction.nodes,
                (
                    _changes(job, **reaction.status),
                    *(Emit(*event) for event in reaction.events),
                    DeletePods(doomed),
                ),
                (
                    *([_changes(job, **fallback.status)] if fallback.status else []),
                    *(Emit(*event) for event in fallback.events),
                ),
            )
            return Decision((*actions, replace), requeue_after=0)
        if reaction.status:
            actions.append(_changes(job, **reaction.status))
        actions += [Emit(*event) for event in reaction.events]
        rank0 = next(p for p in current if p.index == 0)
        if rank0.ip and rank0.phase == "Running":
            actions.append(PollProgress(rank0.name, rank0.ip, spec.metrics.port))
        grow = resizing.grow_due(job.declared or spec, job.status)
        if grow is not None:
            actions.append(grow)
            return Decision(tuple(actions), requeue_after=resizing.GROW_CHECK_SECONDS)
        return Decision(tuple(actions))

    created = [p.created_at for p in current if p.created_at is not None]
    timeout = spec.run_policy.startup_timeout_seconds
    if created:
        left = (min(created) + datetime.timedelta(seconds=timeout) - now).total_seconds()
        if left <= 0:
            waiting = [p.name for p in current if p.phase != "Running"]
            slow = failure.Failure(
                waiting[0] if waiting else "gang",
                False,
                f"{len(waiting)} pod(s) not Running after startupTimeoutSeconds={timeout}",
            )
            decision = _on_failure(job, current, [slow], now)
            return Decision((*actions, *decision.actions), decision.requeue_after)
        recheck = refusals.recheck_after
        return Decision((*actions, *seen), left if recheck is None else min(left, recheck))
    return Decision((*actions, *seen), refusals.recheck_after)


def _old_pods_leaving(
    job: JobState, current: Sequence[failure.PodState], now: datetime.datetime
) -> tuple[Action, ...]:
    """Delete what is left of a dropped placement and say which pods the new gang waits for.

    A terminal pod holds no GPUs, but the new pods take the same names: it is waited for too
    (the API server removes it at once unless a finalizer holds it).
    """
    doomed = tuple(p.name for p in current if not p.deleting)
    names = ", ".join(
        f"{p.name} ({p.phase if p.terminal else 'terminating'}{f' on {p.node}' if p.bound else ''})"
        for p in sorted(current, key=lambda p: p.name)
    )
    message = f"waiting for pod(s) of the dropped placement to be gone: {names}"
    placed = conditions.find(conditions_of(job), conditions.PLACED) or {}
    wait: tuple[Action, ...] = ()
    if (placed.get("reason"), placed.get("message")) != (conditions.OLD_PODS_TERMINATING, message):
        wait = (
            _changes(
                job,
                **placement_status.unschedulable(
                    job, conditions.OLD_PODS_TERMINATING, message, now
                ),
            ),
        )
    return (*([DeletePods(doomed)] if doomed else []), *wait)


def _held_by_kueue(
    job: JobState, pods: Sequence[failure.PodState], kueue: queueing.Gate, now: datetime.datetime
) -> Decision | tuple[Action, ...]:
    """The decision while Kueue withholds admission, or the actions that record an admission.

    An eviction stops the gang like a suspend: every pod gets its grace period to checkpoint,
    nothing counts as a failure, and the quota goes back only once the gang's pod objects are
    gone (:func:`_quota_free`).
    """
    state = kueue.state
    queued = conditions.find(conditions_of(job), conditions.QUEUED) or {}
    if isinstance(state, queueing.Admitted):
        if queued.get("status") == conditions.FALSE:
            return ()
        message = f"admitted by Kueue ClusterQueue {state.cluster_queue}"
        conds = conditions.set(
            conditions_of(job),
            conditions.QUEUED,
            conditions.FALSE,
            conditions.ADMITTED,
            message,
            now,
        )
        return (_changes(job, conditions=conds), Emit("Normal", conditions.ADMITTED, message))
    if state is None and kueue.rejected:
        reason, message = queueing.WORKLOAD_REJECTED, kueue.rejected
    elif state is None:
        reason, message = "WorkloadCreated", "waiting for Kueue: creating the job's Workload"
    else:
        reason = getattr(state, "reason", "Finished")
        message = getattr(state, "message", "") or "the Workload is finished"
    actions: list[Action] = []
    if state is None:
        actions.append(queueing.CreateWorkload(kueue.priority))
    if kueue.move_to is not None:
        actions.append(queueing.MoveWorkload(kueue.move_to))
    if any(not p.deleting for p in pods):
        actions.append(DeletePods(tuple(p.name for p in pods if not p.deleting)))
    free = _quota_free(job, pods)
    if free and isinstance(state, queueing.Evicted) and state.holds_quota:
        actions.append(queueing.ReleaseQuota())
    elif free and isinstance(state, queueing.Outdated):
        actions.append(queueing.DeleteWorkload())
    if (queued.get("status"), queued.get("reason"), queued.get("message")) != (
        conditions.TRUE,
        reason,
        message,
    ):
        conds = conditions.set(
            conditions_of(job), conditions.QUEUED, conditions.TRUE, reason, message, now
        )
        conds = conditions.set(conds, conditions.RUNNING, conditions.FALSE, reason, message, now)
        conds = conditions.set(conds, conditions.PLACED, conditions.FALSE, reason, message, now)
        actions += [
            # Time in the queue is not active time: Kubernetes clears a suspended Job's too.
            _changes(
                job, phase=Phase.PENDING.value, conditions=conds, placement=[], startTime=None
            ),
            Emit(
                "Warning"
                if reason in queueing.WARNING_REASONS
                or isinstance(state, (queueing.Evicted, queueing.Outdated))
                else "Normal",
                reason,
                message,
            ),
        ]
    # A kept pod's deletion wakes the job; the slow recheck is a safety net.
    recheck = 1.0 if holding(pods) else None if free else LEAVING_RECHECK_SECONDS
    return Decision(tuple(actions), requeue_after=recheck)


def _left_kueue(job: JobState, now: datetime.datetime) -> Decision:
    """The queue label is gone and so is the job's Workload: drop Queued; the job is placed as any."""
    message = (
        f'metadata.labels["{queueing.QUEUE_LABEL}"] removed: the job no longer waits for Kueue'
    )
    conds = [c for c in conditions_of(job) if c.get("type") != conditions.QUEUED]
    conds = conditions.set(
        conds, conditions.PLACED, conditions.FALSE, queueing.QUEUE_REMOVED, message, now
    )
    return Decision(
        (
            _changes(job, conditions=conds),
            Emit("Normal", queueing.QUEUE_REMOVED, message),
        ),
        requeue_after=0,
    )
