"""Does a pod fit a node: kube-scheduler's default filters, as pure functions over manifests.

A gang pod is pinned to one node by required node affinity, so a node the scheduler would
refuse leaves it Pending for good.  Placement therefore asks each node what the default filter
plugins ask (NodeUnschedulable, NodeAffinity with the job's own required terms, TaintToleration,
NodeResourcesFit; v1.36 semantics, ``pkg/scheduler/framework/plugins``).
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kubernetes.utils import quantity

from meshtrain.operator.policy import node_affinity

CPU, MEMORY, EPHEMERAL_STORAGE, PODS = "cpu", "memory", "ephemeral-storage", "pods"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
FILTERED_EFFECTS = ("NoSchedule", "NoExecute")
POD_LEVEL_RESOURCES = (CPU, MEMORY)
"""Resources a pod-level ``spec.resources`` may set (and hugepages-*)."""

# Reasons, worded like the scheduler's FailedScheduling message parts.
NOT_READY = "node(s) were not Ready"
UNSCHEDULABLE = "node(s) were unschedulable"
SELECTOR_MISMATCH = "node(s) didn't match Pod's node affinity/selector"
UNTOLERATED_TAINT = "node(s) had untolerated taint(s)"
TOO_MANY_PODS = "Too many pods"


def insufficient(resource: str) -> str:
    """Reason of a node without enough of ``resource`` left."""
    return f"Insufficient {resource}"


def _amount(resource: str, value: Any) -> int:
    """A quantity in the scheduler's integer units: millicores for cpu, else rounded up to a whole unit."""
    try:
        parsed = quantity.parse_quantity(value)
    except (ValueError, TypeError, decimal.InvalidOperation):
        return 0
    if resource == CPU:
        parsed *= 1000
    return int(math.ceil(parsed))


def _scheduled_resource(resource: str) -> bool:
    """Resources NodeResourcesFit compares: the native ones and scalar names (with a domain, or hugepages)."""
    return (
        resource in (CPU, MEMORY, EPHEMERAL_STORAGE)
        or "/" in resource
        or resource.startswith("hugepages-")
    )


def _container_requests(container: Mapping[str, Any]) -> Counter[str]:
    """A container's requests; a resource with only a limit requests the limit (API defaulting)."""
    resources = container.get("resources") or {}
    amounts = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return Counter(
        {name: _amount(name, value) for name, value in amounts.items() if _scheduled_resource(name)}
    )


def _maximum(into: Counter[str], other: Mapping[str, int]) -> None:
    for name, value in other.items():
        into[name] = max(into[name], value)


def pod_requests(pod: Mapping[str, Any]) -> dict[str, int]:
    """What the scheduler charges a node for ``pod`` (units of :func:`_amount`).

    The sidecar-aware formula of ``component-helpers/resource.PodRequests``: containers plus
    restartable init containers, at least each regular init container with the sidecars started
    before it, pod-level cpu/memory requests where set, plus ``overhead``.
    """
    spec = pod.get("spec") or {}
    total: Counter[str] = Counter()
    for container in spec.get("containers") or []:
        total.update(_container_requests(container))
    sidecars: Counter[str] = Counter()
    init_peak: Counter[str] = Counter()
    for container in spec.get("initContainers") or []:
        requests = _container_requests(container)
        if container.get("restartPolicy") == "Always":
            total.update(requests)
            sidecars.update(requests)
            _maximum(init_peak, sidecars)
        else:
            _maximum(init_peak, requests + sidecars)
    _maximum(total, init_peak)
    pod_level = (spec.get("resources") or {}).get("requests") or {}
    for name, value in pod_level.items():
        if name in POD_LEVEL_RESOURCES or name.startswith("hugepages-"):
            total[name] = _amount(name, value)
    for name, value in (spec.get("overhead") or {}).items():
        if _scheduled_resource(name):
            total[name] += _amount(name, value)
    return dict(total)


def holds_resources(pod: Mapping[str, Any]) -> bool:
    """False once the pod is Succeeded or Failed (the scheduler's informer drops terminal pods)."""
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


@dataclasses.dataclass(frozen=True)
class Demand:
    """What one pod of a job needs from a node."""

    requests: Mapping[str, int]
    """Requested amount per resource (see :func:`pod_requests`)."""
    tolerations: tuple[Mapping[str, Any], ...]
    """The pod's tolerations, as in its manifest."""
    node_selector: Mapping[str, str]
    """The pod's nodeSelector."""
    node_affinity: tuple[Mapping[str, Any], ...] = ()
    """The pod's required node selector terms (ORed) less the operator's pin to its planned node
    (:func:`node_affinity.unpinned`); empty: the pod asks for no node."""


def demand_of(pod: Mapping[str, Any]) -> Demand:
    """The demand of a pod manifest (the operator passes the pod it is about to create)."""
    spec = pod.get("spec") or {}
    return Demand(
        requests=pod_requests(pod),
        tolerations=tuple(spec.get("tolerations") or ()),
        node_selector=dict(spec.get("nodeSelector") or {}),
        node_affinity=node_affinity.unpinned(node_affinity.required_terms(pod)),
    )


@dataclasses.dataclass(frozen=True)
class Usage:
    """What the pods already on a node take."""

    requested: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Sum of their requests per resource."""
    pods: int = 0
    """How many there are (held against ``allocatable.pods``)."""


def usage(pods: Iterable[Mapping[str, Any]]) -> Usage:
    """The usage of these pods (terminal ones are skipped)."""
    requested: Counter[str] = Counter()
    count = 0
    for pod in pods:
        if holds_resources(pod):
            requested.update(pod_requests(pod))
            count += 1
    return Usage(requested=dict(requested), pods=count)


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """core/v1 Toleration.ToleratesTaint."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    if key and key != taint.get("key"):
        return False
    if toleration.get("operator") == "Exists":
        return True
    return (toleration.get("value") or "") == (taint.get("value") or "")


def untolerated_taint(
    tolerations: Sequence[Mapping[str, Any]], taints: Iterable[Mapping[str, Any]]
) -> Mapping[str, Any] | None:
    """The first NoSchedule/NoExecute taint no toleration matches, or None."""
    for taint in taints:
        if taint.get("effect") in FILTERED_EFFECTS and not any(
            tolerates(t, taint) for t in tolerations
        ):
            return taint
    return None


def ready(node: Mapping[str, Any]) -> bool:
    """The node's Ready condition is True.

    Stricter than kube-scheduler, which reads no conditions and waits for the node lifecycle
    controller's ``not-ready``/``unreachable`` taints: a gang must not be pinned to a node that
    cannot start it.
    """
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (node.get("status") or {}).get("conditions") or []
    )


def state_refusal(demand: Demand, node: Mapping[str, Any]) -> str | None:
    """:func:`refusal` but for the nodeSelector: what the node's conditions and spec alone decide."""
    spec = node.get("spec") or {}
    if not ready(node):
        return NOT_READY
    if spec.get("unschedulable") and not any(
        tolerates(t, {"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"})
        for t in demand.tolerations
    ):
        return UNSCHEDULABLE
    if untolerated_taint(demand.tolerations, spec.get("taints") or ()) is not None:
        return UNTOLERATED_TAINT
    return None


def with_selector(demand: Demand, node: Mapping[str, Any], state: str | None) -> str | None:
    """The :func:`refusal` of ``node`` given its :func:`state_refusal` ``state``."""
    if state in (NOT_READY, UNSCHEDULABLE):
        return state
    labels = (node.get("metadata") or {}).get("labels") or {}
    if any(labels.get(key) != value for key, value in demand.node_selector.items()):
        return SELECTOR_MISMATCH
    if demand.node_affinity and not node_affinity.any_term_matches(demand.node_affinity, node):
        return SELECTOR_MISMATCH
    return state


def refusal(demand: Demand, node: Mapping[str, Any]) -> str | None:
    """Why no pod of ``demand`` may go to ``node`` whatever runs there (None: the node is eligible)."""
    return with_selector(demand, node, state_refusal(demand, node))


def allocatable(node: Mapping[str, Any]) -> dict[str, int]:
    """``status.allocatable`` in the units of :func:`_amount`."""
    amounts = (node.get("status") or {}).get("allocatable") or {}
    return dict(_parsed(tuple((str(k), str(v)) for k, v in amounts.items())))


@functools.lru_cache(maxsize=4096)
def _parsed(amounts: tuple[tuple[str, str], ...]) -> tuple[tuple[str, int], ...]:
    """Parsing quantities is slow and most nodes of a cluster offer the same: parse each set once."""
    return tuple((name, _amount(name, value)) for name, value in amounts)


def shortage(demand: Demand, node: Mapping[str, Any], used: Usage, count: int = 1) -> str | None:
    """The first resource that ``count`` more pods of ``demand`` would overcommit, or None."""
    offered = allocatable(node)
    if used.pods + count > offered.get(PODS, 0):
        return TOO_MANY_PODS
    for resource, amount in sorted(demand.requests.items()):
        if amount > 0 and amount * count > offered.get(resource, 0) - used.requested.get(
            resource, 0
        ):
            return insufficient(resource)
    return None


def verdict(demand: Demand, node: Mapping[str, Any], used: Usage) -> str | None:
    """Why one more pod of ``demand`` would not be bound to ``node`` now (None: it fits)."""
    return refusal(demand, node) or shortage(demand, node, used)


def slots(demand: Demand, node: Mapping[str, Any], used: Usage, most: int) -> int:
    """How many pods of ``demand`` fit on ``node`` together (at most ``most``).

    The largest count :func:`shortage` accepts, computed per resource rather than
    by trying each count: a placement asks this of every node of the cluster.
    """
    if refusal(demand, node) is not None:
        return 0
    return room(demand, allocatable(node), used, most)


def room(demand: Demand, offered: Mapping[str, int], used: Usage, most: int) -> int:
    """:func:`slots` of an eligible node that offers ``offered`` (its :func:`allocatable`)."""
    fits = min(most, offered.get(PODS, 0) - used.pods)
    for resource, amount in demand.requests.items():
        if amount > 0:
            free = offered.get(resource, 0) - used.requested.get(resource, 0)
            fits = min(fits, free // amount)
    return max(fits, 0)


def summary(reasons: Iterable[str], nodes: int) -> str:
    """``0/N nodes are available: 3 node(s) had untolerated taint(s), 2 Insufficient memory.``"""
    counts = Counter(reasons)
    if not counts:
        return f"{nodes} node(s) considered"
    parts = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))
    return f"{nodes - sum(counts.values())}/{nodes} nodes are available: {parts}."
