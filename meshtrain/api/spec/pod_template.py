"""``spec.podTemplateOverride``: a partial pod merged into every pod of the gang (Kubeflow Trainer
v2's ``podTemplateOverrides``, JobSet's pod template), and what it may not touch.

``spec`` is a partial core/v1 PodSpec kept as written (the CRD preserves it): the API server
judges the merged pod, :mod:`pod_template_shape` what the operator merges and reads.  Here are
its bounds and the fields the operator owns (the gang's gate, its DNS names, the rank
environment, the pin to the planned node, its own volumes), each refused with the field's path
and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pydantic import Field, field_validator

from meshtrain.api import limits
from meshtrain.api.spec import base, kube_names, object_storage, pod, pod_template_shape

PATH = "spec.podTemplateOverride"
TRAINER_CONTAINER = "trainer"
"""The name of the trainer container in every pod: an override container of this name merges into it."""
OPERATOR_VOLUMES = ("shm", "checkpoints", "spec", "tmp", object_storage.CA_VOLUME)
"""Volumes the operator mounts in the trainer container (shared memory, the checkpoint claim, the
job's spec, scratch space, the object store's CA)."""
OPERATOR_MOUNT_PATHS = (object_storage.CA_MOUNT_DIR,)
"""Fixed mount paths of the trainer container's volumes that a job could otherwise also choose."""

OWNED_POD_FIELDS: Mapping[str, str] = {
    "nodeName": "the operator pins each pod to its planned node by required node affinity; "
    "restrict the nodes with affinity.nodeAffinity",
    "schedulingGates": "the operator's gate holds the pods until the whole gang exists",
    "schedulingGroup": "the operator names the gang's PodGroup (spec.schedulingGroup)",
    "hostname": "the operator names each pod in the job's headless Service",
    "subdomain": "the operator names each pod in the job's headless Service",
    "restartPolicy": "the operator restarts the whole gang: set spec.runPolicy.backoffLimit",
    "terminationGracePeriodSeconds": "set spec.runPolicy.terminationGracePeriodSeconds",
    "activeDeadlineSeconds": "set spec.runPolicy.activeDeadlineSeconds",
    "nodeSelector": "set spec.resources.nodeSelector (placement reads it), or use affinity.nodeAffinity",
    "serviceAccountName": "set spec.pod.serviceAccountName",
    "serviceAccount": "set spec.pod.serviceAccountName",
    "priorityClassName": "set spec.pod.priorityClassName (Kueue and preemption read it)",
    "priority": "set spec.pod.priorityClassName (Kueue and preemption read it)",
    "imagePullSecrets": "set spec.pod.imagePullSecrets",
    "schedulerName": "the gang's gate and PodGroup are the default scheduler's",
}
"""Pod fields the operator sets, and where a job says what it wants instead."""

OWNED_TRAINER_FIELDS: Mapping[str, str] = {
    "image": "set spec.image",
    "imagePullPolicy": "set spec.imagePullPolicy",
    "command": "set spec.trainer.command (spec.trainer.type: custom)",
    "args": "set spec.trainer.args (spec.trainer.type: custom)",
    "workingDir": "set spec.trainer.workingDir",
    "terminationMessagePath": "rank 0 reports its final progress there",
    "terminationMessagePolicy": "rank 0 reports its final progress there",
    "restartPolicy": "the kubelet restarts the trainer in place by the operator's rules, else the "
    "operator restarts the whole gang: set spec.runPolicy.recovery and spec.runPolicy.backoffLimit",
    "restartPolicyRules": "the kubelet restarts the trainer in place by the operator's rules, else the "
    "operator restarts the whole gang: set spec.runPolicy.recovery and spec.runPolicy.backoffLimit",
}
"""Fields of the trainer container the operator sets, and where a job says what it wants instead."""

MERGED_LISTS = ("containers", "initContainers", "volumes")
"""Lists of named mappings: a container named like the trainer merges into it; every other
entry is appended (its name must not be one of the operator's)."""


class OverrideMetadata(base.SpecModel):
    """Labels and annotations added to every pod of the gang."""

    labels: dict[str, kube_names.LabelValue] = Field(
        default_factory=dict, max_length=limits.MAX_LIST_LENGTH, description="Extra pod labels."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        max_length=limits.MAX_LIST_LENGTH,
        description="Extra pod annotations, e.g. k8s.v1.cni.cncf.io/networks for Multus.",
    )


class PodTemplateOverride(base.SpecModel):
    """A partial pod merged into every pod of the gang."""

    metadata: OverrideMetadata = Field(
        default_factory=OverrideMetadata, description="Labels and annotations of every pod."
    )
    spec: dict[str, Any] = Field(
        default_factory=dict,
        max_length=limits.MAX_LIST_LENGTH,
        description="A partial core/v1 PodSpec merged into every pod: volumes, init containers "
        "and sidecars, containers (the one named trainer merges into the trainer container: env, "
        "envFrom and volumeMounts appended, resources and securityContext merged), affinity (a "
        "required nodeAffinity is ANDed with the operator's pin to the planned node), tolerations "
        "(appended), securityContext (merged), and any other pod field not owned by the operator. "
        "The API server validates the merged pod; see docs/operator.md.",
    )

    @field_validator("spec")
    @classmethod
    def _spec(cls, value: dict[str, Any]) -> dict[str, Any]:
        problems = list(_problems(value))
        if problems:
            raise ValueError("; ".join(problems))
        return value


def _size(value: Any) -> str | None:
    """Why ``value`` is too large or too deep, walked without recursion and never past the bounds."""
    budget, stack = limits.MAX_POD_OVERRIDE_BYTES, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limits.MAX_DOCUMENT_DEPTH:
            return f"{PATH}.spec nests deeper than {limits.MAX_DOCUMENT_DEPTH} levels"
        if isinstance(item, dict):
            budget -= 2 + sum(len(str(k)) + 4 for k in item)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            budget -= 2 + len(item)
            stack.extend((v, depth + 1) for v in item)
        else:
            budget -= len(str(item)) + 2
        if budget < 0:
            return (
                f"{PATH}.spec is larger than {limits.MAX_POD_OVERRIDE_BYTES} bytes: keep large "
                "files in a ConfigMap or volume and mount them"
            )
    return None


def _entries(spec: Mapping[str, Any], key: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(path, entry) of the list ``spec[key]`` (its shape checked by :func:`_problems` first)."""
    for i, entry in enumerate(spec.get(key) or []):
        yield f"{PATH}.spec.{key}[{i}]", entry


def _shape(spec: Mapping[str, Any]) -> str | None:
    """The merged lists' entries are named, within their bounds (their types checked before)."""
    for key in MERGED_LISTS:
        items = spec.get(key) or []
        unnamed = next((i for i, e in enumerate(items) if not isinstance(e.get("name"), str)), None)
        if unnamed is not None:
            return f"{PATH}.spec.{key}[{unnamed}] needs a name (a string)"
    containers = len(spec.get("containers") or []) + len(spec.get("initContainers") or [])
    if containers > limits.MAX_POD_OVERRIDE_CONTAINERS:
        return (
            f"{PATH}.spec has {containers} containers and initContainers; at most "
            f"{limits.MAX_POD_OVERRIDE_CONTAINERS}"
        )
    if len(spec.get("volumes") or []) > limits.MAX_POD_OVERRIDE_VOLUMES:
        return f"{PATH}.spec.volumes has more than {limits.MAX_POD_OVERRIDE_VOLUMES} entries"
    return None


def _owned(spec: Mapping[str, Any]) -> Iterator[str]:
    for key in spec:
        if key in OWNED_POD_FIELDS:
            yield f"{PATH}.spec.{key} is set by the operator: {OWNED_POD_FIELDS[key]}"
    for where, volume in _entries(spec, "volumes"):
        if volume["name"] in OPERATOR_VOLUMES:
            yield (
                f"{where}.name {volume['name']!r} is a volume of the operator "
                f"({', '.join(OPERATOR_VOLUMES)}): choose another name"
            )
    for where, container in _entries(spec, "initContainers"):
        yield from _env(where, container)
        if container["name"] == TRAINER_CONTAINER:
            yield f"{where}.name {TRAINER_CONTAINER!r} is the trainer container's: choose another name"
    for where, container in _entries(spec, "containers"):
        yield from _env(where, container)
        if container["name"] == TRAINER_CONTAINER:
            yield from _trainer_owned(where, container)
        elif "restartPolicy" in container:
            yield (
                f"{where}.restartPolicy is for init containers (sidecars): the operator "
                "restarts the whole gang; remove it"
            )


def _env(where: str, container: Mapping[str, Any]) -> Iterator[str]:
    """Any container's env: no GPU visibility of its own, no credential in a plain value."""
    for i, var in enumerate(container.get("env") or []):
        name = var.get("name")
        if not isinstance(name, str):
            continue
        if name in pod.GPU_ENV_NAMES:
            yield f"{where}.env[{i}] {name}: {pod.GPU_ENV_FIX}"
        elif var.get("value") is not None and re.search(pod.SECRET_ENV_NAME, name):
            yield (
                f"{where}.env[{i}] {name} looks like a credential but has a plain value, which "
                "anyone who can read the TrainingJob sees: put it in a Secret and use "
                "valueFrom.secretKeyRef"
            )


def _trainer_owned(where: str, container: Mapping[str, Any]) -> Iterator[str]:
    for key in container:
        if key in OWNED_TRAINER_FIELDS:
            yield f"{where}.{key} is set by the operator: {OWNED_TRAINER_FIELDS[key]}"
    for i, mount in enumerate(container.get("volumeMounts") or []):
        if mount.get("mountPath") in OPERATOR_MOUNT_PATHS:
            yield f"{where}.volumeMounts[{i}].mountPath {mount['mountPath']} is the operator's: choose another"
    env = container.get("env") or []
    if not isinstance(env, list):
        return
    for i, var in enumerate(env):
        name = var.get("name") if isinstance(var, dict) else None
        if isinstance(name, str) and pod.is_reserved_env(name):
            yield (
                f"{where}.env[{i}] {name} is set by the operator for torchrun and the trainer "
                f"({', '.join(p + '*' for p in pod.RESERVED_ENV_PREFIXES)}, "
                f"{', '.join(pod.RESERVED_ENV_NAMES)}): remove it; the layout comes from spec.parallelism"
            )


def _problems(spec: Mapping[str, Any]) -> Iterator[str]:
    """Every bound and owned field ``spec`` breaks (the first shape problem alone: the rest read it)."""
    broken = _size(spec) or pod_template_shape.problem(spec, f"{PATH}.spec") or _shape(spec)
    if broken:
        yield broken
        return
    yield from _owned(spec)


def gpu_problem(override: PodTemplateOverride, gpu_resource: str) -> str | None:
    """The gang's GPUs are ``resources.gpusPerNode`` on the trainer container: no container of an
    override names them (placement, capacity and Kueue count them per pod)."""
    for key in ("containers", "initContainers"):
        for where, container in _entries(override.spec, key):
            resources = container.get("resources")
            for kind in ("requests", "limits"):
                amounts = resources.get(kind) if isinstance(resources, dict) else None
                if isinstance(amounts, dict) and gpu_resource in amounts:
                    return (
                        f"{where}.resources.{kind}[{gpu_resource!r}] is set by the operator: the "
                        "gang's GPUs are spec.resources.gpusPerNode on the trainer container"
                    )
    return None


def storage_env_problem(
    override: PodTemplateOverride, pod_env: Sequence[str], storage_set: bool
) -> str | None:
    """With ``spec.objectStorage`` set, the operator gives the trainer the S3 client's variables:
    neither ``spec.pod.env`` (names ``pod_env``) nor the trainer container's env sets them."""
    if not storage_set:
        return None
    named = [(f"spec.pod.env[{i}]", name) for i, name in enumerate(pod_env)]
    for where, container in _entries(override.spec, "containers"):
        if container["name"] == TRAINER_CONTAINER:
            named += [
                (f"{where}.env[{i}]", v.get("name"))
                for i, v in enumerate(container.get("env") or [])
            ]
    for where, name in named:
        if name in object_storage.OPERATOR_ENV:
            return (
                f"{where} {name} is set by the operator from spec.objectStorage: set the store "
                "there (endpoint, region, credentialsSecret, caConfigMap) and remove it"
            )
    return None


def annotations_problem(
    override: PodTemplateOverride, pod_annotations: Mapping[str, str]
) -> str | None:
    """The pods' annotations (``spec.pod``'s and the override's) within their bound."""
    size = sum(
        len(k) + len(v)
        for annotations in (pod_annotations, override.metadata.annotations)
        for k, v in annotations.items()
    )
    if size > limits.MAX_POD_ANNOTATION_BYTES:
        return (
            f"spec.pod.annotations and {PATH}.metadata.annotations hold {size} bytes; at most "
            f"{limits.MAX_POD_ANNOTATION_BYTES}: keep large values in a ConfigMap"
        )
    return None


def placement_warning(override: PodTemplateOverride) -> str | None:
    """Why part of the override's placement does nothing (``meshtrain validate`` warns): each pod
    is pinned to the one node the operator planned, so preferences choose nothing."""
    spec = override.spec
    affinity = spec.get("affinity") or {}
    nodes = affinity.get("nodeAffinity") or {}
    spreads = spec.get("topologySpreadConstraints") or []
    if nodes.get("preferredDuringSchedulingIgnoredDuringExecution") or any(
        s.get("whenUnsatisfiable") == "ScheduleAnyway" for s in spreads
    ):
        return (
            f"{PATH}.spec: preferred node affinity and ScheduleAnyway spreads choose nothing (each "
            "pod is pinned to the node the operator planned): use required terms or "
            "spec.resources.nodeSelector"
        )
    return None


METADATA = "podTemplateOverride.metadata"
RULES: tuple[base.Rule[OverrideMetadata], ...] = (
    pod.labels_not_reserved(METADATA, "labels", "pod-template-labels-not-reserved"),
    pod.labels_not_reserved(METADATA, "annotations", "pod-template-annotations-not-reserved"),
    pod.keys_qualified(METADATA, "labels", "pod-template-labels-keys-qualified"),
    pod.keys_qualified(METADATA, "annotations", "pod-template-annotations-keys-qualified"),
)
"""Rules on the override's metadata (CEL in the CRD: ``kubectl apply`` refuses them)."""
