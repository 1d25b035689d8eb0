"""Topology-aware gang placement: which node hosts each pod of a TrainingJob.

Pure and deterministic: ``placement.plan(request, nodes, reservations)`` returns a
:class:`Placement` or an :class:`Unschedulable`; the operator turns cluster objects into
:class:`Node` and :class:`Reservation` values and the answer into pods.  docs/placement.md has the
cost model and the algorithm.  A spec becomes a request a layer up, in
:mod:`meshtrain.planner.placement_request`.
"""

from meshtrain.placement.algorithm import first_fit, plan
from meshtrain.placement.manifests import node_from_manifest, resource_count
from meshtrain.placement.values import (
    DEVICE_CLIQUE_LABEL,
    INSUFFICIENT_GPUS,
    TOPOLOGY_UNSATISFIABLE,
    FabricLevel,
    Node,
    Placement,
    PlacementRequest,
    Reservation,
    Unschedulable,
)

__all__ = [
    "DEVICE_CLIQUE_LABEL",
    "INSUFFICIENT_GPUS",
    "TOPOLOGY_UNSATISFIABLE",
    "FabricLevel",
    "Node",
    "Placement",
    "PlacementRequest",
    "Reservation",
    "Unschedulable",
    "first_fit",
    "node_from_manifest",
    "plan",
    "resource_count",
]
