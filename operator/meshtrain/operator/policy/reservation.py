"""The node set reserved for the gang that waited longest, and who may use it.  Pure.

The holder (``capacity_queue.holder``) is planned by the placement algorithm on every node it
may use with the GPUs of meshtrain's own pods counted free (they finish; other tenants' pods do
not leave for us): the nodes of that plan are the reservation.  No other path that takes GPUs
(another job's plan, an elastic grow, a spare, a straggler's rebuild) may use them
(:func:`excluded`); a job that places without them still goes.  A replacement of a
running gang's lost pod takes a reserved node only when no other node can take it
(:func:`outside`): a running gang is never starved of its own pod.  The reservation is planned
again only when its holder changes, or when nodes or capacity changed and
:data:`REPLAN_AFTER_SECONDS` passed since its last plan (:func:`due`).

Backfill by declared time limits (the EASY rule of batch schedulers): when every meshtrain job
holding GPUs on the reserved nodes declares ``runPolicy.activeDeadlineSeconds``, the nodes are
clear for the holder, at the latest, by the last of their ends (:func:`end_bound`: start time,
deadline, the pods' grace to stop, :data:`ENFORCE_SLACK_SECONDS`; :func:`clear_by`).  While the
holder cannot start, a job whose own end bound comes no later may take the reserved nodes
(:func:`may_backfill`): it is gone by then, so it never delays the holder past the latest
declared end already on its nodes (it may delay it past their actual ends, which come earlier).
A job without a deadline never backfills, and one without a deadline on the reserved nodes turns
backfill off for that node set (its end is unknown).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Iterable, Mapping
from typing import Any

from meshtrain import placement
from meshtrain.api import spec as api_spec
from meshtrain.api.spec import run_policy
from meshtrain.operator.policy import conditions, kueue_workload, naming, queue_order

REPLAN_AFTER_SECONDS = 30.0
"""The reservation of one holder is planned again at most this often (a plan over every node)."""
DEFAULT_GRACE_SECONDS = run_policy.RunPolicy.model_fields[
    "termination_grace_period_seconds"
].default
"""The pods' grace to stop when the job leaves ``terminationGracePeriodSeconds`` unset."""
ENFORCE_SLACK_SECONDS = 30.0
"""Added to a job's end bound: the operator's pass that fails a job at its deadline may come this
much late (a queue of passes, an API server under load) before its pods are deleted."""
SETTLE_SECONDS = 60.0
"""After an operator (re)start, other jobs wait at most this long for the node set of a job that
may hold (by its condition) to be planned again."""
WAITING_REASONS = frozenset(
    {placement.INSUFFICIENT_GPUS, placement.TOPOLOGY_UNSATISFIABLE, conditions.RESERVED}
)
"""``Placed=False`` reasons of a job waiting for GPUs outside Kueue."""


@dataclasses.dataclass(frozen=True)
class Reservation:
    """The nodes kept for the holder."""

    holder: str
    """UID of the job they are kept for."""
    nodes: frozenset[str]
    """Its plan's nodes with meshtrain's own pods counted free (empty: it fits nowhere then)."""
    basis: tuple[int, int]
    """(node changes, capacity changes) as counted when it was planned."""
    at: float
    """Monotonic time it was planned."""
    clear: float | None = None
    """When its nodes were clear by the declared limits of the jobs on them, as counted when it
    was planned (epoch seconds; None: unknown, a job there declares no limit)."""


def due(
    current: Reservation | None,
    holder: str,
    basis: tuple[int, int],
    now: float,
    every: float = REPLAN_AFTER_SECONDS,
) -> bool:
    """Whether ``holder``'s reservation is to be planned (again) now: none yet or another
    holder's; or nodes or capacity changed since and ``every`` seconds have passed."""
    if current is None or current.holder != holder:
        return True
    return current.basis != basis and now - current.at >= every


def excluded(current: Reservation | None, uid: str, backfills: bool = False) -> frozenset[str]:
    """The nodes job ``uid`` may not take: the reservation's, unless it holds it or
    ``backfills`` (:func:`may_backfill`)."""
    if current is None or current.holder == uid or backfills:
        return frozenset()
    return current.nodes


def may_backfill(clear: float | None, ends: float | None) -> bool:
    """Whether a job whose pods are gone by ``ends`` (:func:`end_bound`) may take reserved nodes
    that are clear for their holder by ``clear`` (:func:`clear_by`): both are known and it ends
    no later."""
    return clear is not None and ends is not None and ends <= clear


def end_bound(
    deadline: int | None, grace: int | None, started: float | None, now: float
) -> float | None:
    """Seconds since the epoch by which a job's pods are gone: its ``activeDeadlineSeconds``
    counted from ``started`` (its ``startTime``; None: not started, so from ``now``), plus the
    pods' ``grace`` to stop (``terminationGracePeriodSeconds``) and
    :data:`ENFORCE_SLACK_SECONDS`.  None: no deadline, no bound."""
    if deadline is None:
        return None
    begins = now if started is None else started
    return begins + deadline + (grace or 0) + ENFORCE_SLACK_SECONDS


def clear_by(ends: Iterable[float | None], now: float) -> float | None:
    """When the reserved nodes are clear of the jobs on them, whose end bounds are ``ends``:
    the latest (``now`` when none); None when any is unknown."""
    latest = now
    for end in ends:
        if end is None:
            return None
        latest = max(latest, end)
    return latest


CLEARING_STEPS = (1.0, 1.25, 1.5, 2.0)
"""Pod slots, in multiples of the holder's pods, whose nodes' latest declared end bounds each
node set tried for it, earliest first (:func:`clearing_limits`); then every node."""


def clearing_limits(
    ends: Mapping[str, float], slots: Mapping[str, int], pods: int, kept: float | None = None
) -> list[float]:
    """The clear times to try the holder's node set under, earliest first, then ``inf`` (every
    node).  Walking the nodes that can take one of its pods (``slots``: pods of it each takes with
    meshtrain's pods gone) from the soonest declared end (``ends``; ``inf``: unknown), each limit
    is the end at which the slots passed reach ``pods`` times a step of :data:`CLEARING_STEPS`.
    Planning on the nodes clear by the first limit that fits picks a set that frees soonest by
    the declared limits, as EASY backfill's reservation does, rather than whichever the fabric
    cost prefers, which may wait for the longest limit there is.  ``kept``: the clear time of the
    set planned before for the same holder, as counted now; it is tried too, so that a plan
    again never keeps a set that clears later while that one still fits (EASY's reserved start
    moves later only when a job overruns)."""
    order = sorted((end, name) for name, end in ends.items() if end != math.inf and slots.get(name))
    limits, total, steps = set(), 0, iter(sorted(CLEARING_STEPS))
    want = next(steps, None)
    for end, name in order:
        total += slots[name]
        while want is not None and total >= math.ceil(pods * want):
            limits.add(end)
            want = next(steps, None)
    if kept is not None and kept != math.inf:
        limits.add(kept)
    return [*sorted(limits), math.inf]


def job_end(spec: api_spec.TrainingJobSpec, status: Mapping[str, Any], now: float) -> float | None:
    """:func:`end_bound` of a job by its spec and status (``now``: seconds since the epoch)."""
    policy = spec.run_policy
    ends = end_bound(
        policy.active_deadline_seconds,
        policy.termination_grace_period_seconds,
        queue_order.epoch(status.get("startTime")),
        now,
    )
    return _kept(ends, status, policy.termination_grace_period_seconds)


def _kept(ends: float | None, status: Mapping[str, Any], grace: int | None) -> float | None:
    """``ends``, or sooner the deadline the job backfilled with (``status.backfill``), which a
    later edit of its spec does not move."""
    record = status.get("backfill")
    kept = queue_order.epoch(record.get("deadlineAt")) if isinstance(record, dict) else None
    if kept is None:
        return ends
    bound = kept + (grace or 0) + ENFORCE_SLACK_SECONDS
    return bound if ends is None else min(ends, bound)


def pod_end(
    pod: Mapping[str, Any] | None, job: Mapping[str, Any] | None, now: float
) -> float | None:
    """When a meshtrain pod on a reserved node is gone (``pod`` None: assumed, not created yet):
    one being deleted by its ``deletionTimestamp`` (the API server sets it to the request's time
    plus the grace period) and :data:`ENFORCE_SLACK_SECONDS`; any other by its ``job``'s
    declared limit as the cache keeps it (``informer.trim_job``).  None: not bounded (no
    deadline, or the job is not in the cache)."""
    deleted = queue_order.epoch(((pod or {}).get("metadata") or {}).get("deletionTimestamp"))
    if deleted is not None:
        return deleted + ENFORCE_SLACK_SECONDS
    if job is None:
        return None
    policy = (job.get("spec") or {}).get("runPolicy") or {}
    deadline = _count(policy.get("activeDeadlineSeconds"))
    grace = _count(policy.get("terminationGracePeriodSeconds"))
    status = job.get("status") or {}
    grace = DEFAULT_GRACE_SECONDS if grace is None else grace
    return _kept(
        end_bound(deadline, grace, queue_order.epoch(status.get("startTime")), now), status, grace
    )


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def outside(free: Mapping[str, int], reserved: frozenset[str]) -> dict[str, int]:
    """``free`` (room per node) without the reserved nodes."""
    return {node: room for node, room in free.items() if node not in reserved}


def is_ours(pod: Mapping[str, Any]) -> bool:
    """Whether meshtrain placed ``pod`` (any job's): its GPUs count free for the holder's plan.

    The informer keeps labels only on the pods a TrainingJob controls (``informer.trim_pod``),
    so a tenant's pod labelled as meshtrain's is not counted free."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(naming.LABEL_MANAGED_BY) == naming.MANAGED_BY)


def may_hold(job: Mapping[str, Any], now: datetime.datetime, after: float) -> bool:
    """Whether a TrainingJob, as its object shows, waits for GPUs outside Kueue and has waited
    ``after`` seconds: after a restart it may hold before this process planned it."""
    metadata = job.get("metadata") or {}
    if metadata.get("deletionTimestamp") or kueue_workload.queue_of(metadata.get("labels")):
        return False
    status = job.get("status") or {}
    placed = conditions.find(status.get("conditions") or [], conditions.PLACED) or {}
    if placed.get("status") != conditions.FALSE or placed.get("reason") not in WAITING_REASONS:
        return False
    since = queue_order.since_of(status, now, metadata.get("generation"))
    return now.timestamp() - since >= after


def message(pods: int, nodes: int, bounded: bool) -> str:
    """Why a job that the reserved nodes would have placed waits (stable per holder); whether
    every job on them declares a limit (``bounded``: a limit of this job's own could backfill)."""
    how = (
        "or on them now with a runPolicy.activeDeadlineSeconds that ends this job before the "
        "jobs on them end by their own limits (backfill)"
        if bounded
        else "(no backfill: a job on them declares no runPolicy.activeDeadlineSeconds)"
    )
    return (
        f"{nodes} node(s) are reserved for the job that has waited longest at the highest "
        f"priority ({pods} pod(s)); no placement without them fits now: placed once it starts "
        f"or room outside them frees, {how}"
    )


def backfilled(nodes: int, holder: str, ends: float | None, clear: float | None) -> str:
    """The event of a job placed on reserved nodes (:func:`may_backfill`), ``holder`` being
    ``namespace/name`` of the job they are kept for."""
    return (
        f"placed on {nodes} node(s) reserved for {holder}, the job that has waited longest: its "
        f"runPolicy.activeDeadlineSeconds ends it by {_stamp(ends)} (grace and "
        f"{ENFORCE_SLACK_SECONDS:.0f} s included), and the jobs on those nodes end by "
        f"{_stamp(clear)} by their own limits"
    )


def _stamp(epoch: float | None) -> str:
    """``epoch`` to the second above it (every time said is a latest time: never rounded early)."""
    if epoch is None:
        return "an unknown time"
    later = datetime.datetime.fromtimestamp(math.ceil(epoch), datetime.UTC)
    return later.strftime("%Y-%m-%dT%H:%M:%SZ")


SHOWN_NODES = 20
"""Nodes named in the holder's event at most (the rest are counted)."""


def described(kept: Reservation) -> str:
    """The holder's event: which nodes are kept for it, and by when they are clear of the jobs on
    them by those jobs' declared limits (``kept.clear``; None: a job there declares no limit, so
    no time can be said).  The time follows :data:`CLEAR_BY`; benchmarks read it."""
    clear = kept.clear
    if not kept.nodes:
        return "no node set fits it even with meshtrain's pods gone: it holds no reservation"
    names = sorted(kept.nodes)
    shown = ", ".join(names[:SHOWN_NODES])
    more = f" and {len(names) - SHOWN_NODES} more" if len(names) > SHOWN_NODES else ""
    bound = (
        f"{CLEAR_BY} {_stamp(clear)} by the declared limits of the jobs on them"
        if clear is not None
        else "no time they clear by: a job on them declares no runPolicy.activeDeadlineSeconds"
    )
    return (
        f"{len(names)} node(s) kept for this job, the longest waiting at the highest priority; "
        f"{bound}; other jobs place beside them: {shown}{more}"
    )


CLEAR_BY = "they clear by"
"""The words before the bound's RFC 3339 time in the holder's event (:func:`described`)."""
