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
from meshtrain.operator import naming


@dataclasses.dataclass(frozen=True)
class JobRef:
    """Identity of a TrainingJob object."""

    name: str
    """metadata.name."""
    namespace: str
    """metadata.namespace."""
    uid: str
    """metadata.uid (owner references need it)."""


def spec_hash(spec: api_spec.TrainingJobSpec) -> str:
    """Short hash of everything in ``spec`` that shapes the gang's pods.

    ``runPolicy`` is left out: suspending, or changing a deadline or the
    backoff limit, must not rebuild a running gang.
    """
    shaping = spec.model_dump(mode="json", by_alias=True, exclude={"run_policy"})
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


def planned_node(pod: dict[str, Any]) -> str | None:
    """The node a pod is bound to, or the one its required affinity pins it to."""
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
    return None
