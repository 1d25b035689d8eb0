"""From no placement to a released gang: when to place, re-create, lift the gates, place again, wait.

The gang attempt is ``status.restarts``, a label of every pod, so pods of an older attempt are
stale.  ``status.placement`` is written before the pods are created: pods missing from a
still-gated gang are re-created on the recorded nodes (crash recovery), while a pod missing
from a released gang is a failure.  Pure.
"""

from __future__ import annotations

from meshtrain.operator.policy import (
    job_actions,
    placement_outcome,
    pod_state,
    rescheduling,
    situation,
)


def _stale_pods_deleted(seen: situation.Situation) -> tuple[job_actions.Action, ...]:
    stale = tuple(p.name for p in seen.stale if not p.deleting)
    return (job_actions.DeletePods(stale),) if stale else ()


def _old_pods_leaving(seen: situation.Situation) -> job_actions.Decision:
    """Delete what is left of a dropped placement and say which pods the new gang waits for.

    Pods without a recorded placement: after a lost status write (rebuild cleanly), or a dropped
    placement whose pods still terminate (wait for them, woken by their deletion).  A terminal pod
    holds no GPUs, but the new pods take the same names: it is waited for too (the API server
    removes it at once unless a finalizer holds it).  An earlier attempt's pods still
    terminating are waited for when the gang is placed (``placing``), the same way.
    """
    doomed = pod_state.undeleted(seen.current)
    waiting = placement_outcome.old_gang_leaving(seen.job, seen.current, seen.now)
    wait = (job_actions.set_status(seen.job, **waiting.status),) if waiting.news else ()
    actions = (*([job_actions.DeletePods(doomed)] if doomed else []), *wait)
    return job_actions.Decision(actions, situation.LEAVING_RECHECK_SECONDS)


def _gang_events(seen: situation.Situation) -> tuple[job_actions.Action, ...]:
    return tuple(job_actions.Emit(*event) for event in seen.observed.events)


def _gates_lifted(seen: situation.Situation) -> tuple[job_actions.Action, ...]:
    """Placed=True first: lifting may find a planned node changed and unplace the gang."""
    if not seen.gated:
        return ()
    return (*seen.observation, job_actions.LiftGates(seen.gated))


def _replaced_after_refusals(seen: situation.Situation) -> job_actions.Decision:
    """PodsScheduled=False first: the reconciler may have to wait out a backoff."""
    refused = rescheduling.ReplaceRefused(seen.refusals.nodes)
    return job_actions.Decision((*seen.observation_unwritten, refused))


def _waiting(seen: situation.Situation) -> job_actions.Decision:
    """What the gang shows so far; look again when the startup timeout or a refusal is due."""
    left, recheck = seen.startup_left, seen.refusals.recheck_after
    if left is not None:
        recheck = left if recheck is None else min(left, recheck)
    return job_actions.Decision(seen.observation_unwritten, recheck)


STALE_PODS_DELETED = situation.MAY_RUN.note(
    "pods of an earlier attempt, or superseded by a replacement: deleted", _stale_pods_deleted
)
OLD_PODS_LEAVING = situation.UNPLACED.rule(
    "pods of the attempt still there: delete them, wait until gone",
    lambda seen: bool(seen.current),
    _old_pods_leaving,
)
PLACE = situation.UNPLACED.rule(
    "no pod of the attempt left: place the gang",
    lambda seen: not seen.current,
    lambda seen: job_actions.Decision(
        (job_actions.Place(seen.attempt, flavors=seen.flavors, topology=seen.topology),)
    ),
)
RECREATE_MISSING = situation.PLACED.rule(
    "pods missing from the still-gated gang, none failed: re-create them on their recorded nodes",
    lambda seen: bool(seen.missing) and not seen.failures,
    lambda seen: job_actions.Decision(
        (job_actions.Place(seen.attempt, seen.missing, seen.flavors),)
    ),
)
GANG_EVENTS = situation.GANG_EXISTS.note(
    "what the gang shows: FailedScheduling Events", _gang_events
)
GATES_LIFTED = situation.GANG_EXISTS.note(
    "some pods still gated: Placed=True, gates lifted", _gates_lifted
)
SCHEDULER_REFUSED = situation.GANG_EXISTS.rule(
    "kube-scheduler keeps refusing released pods on their planned nodes: place the gang again",
    lambda seen: bool(seen.refusals.nodes),
    _replaced_after_refusals,
)
WAITING = situation.Rule(
    "otherwise (the gang is starting): look again when a timeout is due",
    lambda seen: True,
    _waiting,
    section=situation.GANG_STARTING,
)
"""The last row, and the one whose guard always holds: only a starting gang gets this far."""
