"""A queued job on a real API server that serves no Kueue: the refused Workload is said, not looped on."""

from __future__ import annotations

import asyncio

import pytest

from meshtrain.operator import reconciler
from meshtrain.operator.cluster import informer, kube
from meshtrain.operator.policy import kueue_workload
from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster

pytestmark = pytest.mark.integration


def test_a_workload_the_api_server_refuses_is_a_condition_and_an_event_with_backoff(
    control_plane_binaries,
):
    """On a control plane of its own: the suite's shared operator would reconcile the same job and
    race these passes' status writes (409)."""
    with Cluster.private(control_plane_binaries) as cluster:
        _refused_workload_is_said_with_backoff(cluster, "kueue-missing")


def _refused_workload_is_said_with_backoff(cluster: Cluster, namespace: str) -> None:
    cluster.core.create_namespace({"metadata": {"name": namespace}})
    manifest = JobBuilder("queued", namespace).layout(data=1, gpus_per_node=1).manifest()
    manifest["metadata"]["labels"] = {kueue_workload.QUEUE_LABEL: "team-queue"}
    custom = cluster.custom
    custom.create_namespaced_custom_object(
        "meshtrain.io", "v1alpha1", namespace, "trainingjobs", manifest
    )

    async def passes() -> list[reconciler.Outcome]:
        client = await kube.Client.connect(kubeconfig=cluster.kubeconfig)
        try:
            cache = informer.Cache()
            cache.synced.set()
            operator = reconciler.Reconciler(
                client=client, cache=cache, settings=reconciler.Settings()
            )
            return [await operator.reconcile(namespace=namespace, name="queued") for _ in range(3)]
        finally:
            await client.close()

    refused, said, waiting = asyncio.run(passes())
    assert refused.requeue_after == 0  # the next pass says why at once
    assert said.changed and said.requeue_after is not None and said.requeue_after > 1
    assert not waiting.changed, "no Workload create, status write or Event inside the backoff"
    job = custom.get_namespaced_custom_object(
        "meshtrain.io", "v1alpha1", namespace, "trainingjobs", "queued"
    )
    [queued] = [c for c in job["status"]["conditions"] if c["type"] == "Queued"]
    assert queued["reason"] == "WorkloadRejected", queued
    # The API server's own answer (no kueue.x-k8s.io/v1beta2 served here) and what to check.
    assert "404" in queued["message"] and "v1beta2" in queued["message"], queued
    events = cluster.core.list_namespaced_event(namespace).items
    warned = [e for e in events if e.reason == "WorkloadRejected" and e.type == "Warning"]
    assert len(warned) == 1, [(e.reason, e.type, e.count) for e in events]
