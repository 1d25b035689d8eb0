"""Condition types and reasons of a TrainingJob, and the one function that sets one.

:func:`set` keeps ``lastTransitionTime`` unless a condition's status changes.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

from meshtrain.api.spec import run_policy as api_run_policy
from meshtrain.planner import admission

# Condition types.
PLACED = "Placed"
"""True while a placement for the current gang exists; False with the reason it cannot be placed."""
RUNNING = "Running"
"""True while every pod of the gang runs."""
SUSPENDED = "Suspended"
"""True while spec.runPolicy.suspend holds the job without pods."""
SUCCEEDED = "Succeeded"
"""True once every pod of the gang exited 0."""
FAILED = "Failed"
"""True once the job failed for good (see the reasons below)."""
WONT_FIT = admission.REASON_WONT_FIT
"""True when the planner says the job's worst rank needs more memory than the GPU has (the job failed);
also the reason of the conditions it sets."""
API_ERRORS = "ApiErrors"
"""True after consecutive reconcile passes failed on API server errors (5xx, 429, unreachable); False once one succeeds."""
PODS_SCHEDULED = "PodsScheduled"
"""False with the scheduler's message while a pod of the gang is Unschedulable; True once all are bound."""
QUEUED = "Queued"
"""True while Kueue has not admitted the job (its workload waits for quota, or was evicted); the
reason and message are Kueue's."""

# Reasons (a placement's Unschedulable reasons are meshtrain.placement's constants).
GANG_PLACED = "GangPlaced"
CREATING_PODS = "CreatingPods"
"""Placed=False while the planned gang's objects are being created (Placed turns True once they all exist)."""
CREATE_REJECTED = "CreateRejected"
"""The API server refused to create a child (Pod Security, quota, validation): its message, retried with backoff."""
NAME_CONFLICT = "NameConflict"
"""A child's name is taken by an object this job does not own; it is never patched nor deleted."""
FAILED_SCHEDULING = "FailedScheduling"
ALL_PODS_BOUND = "AllPodsBound"
ALL_PODS_RUNNING = "AllPodsRunning"
CONTAINERS_STARTING = "ContainersStarting"
"""Running=False once the kubelet no longer reports why a container could not start (the
reasons it reports are its own: ``container_reasons.REASONS``)."""
GANG_RESTARTING = "GangRestarting"
POD_REPLACED = "PodReplaced"
"""Event: a lost pod of a running gang was replaced alone; the other pods kept running."""
POD_NOT_REPLACED = "PodNotReplaced"
"""Event: a lost pod could not be replaced alone (no room in its domain): the gang is rebuilt."""
BAD_GPU = "BadGPU"
"""A pod's supervisor took one of its GPUs for bad (the same GPU failed twice within an hour, or is
gone; exit 79): the pod is placed again without its node, which ``status.excludedNodes`` names."""
PERMANENT_FAILURE = "PermanentFailure"
BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
DEADLINE_EXCEEDED = "DeadlineExceeded"
INVALID_SPEC = "InvalidSpec"
SUSPENDED_BY_USER = "SuspendedByUser"
RESUMED = "Resumed"
SPEC_CHANGED = "SpecChanged"
"""The spec changed under a placed gang: the gang is rebuilt from the new spec (not a restart)."""
NODES_CHANGED = "PlannedNodesChanged"
"""A planned node could no longer take its pods before the gates were lifted: the gang is placed again."""
PLANNING_DEADLINE_EXCEEDED = "PlanningDeadlineExceeded"
"""Planning the gang used more CPU time than the operator's ``--planning-deadline-seconds``: refused (Failed), not retried."""
PLANNING_FAILED = "PlanningFailed"
"""The planning worker died or did not start (e.g. out of memory): Placed=False, planned again at the next pass."""
RESERVED = "ReservedForLongestWaiting"
"""Placed=False: nodes are reserved for the job that waited longest (``policy.reservation``), one
of them had room for this job, and no placement beside them fits: it waits until the holder
starts or room beside the reserved nodes frees."""
NODES_RESERVED = "NodesReserved"
"""Event on the reservation's holder: the nodes planned for it, kept from every other job
(``policy.reservation``)."""
BACKFILLED = "Backfilled"
"""Event on a job placed on nodes reserved for another (``policy.reservation``): its declared
``runPolicy.activeDeadlineSeconds`` ends it before the holder could start there."""
SCHEDULER_REFUSED = "SchedulerRefused"
"""kube-scheduler refused a released pod on its planned node: the gang is placed again without that node."""
RECONCILE_FAILING = "ReconcileFailing"
RECONCILE_RECOVERED = "ReconcileRecovered"
CLAIM_NOT_SHARED = "CheckpointClaimNotShared"
"""The checkpoint claim's access modes let only one node (or pod) mount it, and the gang spans more."""
OLD_PODS_TERMINATING = "OldPodsTerminating"
"""Pods of the job's earlier gang still terminate and hold their GPUs: the new gang waits for them."""
COMPLETED = "Completed"
ADMITTED = "Admitted"
"""Reason of Queued=False: Kueue admitted the job's workload."""

# runPolicy.elastic (type and reasons).
RESIZED = "Resized"
"""True while runPolicy.elastic runs the gang at a data-parallel degree other than parallelism.data."""
ELASTIC_SHRUNK = "ElasticShrunk"
"""Resized=True: the largest degree that fitted is below parallelism.data (a node was lost)."""
ELASTIC_GROWN = "ElasticGrown"
"""Resized=True: the gang runs above parallelism.data (free capacity, up to maxData)."""
ELASTIC_GROWING = "ElasticGrowing"
"""A smaller gang is rebuilt at a larger degree that now fits (at the next checkpoint)."""
ELASTIC_GROW_PENDING = "ElasticGrowPending"
"""Event: room for a larger degree was found; the gang grows once it is stable and the resize interval passed."""
DECLARED_SIZE = "DeclaredSize"
"""Resized=False: the gang runs at parallelism.data."""

# runPolicy.stragglerPolicy (type and reasons).
STRAGGLER = "Straggler"
"""True while the trainer flags a rank as persistently slower than its data-parallel peers."""
STRAGGLER_DETECTED = "StragglerDetected"
"""Straggler=True: status.straggler names the rank, its node and how much slower it is."""
STRAGGLER_REPLACED = "StragglerReplaced"
"""The gang was stopped (checkpointing its last step) to be placed again without the straggler's node."""
STRAGGLER_NO_REPLACEMENT = "NoReplacement"
"""Straggler=True under ``replace`` while no placement without its node fits: reported, gang kept."""
STRAGGLER_FOLLOWS_RANK = "SlowRankNotNode"
"""Straggler=True under ``replace`` when a rank already moved off a node is flagged again on its new
one: the cause follows the rank (its data, its share of the model), so no further replacement."""
STRAGGLER_GONE = "NoStraggler"
"""Straggler=False: no rank is flagged any more."""

# The measured gradient noise scale against the global batch.
BATCH_ABOVE_NOISE_SCALE = "BatchAboveNoiseScale"
"""True while the global batch is far above the gradient noise scale the trainer measures."""
GLOBAL_BATCH_FAR_ABOVE_NOISE_SCALE = "GlobalBatchFarAboveNoiseScale"
GLOBAL_BATCH_NEAR_NOISE_SCALE = "GlobalBatchNearNoiseScale"

# Checkpoints lost with the pods (meshtrain.api.persistence).
CHECKPOINTS_NOT_PERSISTENT = "CheckpointsNotPersistent"
"""True while checkpoints go to an emptyDir though the run policy lets the gang restart."""
EMPTY_DIR_CHECKPOINTS = "EmptyDirCheckpoints"
"""CheckpointsNotPersistent=True: no checkpoint.claimName and no s3:// checkpoint.path."""
PERSISTENT_CHECKPOINTS = "PersistentCheckpoints"
"""CheckpointsNotPersistent=False: the spec now keeps checkpoints on a claim or in a bucket."""

TRUE, FALSE = "True", "False"

STEADY_SECONDS = float(api_run_policy.STEADY_RUNNING_SECONDS)
"""A gang that ran (every pod Running) this long with no restart has recovered: the disruption
restarts in a row (``disruption_budget``) and the in-place restarts of the attempt
(``recovery_count``) start their count again, so a long job that loses a node or a process every
few hours never fails for it."""


def timestamp(now: datetime.datetime) -> str:
    """RFC 3339 UTC timestamp with a Z, as the API server writes them."""
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime.datetime | None:
    """An RFC 3339 timestamp from the API (``...Z``) as an aware datetime, or None."""
    if not value:
        return None
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def find(conditions: Iterable[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    """The condition of ``type_``, if present."""
    for condition in conditions:
        if condition.get("type") == type_:
            return condition
    return None


def steady(
    status: Mapping[str, Any], now: datetime.datetime, since: datetime.datetime | None = None
) -> bool:
    """Whether the gang has run (``Running`` True) for :data:`STEADY_SECONDS`, and as long since
    ``since`` (its last restart) when given."""
    running = find(status.get("conditions") or [], RUNNING) or {}
    start = parse_time(running.get("lastTransitionTime"))
    if running.get("status") != TRUE or start is None:
        return False
    start = max(start, since) if since is not None else start
    return (now - start).total_seconds() >= STEADY_SECONDS


def set(  # noqa: A001 - called as conditions.set(...)
    conditions: Iterable[dict[str, Any]],
    type_: str,
    status: str,
    reason: str,
    message: str,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """A copy of ``conditions`` with ``type_`` set; lastTransitionTime kept unless status changes."""
    result = []
    found = False
    for condition in conditions:
        if condition.get("type") == type_:
            found = True
            transition = (
                condition.get("lastTransitionTime") if condition.get("status") == status else None
            )
            condition = {
                "type": type_,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": transition or timestamp(now),
            }
        result.append(dict(condition))
    if not found:
        result.append(
            {
                "type": type_,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": timestamp(now),
            }
        )
    return result
