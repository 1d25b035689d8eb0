"""Kueue TAS rewrote the topologyAssignment of a placed gang: the gang follows it.

With ``TASFailedNodeReplacement`` (on by default in Kueue v0.17.0) Kueue rewrites an admitted
Workload's ``topologyAssignment`` in place when a node it names fails, and its TAS cache then
counts the pod set on the new domains.  A gang pod left on a node outside the current assignment
(or beyond its domain's count) would be counted by Kueue where it is not, and hold GPUs where
Kueue counts none.  Each pass, the pods of an existing gang are checked against the current
assignment (``kueue_topology.misplaced``); those outside it are replaced alone inside it
(``job_actions.ReplacePods``: the lost-pod tier's replacement, its nodes from what the rest of
the gang left of the assignment) where the trainer rejoins a running gang, pod 0 is not among
them and ``runPolicy.recovery.inPlaceLimit`` allows; else the gang is rebuilt (a disruption)
and placed again inside the new assignment.  Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from meshtrain.operator.policy import (
    failure,
    job_actions,
    job_state,
    kubelet_tier,
    kueue_topology,
    pod_failure,
    replacement,
    situation,
)

NodeLookup = Callable[[str], Mapping[str, Any] | None]
"""A node's manifest by name (None: unknown), e.g. from the operator's cache."""
REASSIGNED = "TopologyAssignmentChanged"
"""Reason of the rebuild (and of the replacement's cause) when Kueue moved the gang's domains."""


def misplaced(seen: situation.Situation) -> tuple[int, ...]:
    """Indices of the gang's pods outside Kueue's current assignment (() without one)."""
    assignment = seen.topology
    if assignment is None:
        return ()
    placed = replacement.entries(seen.job.status)
    nodes = {}
    for pod in seen.current:
        node = pod.node or str((placed.get(pod.index) or {}).get("node") or "")
        if node:
            nodes[pod.index] = node
    return kueue_topology.misplaced(nodes, seen.node_labels, assignment)


def node_labels(names: Iterable[str], node: NodeLookup) -> dict[str, dict[str, str]]:
    """The labels of the nodes ``names`` that ``node`` (name -> manifest or None) knows."""
    return {
        name: dict((manifest.get("metadata") or {}).get("labels") or {})
        for name in set(names)
        if (manifest := node(name)) is not None
    }


def recorded_outside(
    job: job_state.JobState,
    missing: Iterable[int],
    node: NodeLookup,
    assignment: kueue_topology.Assignment,
) -> dict[str, str]:
    """Crash recovery: the recorded nodes of the ``missing`` pods that Kueue's current
    ``assignment`` no longer holds (outside its domains, or beyond a domain's count beside the
    gang's other pods), each with why (``placement_status.recover_missing``'s ``blocked``);
    ``node``: name -> the node's manifest (None: unknown)."""
    recorded = {
        index: str(entry.get("node") or "")
        for index, entry in replacement.entries(job.status).items()
    }
    labels = node_labels(recorded.values(), node)
    out = set(kueue_topology.misplaced(recorded, labels, assignment)) & set(missing)
    why = f"outside Kueue's topologyAssignment ({assignment.describe()})"
    return {recorded[index]: why for index in out}


def _message(seen: situation.Situation, indices: tuple[int, ...]) -> str:
    assert seen.topology is not None
    pods = ", ".join(str(i) for i in indices)
    return (
        f"Kueue rewrote the gang's topologyAssignment ({seen.topology.describe()}): pod(s) "
        f"{pods} lie outside it"
    )


def _replace_alone(seen: situation.Situation, indices: tuple[int, ...]) -> bool:
    """Whether the pods ``indices`` can be replaced alone (the lost-pod tier's conditions)."""
    if not seen.gang_running or not replacement.rejoins(seen.spec):
        return False
    if any(kubelet_tier.hosts_store(seen.spec, i) for i in indices):
        return False
    survivors = [p for p in seen.current if p.index not in indices]
    if not all(p.rejoins and not p.terminal and not p.gated for p in survivors):
        return False
    restarts = replacement.attempt_restarts(seen.job.status, seen.attempt, seen.now)
    return restarts + len(indices) <= seen.spec.run_policy.recovery.in_place_limit


def _follow(seen: situation.Situation) -> job_actions.Decision:
    indices = seen.once(misplaced)
    message = _message(seen, indices)
    moved = pod_failure.Failure("gang", False, message, disruption=True, reason=REASSIGNED)
    rebuild = failure.restart_or_fail(seen, [moved])
    if not _replace_alone(seen, indices):
        return rebuild
    pods = [p for p in seen.current if p.index in indices]
    replace = job_actions.ReplacePods(
        attempt=seen.attempt,
        indices=indices,
        causes=tuple((p.index, p.name, f"{REASSIGNED}: node {p.node} left") for p in pods),
        avoid=tuple(sorted({p.node for p in pods if p.node})),
        doomed=tuple(p.name for p in pods if not p.deleting),
        flavors=seen.flavors,
        otherwise=rebuild.actions,
        topology=seen.topology,
    )
    return job_actions.Decision(
        (job_actions.Emit("Warning", REASSIGNED, message), replace), rebuild.requeue_after
    )


FOLLOWED = situation.GANG_EXISTS.rule(
    "Kueue TAS moved the gang's domains: the pods outside them replaced alone, or the gang rebuilt",
    lambda seen: bool(seen.once(misplaced)),
    _follow,
)
