"""A DRA job's claim objects, and what its pods add to claim through them (``resources.dra``).

The ResourceClaimTemplate ``<job>-gpus-<hash10>`` (resource.k8s.io/v1, named after its spec's
hash: one request ``gpus`` of exactly ``gpusPerNode`` devices of the job's DeviceClass and
selectors, a ``matchAttribute`` constraint when set), and with ``computeDomain`` NVIDIA's
ComputeDomain ``<job>`` (resource.nvidia.com; ``numNodes: 0``, so its spec never changes) whose
controller creates the channel template ``<job>-channel``.  Each pod claims ``gpus`` (and
``channel``) from them and asks no GPU extended resource.  Also: the API server's refusal of one
of these objects told in the spec's own words.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import naming

RESOURCE_API_VERSION = "resource.k8s.io/v1"
"""DRA's API (GA since Kubernetes 1.34)."""
CLAIM_TEMPLATE = "ResourceClaimTemplate"
COMPUTE_DOMAIN_API_VERSION = "resource.nvidia.com/v1beta1"
"""NVIDIA's DRA driver's ComputeDomain API."""
COMPUTE_DOMAIN = "ComputeDomain"
KINDS = (CLAIM_TEMPLATE, COMPUTE_DOMAIN)
"""The kinds this module builds (the order the operator creates them in)."""


def template_spec(spec: api_spec.TrainingJobSpec) -> dict[str, Any]:
    """The ResourceClaimTemplate's ``spec`` (a ResourceClaim's spec under ``spec.spec``)."""
    dra = spec.resources.dra
    assert dra is not None, "only a job with resources.dra claims devices"
    exactly: dict[str, Any] = {
        "deviceClassName": dra.device_class_name,
        "allocationMode": "ExactCount",
        "count": spec.resources.gpus_per_node,
    }
    if dra.selectors:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in dra.selectors]
    devices: dict[str, Any] = {"requests": [{"name": naming.GPU_CLAIM, "exactly": exactly}]}
    if dra.match_attribute:
        devices["constraints"] = [
            {"requests": [naming.GPU_CLAIM], "matchAttribute": dra.match_attribute}
        ]
    return {"spec": {"devices": devices}}


def compute_domain_spec(job: str) -> dict[str, Any]:
    """The ComputeDomain's ``spec``: ``numNodes: 0`` (NVIDIA's driver v25.8 and later start an
    IMEX daemon on each node where a pod's channel claim lands, without waiting for a count), so
    the spec, immutable, is the same whatever the gang's size: a resized gang keeps its domain and
    its channel template; and the channel template its controller creates for the pods to claim."""
    return {
        "numNodes": 0,
        "channel": {"resourceClaimTemplate": {"name": naming.channel_claim_template_name(job)}},
    }


def gpu_template_name(job: str, spec: api_spec.TrainingJobSpec) -> str:
    """The name of the job's GPU ResourceClaimTemplate for this spec (its spec's hash in it)."""
    return naming.gpu_claim_template_name(job, stamp(template_spec(spec)))


def objects(job: str, spec: api_spec.TrainingJobSpec) -> list[tuple[str, str, str, dict[str, Any]]]:
    """``(apiVersion, kind, name, spec)`` of each object the job's pods claim through; none
    without ``resources.dra``."""
    dra = spec.resources.dra
    if dra is None:
        return []
    found = [
        (
            RESOURCE_API_VERSION,
            CLAIM_TEMPLATE,
            gpu_template_name(job, spec),
            template_spec(spec),
        )
    ]
    if dra.compute_domain:
        found.append(
            (
                COMPUTE_DOMAIN_API_VERSION,
                COMPUTE_DOMAIN,
                naming.compute_domain_name(job),
                compute_domain_spec(job),
            )
        )
    return found


def stamp(object_spec: dict[str, Any]) -> str:
    """A short hash of an object's spec, its ``meshtrain.io/spec-hash`` label (and in the GPU
    template's name): both kinds' specs are immutable."""
    text = json.dumps(object_spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pod_claims(job: str, spec: api_spec.TrainingJobSpec) -> list[dict[str, Any]]:
    """The pod's ``spec.resourceClaims``: ``gpus`` from ``<job>-gpus-<hash10>``, ``channel``
    from ``<job>-channel`` with a ComputeDomain; none without ``resources.dra``."""
    dra = spec.resources.dra
    if dra is None:
        return []
    found = [{"name": naming.GPU_CLAIM, "resourceClaimTemplateName": gpu_template_name(job, spec)}]
    if dra.compute_domain:
        found.append(
            {
                "name": naming.CHANNEL_CLAIM,
                "resourceClaimTemplateName": naming.channel_claim_template_name(job),
            }
        )
    return found


def container_claims(job: str, spec: api_spec.TrainingJobSpec) -> list[dict[str, Any]]:
    """The trainer container's ``resources.claims``: every claim of the pod."""
    return [{"name": claim["name"]} for claim in pod_claims(job, spec)]


SPEC_PATHS = (
    (
        re.compile(
            r"spec\.spec\.devices\.requests\[0\]\.exactly\.selectors(\[\d+\])(\.cel\.expression)?"
        ),
        r"resources.dra.selectors\1",
    ),
    (
        re.compile(r"spec\.spec\.devices\.requests\[0\]\.exactly\.deviceClassName"),
        "resources.dra.deviceClassName",
    ),
    (
        re.compile(r"spec\.spec\.devices\.constraints\[0\]\.matchAttribute"),
        "resources.dra.matchAttribute",
    ),
    (re.compile(r"spec\.spec\.devices\.requests\[0\]\.exactly\.count"), "resources.gpusPerNode"),
)
"""Where the API server's message points in a claim template, and the spec field it came from."""

FIXES = {
    CLAIM_TEMPLATE: "fix resources.dra (resources.dra.selectors: each a CEL expression over one "
    "device that returns a bool, e.g. device.attributes['gpu.nvidia.com'].productName == "
    "'NVIDIA H200')",
    COMPUTE_DOMAIN: "fix resources.dra.computeDomain",
}
"""What to change when the API server refuses a kind as invalid."""

SERVER_MESSAGE_CHARS = 2_048
"""Characters of the API server's message a refusal quotes: it may quote every selector (32 of up
to 10,240 characters), and the condition and Event need only the first problems."""

NOT_SERVED = {
    CLAIM_TEMPLATE: "the cluster does not serve resource.k8s.io/v1 ResourceClaimTemplates "
    "(Dynamic Resource Allocation, Kubernetes 1.34 and later): drop resources.dra to ask for "
    "the extended resource, or run the job on a cluster with DRA",
    COMPUTE_DOMAIN: "the cluster does not serve ComputeDomains (computedomains.resource.nvidia.com, "
    "installed with NVIDIA's DRA driver): install the driver with its compute-domain support, "
    "or set resources.dra.computeDomain to false",
}
"""Why a create answered 404 (the API is not served), and what to do."""


def refusal(kind: str, status: int, server_message: str) -> str | None:
    """The API server's refusal of a claim object in the spec's words, naming the field to fix;
    None for another kind or status."""
    if kind not in KINDS:
        return None
    if status == 404:
        return (
            f"{NOT_SERVED[kind]} (the API server answered: {server_message[:SERVER_MESSAGE_CHARS]})"
        )
    if status != 422:
        return None
    said = server_message
    for pattern, field in SPEC_PATHS:
        said = pattern.sub(field, said)
    if len(said) > SERVER_MESSAGE_CHARS:
        said = f"{said[:SERVER_MESSAGE_CHARS]}... ({len(said)} characters)"
    return (
        f"the API server refused the job's {kind}, built from resources.dra: {said}; {FIXES[kind]}"
    )
