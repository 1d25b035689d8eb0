"""Both gang paths on the real control plane: the native gang API where it is served, scheduling gates alone where not.

With ``GenericWorkload``/``GangScheduling`` on (alpha in v1.36), the operator
creates a PodGroup (``gang.minCount`` = the gang's pods) and every pod names it,
so kube-scheduler itself binds the gang all at once or not at all.  The test
opens the window the operator's own re-check cannot close — a planned node
filled after the gates are lifted — and watches the real scheduler: with the
PodGroup no pod of the gang binds until all can; without it (a plain control
plane) half a gang binds and holds its GPUs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from meshtrain.operator.cluster import kube
from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster, reconcile_passes, wait_for

pytestmark = pytest.mark.integration

NAMESPACE = "gang"


@pytest.fixture(scope="module")
def with_gang_api(control_plane_binaries) -> Iterator[Cluster]:
    with Cluster.private(control_plane_binaries, gang_api=True) as found:
        found.core.create_namespace({"metadata": {"name": NAMESPACE}})
        yield found


@pytest.fixture(scope="module")
def without_gang_api(control_plane_binaries) -> Iterator[Cluster]:
    with Cluster.private(control_plane_binaries) as found:
        found.core.create_namespace({"metadata": {"name": NAMESPACE}})
        yield found


def _gated_gang_with_a_node_filled_after_the_check(cluster: Cluster) -> tuple[list, str]:
    """Two 2-GPU nodes, a 2-pod gang placed on them; then a foreign pod takes node b and the gates go."""
    nodes = [cluster.add_node("g", gpus=2, name=n) for n in ("g-a", "g-b")]
    cluster.apply(JobBuilder("pair", NAMESPACE, "g").layout(data=4).gpus(2))
    # placed: gated pods pinned to g-a and g-b (the pass ends before it would lift the gates)
    reconcile_passes(cluster, NAMESPACE, "pair", stop_before_gates=True)
    pods = cluster.pods(NAMESPACE, "pair")
    assert len(pods) == 2 and all(p.spec.scheduling_gates for p in pods)
    cluster.core.create_namespaced_pod(
        NAMESPACE,
        {
            "metadata": {"name": "intruder"},
            "spec": {
                "nodeName": "g-b",
                "containers": [
                    {
                        "name": "c",
                        "image": "pause",
                        "resources": {"limits": {"nvidia.com/gpu": "2"}},
                    }
                ],
            },
        },
    )

    async def lift() -> None:  # the moment after the operator's check, before the scheduler binds
        client = await kube.Client.connect(kubeconfig=cluster.kubeconfig)
        try:
            await client.lift_gates(
                namespace=NAMESPACE, uids={p.metadata.name: p.metadata.uid for p in pods}
            )
        finally:
            await client.close()

    asyncio.run(lift())
    return nodes, "intruder"


def _bound(cluster: Cluster) -> dict[str, str | None]:
    return {p.metadata.name: p.spec.node_name for p in cluster.pods(NAMESPACE, "pair")}


def test_with_the_gang_api_the_scheduler_binds_the_gang_whole_or_not_at_all(with_gang_api):
    cluster = with_gang_api
    _, intruder = _gated_gang_with_a_node_filled_after_the_check(cluster)
    group_name = cluster.pods(NAMESPACE, "pair")[0].spec.scheduling_group.pod_group_name
    group = cluster.custom.get_namespaced_custom_object(
        "scheduling.k8s.io", "v1alpha2", NAMESPACE, "podgroups", group_name
    )
    assert group["spec"]["schedulingPolicy"]["gang"]["minCount"] == 2
    job_uid = cluster.job(NAMESPACE, "pair")["metadata"]["uid"]
    assert group["metadata"]["ownerReferences"][0]["uid"] == job_uid
    time.sleep(6)  # the scheduler has seen the gang: g-a is free, g-b is not
    assert _bound(cluster) == {"pair-r0-0": None, "pair-r0-1": None}
    cluster.core.delete_namespaced_pod(intruder, NAMESPACE, grace_period_seconds=0)
    wait_for("the whole gang bound", lambda: all(_bound(cluster).values()), timeout=60)
    assert _bound(cluster) == {"pair-r0-0": "g-a", "pair-r0-1": "g-b"}


def test_without_the_gang_api_gates_alone_let_half_a_gang_bind(without_gang_api):
    cluster = without_gang_api
    _gated_gang_with_a_node_filled_after_the_check(cluster)
    assert all(p.spec.scheduling_group is None for p in cluster.pods(NAMESPACE, "pair"))
    wait_for("pod 0 bound", lambda: _bound(cluster)["pair-r0-0"] == "g-a", timeout=30)
    time.sleep(2)
    assert _bound(cluster)["pair-r0-1"] is None  # half a gang holds g-a: what the PodGroup prevents
