"""Topology-aware gang placement: which node hosts each pod of a TrainingJob.

Pure and deterministic: ``placement.plan(request, nodes, reservations)``
returns a :class:`Placement` (a node per pod index and the predicted bytes per
step crossing each fabric level) or an :class:`Unschedulable` with a reason
constant and a message.  No Kubernetes imports, no I/O: the operator turns
cluster objects into :class:`Node` and :class:`Reservation` values and the
answer into pods.  See docs/placement.md for the cost model and algorithm.

Modules: ``values`` (the data), ``manifests`` (Node manifests as values),
``topology`` (levels, label families, the domain tree), ``fabric_cost``
(traffic and bytes model), ``planner`` (``plan`` and the topology-blind
``first_fit`` reference).  The request of a TrainingJob spec, with its pod
traffic from the planner's communication model, is built a layer up by
:mod:`meshtrain.planner.placement_request`.
"""

from meshtrain.placement.algorithm import first_fit, plan
from meshtrain.placement.manifests import node_from_manifest, resource_count
from meshtrain.placement.values import (
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
