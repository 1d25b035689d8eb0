"""When a job began to wait for GPUs: the order of the waiting jobs (after priority), and the
``status.queuedSince`` a placed gang keeps for its next wait.  Pure.

A job waits from the ``lastTransitionTime`` of its ``Placed=False`` condition, a status time, so
an operator restart or a leader failover keeps every wait.  A gang rebuilt for a cause that is
not its tenant's (a node or pod lost, a GPU taken for bad, a preemption) keeps its place through
``queuedSince``; its own failure, a spec change or a resume clears that (``failure``,
``spec_change``, ``suspend``).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from typing import Any

from meshtrain.operator.policy import conditions


def since_of(status: Mapping[str, Any], now: datetime.datetime) -> float:
    """When the job began to wait, in seconds since the epoch: the ``lastTransitionTime`` of its
    ``Placed=False`` condition (kept across reasons and operator restarts), or ``queuedSince``
    when earlier (a gang rebuilt for a cause not its own keeps its place, :func:`queued_since`),
    or of its ``Suspended=False`` when later (``Placed`` stays False while a job is suspended,
    and time suspended is not waiting), else ``now``."""
    found = status.get("conditions") or []
    began = _false_since(conditions.find(found, conditions.PLACED))
    if began is None:
        return now.timestamp()
    kept = epoch(status.get("queuedSince"))
    if kept is not None:
        began = min(began, kept)
    resumed = _false_since(conditions.find(found, conditions.SUSPENDED))
    if resumed is not None:
        began = max(began, resumed)
    return min(began, now.timestamp())


def queued_since(status: Mapping[str, Any], now: datetime.datetime) -> str:
    """``status.queuedSince`` of a gang placed now: the one it has (it was rebuilt for a cause
    not its own and kept its place), else when this wait began (:func:`since_of`)."""
    kept = status.get("queuedSince")
    if isinstance(kept, str) and epoch(kept) is not None:
        return kept
    began = datetime.datetime.fromtimestamp(math.floor(since_of(status, now)), datetime.UTC)
    return conditions.timestamp(began)


def epoch(value: Any) -> float | None:
    """An RFC 3339 time as seconds since the epoch; None when absent, unreadable or naive."""
    try:
        parsed = conditions.parse_time(value)
    except (TypeError, ValueError):
        return None
    if parsed is None or parsed.tzinfo is None:
        return None
    return parsed.timestamp()


def _false_since(condition: Mapping[str, Any] | None) -> float | None:
    """The ``lastTransitionTime`` of a condition whose status is False, as epoch seconds; None
    when it is not False or its time is missing or malformed (a hand-edited status)."""
    if not condition or condition.get("status") != conditions.FALSE:
        return None
    return epoch(condition.get("lastTransitionTime"))
