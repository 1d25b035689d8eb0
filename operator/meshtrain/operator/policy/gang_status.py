"""What the observed gang says about placement: Placed once every pod exists, FailedScheduling as it happens.

``Placed`` turns True only when every pod of the gang exists (a placement whose pods were
refused is not placed); a pod the scheduler reports Unschedulable shows in
``PodsScheduled=False/FailedScheduling`` with the scheduler's message as soon as its status
says so, not at ``startupTimeoutSeconds``.  Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from typing import Any

from meshtrain.operator.policy import conditions, pod_state


@dataclasses.dataclass(frozen=True)
class Observed:
    """Conditions after looking at the gang, and Events worth recording (type, reason, message)."""

    conditions: list[dict[str, Any]]
    events: tuple[tuple[str, str, str], ...] = ()


def observe(
    current: Sequence[dict[str, Any]],
    pods: Sequence[pod_state.PodState],
    expected: int,
    now: datetime.datetime,
) -> Observed:
    """``current`` conditions updated from the gang's ``pods`` (``expected`` of them when complete)."""
    conds = list(current)
    events: list[tuple[str, str, str]] = []
    if len(pods) >= expected:
        nodes = len({p.node for p in pods if p.node})
        conds = conditions.set(
            conds,
            conditions.PLACED,
            conditions.TRUE,
            conditions.GANG_PLACED,
            f"{expected} pod(s) on {nodes} node(s)",
            now,
        )
    refused = [p for p in pods if p.unschedulable_message and not p.terminal]
    before = conditions.find(conds, conditions.PODS_SCHEDULED) or {}
    if refused:
        first = refused[0]
        message = (
            f"{len(refused)} pod(s) not scheduled; {first.name}: {first.unschedulable_message}"
        )
        conds = conditions.set(
            conds,
            conditions.PODS_SCHEDULED,
            conditions.FALSE,
            conditions.FAILED_SCHEDULING,
            message,
            now,
        )
        if before.get("message") != message:
            events.append(("Warning", conditions.FAILED_SCHEDULING, message))
    elif pods and len(pods) >= expected and all(p.bound for p in pods):
        conds = conditions.set(
            conds,
            conditions.PODS_SCHEDULED,
            conditions.TRUE,
            conditions.ALL_PODS_BOUND,
            f"all {len(pods)} pod(s) bound to their nodes",
            now,
        )
    return Observed(conditions=conds, events=tuple(events))
