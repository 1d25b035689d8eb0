"""The sandbox's GPU nodes: name, place in the fabric, GPU count, and the labels' names.

The kubelet nodes register with NVIDIA's topology labels and advertise the ``nvidia.com/gpu``
extended resource, as real GPU clusters' nodes do (:mod:`.nodeconfig`).
"""

from __future__ import annotations

import dataclasses

BLOCK_LABEL = "network.topology.nvidia.com/block"
"""Node label naming the fabric block (spine group) of a node."""
LEAF_LABEL = "network.topology.nvidia.com/leaf"
"""Node label naming the leaf switch of a node."""
GPU_RESOURCE = "nvidia.com/gpu"
"""Extended resource name of a GPU."""
SANDBOX_LABEL = "meshtrain.io/sandbox-node"
"""Marks the sandbox's node (value "true")."""


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """A sandbox node and its place in the fabric."""

    name: str
    """Node name, e.g. gpu-b0-l1-n0."""
    block: str
    """Value of the block label."""
    leaf: str
    """Value of the leaf label."""
    gpus: int
    """GPUs (capacity and allocatable of nvidia.com/gpu)."""
