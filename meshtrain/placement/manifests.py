"""Kubernetes Node manifests (plain dicts) read as placement :class:`~values.Node` values.

Shared by the operator and ``meshtrain plan --from-cluster`` so both see the
same allocatable GPUs, labels and cordons.
"""

from __future__ import annotations

from typing import Any

from meshtrain.placement import values


def resource_count(value: Any) -> int:
    """An extended-resource quantity (a plain integer string such as ``"8"``)."""
    try:
        return int(str(value))
    except ValueError:
        return 0


def node_from_manifest(node: dict[str, Any], gpu_resource: str) -> values.Node:
    """A Node object as the planner sees it: allocatable GPUs, labels, cordon."""
    metadata = node.get("metadata") or {}
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    return values.Node(
        name=metadata.get("name", ""),
        allocatable_gpus=resource_count(allocatable.get(gpu_resource, 0)),
        labels=dict(metadata.get("labels") or {}),
        unschedulable=bool((node.get("spec") or {}).get("unschedulable")),
    )
