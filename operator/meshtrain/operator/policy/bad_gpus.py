"""A pod that left a bad GPU: its node is excluded from the job at once, whatever follows.

A supervisor whose GPU failed twice within an hour, or is gone, exits ``DEVICE_SUSPECT`` (79,
``meshtrain.trainer.recovery.device_fault``; ``PodState.left_bad_gpu``).  The pod is lost by its
node: the pod tier replaces it alone elsewhere (``pod_loss``), or the gang is rebuilt
(``failure``), a disruption either way.  Both write the node into ``status.excludedNodes``
(:func:`newly_bad`, :func:`excluded_after`), so that no later placement of the job (a rebuild after the
replacement found no room, the next attempt, a resize) goes back to it before
``excluded_nodes.EXCLUSION_SECONDS`` have passed, and record a Warning Event on the node
(:func:`node_events`) for its administrator.  Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from meshtrain.operator.policy import (
    conditions,
    excluded_nodes,
    job_actions,
    pod_failure,
    pod_state,
)

REASON = conditions.BAD_GPU
"""``excludedNodes[].reason`` of a node a pod left for a bad GPU."""


def newly_bad(
    status: Mapping[str, Any], pods: Sequence[pod_state.PodState], now: datetime.datetime
) -> dict[str, dict[str, Any]]:
    """The ``excludedNodes`` entry of each node a pod of ``pods`` left a bad GPU on that is not
    excluded for it yet (so each is written, and told, once however many passes see the pod)."""
    # an exclusion of another reason may run out sooner: this one gets its own entry
    excluded = excluded_nodes.excluded(excluded_nodes.of_reason(status, REASON), now)
    added: dict[str, dict[str, Any]] = {}
    for pod in pods:
        if pod.left_bad_gpu and pod.node and pod.node not in excluded and pod.node not in added:
            added[pod.node] = {
                "node": pod.node,
                "reason": REASON,
                "message": f"pod {pod.name}: {pod_failure.bad_gpu_said(pod)}",
                "time": conditions.timestamp(now),
            }
    return added


def excluded_after(
    status: Mapping[str, Any], added: Mapping[str, dict[str, Any]]
) -> list[Any] | None:
    """``status.excludedNodes`` with the :func:`newly_bad` entries ``added``; None when none."""
    if not added:
        return None
    return excluded_nodes.excluded_after(status, list(added.values()), REASON)


def node_events(added: Mapping[str, dict[str, Any]]) -> tuple[job_actions.EmitOnNode, ...]:
    """A Warning Event on each node of the :func:`newly_bad` entries ``added``, with the
    supervisor's words (the rank and its GPU where it named them): where the administrator who
    drains the node or replaces the GPU looks."""
    return tuple(
        job_actions.EmitOnNode(
            node, job_actions.Emit("Warning", REASON, f"{entry['message']}; excluded from the job")
        )
        for node, entry in added.items()
    )


def told_first(
    decision: job_actions.Decision, events: tuple[job_actions.EmitOnNode, ...]
) -> job_actions.Decision:
    """``decision`` with ``events`` right after its first action (its status write): a later
    action's failure (a pod deletion) must not lose them, and a failed status write, which ends
    the pass, is not followed by them."""
    if not events:
        return decision
    first, *rest = decision.actions
    return dataclasses.replace(decision, actions=(first, *events, *rest))


def describe(pods: Sequence[pod_state.PodState], also: Iterable[str] = ()) -> str:
    """``; node(s) n1 excluded: a GPU there taken for bad`` for the pods that left a bad GPU and
    the nodes ``also`` excluded for one (two device errors of the job there: ``device_errors``)."""
    nodes = sorted({p.node for p in pods if p.left_bad_gpu and p.node} | set(also))
    if not nodes:
        return ""
    return f"; node(s) {', '.join(nodes)} excluded: a GPU there taken for bad"
