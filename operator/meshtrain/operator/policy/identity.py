"""Who a TrainingJob is, which spec its pods were built from, and which node a pod is pinned to.

Shared by the manifest builders and the pure policies (lifecycle, failure,
capacity), which need these facts about jobs and pods but build nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import naming


@dataclasses.dataclass(frozen=True)
class JobRef:
    """Identity of a TrainingJob object."""

    name: str
    """metadata.name."""
    namespace: str
    """metadata.namespace."""
    uid: str
    """metadata.uid (owner references need it)."""
    created: str = dataclasses.field(default="", compare=False)
    """metadata.creationTimestamp (RFC 3339; empty: unknown): where the job's goodput wall time
    starts (``MESHTRAIN_JOB_STARTED_AT``); not part of the identity."""


def spec_hash(spec: api_spec.TrainingJobSpec) -> str:
    """Short hash of everything in ``spec`` that shapes the gang's pods.

    ``runPolicy`` is left out: suspending, or changing a deadline or the
    backoff limit, must not rebuild a running gang.  Fields at their defaults are
    left out too, so a release that adds a defaulted field leaves every job's hash as it was.
    """
    return _digest(
        spec.model_dump(mode="json", by_alias=True, exclude={"run_policy"}, exclude_defaults=True)
    )


def _legacy_spec_hash(spec: api_spec.TrainingJobSpec) -> str:
    """The hash releases before defaults were left out stamped (running gangs and Workloads carry it)."""
    return _digest(spec.model_dump(mode="json", by_alias=True, exclude={"run_policy"}))


def _digest(shaping: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


def same_spec(stamped: str, spec: api_spec.TrainingJobSpec) -> bool:
    """Whether ``stamped`` (a specHash recorded on a gang or Workload) is the hash of ``spec``."""
    return stamped == spec_hash(spec) or stamped == _legacy_spec_hash(spec)


def planned_node(pod: dict[str, Any]) -> str | None:
    """The node a pod is bound to, or the one its required affinity pins it to, or the one
    kube-scheduler nominated it for (preemption made room there and the scheduler holds it).

    Read of the operator's own pods; what a foreign pod holds is ``capacity.counted_node``'s.
    """
    bound = (pod.get("spec") or {}).get("nodeName")
    if bound:
        return str(bound)
    annotated = ((pod.get("metadata") or {}).get("annotations") or {}).get(naming.ANNOTATION_NODE)
    if annotated:
        return str(annotated)
    terms = (
        (((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        or {}
    ).get("nodeSelectorTerms") or []
    for term in terms:
        for field in term.get("matchFields") or []:
            if (
                field.get("key") == "metadata.name"
                and field.get("operator") == "In"
                and len(field.get("values") or []) == 1
            ):
                return str(field["values"][0])
    return (pod.get("status") or {}).get("nominatedNodeName") or None
