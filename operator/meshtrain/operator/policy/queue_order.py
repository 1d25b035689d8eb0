"""When a job began to wait for GPUs: the order of the waiting jobs (after priority), and the
``status.queuedSince`` a placed gang keeps for its next wait.  Pure.

A job waits from the ``lastTransitionTime`` of its ``Placed=False`` condition, a status time, so
an operator restart or a leader failover keeps every wait.  A gang rebuilt for a cause that is
not its tenant's (a node or pod lost, a GPU taken for bad, a preemption, a straggler's rebuild)
keeps its place through ``queuedSince`` while its spec generation is the one it was kept for
(``queuedGeneration``); its own failure, a spec change, a resume, an elastic grow and a Kueue
hold give it up (:data:`CLEARED`: ``failure``, ``spec_change``, ``suspend``, ``resizing``,
``kueue``).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from typing import Any

from meshtrain.operator.policy import conditions


def since_of(
    status: Mapping[str, Any], now: datetime.datetime, generation: int | None = None
) -> float:
    """When the job began to wait, in seconds since the epoch: the ``lastTransitionTime`` of its
    ``Placed=False`` condition (kept across reasons and operator restarts), or ``queuedSince``
    when earlier and kept for this ``generation`` of the spec (a gang rebuilt for a cause not its
    own keeps its place, :func:`kept`), or of its ``Suspended=False`` when later (``Placed``
    stays False while a job is suspended, and time suspended is not waiting), else ``now``."""
    found = status.get("conditions") or []
    began = _false_since(conditions.find(found, conditions.PLACED))
    if began is None:
        return now.timestamp()
    place = kept(status, generation)
    if place is not None:
        began = min(began, place)
    resumed = _false_since(conditions.find(found, conditions.SUSPENDED))
    if resumed is not None:
        began = max(began, resumed)
    return min(began, now.timestamp())


def kept(status: Mapping[str, Any], generation: int | None) -> float | None:
    """``status.queuedSince`` as epoch seconds, when it was kept for spec ``generation``
    (``queuedGeneration``): a spec edited while the gang waits (a new generation, larger perhaps)
    waits from its own start, not in the old spec's place.  None: none kept, or another
    generation's, or the generation unknown."""
    if generation is None or status.get("queuedGeneration") != generation:
        return None
    return epoch(status.get("queuedSince"))


def queued(status: Mapping[str, Any], now: datetime.datetime, generation: int) -> dict[str, Any]:
    """``queuedSince`` and ``queuedGeneration`` of spec ``generation``'s gang placed now: the
    place it kept (rebuilt for a cause not its own, the spec unchanged), else when this wait
    began (:func:`since_of`)."""
    began = math.floor(since_of(status, now, generation))
    stamp = conditions.timestamp(datetime.datetime.fromtimestamp(began, datetime.UTC))
    return {"queuedSince": stamp, "queuedGeneration": generation}


CLEARED = {"queuedSince": None, "queuedGeneration": None}
"""The status fields that give up a kept place: the job's own failure, a spec change, a resume,
an elastic grow, a Kueue hold."""


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
