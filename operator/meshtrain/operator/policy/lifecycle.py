"""The TrainingJob state machine: observed job + pods + time -> actions.

:func:`decide` walks :data:`RULES`, an ordered table whose rows come from one module per
policy: the first rule whose guard holds decides; a note on the way owes actions that every
decision below it carries first.  The rows lie in the named sections of ``situation`` (what the
rows above leave for them).  The phases and transitions: docs/operator.md, "Lifecycle".
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence

from meshtrain.operator.policy import (
    disruption_budget,
    failure,
    finish,
    in_place,
    job_actions,
    job_state,
    kueue,
    kueue_reassigned,
    kueue_workload,
    pod_failure,
    pod_loss,
    pod_state,
    running,
    situation,
    spec_change,
    startup,
    stragglers,
    suspend,
)

RULES: tuple[situation.Rule | situation.Note, ...] = (
    # FINISHED: Succeeded or Failed.
    kueue.FINISHED_GANG_STOPPING,
    kueue.WORKLOAD_FINISHED,
    finish.FINISHED,
    # Not finished.
    failure.INVALID_SPEC,
    # VALID: not finished, the spec keeps every rule.
    kueue.SUSPENDED,
    suspend.SUSPEND,
    suspend.RESUME,
    kueue.LEFT,
    kueue.HELD,
    # MAY_RUN: the gang may exist (not suspended, not held by Kueue).
    kueue.ADMISSION_RECORDED,
    startup.STALE_PODS_DELETED,
    kueue.PODS_READY_REPORTED,
    failure.DEADLINE_EXCEEDED,
    # UNPLACED: no placement recorded.
    startup.OLD_PODS_LEAVING,
    disruption_budget.WAITING,
    startup.PLACE,
    # SPEC_CHANGED: placed for an earlier spec.
    spec_change.DONE_BEFORE_REBUILD,
    spec_change.REBUILD,
    # PLACED: placed for the spec as it is.
    in_place.COUNTED,
    failure.GANG_EXITING,
    pod_loss.REPLACE_LOST,
    failure.GANG_FAILED,
    in_place.EXHAUSTED_REBUILD,
    startup.RECREATE_MISSING,
    # GANG_EXISTS: every pod of the gang exists, none failed.
    finish.SUCCEEDED,
    kueue_reassigned.FOLLOWED,
    startup.GANG_EVENTS,
    startup.GATES_LIFTED,
    startup.SCHEDULER_REFUSED,
    # GANG_RUNNING: every pod of the gang runs.
    running.ENTERED,
    stragglers.REPLACE,
    stragglers.REPORTED,
    running.PROGRESS_POLLED,
    running.GROW_CHECK,
    running.RUNNING,
    # GANG_STARTING: not every pod runs yet.
    failure.STARTUP_TIMED_OUT,
    startup.WAITING,
)
"""The state machine, row by row: the first rule whose guard holds decides the pass."""


def decide(
    job: job_state.JobState,
    pods: Sequence[pod_state.PodState],
    now: datetime.datetime,
    kueue: kueue_workload.Gate | None = None,
    nodes_gone: frozenset[str] = frozenset(),
    spares_holding: int = 0,
    node_labels: Mapping[str, Mapping[str, str]] | None = None,
    store_loss: pod_failure.Failure | None = None,
) -> job_actions.Decision:
    """The next actions for ``job`` given its pods (every pod labelled with the job) at ``now``.

    Every decision is idempotent: applying it twice, or crashing between its actions, leads to
    the same next decision.  A failure is counted exactly once: the restart increments
    ``restarts`` (the gang attempt, a label of every pod) before the old pods are deleted, which
    makes them stale.

    ``kueue`` (Kueue's answer) is given for a job Kueue queues: the gang exists only while Kueue
    admits it.  ``nodes_gone``: nodes of ``status.placement`` that no longer exist (a pod that
    vanished with its node, as PodGC force-deletes it, is a disruption).  ``spares_holding``: the
    job's spare pods that still hold resources (no pods of the gang; the quota waits for them).
    ``node_labels``: labels of the nodes the pods are on or planned on (Kueue TAS's assignment).
    ``store_loss``: the placed gang's store pod lost (``store_pod.loss``).
    """
    seen = situation.Situation(
        job,
        tuple(pods),
        now,
        kueue,
        nodes_gone,
        spares_holding,
        dict(node_labels or {}),
        store_loss,
    )
    owed: list[job_actions.Action] = []
    for row in RULES:
        if isinstance(row, situation.Note):
            owed += row.adds(seen)
        elif row.when(seen):
            decided = row.then(seen)
            if not row.owed:
                return decided
            return job_actions.Decision((*owed, *decided.actions), decided.requeue_after)
    raise AssertionError("the last rule of the table always decides")
