"""The operator's side of Kueue's API: reads a queued job's Workload and what it names, acts on it.

The policy (the Workload's shape, what Kueue's answer means) is ``queueing``'s; here are its
reads and writes, through ``kube``.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Any

from meshtrain.api import spec as api_spec
from meshtrain.operator.cluster import kube
from meshtrain.operator.policy import builders, identity, lifecycle, pod_state, queueing

logger = logging.getLogger("meshtrain.operator")
ACTIONS = (
    queueing.CreateWorkload,
    queueing.ReleaseQuota,
    queueing.ReportPodsReady,
    queueing.FinishWorkload,
    queueing.DeleteWorkload,
    queueing.MoveWorkload,
)
"""The lifecycle's actions that act on the Workload (:func:`perform`)."""


class Rejected(Exception):
    """The API server refused to create the job's Workload (a 4xx that retrying does not fix)."""


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


async def gate(
    client: kube.Client,
    body: dict[str, Any],
    queue: queueing.Queue | None,
    rejected: tuple[str, bool] | None = None,
) -> tuple[queueing.Gate | None, dict[str, Any] | None]:
    """Kueue's say over the job (None when it is not queued) and its own Workload as read.

    ``rejected``: why the last Workload create was refused, and whether its backoff is over.
    """
    metadata = body["metadata"]
    if queue is None and not queueing.was_queued(body.get("status") or {}):
        return None, None
    workload = await client.get_workload(
        namespace=metadata["namespace"], name=queueing.workload_name(metadata["name"])
    )
    declared = lifecycle.job_state(body).declared  # Kueue holds the declared size's quota
    spec_hash = identity.spec_hash(declared) if declared is not None else None
    stamped = (
        ((workload or {}).get("metadata") or {})
        .get("annotations", {})
        .get(queueing.SPEC_HASH_ANNOTATION)
    )
    if declared is not None and stamped and identity.same_spec(stamped, declared):
        spec_hash = stamped  # a Workload an earlier release stamped is not outdated by it
    found = queueing.gate_for(workload, metadata["uid"], queue, spec_hash)
    own = (
        workload
        if workload is not None and queueing.controlled_by(workload, metadata["uid"])
        else None
    )
    if found is None or found.state is not None or queue is None:
        return found, own
    if rejected is not None and not rejected[1]:  # the same Queued condition, nothing created
        return queueing.Gate(queueing.Waiting(queueing.WORKLOAD_REJECTED, rejected[0])), None
    priority = await priority_of(client, queue, declared)
    if isinstance(priority, queueing.Waiting):
        return queueing.Gate(priority), None
    return queueing.Gate(None, priority, rejected=rejected[0] if rejected else None), None


async def priority_of(
    client: kube.Client, queue: queueing.Queue, spec: api_spec.TrainingJobSpec | None
) -> queueing.Priority | queueing.Waiting:
    """The Workload's priority, derived as Kueue does for its own integrations.

    The WorkloadPriorityClass label first, else the pods' PriorityClass
    (spec.pod.priorityClassName), else the cluster's globalDefault PriorityClass, else 0.
    A class that is named but missing holds the job (no Workload can carry its priority).
    """
    if queue.priority_class:
        value = await client.workload_priority(name=queue.priority_class)
        if value is None:
            return queueing.missing_priority_class(queue)
        return queueing.workload_priority(queue.priority_class, value)
    name = spec.pod.priority_class_name if spec is not None else None
    if name:
        value = await client.pod_priority(name=name)
        if value is None:
            return queueing.missing_pod_priority_class(name)
        return queueing.pod_priority(name, value)
    return queueing.default_priority(await client.list_priority_classes())


async def perform(
    client: kube.Client,
    action: queueing.CreateWorkload
    | queueing.ReleaseQuota
    | queueing.ReportPodsReady
    | queueing.FinishWorkload
    | queueing.DeleteWorkload
    | queueing.MoveWorkload,
    job: lifecycle.JobState,
    queue: queueing.Queue | None,
    workload: dict[str, Any] | None,
    trainer_image: str,
) -> bool:
    """Carry out one Workload action of the lifecycle; whether it changed anything."""
    ref = job.ref
    if isinstance(action, queueing.CreateWorkload):
        assert job.declared is not None and queue is not None
        template = builders.build_pod(ref, job.declared, 0, 0, "", default_image=trainer_image)
        manifest = queueing.build_workload(ref, job.declared, queue, template, action.priority)
        try:
            created = await client.create_workload(manifest=manifest)
        except kube.ApiError as err:
            if 400 <= err.status < 500 and err.status != 429:
                raise Rejected(queueing.workload_rejected(err.status, err.body)) from err
            raise
        logger.info("queued %s/%s in Kueue LocalQueue %s", ref.namespace, ref.name, queue.name)
        return created is not None
    if workload is None:
        return False
    metadata = workload["metadata"]
    if isinstance(action, queueing.MoveWorkload):
        await client.patch_workload_queue(
            namespace=metadata["namespace"],
            name=metadata["name"],
            queue=action.queue,
            resource_version=metadata["resourceVersion"],
        )
        logger.info("%s/%s: Workload moved to LocalQueue %s", ref.namespace, ref.name, action.queue)
        return True
    if isinstance(action, queueing.DeleteWorkload):
        await client.delete_workload(
            namespace=metadata["namespace"], name=metadata["name"], uid=metadata["uid"]
        )
        logger.info("%s/%s: Workload deleted (outdated or suspended)", ref.namespace, ref.name)
        return True
    if isinstance(action, queueing.ReleaseQuota):
        patch = queueing.release_patch(workload, now())
        logger.info("%s/%s: evicted gang gone, quota released", ref.namespace, ref.name)
    elif isinstance(action, queueing.ReportPodsReady):
        ready = queueing.pods_ready_patch(workload, ready=action.ready, now=now())
        if ready is None:
            return False
        patch = ready
    else:
        patch = queueing.finish_patch(
            workload, succeeded=action.succeeded, message=action.message, now=now()
        )
    await client.patch_workload_status(
        namespace=metadata["namespace"],
        name=metadata["name"],
        patch=patch,
        resource_version=metadata["resourceVersion"],
    )
    return True


async def flavors(
    client: kube.Client, names: tuple[str, ...]
) -> queueing.Assignment | queueing.Unassignable:
    """Where Kueue's admitted ResourceFlavors let the gang run (none named: anywhere)."""
    found = []
    for name in names:
        flavor = await client.resource_flavor(name=name)
        if flavor is None:
            return queueing.Unassignable(
                queueing.FLAVOR_NOT_FOUND,
                f"ResourceFlavor {name}, which Kueue admitted the job with, does not exist; "
                "placing it once it does (or once Kueue admits it again)",
            )
        found.append(flavor)
    return queueing.assignment(found)


async def release_after_pods(
    client: kube.Client, *, namespace: str, name: str, uid: str, pods: Sequence[dict[str, Any]]
) -> int:
    """Delete a deleted job's own Workload once none of ``pods`` (its pods) holds resources.

    Returns how many still do (the Workload and its quota stay): the garbage collector would
    delete the Workload with the job, and Kueue then admit another job onto GPUs the
    stopping ranks still use.
    """
    workload = await client.get_workload(namespace=namespace, name=queueing.workload_name(name))
    if workload is None or not queueing.controlled_by(workload, uid):
        return 0
    states = [s for s in (pod_state.pod_state(p) for p in pods) if s is not None]
    held = sum(s.holds_resources for s in states)
    if held and not isinstance(queueing.state(workload), queueing.Finished):
        return held
    metadata = workload["metadata"]
    await client.delete_workload(namespace=namespace, name=metadata["name"], uid=metadata["uid"])
    return 0
