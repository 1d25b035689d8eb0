"""Replacing a lost pod of a running gang: whether its pods rejoin, the recorded pod of each
index, and the status a replacement writes.

``status.placement[i].pod`` names the pod that holds index ``i`` once it was replaced (absent:
the gang's own ``<job>-r<attempt>-<i>``); a pod of the attempt whose name is not the recorded one
is superseded: stale, like a pod of an earlier attempt.  The entry is written before the pod is
created, so a pass after a crash finds the name to create.  Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import job_state, naming, pod_state, recovery_count

TIER = "pod"
"""``status.recovery.byTier`` key and record tier of a replaced pod."""


def rejoins(spec: api_spec.TrainingJobSpec) -> bool:
    """Whether the job's pods can join a running gang's rendezvous (built-in trainer, in place)."""
    return spec.trainer.type == "builtin" and spec.run_policy.recovery.in_place


def entries(status: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    """``status.placement`` by pod index (malformed entries skipped)."""
    found: dict[int, Mapping[str, Any]] = {}
    for entry in status.get("placement") or []:
        if isinstance(entry, Mapping) and isinstance(entry.get("podIndex"), int):
            found[entry["podIndex"]] = entry
    return found


def recorded_pod(job: str, attempt: int, entry: Mapping[str, Any] | None, index: int) -> str:
    """The pod that holds ``index``: the replacement the entry names, else the gang's own."""
    named = entry.get("pod") if entry is not None else None
    return named if isinstance(named, str) and named else naming.pod_name(job, attempt, index)


def superseded(
    job: str, attempt: int, placed: Mapping[int, Mapping[str, Any]], pod: pod_state.PodState
) -> bool:
    """Whether ``pod`` (of ``attempt``) holds an index that a replacement now holds."""
    return pod.name != recorded_pod(job, attempt, placed.get(pod.index), pod.index)


def replaced_so_far(status: Mapping[str, Any]) -> int:
    """Pods replaced in this gang attempt (``status.placement[*].replaced``)."""
    return sum(int(e.get("replaced") or 0) for e in entries(status).values())


def attempt_restarts(status: Mapping[str, Any], attempt: int) -> int:
    """In-place restarts of any tier in gang ``attempt`` (``status.recovery.attemptRestarts``,
    ``recovery_count``'s book), and at least the pods replaced in it."""
    booked = int(recovery_count.book(status, attempt)["attemptRestarts"])
    return max(booked, replaced_so_far(status))


def next_name(job: str, attempt: int, entry: Mapping[str, Any] | None, index: int) -> str:
    """Name of the next replacement of ``index``."""
    done = int(entry.get("replaced") or 0) if entry is not None else 0
    return naming.replacement_pod_name(job, attempt, index, done + 1)


@dataclasses.dataclass(frozen=True)
class Replaced:
    """One lost pod and its replacement."""

    index: int
    lost: str
    """The lost pod's name."""
    cause: str
    """Why it was lost (``pod deleted``, ``node lost``, ...)."""
    pod: str
    """The replacement's name."""
    node: str
    spare: bool
    """It lands on a spare node reserved for the job."""


def status_changes(
    job: job_state.JobState,
    replaced: Sequence[Replaced],
    gpus_per_pod: int,
    now: datetime.datetime,
) -> dict[str, Any]:
    """Placement entries of the replacements, and ``status.recovery`` counted (tier ``pod``)."""
    placed = entries(job.status)
    for r in replaced:
        before = placed.get(r.index) or {}
        placed[r.index] = {
            "podIndex": r.index,
            "node": r.node,
            "pod": r.pod,
            "replaced": int(before.get("replaced") or 0) + 1,
        }
    attempt = int(job.status.get("restarts") or 0)
    recovery = recovery_count.book(job.status, attempt)
    by_tier = dict(recovery["byTier"])
    by_tier[TIER] = by_tier.get(TIER, 0) + len(replaced)
    stamp = round(now.timestamp(), 3)
    ranks = [x.index * gpus_per_pod + r for x in replaced for r in range(gpus_per_pod)]
    record: dict[str, Any] = dict.fromkeys(recovery_count.RECORD_KEYS)
    record.update(
        tier=TIER,
        cause="; ".join(sorted({r.cause for r in replaced})),
        pod=replaced[0].lost,
        ranks=ranks[: recovery_count.MAX_RANKS],
        failedAt=stamp,
        detectedAt=stamp,
    )
    recovery.update(
        inPlaceRestarts=recovery["inPlaceRestarts"] + len(replaced),
        attemptRestarts=attempt_restarts(job.status, attempt) + len(replaced),
        byTier=by_tier,
        last=record,
    )
    return {
        "placement": [placed[i] for i in sorted(placed)],
        "recovery": recovery,
        "observedGeneration": job.generation,
    }


def message(replaced: Sequence[Replaced]) -> str:
    """The Event's words: which pod went, why, and where its replacement runs."""
    return (
        "; ".join(
            f"pod {r.index} ({r.lost}: {r.cause}) replaced by {r.pod} on node {r.node}"
            + (" (a spare)" if r.spare else "")
            for r in replaced
        )
        + "; the other pods keep running"
    )
