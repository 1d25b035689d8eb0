"""Kueue's Workloads on the cluster: a queued job's Workload read into Kueue's answer, and written.

Labels a job that names no LocalQueue when the cluster requires Kueue (``queue_defaulting``),
reads the Workload (and the priority classes and ResourceFlavors it names) into
``kueue_workload.Gate`` and carries out the Workload actions the state machine decides, through
``kube`` (whose Kueue requests are ``kueue_calls``).  What the answer means and what to do with
it is policy: ``policy.kueue_workload`` and ``policy.kueue``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from meshtrain.api import spec as api_spec
from meshtrain.operator.cluster import clock, kube, status_writes
from meshtrain.operator.policy import (
    builders,
    feasibility,
    identity,
    job_state,
    kueue_topology,
    kueue_workload,
    naming,
    pod_state,
    queue_defaulting,
)

logger = logging.getLogger("meshtrain.operator")
ACTIONS = (
    kueue_workload.CreateWorkload,
    kueue_workload.ReleaseQuota,
    kueue_workload.ReportPodsReady,
    kueue_workload.FinishWorkload,
    kueue_workload.DeleteWorkload,
    kueue_workload.MoveWorkload,
)
"""The lifecycle's actions that act on the Workload (:func:`perform`)."""


class Rejected(Exception):
    """The job's Workload is not created: the API server refused it (a 4xx that retrying does
    not fix), or its queue's TAS Topology cannot keep a required level."""


async def default_queue(
    client: kube.Client,
    writer: status_writes.JobWriter,
    body: dict[str, Any],
    queue: str | None,
) -> dict[str, Any]:
    """``body`` labelled with the LocalQueue ``queue`` when it names none (``queue_defaulting``).

    The label is written before the pass decides, so nothing places the job around Kueue.
    """
    patch = queue_defaulting.label_patch(body, queue)
    if patch is None or queue is None:
        return body
    metadata = body["metadata"]
    answer = await client.patch_job_metadata(
        namespace=metadata["namespace"], name=metadata["name"], patch=patch
    )
    if answer is None:
        return body
    await writer.emit(answer, "Normal", queue_defaulting.DEFAULTED, queue_defaulting.message(queue))
    return answer


async def gate(
    client: kube.Client,
    body: dict[str, Any],
    queue: kueue_workload.Queue | None,
    rejected: tuple[str, bool] | None = None,
) -> tuple[kueue_workload.Gate | None, dict[str, Any] | None]:
    """Kueue's answer for the job (None when it is not queued) and its own Workload as read.

    ``rejected``: why the last Workload create was refused, and whether its backoff is over.
    """
    metadata = body["metadata"]
    if queue is None and not kueue_workload.was_queued(body.get("status") or {}):
        return None, None
    workload = await client.get_workload(
        namespace=metadata["namespace"], name=kueue_workload.workload_name(metadata["name"])
    )
    declared = job_state.read(body).declared  # Kueue holds the declared size's quota
    spec_hash = identity.spec_hash(declared) if declared is not None else None
    stamped = (
        ((workload or {}).get("metadata") or {})
        .get("annotations", {})
        .get(kueue_workload.SPEC_HASH_ANNOTATION)
    )
    if declared is not None and stamped and identity.same_spec(stamped, declared):
        spec_hash = stamped  # a Workload an earlier release stamped is not outdated by it
    found = kueue_workload.gate_for(workload, metadata["uid"], queue, spec_hash)
    own = (
        workload
        if workload is not None and kueue_workload.controlled_by(workload, metadata["uid"])
        else None
    )
    if found is None or found.state is not None or queue is None:
        return found, own
    if rejected is not None and not rejected[1]:  # the same Queued condition, nothing created
        return kueue_workload.Gate(
            kueue_workload.Waiting(kueue_workload.WORKLOAD_REJECTED, rejected[0])
        ), None
    priority = await priority_of(client, queue, declared)
    if isinstance(priority, kueue_workload.Waiting):
        return kueue_workload.Gate(priority), None
    return kueue_workload.Gate(None, priority, rejected=rejected[0] if rejected else None), None


async def priority_of(
    client: kube.Client, queue: kueue_workload.Queue, spec: api_spec.TrainingJobSpec | None
) -> kueue_workload.Priority | kueue_workload.Waiting:
    """The Workload's priority, derived as Kueue does for its own integrations.

    The WorkloadPriorityClass label first, else the pods' PriorityClass
    (spec.pod.priorityClassName), else the cluster's globalDefault PriorityClass, else 0.
    A class that is named but missing holds the job (no Workload can carry its priority).
    """
    if queue.priority_class:
        value = await client.workload_priority(name=queue.priority_class)
        if value is None:
            return kueue_workload.missing_priority_class(queue)
        return kueue_workload.workload_priority(queue.priority_class, value)
    name = spec.pod.priority_class_name if spec is not None else None
    if name:
        value = await client.pod_priority(name=name)
        if value is None:
            return kueue_workload.missing_pod_priority_class(name)
        return kueue_workload.pod_priority(name, value)
    return kueue_workload.default_priority(await client.list_priority_classes())


async def perform(
    client: kube.Client,
    action: kueue_workload.CreateWorkload
    | kueue_workload.ReleaseQuota
    | kueue_workload.ReportPodsReady
    | kueue_workload.FinishWorkload
    | kueue_workload.DeleteWorkload
    | kueue_workload.MoveWorkload,
    job: job_state.JobState,
    queue: kueue_workload.Queue | None,
    workload: dict[str, Any] | None,
    trainer_image: str,
    warn: Callable[[str, str], Awaitable[None]] | None = None,
) -> bool:
    """Carry out one Workload action of the lifecycle; whether it changed anything.

    ``warn(reason, message)``: a Warning Event of the job (an RBAC too old to read Kueue TAS)."""
    ref = job.ref
    if isinstance(action, kueue_workload.CreateWorkload):
        assert job.declared is not None and queue is not None
        template = builders.build_pod(ref, job.declared, 0, 0, "", default_image=trainer_image)
        try:
            levels = await tas_levels(client, ref.namespace, queue.name)
        except kube.ApiError as err:
            if err.status != 403:
                raise
            levels = ()  # an install whose RBAC predates TAS: queued without a topology request
            message = kueue_topology.unread_message(str(err))
            logger.warning("%s/%s: %s", ref.namespace, ref.name, message)
            if warn is not None:
                await warn(kueue_topology.UNREAD, message)
        spares = kueue_workload.spare_pods(job.declared)
        unknown = kueue_topology.unknown_required(job.declared, levels, spares)
        if unknown is not None:
            raise Rejected(unknown)
        manifest = kueue_workload.build_workload(
            ref, job.declared, queue, template, action.priority, levels
        )
        try:
            created = await client.create_workload(manifest=manifest)
        except kube.ApiError as err:
            if 400 <= err.status < 500 and err.status != 429:
                raise Rejected(kueue_workload.workload_rejected(err.status, err.body)) from err
            raise
        logger.info("queued %s/%s in Kueue LocalQueue %s", ref.namespace, ref.name, queue.name)
        return created is not None
    if workload is None:
        return False
    metadata = workload["metadata"]
    if isinstance(action, kueue_workload.MoveWorkload):
        await client.patch_workload_queue(
            namespace=metadata["namespace"],
            name=metadata["name"],
            queue=action.queue,
            resource_version=metadata["resourceVersion"],
        )
        logger.info("%s/%s: Workload moved to LocalQueue %s", ref.namespace, ref.name, action.queue)
        return True
    if isinstance(action, kueue_workload.DeleteWorkload):
        await client.delete_workload(
            namespace=metadata["namespace"], name=metadata["name"], uid=metadata["uid"]
        )
        logger.info("%s/%s: Workload deleted (outdated or suspended)", ref.namespace, ref.name)
        return True
    if isinstance(action, kueue_workload.ReleaseQuota):
        patch = kueue_workload.release_patch(workload, clock.now())
        logger.info("%s/%s: evicted gang gone, quota released", ref.namespace, ref.name)
    elif isinstance(action, kueue_workload.ReportPodsReady):
        ready = kueue_workload.pods_ready_patch(workload, ready=action.ready, now=clock.now())
        if ready is None:
            return False
        patch = ready
    else:
        patch = kueue_workload.finish_patch(
            workload, succeeded=action.succeeded, message=action.message, now=clock.now()
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
) -> kueue_workload.Assignment | kueue_workload.Unassignable:
    """Where Kueue's admitted ResourceFlavors let the gang run (none named: anywhere)."""
    found = []
    for name in names:
        flavor = await client.resource_flavor(name=name)
        if flavor is None:
            return kueue_workload.Unassignable(
                kueue_workload.FLAVOR_NOT_FOUND,
                f"ResourceFlavor {name}, which Kueue admitted the job with, does not exist; "
                "placing it once it does (or once Kueue admits it again)",
            )
        found.append(flavor)
    return kueue_workload.assignment(found)


async def tas_levels(client: kube.Client, namespace: str, queue: str) -> tuple[str, ...]:
    """The levels of the TAS Topology the queue's ClusterQueue hands out, () when none does.

    LocalQueue -> ClusterQueue -> its flavors -> those with ``spec.topologyName`` -> their
    Topologies: the levels every one of them has, in the first one's order (Kueue may pick any
    of the TAS flavors, and skips one whose Topology lacks a level the request names).
    Anything missing reads as no TAS: Kueue then says what is wrong in the queue.
    """
    local = await client.kueue_object(plural="localqueues", name=queue, namespace=namespace)
    cluster_queue = ((local or {}).get("spec") or {}).get("clusterQueue")
    if not cluster_queue:
        return ()
    found = await client.kueue_object(plural="clusterqueues", name=cluster_queue)
    groups = ((found or {}).get("spec") or {}).get("resourceGroups") or []
    every: list[tuple[str, ...]] = []
    for name in dict.fromkeys(f["name"] for g in groups for f in g.get("flavors") or []):
        flavor = await client.resource_flavor(name=name)
        topology = ((flavor or {}).get("spec") or {}).get("topologyName")
        if topology:
            found = await client.kueue_object(plural="topologies", name=topology)
            every.append(kueue_topology.tas_levels(found))
    return tuple(level for level in every[0] if all(level in o for o in every)) if every else ()


async def release_after_pods(
    client: kube.Client, *, namespace: str, name: str, uid: str, pods: Sequence[dict[str, Any]]
) -> int:
    """Delete a deleted job's own Workload once none of ``pods`` (its pods) holds resources.

    Returns how many still do (the Workload and its quota stay): the garbage collector would
    delete the Workload with the job, and Kueue then admit another job onto GPUs the
    stopping ranks still use.
    """
    workload = await client.get_workload(
        namespace=namespace, name=kueue_workload.workload_name(name)
    )
    if workload is None or not kueue_workload.controlled_by(workload, uid):
        return 0
    states = [s for s in (pod_state.read(p) for p in pods) if s is not None]
    held = sum(s.holds_resources for s in states)
    held += sum(  # its spare pods (no pods of the gang) hold GPUs of the quota too
        feasibility.holds_resources(p)
        for p in pods
        if naming.LABEL_SPARE in ((p.get("metadata") or {}).get("labels") or {})
    )
    if held and not isinstance(kueue_workload.state(workload), kueue_workload.Finished):
        return held
    metadata = workload["metadata"]
    await client.delete_workload(namespace=namespace, name=metadata["name"], uid=metadata["uid"])
    return 0
