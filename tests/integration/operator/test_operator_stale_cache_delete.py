"""A delete decided from a cache a moment behind touches only the very pod the job owned.

The informer cache can still list a job's pod after it was deleted and its name
taken by another object (the pod of a namesake job applied right after, another
tenant's pod).  The operator deletes by name; without a UID precondition it
deleted that other pod.  Real API server; the cache is filled by hand to be stale.
"""

from __future__ import annotations

import asyncio
import uuid

import kubernetes
import pytest

from meshtrain.operator import reconciler
from meshtrain.operator.cluster import informer, kube

pytestmark = pytest.mark.integration


def _pod(name: str, namespace: str, job: str, owner_uid: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"meshtrain.io/job": job},
            "ownerReferences": [
                {
                    "apiVersion": "meshtrain.io/v1alpha1",
                    "kind": "TrainingJob",
                    "name": job,
                    "uid": owner_uid,
                    "controller": True,
                }
            ],
        },
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }


def test_deleting_a_jobs_children_from_a_stale_cache_spares_the_pod_that_took_the_name(
    control_plane, kube_api, namespace
):
    core = kubernetes.client.CoreV1Api(kube_api)
    old_job, new_job = str(uuid.uuid4()), str(uuid.uuid4())
    name = "train-0-0"
    stale = core.create_namespaced_pod(namespace, _pod(name, namespace, "train", old_job))
    stale_body = kube_api.sanitize_for_serialization(stale)
    core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    core.create_namespaced_pod(namespace, _pod(name, namespace, "train", new_job))

    async def delete_from_stale_cache() -> None:
        client = await kube.Client.connect(kubeconfig=str(control_plane.kubeconfig_path))
        try:
            cache = informer.Cache()
            cache.pods.upsert({"kind": "Pod", **stale_body})  # the cache missed the delete
            cache.synced.set()
            operator = reconciler.Reconciler(
                client=client, cache=cache, settings=reconciler.Settings()
            )
            await operator.delete_children(namespace=namespace, name="train", uid=old_job)
        finally:
            await client.close()

    asyncio.run(delete_from_stale_cache())
    deleted = (
        "the operator deleted the pod of another job (uid "
        f"{new_job}) that took the name of a pod its cache still held for job {old_job}"
    )
    try:
        survivor = core.read_namespaced_pod(name, namespace)
    except kubernetes.client.ApiException as err:
        assert err.status != 404, deleted
        raise
    assert survivor.metadata.owner_references[0].uid == new_job
    assert survivor.metadata.deletion_timestamp is None, deleted
