"""Plain data of the placement: what the algorithm is given and what it returns.

Frozen values: cluster nodes, reservations, the request a TrainingJob becomes (built from the spec
by :mod:`meshtrain.planner.placement_request`), and the two answers, :class:`Placement` and
:class:`Unschedulable`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

from meshtrain.api import layout as layout_mod

INSUFFICIENT_GPUS = "InsufficientGPUs"
"""Reason: the eligible nodes do not have enough free GPUs for the whole gang."""

TOPOLOGY_UNSATISFIABLE = "TopologyUnsatisfiable"
"""Reason: enough GPUs exist, but not inside one domain of a ``required`` level (for the job, or
for each pipeline stage)."""

NVLINK = "nvlink"
"""Level key of traffic between pods of one NVLink domain (the same node or clique)."""

HOSTNAME_LABEL = "kubernetes.io/hostname"
"""Level key of traffic that leaves an NVLink domain when the domain is the node."""

DEVICE_CLIQUE_LABEL = "nvidia.com/gpu.clique"
"""The NVLink domain of a DRA job's nodes: the node label NVIDIA's GPU feature discovery writes,
or the ``cliqueId`` the node's devices report in a ResourceSlice (which wins; same form)."""


@dataclasses.dataclass(frozen=True)
class Node:
    """A cluster node as the planner sees it."""

    name: str
    """Node name (unique in the cluster)."""
    allocatable_gpus: int
    """GPUs the node offers (its allocatable GPU resource)."""
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Node labels: NVLink domain, fabric levels, anything a node selector names."""
    unschedulable: bool = False
    """True when the node is cordoned; it then hosts no new pod."""


@dataclasses.dataclass(frozen=True)
class Reservation:
    """GPUs of one node already promised to another job or used by a pod."""

    node: str
    """Name of the node the GPUs belong to."""
    gpus: int
    """Number of GPUs taken."""
    owner: str
    """Who holds them (``namespace/job`` or a pod name), for messages."""


@dataclasses.dataclass(frozen=True)
class FabricLevel:
    """One level of the network fabric, named by a node label."""

    label: str
    """Node label whose value names the domain at this level."""
    required: bool = False
    """True: the job (or each stage, see ``scope``) must fit in one domain of this level; False:
    only preferred."""
    scope: Literal["job", "stage"] = "job"
    """What a required level keeps in one domain: ``job``, the whole gang; ``stage``, each
    pipeline stage's run of pods (the gang may span domains)."""
    weight: float | None = None
    """Cost of one byte crossing this level; None takes the default (see ``topology.weights``)."""
    held: bool = False
    """Required only for now: a preferred level whose ``waitSeconds`` hold the job's first
    placement for one domain (what an unplaced gang's message says of it)."""

    @property
    def why_one_domain(self) -> str:
        """How an unplaced gang's message names this required level's rule."""
        return "held to one for now" if self.held else "required"


@dataclasses.dataclass(frozen=True)
class PlacementRequest:
    """What one gang needs: its pods, their layout and their traffic per step.

    The layout must fill whole pods and keep each tensor-parallel group in one.  A request
    built from a job (:func:`meshtrain.planner.placement_request.request_from_spec`) carries the
    spec's layout, which keeps that by the spec's rules; the request asks the layout again
    (:meth:`~meshtrain.api.layout.ParallelLayout.pod_problem`, the rules' own check) because
    benchmarks and tests build requests by hand.
    """

    gpus_per_node: int
    """GPUs per pod; a pod runs ranks ``[i*gpus_per_node, (i+1)*gpus_per_node)``."""
    layout: layout_mod.ParallelLayout
    """The job's degrees and rank arithmetic (``spec.parallelism.layout``)."""
    dp_bytes_per_step: float = 0.0
    """Bytes one rank sends to its data-parallel ring successor per optimizer step."""
    pp_bytes_per_step: float = 0.0
    """Bytes between a rank and its next-stage peer per step (activations and their gradients)."""
    cp_bytes_per_step: float = 0.0
    """Bytes one rank sends to its context-parallel ring successor per step (ring attention's K/V and dK/dV)."""
    nvlink_domain_label: str | None = None
    """Node label naming a multi-node NVLink domain; None: each node is its own domain."""
    levels: tuple[FabricLevel, ...] = ()
    """Fabric levels, top (block) first; empty: detect a known label family on the nodes."""
    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Labels a node must carry to host a pod of this job."""
    nvlink_domain_level: FabricLevel | None = None
    """What the NVLink domain itself requires (its label, required for the job or for each stage),
    below every fabric level; None: it is only preferred, as always."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        problem = self.layout.pod_problem(self.gpus_per_node)
        if problem is not None:
            raise ValueError(problem)
        if min(self.dp_bytes_per_step, self.pp_bytes_per_step, self.cp_bytes_per_step) < 0:
            raise ValueError("bytes per step must be >= 0")
        domain = self.nvlink_domain_level
        if domain is not None and domain.label != self.nvlink_domain_label:
            raise ValueError(
                f"nvlink_domain_level {domain.label!r} is not the NVLink-domain label "
                f"{self.nvlink_domain_label!r}"
            )
        every = (*self.levels, *((domain,) if domain is not None else ()))
        staged = [level.label for level in every if level.scope == "stage"]
        if any(level.scope == "stage" and not level.required for level in every):
            raise ValueError(f"levels {staged}: scope stage is for required levels only")
        if staged and not self.stage_pods:
            raise ValueError(
                f"levels {staged} keep each stage in one domain, but a stage's ranks do not fill "
                f"whole pods of {self.gpus_per_node} GPUs"
            )

    @property
    def world_size(self) -> int:
        """Ranks in the job: data x pipeline x context x tensor."""
        return self.layout.world_size

    @property
    def pods(self) -> int:
        """Pods in the gang, one per node slot of ``gpus_per_node`` GPUs."""
        return self.layout.pods(self.gpus_per_node)

    def constrained(self, levels: tuple[FabricLevel, ...]) -> tuple[FabricLevel, ...]:
        """``levels`` (the fabric levels planned with), then the NVLink domain's requirement if
        any: level ``i`` of the answer is the tree's depth ``i + 1`` (the NVLink domain lies
        below every fabric level)."""
        domain = self.nvlink_domain_level
        return levels if domain is None else (*levels, domain)

    @property
    def stage_pods(self) -> int:
        """Pods of one pipeline stage (pods ``[k*stage_pods, (k+1)*stage_pods)`` are stage k);
        0 when stages share pods."""
        grid = self.layout
        ranks = grid.data * grid.context * grid.tensor
        return ranks // self.gpus_per_node if ranks % self.gpus_per_node == 0 else 0


@dataclasses.dataclass(frozen=True)
class Placement:
    """A feasible placement of the whole gang and its predicted traffic."""

    nodes: tuple[str, ...]
    """Node of each pod: ``nodes[i]`` hosts pod ``i`` (node rank ``i``)."""
    level_bytes: Mapping[str, float]
    """Bytes per step between pods, by the highest level they cross (top first, then the
    NVLink-domain label, then ``"nvlink"`` for pods in one domain)."""
    cost: float
    """Weighted cost: sum over level keys of bytes x the level's weight."""
    levels: tuple[FabricLevel, ...]
    """Fabric levels the plan used (the request's, or the detected defaults)."""
    domains_used: Mapping[str, int]
    """How many distinct domains of each level key the gang spans."""


@dataclasses.dataclass(frozen=True)
class Unschedulable:
    """Why the gang cannot be placed now (nothing is placed)."""

    reason: str
    """A reason constant: ``INSUFFICIENT_GPUS`` or ``TOPOLOGY_UNSATISFIABLE``."""
    message: str
    """Human explanation with the numbers: needed, free, eligible."""
