"""The node set reserved for the gang that waited longest, and who may use it.  Pure.

The holder (``capacity_queue.holder``) is planned by the placement algorithm on every node it
may use with the GPUs of meshtrain's own pods counted free (they finish; other tenants' pods do
not leave for us): the nodes of that plan are the reservation.  No other path that takes GPUs
(another job's plan, an elastic grow, a spare, a straggler's rebuild) may use them
(:func:`excluded`); a job that places without them still goes (backfill).  A replacement of a
running gang's lost pod takes a reserved node only when no other node can take it
(:func:`outside`): a running gang is never starved of its own pod.  The reservation is planned
again only when its holder changes, or when nodes or capacity changed and
:data:`REPLAN_AFTER_SECONDS` passed since its last plan (:func:`due`).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

from meshtrain import placement
from meshtrain.operator.policy import conditions, kueue_workload, naming

REPLAN_AFTER_SECONDS = 30.0
"""The reservation of one holder is planned again at most this often (a plan over every node)."""
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


def excluded(current: Reservation | None, uid: str) -> frozenset[str]:
    """The nodes job ``uid`` may not take: the reservation's, unless it holds it."""
    if current is None or current.holder == uid:
        return frozenset()
    return current.nodes


def outside(free: Mapping[str, int], reserved: frozenset[str]) -> dict[str, int]:
    """``free`` (room per node) without the reserved nodes."""
    return {node: room for node, room in free.items() if node not in reserved}


def is_ours(pod: Mapping[str, Any]) -> bool:
    """Whether meshtrain placed ``pod`` (any job's): its GPUs count free for the holder's plan.

    The informer keeps labels only on the pods a TrainingJob controls (``informer.trim_pod``),
    so a tenant's pod labelled as meshtrain's is not counted free."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(naming.LABEL_MANAGED_BY) == naming.MANAGED_BY)


def since_of(status: Mapping[str, Any], now: datetime.datetime) -> float:
    """When the job began to wait, in seconds since the epoch: the ``lastTransitionTime`` of its
    ``Placed=False`` condition (kept across reasons and operator restarts), or of its
    ``Suspended=False`` when later (``Placed`` stays False while a job is suspended, and time
    suspended is not waiting), else ``now``."""
    found = status.get("conditions") or []
    began = _false_since(conditions.find(found, conditions.PLACED))
    if began is None:
        return now.timestamp()
    resumed = _false_since(conditions.find(found, conditions.SUSPENDED))
    if resumed is not None:
        began = max(began, resumed)
    return min(began, now.timestamp())


def _false_since(condition: Mapping[str, Any] | None) -> float | None:
    """The ``lastTransitionTime`` of a condition whose status is False, as epoch seconds; None
    when it is not False or its time is missing or malformed (a hand-edited status)."""
    if not condition or condition.get("status") != conditions.FALSE:
        return None
    try:
        began = conditions.parse_time(condition.get("lastTransitionTime"))
    except (TypeError, ValueError):
        return None
    if began is None or began.tzinfo is None:
        return None
    return began.timestamp()


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
    return now.timestamp() - since_of(status, now) >= after


def message(pods: int, nodes: int) -> str:
    """Why a job that the reserved nodes would have placed waits (stable per holder)."""
    return (
        f"{nodes} node(s) are reserved for the job that has waited longest at the highest "
        f"priority ({pods} pod(s)); no placement without them fits now: placed once it starts "
        "or room outside them frees"
    )


SHOWN_NODES = 20
"""Nodes named in the holder's event at most (the rest are counted)."""


def described(kept: Reservation) -> str:
    """The holder's event: which nodes are kept for it."""
    if not kept.nodes:
        return "no node set fits it even with meshtrain's pods gone: it holds no reservation"
    names = sorted(kept.nodes)
    shown = ", ".join(names[:SHOWN_NODES])
    more = f" and {len(names) - SHOWN_NODES} more" if len(names) > SHOWN_NODES else ""
    return (
        f"{len(names)} node(s) kept for this job, the longest waiting at the highest priority; "
        f"other jobs place beside them: {shown}{more}"
    )
