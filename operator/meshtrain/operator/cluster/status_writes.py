"""Writes of a TrainingJob's status, and its Events.

A status write carries the resourceVersion it was decided on, so it applies only to the job as
read; Events are best effort (one the API server refuses is logged, never retried).
"""

from __future__ import annotations

import logging
from typing import Any

from meshtrain.operator.cluster import clock, informer, kube, metrics
from meshtrain.operator.policy import conditions, identity, job_actions, job_state, kueue_workload

logger = logging.getLogger("meshtrain.operator")

CONFLICT_RETRIES = 3
"""Status writes retried after a 409 when the job changed only outside spec and status."""

Step = tuple[dict[str, Any], job_state.JobState, bool]
"""What an action leaves: the job as last written or read, its state, and whether anything changed."""


DECIDING_LABELS = (kueue_workload.QUEUE_LABEL, kueue_workload.PRIORITY_CLASS_LABEL)
"""The job's labels a pass decides on (Kueue's): a write is not retried over their change."""


def _decided_on(read: dict[str, Any], fresh: dict[str, Any]) -> bool:
    """True when ``fresh`` has the spec generation, Kueue labels and status that ``read`` had."""
    before, after = read.get("metadata") or {}, fresh.get("metadata") or {}
    labels_before, labels_after = before.get("labels") or {}, after.get("labels") or {}
    return (
        after.get("generation") == before.get("generation")
        and all(labels_after.get(k) == labels_before.get(k) for k in DECIDING_LABELS)
        and fresh.get("status") == read.get("status")
    )


def _same(status: dict[str, Any], changes: dict[str, Any]) -> bool:
    """True when merging ``changes`` would not change ``status``."""
    return all(status.get(key) == value for key, value in changes.items())


class JobWriter:
    """Status and Event writes of every job of the process, through one API client."""

    def __init__(self, client: kube.Client, cache: informer.Cache) -> None:
        self.client = client
        self.cache = cache

    async def set_status(
        self, body: dict[str, Any], job: job_state.JobState, changes: dict[str, Any]
    ) -> Step:
        """Merge ``changes`` into the status of the job as ``body`` was read.

        On 409 the job is read again: if neither its spec, its Kueue labels nor its status changed
        (kopf's finalizer and annotations, another tool's labels) the write is retried on the new
        version, else ``kube.Conflict`` ends the pass and the next pass decides from the fresh read.
        """
        if _same(dict(job.status), changes):
            return body, job, False
        ref = job.ref
        version = (body.get("metadata") or {}).get("resourceVersion")
        for _ in range(CONFLICT_RETRIES):
            try:
                answer = await self.client.patch_job_status(
                    namespace=ref.namespace, name=ref.name, status=changes, resource_version=version
                )
                break
            except kube.Conflict:
                # Re-read: a write that left spec and status as decided on (kopf's finalizer
                # and annotations) does not change the decision; anything else does.
                fresh = await self.client.get_job(namespace=ref.namespace, name=ref.name)
                if fresh is None or not _decided_on(body, fresh):
                    raise
                version = (fresh.get("metadata") or {}).get("resourceVersion")
        else:
            raise kube.Conflict(409, "patch", "trainingjobs/status", "kept changing")
        if answer is None:
            return body, job, False
        metrics.restarted(job.ref.namespace, job.ref.name, job.status, {**job.status, **changes})
        return answer, job_state.read(answer), True

    async def emit(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        try:
            await self.client.create_event(
                job=body,
                type_=type_,
                reason=reason,
                message=message,
                now=conditions.timestamp(clock.now()),
            )
        except (kube.ApiError, OSError) as err:
            logger.warning("could not record event %s: %s", reason, err)

    async def emit_on_node(self, node: str, ref: identity.JobRef, note: job_actions.Emit) -> None:
        """``note`` as an Event of ``node`` too, the job named in front (best effort)."""
        raw = self.cache.nodes.get(("", node)) or {}
        try:
            await self.client.create_node_event(
                node=node,
                # the kubelet's own node Events carry the node's name as its UID
                uid=(raw.get("metadata") or {}).get("uid") or node,
                type_=note.type,
                reason=note.reason,
                message=f"TrainingJob {ref.namespace}/{ref.name}: {note.message}",
                now=conditions.timestamp(clock.now()),
            )
        except (kube.ApiError, OSError) as err:
            logger.warning("could not record event %s on node %s: %s", note.reason, node, err)
