"""``spec.resources``: what each pod (one per node slot) asks of its node, and the rules on the
section alone: quantities the API server would refuse in every pod, and the GPUs asked only
through ``gpusPerNode`` (as an extended resource, or through DRA claims with ``dra``)."""

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

DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
"""The GPUs' extended resource name unless ``gpuResourceName`` says otherwise."""

DEVICE_ATTRIBUTE = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z_][A-Za-z0-9_]*$"
)
"""A fully qualified device attribute name (resource.k8s.io): a DNS domain, '/', a C identifier."""

DEVICE_ATTRIBUTE_MAX_LENGTH = 63 + 1 + 32
"""The domain (63), the slash and the identifier (32), as the API server bounds them."""


Selector = Annotated[
    str,
    Field(
        min_length=1,
        max_length=limits.MAX_DRA_SELECTOR_LENGTH,
        description="A CEL expression over one device (device.driver, device.attributes, device.capacity).",
    ),
]


class DeviceClaims(base.SpecModel):
    """GPUs through Dynamic Resource Allocation: each pod claims ``gpusPerNode`` devices of a
    DeviceClass from a ResourceClaimTemplate the operator creates and owns (``<job>-gpus``)."""

    device_class_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=kube_names.DNS_1123_SUBDOMAIN,
        description="DeviceClass the GPUs come from, e.g. gpu.nvidia.com (NVIDIA's DRA driver).",
    )
    selectors: list[Selector] = Field(
        default_factory=list,
        max_length=limits.MAX_DRA_SELECTORS,
        description="CEL expressions a device must all satisfy, e.g. "
        "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H200' or "
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0; the API "
        "server compiles them when the operator creates the claim template.",
    )
    match_attribute: str | None = Field(
        None,
        max_length=DEVICE_ATTRIBUTE_MAX_LENGTH,
        pattern=DEVICE_ATTRIBUTE,
        description="Fully qualified device attribute all GPUs of one pod share, e.g. "
        "resource.kubernetes.io/pcieRoot (one PCIe switch); only an attribute the cluster's DRA "
        "driver publishes (a device without it serves no pod); empty: no constraint.",
    )
    compute_domain: bool = Field(
        False,
        description="Also create a ComputeDomain (resource.nvidia.com, NVIDIA's DRA driver) for the "
        "job's pods, so that tensor-parallel groups may span the nodes of one multi-node NVLink "
        "domain (IMEX); each pod claims its channel.",
    )


class Resources(base.SpecModel):
    """What each pod (one per node slot) asks of its node."""

    gpus_per_node: int = Field(
        8,
        ge=1,
        le=limits.MAX_GPUS_PER_NODE,
        description="GPUs per pod; one pod per node runs torchrun --nproc-per-node=gpusPerNode.",
    )
    gpu_resource_name: str = Field(
        DEFAULT_GPU_RESOURCE,
        min_length=1,
        max_length=kube_names.QUALIFIED_NAME_MAX_LENGTH,
        pattern=kube_names.QUALIFIED_NAME,
        description="Extended resource name of a GPU (unused with dra).",
    )
    dra: DeviceClaims | None = Field(
        None,
        description="Ask the GPUs through Dynamic Resource Allocation claims instead of the "
        "extended resource gpuResourceName; empty: the extended resource.",
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


DRA_GPU_NAME_MESSAGE = (
    "resources.dra asks for the GPUs through DRA claims, and resources.gpuResourceName names them "
    f"as an extended resource: set one; with resources.dra leave gpuResourceName at {DEFAULT_GPU_RESOURCE} "
    "(unused) and choose the GPUs with resources.dra.deviceClassName and resources.dra.selectors"
)


def _dra_leaves_gpu_resource_name(r: Resources) -> str | None:
    if r.dra is not None and r.gpu_resource_name != DEFAULT_GPU_RESOURCE:
        return f"{DRA_GPU_NAME_MESSAGE}; got gpuResourceName={base.quoted(r.gpu_resource_name)}"
    return None


DRA_EXTRA_GPU_MESSAGE = (
    "resources.extraResources may not name an extended GPU resource (a name ending in /gpu) beside "
    "resources.dra: the pods would ask for GPUs twice; the GPUs per pod are resources.gpusPerNode "
    "devices of resources.dra.deviceClassName"
)


def _dra_extra_resources_leave_the_gpus(r: Resources) -> str | None:
    named = [k for k in r.extra_resources if k.endswith("/gpu")]
    if r.dra is not None and named:
        return f"{DRA_EXTRA_GPU_MESSAGE}; got extraResources[{base.quoted(named[0])}]"
    return None


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
    base.Rule(
        "dra-leaves-gpu-resource-name",
        "spec.resources.gpuResourceName",
        f"!has(self.resources.dra) || self.resources.gpuResourceName == '{DEFAULT_GPU_RESOURCE}'",
        DRA_GPU_NAME_MESSAGE,
        _dra_leaves_gpu_resource_name,
    ),
    base.Rule(
        "dra-extra-resources-leave-the-gpus",
        "spec.resources.extraResources",
        "!has(self.resources.dra) || !self.resources.extraResources.exists(k, k.endsWith('/gpu'))",
        DRA_EXTRA_GPU_MESSAGE,
        _dra_extra_resources_leave_the_gpus,
    ),
)
"""Quantities the pods carry (malformed, they would make the API server refuse every pod), the
GPU resource left to ``gpusPerNode``, and the GPUs asked one way only (extended resource or DRA)."""
