"""Volume topology: the nodes a job's claim lets its pods run on (kube-scheduler's VolumeBinding filter).

A pod whose claim is bound to a volume with ``spec.nodeAffinity`` (a local volume, a zonal
disk) and pinned to a node that affinity does not allow stays Pending (``volume node affinity
conflict``), so placement offers only the nodes :func:`topology` allows.  The caller
(``claims``) reads the manifests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from kubernetes.utils import quantity

from meshtrain.operator.policy import node_affinity

CONFLICT = "node(s) had volume node affinity conflict"
"""Refusal reason, worded as kube-scheduler's VolumeBinding filter words it."""
NO_PROVISIONER = "kubernetes.io/no-provisioner"
WAIT_FOR_FIRST_CONSUMER = "WaitForFirstConsumer"
SINGLE_NODE_MODES = frozenset({"ReadWriteOnce", "ReadWriteOncePod"})
"""Access modes that let one node (ReadWriteOnce) or one pod (ReadWriteOncePod) mount a volume."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where a job's claim lets its pods go."""

    claim: str
    """The claim's name (``checkpoint.claimName``)."""
    terms: tuple[Mapping[str, Any], ...]
    """Node selector terms (ORed); a node matching one of them is allowed."""
    why: str
    """Where the terms come from (for messages)."""

    def allows(self, node: Mapping[str, Any]) -> bool:
        return node_affinity.any_term_matches(self.terms, node)


def _allowed_topologies(storage_class: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    """A class's allowedTopologies as node selector terms."""
    return tuple(
        {
            "matchExpressions": [
                {"key": e.get("key"), "operator": "In", "values": list(e.get("values") or [])}
                for e in term.get("matchLabelExpressions") or []
            ]
        }
        for term in storage_class.get("allowedTopologies") or []
    )


def _required_terms(volume: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...] | None:
    """The volume's required node selector terms; None when it has no node affinity."""
    required = (((volume.get("spec") or {}).get("nodeAffinity") or {}).get("required")) or {}
    terms = required.get("nodeSelectorTerms")
    return tuple(terms) if terms else None


def _bytes(amount: Any) -> int:
    try:
        return int(quantity.parse_quantity(amount))
    except (ValueError, TypeError, ArithmeticError):
        return 0


def _could_take(volume: Mapping[str, Any], claim: Mapping[str, Any], class_name: str) -> bool:
    """An unclaimed volume of the claim's class, as large as it asks, with its access modes."""
    spec, claim_spec = volume.get("spec") or {}, claim.get("spec") or {}
    if (volume.get("status") or {}).get("phase") in ("Released", "Failed"):
        return False
    if spec.get("claimRef") or spec.get("storageClassName", "") != class_name:
        return False
    wanted = ((claim_spec.get("resources") or {}).get("requests") or {}).get("storage", "0")
    if _bytes((spec.get("capacity") or {}).get("storage", "0")) < _bytes(wanted):
        return False
    return set(claim_spec.get("accessModes") or ()) <= set(spec.get("accessModes") or ())


def topology(
    claim: Mapping[str, Any] | None,
    volume: Mapping[str, Any] | None,
    storage_class: Mapping[str, Any] | None,
    volumes: Iterable[Mapping[str, Any]] = (),
) -> Topology | None:
    """Where ``claim`` lets its pods go (None: anywhere, as far as placement is concerned).

    ``volume``: the volume it is bound to; ``storage_class``: its class;
    ``volumes``: the cluster's volumes (read only for an unbound local claim).

    * a bound claim (``spec.volumeName``): the volume's required node affinity (none: any node);
    * an unbound claim of a ``WaitForFirstConsumer`` class without a provisioner (local
      volumes): the nodes an unclaimed volume of the class that could take the claim (size,
      access modes) allows; the scheduler binds one of those for the node the pod goes to;
    * an unbound claim of a ``WaitForFirstConsumer`` class with a provisioner: the class's
      ``allowedTopologies`` (none: any node);
    * anything else (no claim of that name, an unbound ``Immediate`` claim): no restriction
      here; kube-scheduler refuses the pod as a whole and the job says so (``PodsScheduled=False``).
    """
    if claim is None:
        return None
    name = (claim.get("metadata") or {}).get("name", "")
    spec = claim.get("spec") or {}
    if spec.get("volumeName"):
        terms = _required_terms(volume or {}) if volume is not None else None
        why = f"the node affinity of volume {spec['volumeName']}"
        return Topology(name, terms, why) if terms is not None else None
    if storage_class is None or storage_class.get("volumeBindingMode") != WAIT_FOR_FIRST_CONSUMER:
        return None
    class_name = (storage_class.get("metadata") or {}).get("name", "")
    if storage_class.get("provisioner") == NO_PROVISIONER:
        local: list[Mapping[str, Any]] = []
        names = []
        for candidate in volumes:
            found = _required_terms(candidate)
            if found is not None and _could_take(candidate, claim, class_name):
                local.extend(found)
                names.append((candidate.get("metadata") or {}).get("name", ""))
        listed = ", ".join(sorted(names)) or "none"
        why = f"the node affinity of the free volume(s) of class {class_name} that could take it ({listed})"
        return Topology(name, tuple(local), why)
    allowed = _allowed_topologies(storage_class)
    if not allowed:
        return None
    return Topology(name, allowed, f"the allowedTopologies of class {class_name}")


def refusal(where: Topology | None, node: Mapping[str, Any]) -> str | None:
    """:data:`CONFLICT` when ``where`` does not allow ``node``."""
    return CONFLICT if where is not None and not where.allows(node) else None


def access_refusal(claim: Mapping[str, Any] | None, nodes: int, pods: int) -> str | None:
    """Why the gang's pods (``pods`` on ``nodes`` nodes) cannot all mount ``claim`` (None: they can).

    kube-scheduler binds them all the same; the kubelets then hold every pod but the first
    node's in ContainerCreating (Multi-Attach errors), and the gang never starts.
    """
    if claim is None:
        return None
    modes = list(
        (claim.get("status") or {}).get("accessModes")
        or (claim.get("spec") or {}).get("accessModes")
        or []
    )
    if not modes or not set(modes) <= SINGLE_NODE_MODES:
        return None
    one_pod = set(modes) == {"ReadWriteOncePod"}
    if (pods if one_pod else nodes) <= 1:
        return None
    name = (claim.get("metadata") or {}).get("name", "")
    spread = f"{pods} pods" if one_pod else f"{pods} pods on {nodes} nodes"
    return (
        f"checkpoint.claimName {name} has accessModes {', '.join(modes)}: the gang's {spread} "
        "cannot all mount it (the kubelets would hold them in ContainerCreating with Multi-Attach "
        "errors); use a ReadWriteMany claim, or a layout that fits on one node"
    )
