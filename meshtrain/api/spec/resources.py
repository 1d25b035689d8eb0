"""``spec.resources``: what each pod (one per node slot) asks of its node, and the rules on the
section alone: quantities the API server would refuse in every pod, and the GPUs asked only
through ``gpusPerNode``."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field
from pydantic.alias_generators import to_snake

from meshtrain.api.spec import base


class Toleration(base.SpecModel):
    """A pod toleration, as in the core API."""

    key: str | None = Field(
        None,
        description="Taint key the toleration applies to; empty matches all keys with operator Exists.",
    )
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Exists or Equal.")
    value: str | None = Field(None, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty tolerates all effects."
    )
    toleration_seconds: int | None = Field(
        None,
        ge=0,
        description="For NoExecute: how long the pod stays bound after the taint appears.",
    )


QUANTITY_MAX_LENGTH = 32
"""Longest quantity string (bounds the cost of the CEL isQuantity rules)."""


class Resources(base.SpecModel):
    """What each pod (one per node slot) asks of its node."""

    gpus_per_node: int = Field(
        8,
        ge=1,
        description="GPUs per pod; one pod per node runs torchrun --nproc-per-node=gpusPerNode.",
    )
    gpu_resource_name: str = Field(
        "nvidia.com/gpu", min_length=1, description="Extended resource name of a GPU."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Labels a node must carry to host this job's pods."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        description="Tolerations added to every pod (e.g. for GPU node taints).",
    )
    extra_resources: dict[str, Annotated[str, Field(max_length=QUANTITY_MAX_LENGTH)]] = Field(
        default_factory=dict,
        max_length=16,
        description="More extended resources per pod, e.g. {rdma/ib: '1'} for InfiniBand devices.",
    )
    cpu: str | None = Field(
        None,
        max_length=QUANTITY_MAX_LENGTH,
        description="CPU request and limit per pod; empty leaves it unset.",
    )
    memory: str | None = Field(
        None,
        max_length=QUANTITY_MAX_LENGTH,
        description="Memory request and limit per pod; empty leaves it unset.",
    )
    shm_size: str = Field(
        "16Gi",
        max_length=QUANTITY_MAX_LENGTH,
        description="Size of the in-memory /dev/shm volume (NCCL and data loader workers need more than the default 64Mi).",
    )


QUANTITY = re.compile(r"[+-]?\d*(\.\d*)?(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?")
"""apimachinery's quantity grammar as its parser applies it: a sign, digits and a fraction (each
may be empty: "Gi" and "." parse as zero), then a binary-SI, decimal-SI or exponent suffix."""


def is_quantity(value: str) -> bool:
    """What CEL's ``isQuantity`` (``resource.ParseQuantity``) accepts."""
    return value != "" and QUANTITY.fullmatch(value) is not None


def _quantity_rule(field: str, optional: bool) -> base.Rule[Resources]:
    attribute = f"self.resources.{field}"
    cel = f"isQuantity({attribute})"
    path = f"spec.resources.{field}"
    message = (
        f"resources.{field} must be a Kubernetes quantity such as 16Gi, 500m or 2 "
        "(a number with an optional suffix Ki Mi Gi Ti Pi Ei, m k M G T P E, or e<exponent>)"
    )

    def check(resources: Resources) -> str | None:
        value = getattr(resources, to_snake(field))
        if value is None or is_quantity(value):
            return None
        return f"{message}; got {value!r}"

    return base.Rule(
        f"{field}-is-quantity",
        path,
        f"!has({attribute}) || {cel}" if optional else cel,
        message,
        check,
    )


EXTRA_RESOURCES_MESSAGE = (
    "every resources.extraResources value must be a Kubernetes quantity such as 1 or 8"
)


def _extra_resources_are_quantities(resources: Resources) -> str | None:
    bad = {k: v for k, v in resources.extra_resources.items() if not is_quantity(v)}
    if bad:
        return f"{EXTRA_RESOURCES_MESSAGE}; got {bad}"
    return None


EXTRA_GPU_MESSAGE = (
    "resources.extraResources may not name resources.gpuResourceName: set the GPUs per pod with "
    "resources.gpusPerNode (the parallel layout, placement and quota are sized from it)"
)


def _extra_resources_leave_the_gpu_to_gpus_per_node(r: Resources) -> str | None:
    if r.gpu_resource_name in r.extra_resources:
        return (
            f"{EXTRA_GPU_MESSAGE}; got extraResources[{r.gpu_resource_name!r}]="
            f"{r.extra_resources[r.gpu_resource_name]!r} beside gpusPerNode={r.gpus_per_node}"
        )
    return None


RULES: tuple[base.Rule[Resources], ...] = (
    _quantity_rule("cpu", optional=True),
    _quantity_rule("memory", optional=True),
    _quantity_rule("shmSize", optional=False),
    base.Rule(
        "extra-resources-are-quantities",
        "spec.resources.extraResources",
        "self.resources.extraResources.all(k, isQuantity(self.resources.extraResources[k]))",
        EXTRA_RESOURCES_MESSAGE,
        _extra_resources_are_quantities,
    ),
    base.Rule(
        "extra-resources-leave-the-gpu-to-gpus-per-node",
        "spec.resources.extraResources",
        "!(self.resources.gpuResourceName in self.resources.extraResources)",
        EXTRA_GPU_MESSAGE,
        _extra_resources_leave_the_gpu_to_gpus_per_node,
    ),
)
"""Quantities the pods carry (malformed, they would make the API server refuse every pod) and the
GPU resource left to ``gpusPerNode``."""
