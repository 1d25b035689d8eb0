"""A TrainingJob as the operator's state machine reads it: the parsed spec, its problems, the status."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.api.spec import status as api_status
from meshtrain.operator.policy import identity, resizing

Phase = api_status.Phase
FINAL = (Phase.SUCCEEDED.value, Phase.FAILED.value)


@dataclasses.dataclass(frozen=True)
class JobState:
    """A TrainingJob as the state machine sees it."""

    ref: identity.JobRef
    generation: int
    """metadata.generation (becomes status.observedGeneration)."""
    spec: api_spec.TrainingJobSpec | None
    """The spec the placed gang runs (``declared`` resized by ``status.elastic``), or None when it breaks a rule."""
    problems: tuple[str, ...]
    """Why the spec is invalid (empty when valid)."""
    status: Mapping[str, Any]
    """The current status (camelCase, as stored)."""
    ttl_seconds_after_finished: int | None = None
    """runPolicy.ttlSecondsAfterFinished, read even when the rest of the spec is invalid."""
    declared: api_spec.TrainingJobSpec | None = None
    """The validated spec as written (``spec`` differs only while runPolicy.elastic resized the gang)."""


def read(body: Mapping[str, Any]) -> JobState:
    """Read a TrainingJob object; an invalid spec gives ``spec=None`` and the problems."""
    metadata = body.get("metadata") or {}
    ref = identity.JobRef(
        name=metadata.get("name", ""),
        namespace=metadata.get("namespace", ""),
        uid=metadata.get("uid", ""),
        created=str(metadata.get("creationTimestamp") or ""),
    )
    raw_spec = body.get("spec") or {}
    ttl = (raw_spec.get("runPolicy") or {}).get("ttlSecondsAfterFinished")
    problems: tuple[str, ...]
    try:
        parsed, problems = (
            loading.parse_spec(raw_spec, f"TrainingJob {ref.namespace}/{ref.name}"),
            (),
        )
    except loading.SpecError as err:
        parsed, problems = None, tuple(str(p) for p in err.problems)
    status = dict(body.get("status") or {})
    if parsed is not None:
        parsed = resizing.within_quota(parsed, metadata.get("labels"))
    return JobState(
        ref=ref,
        generation=int(metadata.get("generation") or 0),
        spec=resizing.running_spec(parsed, status) if parsed is not None else None,
        problems=problems,
        status=status,
        ttl_seconds_after_finished=ttl if isinstance(ttl, int) else None,
        declared=parsed,
    )


def conditions_of(job: JobState) -> list[dict[str, Any]]:
    return list(job.status.get("conditions") or [])


def shape(job: JobState) -> dict[str, Any]:
    """``status.layout`` and ``status.worldSize`` of the job's valid spec."""
    assert job.spec is not None
    return {
        "layout": job.spec.parallelism.layout_string,
        "worldSize": job.spec.world_size,
    }
