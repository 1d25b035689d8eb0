"""The operator places a DRA gang where kube-scheduler can allocate its claims: on the nodes whose
published devices are free and match, never where a claim holds them or the product differs."""

from __future__ import annotations

import kubernetes
import pytest

from tests.builders import JobBuilder
from tests.integration.operator.cluster import SIM_DRIVER

pytestmark = pytest.mark.integration

H200 = f"device.attributes['{SIM_DRIVER}'].productName == 'NVIDIA H200'"


def _hold(cluster, namespace: str, node: str, gpus: list[str]) -> None:
    """A claim whose allocation (as kube-scheduler writes it) holds ``gpus`` of ``node``."""
    resource = kubernetes.client.ResourceV1Api(cluster.core.api_client)
    exactly = {"deviceClassName": SIM_DRIVER, "allocationMode": "ExactCount", "count": len(gpus)}
    claim = {
        "metadata": {"name": f"held-{node}"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": exactly}]}},
    }
    resource.create_namespaced_resource_claim(namespace, claim)
    results = [{"request": "gpus", "driver": SIM_DRIVER, "pool": node, "device": g} for g in gpus]
    resource.patch_namespaced_resource_claim_status(
        f"held-{node}", namespace, {"status": {"allocation": {"devices": {"results": results}}}}
    )


def test_a_dra_gang_goes_only_where_matching_devices_are_free(cluster, operator, namespace, pool):
    free = [cluster.add_node(pool, gpus=4) for _ in range(2)]
    held, bare = cluster.add_node(pool, gpus=4), cluster.add_node(pool, gpus=4)
    for node in [*free, held]:
        cluster.publish_gpus(node, 4, pool)
    _hold(cluster, namespace, held, ["gpu-0"])  # 3 of 4 left: no room for a 4-GPU pod
    # `bare` advertises nvidia.com/gpu through a device plugin and publishes no device
    job = JobBuilder("picky", namespace, pool).layout(data=8, gpus_per_node=4).dra(SIM_DRIVER, H200)
    cluster.apply(job)
    pods = cluster.wait_gang(namespace, "picky", 2, timeout=60)
    planned = sorted(
        term.match_fields[0].values[0]
        for pod in pods
        for term in pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    )
    assert planned == sorted(free), (planned, free, held, bare)
