"""What the state machine asks the reconciler to do: the actions of a decision, and the decision."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from meshtrain.operator.policy import (
    job_state,
    kueue_topology,
    kueue_workload,
    rescheduling,
    resizing,
)


@dataclasses.dataclass(frozen=True)
class SetStatus:
    """Merge these fields into status (a JSON merge patch of the status subresource)."""

    changes: Mapping[str, Any]


def set_status(job: job_state.JobState, **fields: Any) -> SetStatus:
    """Write ``fields``, and the generation they were decided on as ``observedGeneration``."""
    return SetStatus({**fields, "observedGeneration": job.generation})


@dataclasses.dataclass(frozen=True)
class Emit:
    """Record a Kubernetes Event on the job."""

    type: str
    """Normal or Warning."""
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class EmitOnNode:
    """Record ``note`` as an Event of ``node`` too, where an administrator looking at the node sees
    it (the job's name goes in front of its message)."""

    node: str
    note: Emit


@dataclasses.dataclass(frozen=True)
class DeletePods:
    """Delete these pods (already-gone ones are fine)."""

    names: tuple[str, ...]
    grace_seconds: int | None = None
    """None: the pods' own grace period (time to checkpoint the step they stop at)."""


@dataclasses.dataclass(frozen=True)
class Place:
    """Plan and create the gang of ``attempt`` (all pods), or re-create ``missing`` on the recorded nodes."""

    attempt: int
    missing: tuple[int, ...] | None = None
    flavors: tuple[str, ...] = ()
    """The ResourceFlavors Kueue admitted the job with: only nodes they cover, with their tolerations."""
    topology: kueue_topology.Assignment | None = None
    """Kueue TAS's topologyAssignment: the gang only in its domains, each with its count."""


@dataclasses.dataclass(frozen=True)
class LiftGates:
    """Remove the gang scheduling gate from these pods (the whole gang exists)."""

    names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class DeleteJob:
    """Delete the TrainingJob itself (TTL after finishing)."""


@dataclasses.dataclass(frozen=True)
class PollProgress:
    """Read rank 0's /progress and store it in the status."""

    pod: str
    ip: str
    port: int


@dataclasses.dataclass(frozen=True)
class ReplaceStraggler:
    """Rebuild the gang without ``nodes`` if a placement without them fits now, else only report.

    The check needs the cluster (the reconciler plans the gang, shrunk elastic
    sizes included, with the node left out); stopping a gang that then cannot
    be placed anywhere would trade a slow job for a stopped one.
    """

    nodes: tuple[str, ...]
    replaced: tuple[SetStatus | Emit | DeletePods, ...]
    otherwise: tuple[SetStatus | Emit, ...]
    topology: kueue_topology.Assignment | None = None
    """Kueue TAS's topologyAssignment: the placement without the nodes must fit inside it."""


@dataclasses.dataclass(frozen=True)
class ReplacePods:
    """Replace the lost pods ``indices`` of the running gang ``attempt`` alone, if a node takes
    each now (its domain kept where the plan requires one), else do ``otherwise`` (today's rule:
    the gang rebuilt, at a smaller elastic size where that is what fits).

    Only the cluster says whether a node takes them, so the choice is the reconciler's.
    """

    attempt: int
    indices: tuple[int, ...]
    causes: tuple[tuple[int, str, str], ...]
    """(pod index, lost pod's name or "", why it was lost) of each lost pod."""
    avoid: tuple[str, ...]
    """Nodes a replacement must not go to: the lost pods' own, where the node lost them."""
    doomed: tuple[str, ...]
    """Lost pods still to delete (the replacement supersedes them)."""
    flavors: tuple[str, ...]
    """The ResourceFlavors Kueue admitted the job with."""
    otherwise: tuple[Action, ...]
    """What ``failure.GANG_FAILED`` decides for the same pass."""
    topology: kueue_topology.Assignment | None = None
    """Kueue TAS's topologyAssignment: replacements only where it has room left."""


Action = (
    SetStatus
    | ReplacePods
    | ReplaceStraggler
    | Emit
    | EmitOnNode
    | DeletePods
    | Place
    | LiftGates
    | DeleteJob
    | PollProgress
    | resizing.Grow
    | rescheduling.ReplaceRefused
    | kueue_workload.CreateWorkload
    | kueue_workload.ReleaseQuota
    | kueue_workload.ReportPodsReady
    | kueue_workload.FinishWorkload
    | kueue_workload.DeleteWorkload
    | kueue_workload.MoveWorkload
)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do now, and when to look again at the latest (None: on the next event or resync)."""

    actions: tuple[Action, ...] = ()
    requeue_after: float | None = None
