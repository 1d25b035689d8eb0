"""Cluster objects -> the planner's values: the nodes a gang may use, and what pods already hold.

Reservations are derived from pods alone (their bound node, or the node their required affinity
pins them to), so they survive an operator restart: the GPUs planned for a gang are held by
its gated pods from the moment they are created.  Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from meshtrain import placement
from meshtrain.operator.policy import feasibility, identity, naming, volumes

NOTHING = feasibility.Usage()
"""Usage of a node no pod holds resources on."""


def pod_gpus(pod: dict[str, Any], gpu_resource: str) -> int:
    """GPUs a pod requests (limits count where requests are absent, as for extended resources)."""
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        amount = (resources.get("requests") or {}).get(
            gpu_resource, (resources.get("limits") or {}).get(gpu_resource, 0)
        )
        total += placement.resource_count(amount)
    return total


def holds_gpus(pod: dict[str, Any]) -> bool:
    """False for pods that finished: Succeeded and Failed pods free their GPUs."""
    return ((pod.get("status") or {}).get("phase")) not in ("Succeeded", "Failed")


def belongs_to(pod: dict[str, Any], namespace: str, job: str) -> bool:
    """True when the pod is a child of TrainingJob ``namespace/job``."""
    metadata = pod.get("metadata") or {}
    return (
        metadata.get("namespace") == namespace
        and (metadata.get("labels") or {}).get(naming.LABEL_JOB) == job
    )


def reservations(
    pods: Iterable[dict[str, Any]],
    gpu_resource: str,
    *,
    exclude: tuple[str, str] | None = None,
) -> list[placement.Reservation]:
    """GPUs held on each node by live pods, except those of job ``exclude`` = (namespace, name)."""
    result = []
    for pod in pods:
        if not holds_gpus(pod):
            continue
        if exclude is not None and belongs_to(pod, *exclude):
            continue
        gpus = pod_gpus(pod, gpu_resource)
        node = identity.planned_node(pod)
        if gpus <= 0 or not node:
            continue
        metadata = pod.get("metadata") or {}
        result.append(
            placement.Reservation(
                node=node, gpus=gpus, owner=f"{metadata.get('namespace')}/{metadata.get('name')}"
            )
        )
    return result


def free_gpus(
    nodes: Iterable[placement.Node], taken: Iterable[placement.Reservation]
) -> dict[str, int]:
    """Free GPUs per schedulable node."""
    free = {node.name: node.allocatable_gpus for node in nodes if not node.unschedulable}
    for reservation in taken:
        if reservation.node in free:
            free[reservation.node] -= reservation.gpus
    return free


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """True when ``obj`` carries an ownerReference to the object with ``uid``."""
    return any(
        ref.get("uid") == uid for ref in (obj.get("metadata") or {}).get("ownerReferences") or []
    )


def _replaceable(pod: dict[str, Any], attempt: int) -> bool:
    metadata = pod.get("metadata") or {}
    return naming.int_label(
        metadata.get("labels"), naming.LABEL_ATTEMPT
    ) == attempt and not metadata.get("deletionTimestamp")


def freed_by_replacing(pods: Iterable[dict[str, Any]], attempt: int) -> list[dict[str, Any]]:
    """The job's pods whose resources a new placement of it may count as free.

    Only pods of the current ``attempt`` not yet deleting: a terminating pod (an
    earlier attempt's, or one already deleted) holds its node's resources until it
    is gone, and kube-scheduler counts it until then.
    """
    return [p for p in pods if _replaceable(p, attempt)]


def still_leaving(pods: Iterable[dict[str, Any]], attempt: int) -> list[dict[str, Any]]:
    """The job's pods that still hold resources but are on their way out (see ``freed_by_replacing``)."""
    return [p for p in pods if feasibility.holds_resources(p) and not _replaceable(p, attempt)]


def offered_nodes(
    demand: feasibility.Demand,
    nodes: Iterable[dict[str, Any]],
    used: Mapping[str, feasibility.Usage],
    *,
    gpus_per_pod: int,
    pods_wanted: int,
    claim: volumes.Topology | None = None,
) -> tuple[list[placement.Node], list[str]]:
    """The nodes as the planner should see them, and why the others take no pod.

    A node offers ``slots x gpus_per_pod`` GPUs, where ``slots`` is how many
    pods of ``demand`` kube-scheduler would bind there together (every filter,
    every resource; :mod:`feasibility`; the nodes ``claim`` allows, :mod:`volumes`),
    so the planner needs no reservations.
    """
    offered, refused = [], []
    # Nodes mostly share their conditions, spec and allocatable (one object each in the
    # cache): each distinct one is judged once per call, not once per node.
    states: dict[tuple[int, int], tuple[Any, Any, str | None]] = {}
    amounts: dict[int, tuple[Any, dict[str, int]]] = {}
    for node in nodes:
        metadata = node.get("metadata") or {}
        status = node.get("status") or {}
        conditions, spec = status.get("conditions"), node.get("spec")
        state = states.get((id(conditions), id(spec)))
        if state is None or state[0] is not conditions or state[1] is not spec:
            state = (conditions, spec, feasibility.state_refusal(demand, node))
            states[(id(conditions), id(spec))] = state
        taken = used.get(metadata.get("name", ""), NOTHING)
        slots = 0
        refused_by = feasibility.with_selector(demand, node, state[2]) or volumes.refusal(
            claim, node
        )
        if refused_by is None:
            source = status.get("allocatable")
            parsed = amounts.get(id(source))
            if parsed is None or parsed[0] is not source:
                parsed = amounts[id(source)] = (source, feasibility.allocatable(node))
            slots = feasibility.room(demand, parsed[1], taken, pods_wanted)
        if slots == 0:
            refused.append(refused_by or feasibility.verdict(demand, node, taken) or "no room")
            continue
        offered.append(
            placement.Node(
                name=metadata.get("name", ""),
                allocatable_gpus=slots * gpus_per_pod,
                labels=metadata.get("labels") or {},  # read only: no copy per node and placement
            )
        )
    return offered, refused


def infeasible_nodes(
    demand: feasibility.Demand,
    planned: Mapping[str, int],
    nodes: Iterable[dict[str, Any]],
    used: Mapping[str, feasibility.Usage],
) -> dict[str, str]:
    """Planned nodes (name -> pods of the gang there) that can no longer take those pods, with why."""
    by_name = {(n.get("metadata") or {}).get("name"): n for n in nodes}
    problems = {}
    for name, count in planned.items():
        node = by_name.get(name)
        if node is None:
            problems[name] = "node deleted"
            continue
        reason = feasibility.refusal(demand, node) or feasibility.shortage(
            demand, node, used.get(name, NOTHING), count
        )
        if reason:
            problems[name] = reason
    return problems
