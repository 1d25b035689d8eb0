"""``spec.topology``: how the cluster's network is described by node labels (the NVLink domain
and the fabric levels)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshtrain.api.spec import base, kube_names


class FabricLevel(base.SpecModel):
    """One level of the network fabric, named by a node label."""

    label: str = Field(
        min_length=1,
        max_length=kube_names.QUALIFIED_NAME_MAX_LENGTH,
        pattern=kube_names.QUALIFIED_NAME,
        description="Node label whose value names the domain at this level, e.g. network.topology.nvidia.com/block.",
    )
    mode: Literal["required", "preferred"] = Field(
        "preferred",
        description="required: the whole job must fit in one domain of this level; preferred: minimise traffic across it.",
    )


class Topology(base.SpecModel):
    """How the cluster's network is described by node labels."""

    nvlink_domain_label: str | None = Field(
        None,
        max_length=kube_names.QUALIFIED_NAME_MAX_LENGTH,
        pattern=kube_names.QUALIFIED_NAME,
        description="Node label naming a multi-node NVLink domain (e.g. nvidia.com/gpu.clique); empty: the node itself.",
    )
    levels: list[FabricLevel] = Field(
        default_factory=list,
        max_length=8,
        description="Fabric levels from the top (block) down to the bottom (leaf/rack); empty detects the NVIDIA, GKE or AWS topology labels on the nodes.",
    )
