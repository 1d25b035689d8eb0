"""Status fields of a placement answer: placed, unschedulable, won't fit, a placement dropped, children refused, and crash recovery of a gated gang."""

from __future__ import annotations

import collections
import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.operator.policy import conditions, identity, job_state, queue_order


def _plan(plan: Mapping[str, Any] | None) -> dict[str, Any]:
    """``status.plan`` when the job was judged by a profile (nothing otherwise)."""
    return {"plan": dict(plan)} if plan else {}


def placed(
    job: job_state.JobState,
    nodes: Sequence[str],
    level_bytes: Mapping[str, float],
    now: datetime.datetime,
    plan: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Status fields once a gang of ``nodes`` (node per pod index) has been planned; ``plan`` -> status.plan."""
    assert job.spec is not None  # only a valid spec is placed
    message = f"creating {len(nodes)} pod(s) on {len(set(nodes))} node(s)"
    conds = conditions.set(
        job_state.conditions_of(job),
        conditions.PLACED,
        conditions.FALSE,
        conditions.CREATING_PODS,
        message,
        now,
    )
    fields: dict[str, Any] = {
        "phase": job_state.Phase.PLACING.value,
        "conditions": conds,
        "placement": [{"podIndex": i, "node": node} for i, node in enumerate(nodes)],
        "straggler": None,  # measured on the previous gang: the new one is judged afresh
        "crossLevelBytes": dict(level_bytes),
        "specHash": identity.spec_hash(job.spec),
        "observedGeneration": job.generation,
        **queue_order.queued(job.status, now, job.generation),
        **job_state.shape(job),
        **_plan(plan),
    }
    if not job.status.get("startTime"):
        fields["startTime"] = conditions.timestamp(now)
    return fields


def unschedulable(
    job: job_state.JobState,
    reason: str,
    message: str,
    now: datetime.datetime,
    plan: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Status fields when the gang cannot be placed now (no pods are created); ``plan`` -> status.plan."""
    phase = job.status.get("phase") or job_state.Phase.PENDING.value
    conds = conditions.set(
        job_state.conditions_of(job), conditions.PLACED, conditions.FALSE, reason, message, now
    )
    return {
        "phase": job_state.Phase.RESTARTING.value
        if phase == job_state.Phase.RESTARTING.value
        else job_state.Phase.PENDING.value,
        "conditions": conds,
        "observedGeneration": job.generation,
        **job_state.shape(job),
        **_plan(plan),
    }


def wont_fit(
    job: job_state.JobState,
    message: str,
    now: datetime.datetime,
    plan: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Status fields of a job refused by plan: Failed, with WontFit (and Failed, Placed) conditions; no pods.

    Final like any failure: the job's worst rank needs more memory than the
    GPU has, and only a spec change (a new job) can alter that.
    """
    reason = conditions.WONT_FIT
    conds = conditions.set(
        job_state.conditions_of(job), conditions.WONT_FIT, conditions.TRUE, reason, message, now
    )
    return refused(job, reason, message, now, plan, conds)


def refused(
    job: job_state.JobState,
    reason: str,
    message: str,
    now: datetime.datetime,
    plan: Mapping[str, Any] | None = None,
    conds: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Status fields of a job refused before it was placed: Failed, with Placed=False and Failed
    naming ``reason``; no pods.  ``conds``: the conditions to start from (the job's own by default)."""
    conds = job_state.conditions_of(job) if conds is None else conds
    conds = conditions.set(conds, conditions.PLACED, conditions.FALSE, reason, message, now)
    conds = conditions.set(conds, conditions.FAILED, conditions.TRUE, reason, message, now)
    return {
        "phase": job_state.Phase.FAILED.value,
        "conditions": conds,
        "completionTime": conditions.timestamp(now),
        "observedGeneration": job.generation,
        **job_state.shape(job),
        **_plan(plan),
    }


def dropped(
    job: job_state.JobState,
    now: datetime.datetime,
    message: str,
    reason: str = conditions.GANG_RESTARTING,
) -> dict[str, Any]:
    """Status fields that drop a recorded placement whose nodes are no longer free (re-plan, not a restart)."""
    conds = conditions.set(
        job_state.conditions_of(job), conditions.PLACED, conditions.FALSE, reason, message, now
    )
    return {
        "placement": [],
        "straggler": None,
        "conditions": conds,
        "observedGeneration": job.generation,
    }


def children_refused(
    job: job_state.JobState, reason: str, message: str, now: datetime.datetime
) -> dict[str, Any]:
    """Status fields when the API server refused the gang's children: no placement, Placed=False."""
    return {**unschedulable(job, reason, message, now), "placement": []}


@dataclasses.dataclass(frozen=True)
class Recreate:
    """Re-create the missing pods of a still-gated gang on their recorded nodes."""

    nodes: tuple[tuple[int, str], ...]
    """(pod index, recorded node) of each missing pod."""


@dataclasses.dataclass(frozen=True)
class Replan:
    """Delete the gang's pods and drop its placement: a recorded node can no longer take its pods."""

    status: dict[str, Any]


def _recorded(job: job_state.JobState) -> dict[int, str]:
    return {p["podIndex"]: p["node"] for p in job.status.get("placement") or []}


def missing_per_node(job: job_state.JobState, missing: Sequence[int]) -> collections.Counter[str]:
    """Recorded node -> how many ``missing`` pods it must take again ("" for an index without one)."""
    recorded = _recorded(job)
    return collections.Counter(recorded.get(i, "") for i in missing)


def recover_missing(
    job: job_state.JobState,
    missing: Sequence[int],
    blocked: Mapping[str, str],
    now: datetime.datetime,
) -> Recreate | Replan:
    """Crash recovery of a gated gang, given the recorded nodes that can no longer take their pods."""
    if not blocked:
        recorded = _recorded(job)
        return Recreate(tuple((i, recorded[i]) for i in missing))
    why = ", ".join(f"{node}: {reason}" for node, reason in sorted(blocked.items()))
    message = f"recorded nodes can no longer take the gang ({why}); planning it again"
    return Replan(dropped(job, now, message))
