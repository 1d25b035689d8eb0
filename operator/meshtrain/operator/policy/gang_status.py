"""What the observed gang says about placement: Placed once every pod exists, FailedScheduling as it happens.

``Placed`` turns True only when every pod of the gang exists (a placement whose pods were
refused is not placed); a pod the scheduler reports Unschedulable shows in
``PodsScheduled=False/FailedScheduling`` with the scheduler's message as soon as its status
says so, not at ``startupTimeoutSeconds``; a container the kubelet cannot start (its image,
a Secret its environment names) shows in ``Running=False`` with the kubelet's reason and
message (``container_reasons``) the same way.  Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from typing import Any

from meshtrain.operator.policy import conditions, container_reasons, pod_state


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
    conds = _containers(conds, pods, now, events)
    return Observed(conditions=conds, events=tuple(events))


def _containers(
    conds: list[dict[str, Any]],
    pods: Sequence[pod_state.PodState],
    now: datetime.datetime,
    events: list[tuple[str, str, str]],
) -> list[dict[str, Any]]:
    """``Running=False`` with the kubelet's reason while a container of a live pod cannot start.

    An Event when the reason or message changes; once the kubelet no longer says it, the
    condition says the gang is starting again.
    """
    named = [
        (p.name, p.problem)
        for p in pods
        if p.problem is not None and not p.terminal and not p.deleting
    ]
    before = conditions.find(conds, conditions.RUNNING) or {}
    message = container_reasons.pending(named)
    if named and message is not None:
        reason = named[0][1].reason
        if (before.get("reason"), before.get("message")) != (reason, message):
            events.append(("Warning", reason, message))
        return conditions.set(conds, conditions.RUNNING, conditions.FALSE, reason, message, now)
    cleared = before.get("reason") in container_reasons.WAITING_REASONS
    if cleared and before.get("status") == conditions.FALSE and not pod_state.all_running(pods):
        message = f"the kubelet no longer reports {before.get('reason')}; the gang is starting"
        reason = conditions.CONTAINERS_STARTING
        return conditions.set(conds, conditions.RUNNING, conditions.FALSE, reason, message, now)
    return conds
