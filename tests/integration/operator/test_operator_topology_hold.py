"""A preferred fabric level with ``waitSeconds`` on a real API server and kube-scheduler: a gang
that fits now only across racks waits for one rack (Placed=False says until when); a tenant's pod
leaving that rack places it there; a hold that runs out places it across racks with no capacity
change (the operator's resync is long, and nothing else changes by then: only the hold's own
requeue can plan it); and a gang no rack could ever hold (too few nodes, or a node whose taint it
does not tolerate) is placed across racks at once."""

from __future__ import annotations

import time
import uuid

import kubernetes

from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster, operated, wait_for

RACK = "meshtrain.test/rack"
BLOCK = "meshtrain.test/block"


def _racks(cluster: Cluster, pool: str, sizes: tuple[int, ...]) -> list[list[str]]:
    """Racks of ``sizes`` 8-GPU nodes in one block; the node names per rack."""
    return [
        [
            cluster.add_node(pool, gpus=8, labels={BLOCK: f"{pool}-b", RACK: f"{pool}-r{rack}"})
            for _ in range(count)
        ]
        for rack, count in enumerate(sizes)
    ]


def _tenant(cluster: Cluster, namespace: str, node: str) -> str:
    """Another tenant's pod holding all 8 GPUs of ``node`` (bound there; no kubelet runs it)."""
    name = f"tenant-{uuid.uuid4().hex[:6]}"
    cluster.core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": name},
            "spec": {
                "nodeName": node,
                "containers": [
                    {
                        "name": "c",
                        "image": "tenant",
                        "resources": {
                            "requests": {"nvidia.com/gpu": "8"},
                            "limits": {"nvidia.com/gpu": "8"},
                        },
                    }
                ],
            },
        },
    )
    return name


def _job(name: str, namespace: str, pool: str, wait: int) -> JobBuilder:
    """Two pods of 8 GPUs; the rack level preferred, held ``wait`` seconds for one rack."""
    job = JobBuilder(name, namespace, pool).layout(data=16, gpus_per_node=8).gpus(8)
    return job.topology(levels=[{"label": BLOCK}, {"label": RACK, "waitSeconds": wait}])


def _racks_used(cluster: Cluster, namespace: str, job: str) -> set[str]:
    """The racks of the nodes the gang's recorded placement names (read from the Node objects)."""
    nodes = {entry["node"] for entry in cluster.status(namespace, job)["placement"]}
    return {cluster.core.read_node(node).metadata.labels[RACK] for node in nodes}


def test_a_held_gang_waits_for_one_rack_and_is_spread_only_once_its_hold_runs_out(
    control_plane_binaries, tmp_path
):
    log = str(tmp_path / "operator.log")
    with operated(control_plane_binaries, log, resync_seconds=300) as (cluster, _):
        namespace = f"hold-{uuid.uuid4().hex[:6]}"
        cluster.core.create_namespace({"metadata": {"name": namespace}})
        # rack r0: two nodes, one a tenant's; rack r1: one node.  Free: one node per rack.
        freed, timed, never, tainted = (f"p{uuid.uuid4().hex[:6]}" for _ in range(4))
        tenants = {}
        for pool in (freed, timed):
            racks = _racks(cluster, pool, (2, 1))
            tenants[pool] = _tenant(cluster, namespace, racks[0][0])
        _racks(cluster, never, (1, 1))  # no rack could ever hold two pods
        # nor here: the second node of rack r0 has a taint the job does not tolerate
        rack = f"{tainted}-r0"
        cluster.add_node(tainted, gpus=8, labels={BLOCK: f"{tainted}-b", RACK: rack})
        taint = [{"key": "example.com/reserved", "value": "x", "effect": "NoSchedule"}]
        labels = {BLOCK: f"{tainted}-b", RACK: rack}
        cluster.add_node(tainted, gpus=8, labels=labels, taints=taint)
        _racks(cluster, tainted, (0, 1))

        cluster.apply(_job("freed", namespace, freed, wait=600))
        cluster.apply(_job("never", namespace, never, wait=600))
        cluster.apply(_job("tainted", namespace, tainted, wait=600))

        # waiting could not help: placed at once, across racks
        for job, pool in (("never", never), ("tainted", tainted)):
            cluster.wait_gang(namespace, job, 2)
            assert _racks_used(cluster, namespace, job) == {f"{pool}-r0", f"{pool}-r1"}

        held = cluster.wait_reason(namespace, "freed", "Placed", "TopologyUnsatisfiable")
        assert RACK in held["message"] and "held inside one domain" in held["message"]
        assert "waitSeconds 600) until" in held["message"], held["message"]
        assert "domain (held to one for now)" in held["message"], held["message"]
        assert "(required)" not in held["message"]  # preferred: it waits, it is not refused
        assert cluster.pods(namespace, "freed") == []

        # the tenant leaves rack r0 of "freed": the wake-up places the gang inside it
        cluster.core.delete_namespaced_pod(
            tenants[freed],
            namespace,
            body=kubernetes.client.V1DeleteOptions(grace_period_seconds=0),
        )
        cluster.wait_gang(namespace, "freed", 2)
        assert _racks_used(cluster, namespace, "freed") == {f"{freed}-r0"}
        for name in ("freed", "never", "tainted"):
            _bound(cluster, namespace, name)

        # now nothing else changes: only the hold's own requeue can plan "timed" again
        applied = time.monotonic()
        cluster.apply(_job("timed", namespace, timed, wait=6))
        cluster.wait_reason(namespace, "timed", "Placed", "TopologyUnsatisfiable")
        cluster.wait_gang(namespace, "timed", 2, timeout=60)
        assert time.monotonic() - applied >= 5.0  # from the first plan's whole second
        assert _racks_used(cluster, namespace, "timed") == {f"{timed}-r0", f"{timed}-r1"}
        assert set(_bound(cluster, namespace, "timed")) == {
            entry["node"] for entry in cluster.status(namespace, "timed")["placement"]
        }


def _bound(cluster: Cluster, namespace: str, job: str) -> list[str]:
    """The nodes kube-scheduler bound the gang's pods to, once it bound them all."""
    return wait_for(
        f"the gang of {job} bound by kube-scheduler",
        lambda: (
            nodes
            if all(nodes := [p.spec.node_name for p in cluster.pods(namespace, job)])
            else None
        ),
    )
