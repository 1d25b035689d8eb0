"""A job's own pods and children, by UID: read from the cache, deleted, and removed when the job is deleted.

A pod labelled with the job's name is the job's only when it is owned by the
job's UID (a namesake's pods are not), and each delete names that very object
(its UID), so nothing another tenant or a namesake owns is ever deleted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from meshtrain.operator.cluster import children, informer, kube, workloads
from meshtrain.operator.policy import capacity, identity, naming


def owned_pods(cache: informer.Cache, ref: identity.JobRef) -> list[dict[str, Any]]:
    """The job's pods: labelled with its name and owned by its UID."""
    return [p for p in cache.job_pods(ref.namespace, ref.name) if capacity.owned_by(p, ref.uid)]


def departed_store(
    cache: informer.Cache, ref: identity.JobRef, attempt: int
) -> dict[str, Any] | None:
    """What the cache last saw of gang ``attempt``'s store pod if it is gone and was the job's
    (owned by its UID, not a namesake's deleted and made again)."""
    last = cache.departed((ref.namespace, naming.store_pod_name(ref.name, attempt)))
    return last if last is not None and capacity.owned_by(last, ref.uid) else None


async def delete_pods(
    client: kube.Client,
    cache: informer.Cache,
    ref: identity.JobRef,
    names: Iterable[str],
    grace_seconds: int | None = None,
) -> None:
    """Delete these pods of the job, each only as the very object (UID) the cache holds as the job's.

    The cache may be a moment behind: a name it still lists may already belong to
    another object (a namesake job's pod, another tenant's); that one is not touched.
    """
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in owned_pods(cache, ref)}
    await client.delete_pods(
        namespace=ref.namespace,
        names=[n for n in names if n in uids],
        grace_seconds=grace_seconds,
        uids=uids,
    )


async def delete_children(
    client: kube.Client, cache: informer.Cache, ref: identity.JobRef, *, isolated: bool = False
) -> int:
    """Remove the children the deleted job ``ref`` owns, and nothing else (idempotent).

    ``isolated``: the job's namespace is one where gangs get their own NetworkPolicy, which
    goes too.

    Returns how many of its pods still hold their resources while its Workload holds
    Kueue quota: the caller calls again later.  The Workload goes only once they are gone
    (the garbage collector would delete it with the job, and Kueue then admit another job
    onto GPUs the stopping ranks still use).
    """
    owned = owned_pods(cache, ref)
    await delete_pods(
        client,
        cache,
        ref,
        [p["metadata"]["name"] for p in owned if not p["metadata"].get("deletionTimestamp")],
    )
    if late := await _uncached_pods(client, ref, {p["metadata"]["uid"] for p in owned}):
        # A placement cancelled by the deletion may have created pods the cache has not seen
        # yet: delete them, and look again later (a create still in flight may land after).
        await client.delete_pods(
            namespace=ref.namespace,
            names=[p["metadata"]["name"] for p in late],
            uids={p["metadata"]["name"]: p["metadata"]["uid"] for p in late},
        )
        return len(late)
    held = await workloads.release_after_pods(
        client, namespace=ref.namespace, name=ref.name, uid=ref.uid, pods=owned
    )
    if held:
        return held
    for kind, child in (
        ("Service", naming.service_name(ref.name)),
        ("ConfigMap", naming.configmap_name(ref.name)),
        *([("NetworkPolicy", naming.network_policy_name(ref.name))] if isolated else []),
    ):
        await children.delete_owned(client, ref.uid, kind, ref.namespace, child)
    return 0


async def _uncached_pods(
    client: kube.Client, ref: identity.JobRef, cached: set[str]
) -> list[dict[str, Any]]:
    """The job's pods on the API server (one LIST) that are not being deleted and not in ``cached``."""
    pods, _ = await client.list_pods(
        namespace=ref.namespace, selector=f"{naming.LABEL_JOB}={ref.name}"
    )
    return [
        p
        for p in pods
        if capacity.owned_by(p, ref.uid)
        and p["metadata"]["uid"] not in cached
        and not p["metadata"].get("deletionTimestamp")
    ]
