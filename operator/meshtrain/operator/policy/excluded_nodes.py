"""``status.excludedNodes``: the nodes a job is not placed on again for a while, and why.

Three policies write entries: a replaced straggler's node (``stragglers``, reason
``Straggler``), a node that disrupted the job twice (``disruption_budget``, ``Disrupted``), and
a node a pod left for a bad GPU (``bad_gpus``, ``BadGPU``).  Every placement of the job leaves
them out for :data:`EXCLUSION_SECONDS` (``gang_fit``).  Pure.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.operator.policy import conditions

KEPT_PER_REASON = 32
"""Entries of one reason kept (the newest): the status stays bounded."""
EXCLUSION_SECONDS = 24 * 3600
"""How long an excluded node stays out of the job's placements: a throttling or failing GPU
is usually repaired (or the node drained) within a day, and a long job must not lose nodes for good."""


def excluded(status: Mapping[str, Any], now: datetime.datetime) -> frozenset[str]:
    """Nodes this job is not placed on now: excluded less than :data:`EXCLUSION_SECONDS` ago.

    An entry without a readable ``time`` stays excluded.  Expired entries stay in
    ``status.excludedNodes`` as the record of the replacement.
    """
    return frozenset(returns_in(status, now))


def returns_in(status: Mapping[str, Any], now: datetime.datetime) -> dict[str, float]:
    """Seconds until each node excluded at ``now`` may take the job's pods again (``math.inf``:
    an entry without a readable ``time``, excluded for good)."""
    left: dict[str, float] = {}
    for entry in status.get("excludedNodes") or []:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("node"), str):
            continue
        since = conditions.parse_time(entry.get("time"))
        remaining = math.inf if since is None else EXCLUSION_SECONDS - (now - since).total_seconds()
        if remaining > 0:
            left[entry["node"]] = max(remaining, left.get(entry["node"], 0.0))
    return left


def of_reason(status: Mapping[str, Any], reason: str) -> dict[str, Any]:
    """``status`` with only the ``excludedNodes`` entries of ``reason``."""
    entries = [
        e
        for e in status.get("excludedNodes") or []
        if isinstance(e, Mapping) and e.get("reason") == reason
    ]
    return {**status, "excludedNodes": entries}


def excluded_after(
    status: Mapping[str, Any], added: Sequence[dict[str, Any]], reason: str
) -> list[Any]:
    """``status.excludedNodes`` with ``added`` (entries of ``reason``): other reasons' entries
    kept, of ``reason`` the newest :data:`KEPT_PER_REASON`."""
    previous = [e for e in status.get("excludedNodes") or [] if isinstance(e, Mapping)]
    ours = [i for i, e in enumerate(previous) if e.get("reason") == reason]
    dropped = set(ours[: max(len(ours) + len(added) - KEPT_PER_REASON, 0)])
    return [*(e for i, e in enumerate(previous) if i not in dropped), *added]
