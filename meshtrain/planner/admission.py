"""What the operator asks the planner: does the job fit, what goes in ``status.plan``, which profile judges a node.

Pure functions for the operator's reconcile path (:func:`check`, :func:`status_summary`,
:func:`profile_for_labels`, :func:`node_profile`); the operator turns a :class:`WontFit` into a
condition and an Event.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.planner import estimate, memory, profiles

REASON_WONT_FIT = "WontFit"
"""Condition reason for a job whose ranks exceed device memory."""

PRODUCT_LABEL = "nvidia.com/gpu.product"
"""Node label naming the GPU model (set by NVIDIA GPU feature discovery)."""

MEMORY_LABEL = "nvidia.com/gpu.memory"
"""Node label with one GPU's memory in MiB (GPU feature discovery; a MIG slice's own under its
single strategy)."""

_PRODUCTS = (
    ("H200", "h200"),
    ("H100", "h100-sxm"),
    ("A100-SXM4-80GB", "a100-80g"),
    ("A100-80GB", "a100-80g"),
    ("A100", "a100-40g"),
    ("L40S", "l40s"),
)
"""Substrings of the product label (checked in order) and the profile they map to."""


@dataclasses.dataclass(frozen=True)
class WontFit:
    """A job whose worst rank does not fit in device memory."""

    reason: str
    """Condition reason: :data:`REASON_WONT_FIT`."""
    message: str
    """Human explanation with the numbers (bytes by component, capacity, what to change)."""
    stage: int
    """Pipeline stage of the worst rank."""
    needed_bytes: float
    """Bytes the worst rank needs."""
    capacity_bytes: float
    """Device memory the profile leaves a rank's tensors."""


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"


REMEDIES = (
    "training.activationCheckpointing=true",
    "parallelism.zeroStage=1",
    "parallelism.zeroStage=2",
    "parallelism.sequenceParallel=true",
    "training.microBatch=1",
)
"""Single spec changes tried on a job that does not fit (each kept only if the spec stays valid)."""


def fitting_remedies(
    job: api_spec.TrainingJobSpec, profile: profiles.Profile
) -> list[tuple[str, float]]:
    """Which one of :data:`REMEDIES` alone makes ``job`` fit ``profile``, with the bytes per GPU it would need."""
    found = []
    for remedy in REMEDIES:
        try:
            changed = loading.apply_overrides(job, [remedy])
        except loading.SpecError:  # e.g. ZeRO without data parallelism, or a fixed globalBatch
            continue
        if changed == job:
            continue
        plan = memory.plan_memory(changed, profile)
        if plan.fits:
            found.append((remedy, plan.worst.total))
    return found


def check(job: api_spec.TrainingJobSpec, profile: profiles.Profile) -> WontFit | None:
    """None when every rank fits in ``profile``'s memory, else a :class:`WontFit` with the numbers."""
    plan = memory.plan_memory(job, profile)
    if plan.fits:
        return None
    worst = plan.worst
    par = job.parallelism
    message = (
        f"{par.layout_string} on {profile.name}: pipeline stage {worst.stage} needs {_gib(worst.total)} per GPU "
        f"(weights {_gib(worst.weights)}, gradients {_gib(worst.grads)}, optimizer {_gib(worst.optimizer)}, "
        f"activations {_gib(worst.activations)} for {worst.in_flight:g} micro-batch(es) in flight"
        + (
            f", autocast's bf16 copies of the weights {_gib(worst.weight_casts)}"
            if worst.weight_casts
            else ""
        )
        + ") but the GPU "
        f"has {plan.describe_capacity()}; {plan.total_params:,} parameters, {worst.params:,} on this rank. "
        f"Raise parallelism.tensor or parallelism.pipeline, set parallelism.zeroStage, or lower training.microBatch"
    )
    remedies = fitting_remedies(job, profile)
    if remedies:
        message += "; each of these alone would fit: " + ", ".join(
            f"{r} ({_gib(need)})" for r, need in remedies
        )
    return WontFit(
        reason=REASON_WONT_FIT,
        message=message,
        stage=worst.stage,
        needed_bytes=worst.total,
        capacity_bytes=plan.capacity,
    )


def status_summary(plan: estimate.Plan) -> dict[str, Any]:
    """Key numbers of a plan for ``status.plan`` (JSON-ready, camelCase keys)."""
    mem, tp = plan.memory, plan.time
    worst = tp.worst
    ratio = tp.compute_comm_ratio
    return {
        "profile": plan.profile.name,
        "parameters": mem.total_params,
        "memoryPerGpuBytes": int(mem.worst.total),
        "memoryHeadroomBytes": int(mem.headroom),
        "fits": mem.fits,
        "stepSeconds": round(tp.step_seconds, 6),
        "tokensPerSecond": round(tp.tokens_per_second, 1),
        "bubbleRatio": round(tp.bubble, 6),
        "computeCommRatio": round(ratio, 4) if ratio != float("inf") else None,
        "verdict": tp.verdict,
        "dpBytesPerStep": int(plan.comm[worst.stage].payload("dp")),
        "tpBytesPerStep": int(plan.comm[worst.stage].payload("tp")),
        "ppBytesPerStep": int(plan.comm[worst.stage].payload("pp")),
        "globalBatchTokens": plan.batch.tokens,
        "warnings": plan.warnings,
    }


def profile_for_labels(
    labels: Mapping[str, str], extra_dirs: tuple[str, ...] = ()
) -> profiles.Profile | None:
    """The profile of a node from its ``nvidia.com/gpu.product`` label, or None when unknown.

    A MIG slice (``...-MIG-1g.10gb``) has a fraction of its GPU's memory and a
    GH200 another memory than the H200 its name contains: neither is a
    built-in profile's device, so both are unknown (the operator's
    ``--gpu-profile`` judges them).
    """
    product = labels.get(PRODUCT_LABEL, "").upper()
    if not product or "-MIG-" in product or "GH200" in product:
        return None
    for needle, name in _PRODUCTS:
        if needle in product:
            return profiles.get(name, extra_dirs)
    return None


@dataclasses.dataclass(frozen=True)
class NodeProfile:
    """The profile a node's GPUs are judged by, and where it comes from (for messages)."""

    profile: profiles.Profile
    why: str
    """E.g. ``label nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3, at nvidia.com/gpu.memory=...``."""


MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
"""GPU resources of MIG slices under GPU feature discovery's mixed strategy (``nvidia.com/mig-1g.10gb``)."""


def node_profile(
    labels: Mapping[str, str],
    default: profiles.Profile | None,
    resource: str = "nvidia.com/gpu",
    extra_dirs: tuple[str, ...] = (),
) -> NodeProfile | None:
    """What a GPU node is judged by for a job asking for ``resource``: its product's profile
    (:func:`profile_for_labels`), else ``default``, with no more memory than the node's labels
    give one GPU of that resource.

    A node that names a GPU no built-in profile is of (a newer GPU, a GH200,
    a MIG slice under the single strategy, whose product and
    :data:`MEMORY_LABEL` are the slice's) gets ``default``; so does a MIG
    slice resource of the mixed strategy (``nvidia.com/mig-1g.10gb``, its
    memory in ``nvidia.com/mig-1g.10gb.memory``).  None for a node that names
    no GPU, or when there is nothing to judge by.
    """
    product = labels.get(PRODUCT_LABEL)
    if not product:
        return None
    memory_label = MEMORY_LABEL
    builtin = None
    if resource.startswith(MIG_RESOURCE_PREFIX):
        memory_label = f"{resource}.memory"
        unknown = f"{resource} is a MIG slice"
    else:
        builtin = profile_for_labels(labels, extra_dirs)
        unknown = f"{PRODUCT_LABEL}={product} names no built-in profile"
    if builtin is not None:
        profile, why = builtin, f"label {PRODUCT_LABEL}={product}"
    elif default is not None:
        profile, why = default, f"operator default --gpu-profile {default.name} ({unknown})"
    else:
        return None
    mib = labels.get(memory_label, "")
    if mib.isdigit() and int(mib) * 2**20 < profile.memory_bytes:
        profile = dataclasses.replace(
            profile,
            memory_bytes=float(int(mib) * 2**20),
            description=f"{profile.description}; {memory_label}={mib} MiB",
        )
        why += f", at {memory_label}={mib} MiB"
    return NodeProfile(profile, why)
