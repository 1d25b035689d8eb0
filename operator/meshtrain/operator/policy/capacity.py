"""Cluster objects -> the planner's values: the nodes a gang may use, and what pods already hold.

A node is used by what kube-scheduler counts there and by nothing a tenant can write: pods bound
to it, pods the scheduler holds it for (a nomination, which only it or a holder of
``pods/status`` writes), and this operator's own gated pods of live jobs (the GPUs planned for a
gang are held by its gated pods from the moment they are created, and survive an operator
restart).  A tenant can create a pod with any labels, owner reference and annotation, so an own
pod's node is read from its job's ``status.placement`` (written through the status subresource,
which tenants cannot write), never from the pod: a pod counts there only as the one pod the
operator creates for that entry.  A pod's annotation or node affinity reserves nothing.  Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from meshtrain import placement
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import devices, feasibility, naming, volumes

NOTHING = feasibility.Usage()
"""Usage of a node no pod holds resources on."""
DEFAULT_SCHEDULER = "default-scheduler"
"""The scheduler of the gang pods (the API server's default ``spec.schedulerName``)."""
FINISHED_PHASES = ("Succeeded", "Failed")
"""TrainingJob phases after which its pods hold nothing for it."""


def holds_gpus(pod: dict[str, Any]) -> bool:
    """False for pods that finished: Succeeded and Failed pods free their GPUs."""
    return ((pod.get("status") or {}).get("phase")) not in ("Succeeded", "Failed")


def live_uid(job: Mapping[str, Any]) -> str | None:
    """The UID of a TrainingJob whose gated pods hold their nodes: None once it is being deleted or finished."""
    metadata = job.get("metadata") or {}
    if metadata.get("deletionTimestamp"):
        return None
    if (job.get("status") or {}).get("phase") in FINISHED_PHASES:
        return None
    return metadata.get("uid") or None


@dataclasses.dataclass(frozen=True)
class Owner:
    """A live TrainingJob as its status says which gated pods hold which nodes."""

    uid: str
    """metadata.uid: the controller owner reference of its pods."""
    attempt: int
    """status.restarts: the gang attempt whose pods hold nodes (their ``meshtrain.io/attempt``)."""
    placement: Mapping[int, str]
    """status.placement: pod index -> the node the operator planned for it."""
    pods: Mapping[int, str] = dataclasses.field(default_factory=dict)
    """status.placement: pod index -> the replacement that holds it (absent: the gang's own pod)."""
    spares: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """status.spares: spare pod name -> the node it holds for the job."""


def live_owner(job: Mapping[str, Any]) -> Owner | None:
    """What a live TrainingJob's status holds for its gated pods; None once it is deleted or finished."""
    uid = live_uid(job)
    if uid is None:
        return None
    status = job.get("status") or {}
    restarts = status.get("restarts")
    planned: dict[int, str] = {}
    pods: dict[int, str] = {}
    for entry in status.get("placement") or []:
        if not isinstance(entry, dict):
            continue
        index, node, pod = entry.get("podIndex"), entry.get("node"), entry.get("pod")
        if type(index) is int and isinstance(node, str) and node:
            planned[index] = node
            if isinstance(pod, str) and pod:
                pods[index] = pod
    spares: dict[str, str] = {}
    for entry in status.get("spares") or []:
        pod, node = (entry.get("pod"), entry.get("node")) if isinstance(entry, dict) else ("", "")
        if isinstance(pod, str) and isinstance(node, str) and pod and node:
            spares[pod] = node
    attempt = restarts if type(restarts) is int else 0
    return Owner(uid=uid, attempt=attempt, placement=planned, pods=pods, spares=spares)


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The UID in ``obj``'s controller owner reference when that controller is a TrainingJob."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if (
            ref.get("controller") is True
            and ref.get("kind") == api_spec.KIND
            and str(ref.get("apiVersion") or "").startswith(f"{naming.GROUP}/")
        ):
            return str(ref.get("uid") or "") or None
    return None


def reserved_node(pod: Mapping[str, Any], owner: Owner) -> str | None:
    """The node ``owner``'s ``status.placement`` holds for ``pod``: None unless ``pod`` is the pod
    the operator creates for that entry (its controller, name, attempt and index: the gang's own
    name, or the replacement the entry names), or a spare pod ``status.spares`` names.

    Names are unique in a namespace, so one pod at most counts per placement entry, and only on
    the node the operator planned: a pod a tenant made reserves nothing the job does not hold.
    Gated or released makes no difference: a released pod holds its node until it binds there
    (else the next plan would count its GPUs free while the scheduler is still binding it, and
    two gangs would be placed on the same GPUs: test_competing_jobs_never_share_gpus).
    """
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    index = naming.int_label(labels, naming.LABEL_NODE_RANK)
    attempt = naming.int_label(labels, naming.LABEL_ATTEMPT)
    if attempt != owner.attempt or controller_uid(pod) != owner.uid:
        return None
    name = metadata.get("name")
    if index is None:  # a spare pod: the node status.spares holds for it
        return owner.spares.get(str(name)) if naming.LABEL_SPARE in labels else None
    own = owner.pods.get(index) or naming.pod_name(
        str(labels.get(naming.LABEL_JOB)), attempt, index
    )
    return owner.placement.get(index) if name == own else None


def counted_node(pod: Mapping[str, Any], owner: Owner | None) -> str | None:
    """The node whose resources ``pod`` takes, or None.

    ``owner`` is the live TrainingJob in the pod's namespace that its ``meshtrain.io/job`` label
    names (None: no such job).  A terminal pod takes nothing; a bound one its node; an unbound
    one the node ``owner``'s placement holds for it (:func:`reserved_node`); any other unbound
    pod only the node kube-scheduler nominated it for, as the scheduler holds it (its own pods
    only, whatever their gates).
    """
    if not feasibility.holds_resources(pod):
        return None
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    reserved = reserved_node(pod, owner) if owner is not None else None
    if reserved is not None:
        return reserved
    if (spec.get("schedulerName") or DEFAULT_SCHEDULER) != DEFAULT_SCHEDULER:
        return None
    return (pod.get("status") or {}).get("nominatedNodeName") or None


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
    ask: devices.Ask | None = None,
) -> tuple[list[placement.Node], list[str]]:
    """The nodes as the planner should see them, and why the others take no pod.

    A node offers ``slots x gpus_per_pod`` GPUs, where ``slots`` is how many
    pods of ``demand`` kube-scheduler would bind there together (every filter,
    every resource; :mod:`feasibility`; the nodes ``claim`` allows, :mod:`volumes`;
    the free devices ``ask`` judges, :mod:`devices`), so the planner needs no reservations.
    A node whose devices report one NVLink domain carries it as ``placement.DEVICE_CLIQUE_LABEL``.
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
        judged = devices.NodeDevices(None)
        if refused_by is None:
            source = status.get("allocatable")
            parsed = amounts.get(id(source))
            if parsed is None or parsed[0] is not source:
                parsed = amounts[id(source)] = (source, feasibility.allocatable(node))
            if ask is not None:
                judged = devices.judge(ask, metadata.get("name", ""), parsed[1], taken.requested)
            slots = feasibility.room(_served(demand, ask, judged), parsed[1], taken, pods_wanted)
            slots = slots if judged.slots is None else min(slots, judged.slots)
        if slots == 0:
            refused.append(
                refused_by
                or feasibility.verdict(_served(demand, ask, judged), node, taken)
                or judged.reason
                or "no room"
            )
            continue
        offered.append(
            placement.Node(
                name=metadata.get("name", ""),
                allocatable_gpus=slots * gpus_per_pod,
                labels=_with_domain(metadata.get("labels") or {}, judged.domain),
            )
        )
    return offered, refused


def _with_domain(labels: Mapping[str, str], domain: str | None) -> Mapping[str, str]:
    """The node's labels (read only: no copy per node and placement), the devices' NVLink domain
    in ``placement.DEVICE_CLIQUE_LABEL`` where they report one (the label stays the fallback)."""
    if domain is None or labels.get(placement.DEVICE_CLIQUE_LABEL) == domain:
        return labels
    return {**labels, placement.DEVICE_CLIQUE_LABEL: domain}


def _served(
    demand: feasibility.Demand, ask: devices.Ask | None, judged: devices.NodeDevices
) -> feasibility.Demand:
    """``demand`` as NodeResourcesFit checks it: less the extended resource that a DeviceClass
    serves from the node's slices (KEP-5004; DynamicResources checks those)."""
    if ask is None or not judged.serves_extended:
        return demand
    kept = {r: a for r, a in demand.requests.items() if r != ask.gpu_resource}
    return dataclasses.replace(demand, requests=kept)


def verdict(
    demand: feasibility.Demand,
    node: Mapping[str, Any],
    used: feasibility.Usage,
    ask: devices.Ask | None = None,
    count: int = 1,
) -> str | None:
    """Why ``count`` more pods of ``demand`` would not be bound to ``node`` now (None: they fit),
    their devices (``ask``) included."""
    name = (node.get("metadata") or {}).get("name", "")
    judged = devices.NodeDevices(None)
    if ask is not None:
        judged = devices.judge(ask, name, feasibility.allocatable(node), used.requested)
    served = _served(demand, ask, judged)
    reason = feasibility.refusal(served, node) or feasibility.shortage(served, node, used, count)
    if reason is None and judged.slots is not None and judged.slots < count:
        return judged.reason
    return reason


def infeasible_nodes(
    demand: feasibility.Demand,
    planned: Mapping[str, int],
    nodes: Iterable[dict[str, Any]],
    used: Mapping[str, feasibility.Usage],
    ask: devices.Ask | None = None,
) -> dict[str, str]:
    """Planned nodes (name -> pods of the gang there) that can no longer take those pods, with why."""
    by_name = {(n.get("metadata") or {}).get("name"): n for n in nodes}
    problems = {}
    for name, count in planned.items():
        node = by_name.get(name)
        if node is None:
            problems[name] = "node deleted"
            continue
        reason = verdict(demand, node, used.get(name, NOTHING), ask, count)
        if reason:
            problems[name] = reason
    return problems
