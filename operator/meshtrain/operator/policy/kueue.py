"""Kueue policy: what the state machine does with a job Kueue queues, given Kueue's answer.

The rows of ``lifecycle``'s table for a queued job; the answer itself is read from the Workload
by ``kueue_workload``, and the Workload read and written by ``cluster.workloads``.  The gang
exists only while Kueue admits the job: held, it has no pods (an eviction stops it like a
suspend); admitted, it is placed on the flavors Kueue assigned.  The quota goes back, and a
finished job's Workload is marked finished, only once no pod of the gang holds resources.  Pure.
"""

from __future__ import annotations

from meshtrain.operator.policy import (
    conditions,
    finish,
    job_actions,
    job_state,
    kueue_workload,
    pod_state,
    queue_order,
    situation,
    suspend,
)


def quota_free(seen: situation.Situation) -> bool:
    """Whether a stopped gang's quota may go back to Kueue (eviction, outdated Workload, suspend).

    Pod names are reused (an eviction, an outdated Workload or a suspend keeps the attempt), so
    every pod object of the attempt must be gone, terminal or not: a kept one would block the
    re-admitted gang's creation while it holds the quota.
    """
    return not seen.holding and not seen.current


def _finished_gang_stopping(seen: situation.Situation) -> job_actions.Decision:
    finished = finish.finished(seen)
    wait = 1.0 if finished.requeue_after is None else min(finished.requeue_after, 1.0)
    return job_actions.Decision(finished.actions, requeue_after=wait)


def _workload_finished(seen: situation.Situation) -> job_actions.Decision:
    finished = finish.finished(seen)
    done = kueue_workload.FinishWorkload(
        seen.phase == job_state.Phase.SUCCEEDED.value,
        f"TrainingJob {seen.job.ref.name} {seen.phase.lower()}",
    )
    return job_actions.Decision((*finished.actions, done), finished.requeue_after)


def _suspended(seen: situation.Situation) -> job_actions.Decision:
    suspended = suspend.suspended(seen)
    return job_actions.Decision(
        (*suspended.actions, kueue_workload.DeleteWorkload()), suspended.requeue_after
    )


def _left(seen: situation.Situation) -> job_actions.Decision:
    """The queue label is gone and so is the job's Workload: drop Queued; the job is placed as any."""
    message = f'metadata.labels["{kueue_workload.QUEUE_LABEL}"] removed: the job no longer waits for Kueue'
    conds = [c for c in job_state.conditions_of(seen.job) if c.get("type") != conditions.QUEUED]
    conds = conditions.set(
        conds, conditions.PLACED, conditions.FALSE, kueue_workload.QUEUE_REMOVED, message, seen.now
    )
    return job_actions.Decision(
        (
            job_actions.set_status(seen.job, conditions=conds),
            job_actions.Emit("Normal", kueue_workload.QUEUE_REMOVED, message),
        ),
        requeue_after=0,
    )


def _why_held(gate: kueue_workload.Gate) -> tuple[str, str]:
    """The Queued reason and message while Kueue withholds admission."""
    state = gate.state
    if state is None and gate.rejected:
        return kueue_workload.WORKLOAD_REJECTED, gate.rejected
    if state is None:
        return "WorkloadCreated", "waiting for Kueue: creating the job's Workload"
    reason = getattr(state, "reason", "Finished")
    return reason, getattr(state, "message", "") or "the Workload is finished"


def _held(seen: situation.Situation) -> job_actions.Decision:
    """Kueue withholds admission: no pods; create or move the Workload, give quota back, say why.

    The quota goes back only once the gang's pod objects are gone (:func:`quota_free`).
    """
    job, pods = seen.job, seen.pods
    assert seen.kueue is not None
    state = seen.kueue.state
    queued = conditions.find(job_state.conditions_of(job), conditions.QUEUED) or {}
    reason, message = _why_held(seen.kueue)
    actions: list[job_actions.Action] = []
    # Queued=True is written before the Workload is created: a job without its queue label is
    # looked up in Kueue only when its status says it was queued, so a Workload created by a
    # pass whose status write then lost a race (the label removed meanwhile) would be left
    # behind, waiting in Kueue for a job that no longer queues.
    if (queued.get("status"), queued.get("reason"), queued.get("message")) != (
        conditions.TRUE,
        reason,
        message,
    ):
        conds = situation.set_conditions(
            seen,
            reason,
            message,
            (conditions.QUEUED, conditions.TRUE),
            (conditions.RUNNING, conditions.FALSE),
            (conditions.PLACED, conditions.FALSE),
        )
        warning = reason in kueue_workload.WARNING_REASONS or isinstance(
            state, (kueue_workload.Evicted, kueue_workload.Outdated)
        )
        actions += [
            # Time in the queue is not active time: Kubernetes clears a suspended Job's too.
            job_actions.set_status(
                job,
                phase=job_state.Phase.PENDING.value,
                conditions=conds,
                placement=[],
                startTime=None,
                **queue_order.CLEARED,  # Kueue's queue orders it now
            ),
            job_actions.Emit("Warning" if warning else "Normal", reason, message),
        ]
    if state is None:
        actions.append(kueue_workload.CreateWorkload(seen.kueue.priority))
    if seen.kueue.move_to is not None:
        actions.append(kueue_workload.MoveWorkload(seen.kueue.move_to))
    if any(not p.deleting for p in pods):
        actions.append(job_actions.DeletePods(pod_state.undeleted(pods)))
    free = quota_free(seen)
    if free and isinstance(state, kueue_workload.Evicted) and state.holds_quota:
        actions.append(kueue_workload.ReleaseQuota())
    elif free and isinstance(state, kueue_workload.Outdated):
        actions.append(kueue_workload.DeleteWorkload())
    # A kept pod's deletion wakes the job; the slow recheck is a safety net.
    recheck = 1.0 if seen.holding else None if free else situation.LEAVING_RECHECK_SECONDS
    return job_actions.Decision(tuple(actions), requeue_after=recheck)


def _admission_recorded(seen: situation.Situation) -> tuple[job_actions.Action, ...]:
    """Queued=False (Admitted) and its Event, once, when Kueue admitted the job."""
    if seen.kueue is None or not isinstance(seen.kueue.state, kueue_workload.Admitted):
        return ()
    queued = conditions.find(job_state.conditions_of(seen.job), conditions.QUEUED) or {}
    if queued.get("status") == conditions.FALSE:
        return ()
    message = f"admitted by Kueue ClusterQueue {seen.kueue.state.cluster_queue}"
    conds = situation.set_conditions(
        seen, conditions.ADMITTED, message, (conditions.QUEUED, conditions.FALSE)
    )
    return (
        job_actions.set_status(seen.job, conditions=conds),
        job_actions.Emit("Normal", conditions.ADMITTED, message),
    )


def _pods_ready(seen: situation.Situation) -> tuple[job_actions.Action, ...]:
    """PodsReady for Kueue when what it says no longer matches the gang (waitForPodsReady reads it)."""
    if seen.kueue is None or not isinstance(seen.kueue.state, kueue_workload.Admitted):
        return ()
    ready = len(seen.current) == seen.spec.pods and pod_state.all_running(seen.current)
    if kueue_workload.pods_ready_condition(seen.kueue.state.pods_ready, ready) is None:
        return ()
    return (kueue_workload.ReportPodsReady(ready),)


FINISHED_GANG_STOPPING = situation.FINISHED.rule(
    "its Workload open, a pod still holds resources: wait before Kueue frees the quota",
    lambda seen: seen.workload_open and seen.holding,
    _finished_gang_stopping,
)
WORKLOAD_FINISHED = situation.FINISHED.rule(
    "its Workload open, no pod holds resources: mark the Workload finished",
    lambda seen: seen.workload_open and not seen.holding,
    _workload_finished,
)
SUSPENDED = situation.VALID.rule(
    "suspended, the gang gone, a Workload exists: suspend and delete the Workload",
    lambda seen: (
        seen.spec.run_policy.suspend
        and quota_free(seen)
        and seen.kueue is not None
        and seen.kueue.state is not None
    ),
    _suspended,
)
LEFT = situation.VALID.rule(
    "the queue label and the Workload are gone: drop Queued, placed as any job",
    lambda seen: seen.left_kueue,
    _left,
)
HELD = situation.VALID.rule(
    "queued, not admitted: no pods, Workload created/moved/released, Queued=True",
    lambda seen: not seen.kueue_admits,
    _held,
)
ADMISSION_RECORDED = situation.MAY_RUN.note("admitted: Queued=False, once", _admission_recorded)
PODS_READY_REPORTED = situation.MAY_RUN.note("admitted: PodsReady as the gang stands", _pods_ready)
