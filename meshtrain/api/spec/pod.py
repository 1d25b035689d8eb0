"""``spec.pod``: settings of every pod of the gang beyond the training (environment, pull secrets,
ServiceAccount, priority, labels, annotations, RDMA), and the rules on the section alone:
what the operator sets itself, and credentials kept out of plain values."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field

from meshtrain.api.spec import base, kube_names


class KeyRef(base.SpecModel):
    """One key of a Secret or ConfigMap in the job's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Name of the Secret or ConfigMap.")
    key: str = Field(min_length=1, max_length=253, description="Key within it.")
    optional: bool | None = Field(None, description="Start the pod even if the key is missing.")


class FieldRef(base.SpecModel):
    """A field of the pod itself (Downward API)."""

    field_path: str = Field(
        min_length=1,
        max_length=253,
        description="e.g. metadata.name, status.hostIP, spec.nodeName.",
    )


class EnvSource(base.SpecModel):
    """Where an environment variable's value comes from; exactly one member is set."""

    secret_key_ref: KeyRef | None = Field(None, description="A key of a Secret.")
    config_map_key_ref: KeyRef | None = Field(None, description="A key of a ConfigMap.")
    field_ref: FieldRef | None = Field(None, description="A field of the pod.")


ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"


class EnvVar(base.SpecModel):
    """An environment variable of the trainer container, e.g. an NCCL_* setting."""

    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=ENV_NAME_PATTERN,
        description="Variable name: a C identifier (letters, digits, underscores; no leading digit).",
    )
    value: str | None = Field(
        None, max_length=4096, description="Literal value (never a secret: use valueFrom)."
    )
    value_from: EnvSource | None = Field(
        None, description="Value from a Secret, ConfigMap or pod field."
    )


class PodSettings(base.SpecModel):
    """Settings of every pod of the gang that clusters need beyond the training itself."""

    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=128,
        description="Extra environment variables of the trainer container (NCCL_*, proxies, "
        "experiment trackers).",
    )
    image_pull_secrets: list[
        Annotated[str, Field(min_length=1, max_length=253, description="A Secret's name.")]
    ] = Field(
        default_factory=list,
        max_length=16,
        description="Names of Secrets in the job's namespace used to pull the trainer image.",
    )
    service_account_name: str | None = Field(
        None,
        max_length=253,
        description="ServiceAccount the pods run as; its token is mounted only when this is set.",
    )
    priority_class_name: str | None = Field(
        None, max_length=253, description="PriorityClass of the pods (preemption order)."
    )
    labels: dict[str, kube_names.LabelValue] = Field(
        default_factory=dict,
        max_length=64,
        description="Extra pod labels.",
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description="Extra pod annotations, e.g. k8s.v1.cni.cncf.io/networks for Multus.",
    )
    rdma: bool = Field(
        False,
        description="Add the IPC_LOCK capability (RDMA memory registration for NCCL over InfiniBand/RoCE) "
        "and request one rdmaResource per pod. Beyond the restricted and baseline Pod Security levels: "
        "the namespace must admit privileged pods.",
    )
    rdma_resource: str = Field(
        "rdma/ib",
        max_length=253,
        description="The RDMA device plugin's extended resource that rdma requests one of per pod "
        "(e.g. rdma/ib, rdma/hca_shared_devices_a); empty requests none. resources.extraResources "
        "naming it sets another count.",
    )


RESERVED_ENV_PREFIXES = ("MESHTRAIN_", "PET_", "TORCHELASTIC_")
"""Environment the operator sets for torchrun and the trainer; a job may not override it."""
RESERVED_ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
"""The same, by whole name."""
FAULT_ENV_NAMES = ("MESHTRAIN_FAULT_INJECT", "MESHTRAIN_FAULT_NODE", "MESHTRAIN_FAULT_SLOW")
"""The built-in trainer's fault injection (``meshtrain.trainer.guards.faults``), which a job may
set for a chaos drill of its own: a rank killed, hung, slowed or meeting a GPU error.  The
operator never sets them, and they fail nothing but the job that sets them."""
GPU_ENV_NAMES = ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "CUDA_VISIBLE_DEVICES")
"""Which GPUs a container sees is the device plugin's to set (the GPUs the pod was given)."""
GPU_ENV_FIX = (
    "the device plugin sets which GPUs a container sees (set here, a container could use "
    "GPUs of other pods on the node): remove it; request GPUs with resources.gpusPerNode"
)
SECRET_ENV_NAME = r"(?i)(secret|token|passw(or)?d|api_?key|access_?key|private_?key|credential)"
"""A plain ``value`` under such a name is almost certainly a credential."""
RESERVED_LABEL_PREFIX = "meshtrain.io/"
"""Labels the operator selects its pods by."""
KUEUE_PREFIX = "kueue.x-k8s.io/"
"""Kueue's labels and annotations: on a pod they would make Kueue manage it apart from the gang's
Workload (its pod integration), or forge Kueue's own bookkeeping."""
RESERVED_LABELS = ("app.kubernetes.io/managed-by",)
"""The same, by whole key."""


def is_reserved_env(name: str) -> bool:
    """Whether ``name`` is environment the operator sets (:data:`RESERVED_ENV_PREFIXES`,
    :data:`RESERVED_ENV_NAMES`), so that a job may not set it."""
    if name in FAULT_ENV_NAMES:
        return False
    return name.startswith(RESERVED_ENV_PREFIXES) or name in RESERVED_ENV_NAMES


def _env_value_or_source(pod: PodSettings) -> str | None:
    for i, var in enumerate(pod.env):
        sources = var.value_from and [
            s
            for s in (
                var.value_from.secret_key_ref,
                var.value_from.config_map_key_ref,
                var.value_from.field_ref,
            )
            if s is not None
        ]
        if (var.value is None) == (var.value_from is None) or (
            var.value_from is not None and len(sources or []) != 1
        ):
            return (
                f"env[{i}] {var.name} must set exactly one of value or valueFrom, and valueFrom exactly "
                "one of secretKeyRef, configMapKeyRef, fieldRef"
            )
    return None


def _env_not_reserved(pod: PodSettings) -> str | None:
    for i, var in enumerate(pod.env):
        if is_reserved_env(var.name):
            return (
                f"env[{i}] {var.name} is set by the operator for torchrun and the trainer "
                f"({', '.join(p + '*' for p in RESERVED_ENV_PREFIXES)}, {', '.join(RESERVED_ENV_NAMES)}): "
                "remove it; the layout comes from spec.parallelism"
            )
    return None


def _env_no_gpu_visibility(pod: PodSettings) -> str | None:
    for i, var in enumerate(pod.env):
        if var.name in GPU_ENV_NAMES:
            return f"env[{i}] {var.name}: {GPU_ENV_FIX}"
    return None


def _env_no_plain_secrets(pod: PodSettings) -> str | None:
    for i, var in enumerate(pod.env):
        if var.value is not None and re.search(SECRET_ENV_NAME, var.name):
            return (
                f"env[{i}] {var.name} looks like a credential but has a plain value, which anyone who "
                "can read the TrainingJob sees: put it in a Secret and use valueFrom.secretKeyRef"
            )
    return None


def labels_not_reserved(section: str, field: str, name: str) -> base.Rule[Any]:
    """``spec.<section>.<field>`` (a map of a model at ``section``) uses none of the operator's
    or Kueue's keys."""
    prefixes = (RESERVED_LABEL_PREFIX, KUEUE_PREFIX)
    allowed = f"{', '.join(p + '*' for p in prefixes)} or {', '.join(RESERVED_LABELS)}"

    def check(judged: Any) -> str | None:
        taken = sorted(
            k for k in getattr(judged, field) if k.startswith(prefixes) or k in RESERVED_LABELS
        )
        if taken:
            return (
                f"{field} {taken} are the operator's own or Kueue's (the operator selects its "
                f"pods by them, Kueue manages pods by them): choose keys outside {allowed}"
            )
        return None

    return base.Rule(
        name,
        f"spec.{section}.{field}",
        f"self.{section}.{field}.all(k, "
        + " && ".join(f"!k.startsWith('{p}')" for p in prefixes)
        + f" && !(k in {_cel_list(RESERVED_LABELS)}))",
        f"{section}.{field} may not use {allowed} (the operator selects its pods by them, "
        "Kueue manages pods by them)",
        check,
    )


def keys_qualified(section: str, field: str, name: str) -> base.Rule[Any]:
    """``spec.<section>.<field>``'s keys are qualified names (the API server refuses others in every pod)."""
    message = (
        f"{section}.{field} keys must be Kubernetes qualified names: an optional DNS prefix and '/', "
        "then at most 63 letters, digits, '-', '_' or '.' starting and ending with a letter or "
        "digit, e.g. team or example.com/team"
    )

    def check(judged: Any) -> str | None:
        bad = [k for k in getattr(judged, field) if not kube_names.is_qualified_name(k)]
        return f"{message}; got {base.quoted(bad[0])}" if bad else None

    return base.Rule(
        name,
        f"spec.{section}.{field}",
        kube_names.cel_all_keys_qualified(f"self.{section}.{field}"),
        message,
        check,
    )


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


RULES: tuple[base.Rule[PodSettings], ...] = (
    base.Rule(
        "env-value-or-source",
        "spec.pod.env",
        "self.pod.env.all(e, has(e.value) != has(e.valueFrom) && (!has(e.valueFrom) || "
        "(has(e.valueFrom.secretKeyRef) ? 1 : 0) + (has(e.valueFrom.configMapKeyRef) ? 1 : 0) "
        "+ (has(e.valueFrom.fieldRef) ? 1 : 0) == 1))",
        "every pod.env entry sets exactly one of value or valueFrom, and valueFrom exactly one of "
        "secretKeyRef, configMapKeyRef, fieldRef",
        _env_value_or_source,
    ),
    base.Rule(
        "env-not-reserved",
        "spec.pod.env",
        f"self.pod.env.all(e, e.name in {_cel_list(FAULT_ENV_NAMES)} || ("
        + " && ".join(f"!e.name.startsWith('{p}')" for p in RESERVED_ENV_PREFIXES)
        + f" && !(e.name in {_cel_list(RESERVED_ENV_NAMES)})))",
        f"pod.env may not set {', '.join(p + '*' for p in RESERVED_ENV_PREFIXES)} or "
        f"{', '.join(RESERVED_ENV_NAMES)}: the operator sets them for torchrun and the trainer",
        _env_not_reserved,
    ),
    base.Rule(
        "env-no-gpu-visibility",
        "spec.pod.env",
        f"self.pod.env.all(e, !(e.name in {_cel_list(GPU_ENV_NAMES)}))",
        f"pod.env may not set {', '.join(GPU_ENV_NAMES)}: the device plugin sets which GPUs a "
        "container sees",
        _env_no_gpu_visibility,
    ),
    base.Rule(
        "env-no-plain-secrets",
        "spec.pod.env",
        f"self.pod.env.all(e, !has(e.value) || !e.name.matches('{SECRET_ENV_NAME}'))",
        "a pod.env name that looks like a credential (secret, token, password, api key) needs "
        "valueFrom.secretKeyRef, not a plain value",
        _env_no_plain_secrets,
    ),
    labels_not_reserved("pod", "labels", "labels-not-reserved"),
    labels_not_reserved("pod", "annotations", "annotations-not-reserved"),
    keys_qualified("pod", "labels", "pod-labels-keys-qualified"),
    keys_qualified("pod", "annotations", "pod-annotations-keys-qualified"),
)
