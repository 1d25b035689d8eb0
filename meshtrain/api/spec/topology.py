"""``spec.topology``: how the cluster's network is described by node labels (the NVLink domain
and the fabric levels)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshtrain.api.spec import base, kube_names

MAX_WAIT_SECONDS = 3600
"""The longest a preferred level may hold a job for one domain (``waitSeconds``)."""


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
        description="required: the job (scope job) or each pipeline stage (scope stage) must fit in one domain of this level; preferred: minimise traffic across it.",
    )
    scope: Literal["job", "stage"] = Field(
        "job",
        description="What a required level keeps in one domain: job, the whole gang; stage, each pipeline "
        "stage's pods (every data, context and tensor rank of one stage), the job spanning domains.",
    )
    wait_seconds: int = Field(
        0,
        ge=0,
        le=MAX_WAIT_SECONDS,
        description="mode preferred only: for up to this many seconds after the job begins to wait for "
        "placement, place it only inside one domain of this level (as if required); then weigh the "
        "level per byte again and place it across domains if need be (Slurm's --switches=N@time). "
        "0: never wait. Not applied where no domain of this level holds the gang even when empty.",
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
        description="Fabric levels from the top (block) down to the bottom (leaf/rack); empty detects the NVIDIA, GKE or AWS topology labels on the nodes. "
        "The last may name nvlinkDomainLabel: what the NVLink domain itself requires (mode, scope).",
    )


def _stage_scope_required(topology: Topology) -> str | None:
    for index, level in enumerate(topology.levels):
        if level.scope == "stage" and level.mode != "required":
            return (
                f"spec.topology.levels[{index}] ({level.label}) has scope stage with mode preferred: a "
                "preference is weighed per byte whatever its scope, so scope applies to required levels "
                "only; write mode: required to keep each pipeline stage in one domain of it, or drop scope"
            )
    return None


def _wait_preferred_only(topology: Topology) -> str | None:
    for index, level in enumerate(topology.levels):
        if level.wait_seconds and level.mode != "preferred":
            return (
                f"spec.topology.levels[{index}] ({level.label}) sets waitSeconds with mode required: a "
                "required level waits for one domain as long as it takes; drop waitSeconds, or write "
                "mode: preferred to wait at most that long and then place across domains"
            )
    return None


def _nvlink_domain_level_last(topology: Topology) -> str | None:
    label = topology.nvlink_domain_label
    named = [i for i, level in enumerate(topology.levels) if level.label == label]
    if named and named != [len(topology.levels) - 1]:
        return (
            f"spec.topology.levels[{named[0]}] names the NVLink-domain label {label} (nvlinkDomainLabel), "
            "which lies below every fabric level: list it once, as the last level (it then says what "
            "the NVLink domain requires: mode required, for the job or with scope stage for each stage)"
        )
    return None


RULES: tuple[base.Rule[Topology], ...] = (
    base.Rule(
        "nvlink-domain-level-last",
        "spec.topology.levels",
        "!has(self.topology.nvlinkDomainLabel) || !has(self.topology.levels) "
        "|| !self.topology.levels.exists(l, l.label == self.topology.nvlinkDomainLabel) "
        "|| (self.topology.levels.exists_one(l, l.label == self.topology.nvlinkDomainLabel) "
        "&& self.topology.levels[size(self.topology.levels) - 1].label == self.topology.nvlinkDomainLabel)",
        "topology.levels may name topology.nvlinkDomainLabel once, as the last level (the NVLink domain "
        "lies below every fabric level)",
        _nvlink_domain_level_last,
    ),
    base.Rule(
        "stage-scope-required",
        "spec.topology.levels",
        "!has(self.topology.levels) || self.topology.levels.all(l, !has(l.scope) || l.scope != 'stage' "
        "|| (has(l.mode) && l.mode == 'required'))",
        "topology.levels[].scope stage needs mode required (a preferred level is weighed per byte whatever its scope)",
        _stage_scope_required,
    ),
    base.Rule(
        "wait-preferred-only",
        "spec.topology.levels",
        "!has(self.topology.levels) || self.topology.levels.all(l, !has(l.waitSeconds) "
        "|| l.waitSeconds == 0 || !has(l.mode) || l.mode == 'preferred')",
        "topology.levels[].waitSeconds applies to mode preferred only (a required level waits as long as it takes)",
        _wait_preferred_only,
    ),
)
"""Rules on the topology section alone."""
