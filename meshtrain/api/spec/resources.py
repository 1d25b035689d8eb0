"""``spec.resources``: what each pod (one per node slot) asks of its node, and the rules on the
section alone: quantities the API server would refuse in every pod, and the GPUs asked only
through ``gpusPerNode``."""

from __future__ import annotations

import decimal
import re
from typing import Annotated, Literal

from pydantic import Field
from pydantic.alias_generators import to_snake

from meshtrain.api import limits
from meshtrain.api.spec import base, kube_names


class Toleration(base.SpecModel):
    """A pod toleration, as in the core API."""

    key: str | None = Field(
        None,
        max_length=kube_names.QUALIFIED_NAME_MAX_LENGTH,
        description="Taint key the toleration applies to; empty matches all keys with operator Exists.",
    )
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Exists or Equal.")
    value: kube_names.LabelValue | None = Field(None, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty tolerates all effects."
    )
    toleration_seconds: int | None = Field(
        None,
        ge=0,
        le=limits.MAX_SECONDS,
        description="For NoExecute: how long the pod stays bound after the taint appears.",
    )


QUANTITY_MAX_LENGTH = 32
"""Longest quantity string (bounds the cost of the CEL isQuantity rules)."""


class Resources(base.SpecModel):
    """What each pod (one per node slot) asks of its node."""

    gpus_per_node: int = Field(
        8,
        ge=1,
        le=limits.MAX_GPUS_PER_NODE,
        description="GPUs per pod; one pod per node runs torchrun --nproc-per-node=gpusPerNode.",
    )
    gpu_resource_name: str = Field(
        "nvidia.com/gpu",
        min_length=1,
        max_length=kube_names.QUALIFIED_NAME_MAX_LENGTH,
        pattern=kube_names.QUALIFIED_NAME,
        description="Extended resource name of a GPU.",
    )
    node_selector: dict[str, kube_names.LabelValue] = Field(
        default_factory=dict,
        max_length=limits.MAX_LIST_LENGTH,
        description="Labels a node must carry to host this job's pods.",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=limits.MAX_LIST_LENGTH,
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


POSITIVE = r"^\+?[0-9]*\.?[0-9]*[1-9]"
"""A quantity above zero: no minus sign, and a non-zero digit before the suffix."""


def is_quantity(value: str) -> bool:
    """What CEL's ``isQuantity`` (``resource.ParseQuantity``) accepts."""
    return value != "" and QUANTITY.fullmatch(value) is not None


def is_positive_quantity(value: str) -> bool:
    """A quantity above zero (``-1Gi``, ``0`` and ``Gi`` are quantities, but not sizes)."""
    return is_quantity(value) and re.match(POSITIVE, value) is not None


SUFFIXES: dict[str, float] = {
    **{s: 1024**i for i, s in enumerate(("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: 1000**i for i, s in enumerate(("", "k", "M", "G", "T", "P", "E")) if s},
    "n": 1e-9,
    "u": 1e-6,
    "m": 1e-3,
}
"""A quantity suffix's multiplier (``e<exponent>`` is parsed apart)."""


def quantity_value(value: str) -> float:
    """A quantity as a number (``16Gi`` -> 17179869184.0); ValueError when it is none."""
    if not is_quantity(value):
        raise ValueError(f"not a Kubernetes quantity: {base.quoted(value)}")
    number = re.match(r"[+-]?\d*(\.\d*)?", value)
    assert number is not None  # the grammar starts with it
    digits, suffix = number.group(0), value[number.end() :]
    if not digits.strip("+-."):
        return 0.0
    if suffix[:1] in ("e", "E"):  # decimal arithmetic: an exponent past a float's range saturates
        exponent = max(-999, min(999, int(suffix[1:])))  # past a float's range either way
        return float(decimal.Decimal(digits) * decimal.Decimal(10) ** exponent)
    return float(digits) * SUFFIXES[suffix]


def _quantity_rule(field: str, optional: bool) -> base.Rule[Resources]:
    attribute = f"self.resources.{field}"
    cel = f"isQuantity({attribute}) && {attribute}.matches(r'{POSITIVE}')"
    path = f"spec.resources.{field}"
    message = (
        f"resources.{field} must be a Kubernetes quantity such as 16Gi, 500m or 2 "
        "(a number with an optional suffix Ki Mi Gi Ti Pi Ei, m k M G T P E, or e<exponent>) "
        "above zero"
    )

    def check(resources: Resources) -> str | None:
        value = getattr(resources, to_snake(field))
        if value is None or is_positive_quantity(value):
            return None
        return f"{message}; got {base.quoted(value)}"

    return base.Rule(
        f"{field}-is-quantity",
        path,
        f"!has({attribute}) || {cel}" if optional else cel,
        message,
        check,
    )


EXTRA_RESOURCES_MESSAGE = (
    "every resources.extraResources value must be a Kubernetes quantity such as 1 or 8, above zero"
)


def _extra_resources_are_quantities(resources: Resources) -> str | None:
    bad = {k: v for k, v in resources.extra_resources.items() if not is_positive_quantity(v)}
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


NODE_SELECTOR_MESSAGE = (
    "resources.nodeSelector keys must be Kubernetes qualified names, e.g. example.com/pool "
    "(an optional DNS prefix and '/', then at most 63 letters, digits, '-', '_' or '.')"
)


def _node_selector_keys_qualified(r: Resources) -> str | None:
    bad = [k for k in r.node_selector if not kube_names.is_qualified_name(k)]
    return f"{NODE_SELECTOR_MESSAGE}; got {base.quoted(bad[0])}" if bad else None


RULES: tuple[base.Rule[Resources], ...] = (
    base.Rule(
        "node-selector-keys-qualified",
        "spec.resources.nodeSelector",
        kube_names.cel_all_keys_qualified("self.resources.nodeSelector"),
        NODE_SELECTOR_MESSAGE,
        _node_selector_keys_qualified,
    ),
    _quantity_rule("cpu", optional=True),
    _quantity_rule("memory", optional=True),
    _quantity_rule("shmSize", optional=False),
    base.Rule(
        "extra-resources-are-quantities",
        "spec.resources.extraResources",
        "self.resources.extraResources.all(k, isQuantity(self.resources.extraResources[k]) && "
        f"self.resources.extraResources[k].matches(r'{POSITIVE}'))",
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
