"""What the placement step does with a plan: the pure half of ``placing``.

:func:`choose` picks the size to place from ``gang_fit``'s plans at each size, and :func:`judge`
says what that plan comes to: the job fails because its memory plan fits no GPU
(:class:`WontFit`), waits with the reason and what was tried (:class:`Unplaced`), or is placed
(:class:`Placed`).  ``placing`` performs it.  Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from meshtrain import placement
from meshtrain.api import elastic
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import (
    conditions,
    feasibility,
    job_state,
    kueue_topology,
    memory_admission,
    placement_status,
    pod_state,
    resizing,
    volumes,
)
from meshtrain.planner import placement_request


@dataclasses.dataclass(frozen=True)
class Sized:
    """The placement answer at one size of the gang (``size`` None without runPolicy.elastic)."""

    size: elastic.Size | None
    spec: api_spec.TrainingJobSpec
    """The spec at that size."""
    verdict: memory_admission.Admitted | memory_admission.Refused | None
    """Memory admission at that size (None: not judged)."""
    answer: placement.Placement | placement.Unschedulable | None
    """None when the verdict refused the size."""
    refusals: list[str]
    """Why each node left out of the offer was (the scheduler's filter reasons)."""


def choose(tried: Iterable[Sized]) -> Sized:
    """The size to place, from the plans at each size the job may take, largest first.

    The first that fits; else the first a plan answered (why the gang is unschedulable); else
    the first (memory admission refused every size, so the refusal is the answer).  ``tried`` is
    read only up to the first that fits: smaller sizes are not planned.
    """
    first: Sized | None = None
    answered: Sized | None = None
    for sized in tried:
        if isinstance(sized.answer, placement.Placement):
            return sized
        first = first or sized
        if answered is None and sized.answer is not None:
            answered = sized
    assert first is not None, "a job may always take at least one size"
    return answered or first


@dataclasses.dataclass(frozen=True)
class Ask:
    """Everything planning a gang needs, as plain values: it is pickled to the planning worker."""

    declared: api_spec.TrainingJobSpec
    """The job's declared spec; its sizes come from ``runPolicy.elastic``."""
    cap: int | None
    """No size above this data-parallel degree (None: any size allowed)."""
    choice: memory_admission.Choice
    """The profile memory admission judges every size by (the same nodes are candidates at each)."""
    offered: tuple[placement.Node, ...]
    """Nodes with room, each offering at most :func:`most_pods` pods (a size takes no more than its own)."""
    held: frozenset[str] = frozenset()
    """Labels of preferred levels required of the whole gang for this plan (``topology_hold``)."""


def most_pods(declared: api_spec.TrainingJobSpec) -> int:
    """The most pods any size of the job has: the offer :class:`Ask` carries is capped at it."""
    bounds = declared.run_policy.elastic
    data = max(declared.parallelism.data, bounds.max_data if bounds is not None else 0)
    p = declared.parallelism
    per_replica = p.pipeline * p.context * p.tensor
    return -(-data * per_replica // declared.resources.gpus_per_node)


def plan_sizes(ask: Ask) -> Sized:
    """The plan at the size :func:`choose` picks among those runPolicy.elastic allows (none above
    ``ask.cap``), planned largest first until one fits.

    Work grows with the world size and the elastic range, so the operator runs this in its
    planning worker under a deadline, never on its event loop.  ``refusals`` is left empty: the
    nodes without room are the caller's, the same at every size.
    """
    return choose(
        _plan_at(ask, size, spec)
        for size, spec in resizing.no_larger_than(resizing.candidates(ask.declared), ask.cap)
    )


def _plan_at(ask: Ask, size: elastic.Size | None, spec: api_spec.TrainingJobSpec) -> Sized:
    """Memory admission at one size and, unless it refused, a plan on the offered nodes."""
    verdict = memory_admission.admit(spec, ask.choice)
    if isinstance(verdict, memory_admission.Refused):
        return Sized(size, spec, verdict, None, [])
    most = spec.pods * spec.resources.gpus_per_node  # what a node offers at this size, at most
    offered = [
        node if node.allocatable_gpus <= most else dataclasses.replace(node, allocatable_gpus=most)
        for node in ask.offered
    ]
    request = placement_request.request_from_spec(spec, ask.held)
    answer = placement.plan(request, offered, [])
    return Sized(size, spec, verdict, answer, [])


@dataclasses.dataclass(frozen=True)
class WontFit:
    """The memory plan fits no size the job may take: Failed, no pods."""

    status: dict[str, Any]
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Unplaced:
    """No pods now: the status that says why (Placed=False)."""

    status: dict[str, Any]
    reason: str
    message: str
    news: bool
    """Placed says something new: log it and emit a Warning."""


@dataclasses.dataclass(frozen=True)
class Resized:
    """A gang placed at another data-parallel degree than it ran: what to count and announce."""

    direction: str
    """``shrink`` or ``grow``."""
    type: str
    """Event type: Warning for a shrink, Normal for a grow."""
    reason: str
    message: str
    """The Event's message, both degrees named."""
    detail: str
    """``status.elastic.message``."""


@dataclasses.dataclass(frozen=True)
class Placed:
    """The gang fits: record the placement, then create its pods."""

    status: dict[str, Any]
    """Status fields written before any pod is created (placement, plan, elastic)."""
    spec: api_spec.TrainingJobSpec
    """The spec the pods run (the size placed)."""
    nodes: tuple[str, ...]
    """The node of each pod, by pod index."""
    resized: Resized | None
    message: str
    """The GangPlaced Event once the pods exist."""


def unplaced(
    job: job_state.JobState,
    reason: str,
    message: str,
    now: datetime.datetime,
    plan: Mapping[str, Any] | None = None,
) -> Unplaced:
    """The gang cannot be placed now for ``reason``: said once (``news`` while Placed says otherwise)."""
    before = conditions.find(job_state.conditions_of(job), conditions.PLACED) or {}
    status = placement_status.unschedulable(job, reason, message, now, plan)
    news = (before.get("reason"), before.get("message")) != (reason, message)
    return Unplaced(status, reason, message, news)


def planning_refused(job: job_state.JobState, seconds: float, now: datetime.datetime) -> WontFit:
    """Planning the gang outlasted the operator's deadline of ``seconds``: the job fails, naming the
    deadline and what to change (planning the same spec again would take as long)."""
    bounds = (job.declared or job.spec).run_policy.elastic if job.spec is not None else None
    narrower = (
        f"narrow runPolicy.elastic [minData={bounds.min_data}, maxData={bounds.max_data}] "
        "(every degree in it may be planned) or lower"
        if bounds is not None
        else "lower"
    )
    message = (
        f"planning the gang took more CPU time than the operator's planning deadline of {seconds:g} s "
        "(--planning-deadline-seconds, chart value operator.planningDeadlineSeconds) and was "
        f"stopped; {narrower} the parallelism degrees, or ask the cluster administrator to raise "
        "the deadline; then create the job again"
    )
    reason = conditions.PLANNING_DEADLINE_EXCEEDED
    return WontFit(placement_status.refused(job, reason, message, now), reason, message)


def old_gang_leaving(
    job: job_state.JobState,
    pods: Sequence[pod_state.PodState],
    now: datetime.datetime,
    stores: Sequence[str] = (),
) -> Unplaced:
    """The gang waits while ``pods`` of a dropped placement are still there: Placed=False, naming them
    (and ``stores``, its rendezvous store's pod still terminating: the new one takes its name).

    Pods of the attempt take the new pods' names; an earlier attempt's hold their GPUs until gone
    (planned beside them, the gang would be sized down for a moment's shortage; onto their GPUs,
    kube-scheduler would refuse it until they are gone).
    """
    names = ", ".join(
        f"{p.name} ({p.phase if p.terminal else 'terminating'}{f' on {p.node}' if p.bound else ''})"
        for p in sorted(pods, key=lambda p: p.name)
    )
    names = ", ".join([*([names] if names else []), *(f"{s} (terminating)" for s in stores)])
    message = f"waiting for pod(s) of the dropped placement to be gone: {names}"
    return unplaced(job, conditions.OLD_PODS_TERMINATING, message, now)


def _tried(
    job: job_state.JobState,
    sized: Sized,
    avoid: frozenset[str],
    claim: volumes.Topology | None,
) -> str:
    """What an unschedulable message adds: the sizes tried, the nodes left out, the claim's limit."""
    bounds = (job.declared or sized.spec).run_policy.elastic
    tried = (
        f"; no data-parallel degree from {bounds.max_data} down to {bounds.min_data} fits"
        if bounds is not None
        else ""
    )
    if avoid:
        tried += (
            f"; excluded for this job (stragglers, scheduler refusals): {', '.join(sorted(avoid))}"
        )
    if claim is not None and volumes.CONFLICT in sized.refusals:
        tried += f"; claim {claim.claim} allows only the nodes of {claim.why}"
    return tried


def _resized(
    previous: int | None, size: elastic.Size | None, fields: Mapping[str, Any]
) -> Resized | None:
    direction = resizing.change(previous, size)
    if direction is None or size is None:
        return None
    detail = fields["elastic"]["message"]
    shrink = direction == "shrink"
    return Resized(
        direction,
        "Warning" if shrink else "Normal",
        conditions.ELASTIC_SHRUNK if shrink else conditions.ELASTIC_GROWN,
        f"data-parallel degree {previous} -> {size.data}: {detail}",
        detail,
    )


def judge(
    job: job_state.JobState,
    sized: Sized,
    *,
    avoid: frozenset[str],
    claim: volumes.Topology | None,
    nodes_seen: int,
    now: datetime.datetime,
    hold_note: str = "",
) -> WontFit | Unplaced | Placed:
    """What the plan ``sized`` comes to for ``job`` (as read before the plan).

    ``avoid``: nodes left out for this job; ``claim``: where its claim lets pods go;
    ``nodes_seen``: how many nodes the plan considered; ``hold_note``: what an unplaced gang's
    message adds while preferred levels hold it (``topology_hold.Hold.note``).
    """
    assert job.spec is not None
    previous = job.spec.parallelism.data if job.status.get("elastic") else None
    job = dataclasses.replace(job, spec=sized.spec)
    verdict, answer = sized.verdict, sized.answer
    if isinstance(verdict, memory_admission.Refused):
        status = placement_status.wont_fit(job, verdict.message, now, verdict.summary)
        return WontFit(status, verdict.reason, verdict.message)
    plan = verdict.summary if verdict is not None else None
    assert answer is not None  # only a refused size has no answer
    if isinstance(answer, placement.Unschedulable):
        said = feasibility.summary(sized.refusals, nodes_seen)
        message = f"{answer.message}{hold_note}{_tried(job, sized, avoid, claim)}; {said}"
        return unplaced(job, answer.reason, message, now, plan)
    declared = job.declared or sized.spec
    fields = placement_status.placed(job, answer.nodes, answer.level_bytes, now, plan)
    fields |= resizing.placed_fields(declared, sized.size, {**job.status, **fields}, now)
    spec, nodes = sized.spec, tuple(answer.nodes)
    message = (
        f"{spec.pods} pod(s) of {spec.parallelism.layout_string} placed on "
        f"{len(set(nodes))} node(s)"
    )
    return Placed(fields, spec, nodes, _resized(previous, sized.size, fields), message)


def larger_size(sized: Sized, running: int) -> elastic.Size | None:
    """The larger size a grow check found room for (None: no larger size fits beside everyone else)."""
    size = sized.size
    if size is None or size.data <= running or not isinstance(sized.answer, placement.Placement):
        return None
    return size


def within_assignment(
    outcome: Placed | Unplaced,
    job: job_state.JobState,
    assignment: kueue_topology.Assignment,
    nodes: Iterable[placement.Node],
    now: datetime.datetime,
) -> Placed | Unplaced:
    """``outcome`` of a plan made inside Kueue TAS's ``assignment`` (``kueue_topology.restrict``).

    No plan inside the assigned domains, or one that does not fill them with exactly their
    counts (an elastic size below the admitted one, a required level split across domains),
    is Placed=False/``kueue_topology.CONFLICT``: the gang never runs outside what Kueue assigned.
    """
    declared = job.declared or job.spec
    assert declared is not None
    if isinstance(outcome, Unplaced):
        why = f"{outcome.reason}: {outcome.message}"
    else:
        labels = {node.name: node.labels for node in nodes}
        spares = max(0, assignment.total - declared.pods)
        found = kueue_topology.conflict(outcome.nodes, labels, assignment, spares)
        if found is None:
            return outcome
        why = found
    message = kueue_topology.conflict_message(why, assignment)
    return unplaced(job, kueue_topology.CONFLICT, message, now)
