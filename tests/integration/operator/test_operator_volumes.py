"""A job whose checkpoint claim lives on a node-local volume is placed only where that volume is.

Private API server and kube-scheduler (no controller-manager: the claim is bound
by hand, as the PV controller would bind it).  Node ``vol-a`` has more GPUs, so
placement by GPUs alone prefers it; the local volume is on ``vol-b``.
"""

from __future__ import annotations

from collections.abc import Iterator

import kubernetes
import pytest

from meshtrain.operator.policy import conditions, naming
from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster, Reconciling, wait_for

pytestmark = pytest.mark.integration

NAMESPACE = "volumes"
LOCAL = "local-wffc"


@pytest.fixture(scope="module")
def private(control_plane_binaries) -> Iterator[Cluster]:
    with Cluster.private(control_plane_binaries) as found:
        found.core.create_namespace({"metadata": {"name": NAMESPACE}})
        kubernetes.client.StorageV1Api(found.core.api_client).create_storage_class(
            {
                "metadata": {"name": LOCAL},
                "provisioner": "kubernetes.io/no-provisioner",
                "volumeBindingMode": "WaitForFirstConsumer",
            }
        )
        yield found


def _local_volume(cluster: Cluster, name: str, node: str, claim: str | None = None) -> None:
    spec = {
        "capacity": {"storage": "1Gi"},
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": LOCAL,
        "local": {"path": "/mnt/checkpoints"},
        "nodeAffinity": {
            "required": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}
                        ]
                    }
                ]
            }
        },
    }
    if claim is not None:
        spec["claimRef"] = {"namespace": NAMESPACE, "name": claim}
    cluster.core.create_persistent_volume({"metadata": {"name": name}, "spec": spec})


def _claim(cluster: Cluster, name: str, volume: str | None = None) -> None:
    metadata: dict = {"name": name}
    spec: dict = {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": LOCAL,
        "resources": {"requests": {"storage": "1Gi"}},
    }
    if volume is not None:  # bound, as the PV controller leaves it
        metadata["annotations"] = {"pv.kubernetes.io/bind-completed": "yes"}
        spec["volumeName"] = volume
    cluster.core.create_namespaced_persistent_volume_claim(
        NAMESPACE, {"metadata": metadata, "spec": spec}
    )
    if volume is not None:
        cluster.core.patch_namespaced_persistent_volume_claim_status(
            name, NAMESPACE, {"status": {"phase": "Bound"}}
        )


def test_a_claim_bound_to_a_local_volume_places_the_gang_on_its_node(private):
    private.add_node("bound", gpus=4, name="bound-a")
    private.add_node("bound", gpus=8, name="bound-b")
    _local_volume(private, "ckpt-on-b", "bound-b", claim="ckpt")
    _claim(private, "ckpt", volume="ckpt-on-b")
    private.apply(
        JobBuilder("local", NAMESPACE, "bound").layout(data=4).gpus(4).checkpoint(claimName="ckpt")
    )
    reconciling = Reconciling(private)
    try:

        def bound() -> list | None:
            reconciling.passes(NAMESPACE, "local")
            pods = private.pods(NAMESPACE, "local")
            return pods if len(pods) == 1 and pods[0].spec.node_name else None

        # kube-scheduler binds the released pod: its VolumeBinding filter agrees with the node.
        [pod] = wait_for("the gang bound by kube-scheduler", bound, timeout=60, interval=0.5)
    finally:
        reconciling.close()
    assert pod.metadata.annotations[naming.ANNOTATION_NODE] == "bound-b"
    assert pod.spec.node_name == "bound-b"
    # Placed there at once, not after the scheduler refused the node GPUs alone would pick.
    events = private.core.list_namespaced_event(NAMESPACE).items
    assert not [e.message for e in events if e.reason == conditions.SCHEDULER_REFUSED]


def _reconcile(cluster, name: str, passes: int = 1) -> None:
    """Run the reconciler's passes over job ``name`` of NAMESPACE, then close it."""
    reconciling = Reconciling(cluster)
    try:
        reconciling.passes(NAMESPACE, name, passes=passes)
    finally:
        reconciling.close()


def test_a_waiting_local_claim_places_the_gang_where_a_volume_could_take_it(private):
    private.add_node("unbound", gpus=8, name="unbound-a")
    private.add_node("unbound", gpus=4, name="unbound-b")
    _local_volume(private, "free-on-b", "unbound-b")
    _claim(private, "scratch")  # WaitForFirstConsumer: bound when the first pod is scheduled
    job = JobBuilder("later", NAMESPACE, "unbound").layout(data=4).gpus(4)
    private.apply(job.checkpoint(claimName="scratch"))
    _reconcile(private, "later")
    assert private.status(NAMESPACE, "later")["placement"] == [{"podIndex": 0, "node": "unbound-b"}]


def test_a_claim_whose_volume_node_has_no_room_waits_and_says_why(private):
    private.add_node("full", gpus=8, name="full-a")
    private.add_node("full", gpus=2, name="full-b")
    _local_volume(private, "ckpt-on-full-b", "full-b", claim="small")
    _claim(private, "small", volume="ckpt-on-full-b")
    job = JobBuilder("cramped", NAMESPACE, "full").layout(data=4).gpus(4)
    private.apply(job.checkpoint(claimName="small"))
    _reconcile(private, "cramped")
    assert private.pods(NAMESPACE, "cramped") == []
    placed = private.condition(NAMESPACE, "cramped", "Placed")
    assert placed["status"] == "False"
    assert "1 node(s) had volume node affinity conflict" in placed["message"]
    assert (
        "claim small allows only the nodes of the node affinity of volume ckpt-on-full-b"
        in (placed["message"])
    )


def test_a_read_write_once_claim_is_refused_for_a_gang_on_several_nodes(private):
    """kube-scheduler would bind the pods (the volume has no node affinity); the kubelets would
    then hold all but one node's in ContainerCreating (Multi-Attach): the gang never starts."""
    private.add_node("attach", gpus=4, name="attach-a")
    private.add_node("attach", gpus=4, name="attach-b")
    private.core.create_persistent_volume(
        {
            "metadata": {"name": "one-node-disk"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": LOCAL,
                "hostPath": {"path": "/mnt/checkpoints"},
                "claimRef": {"namespace": NAMESPACE, "name": "one-node"},
            },
        }
    )
    _claim(private, "one-node", volume="one-node-disk")
    job = JobBuilder("spread", NAMESPACE, "attach").layout(data=8).gpus(4)
    private.apply(job.checkpoint(claimName="one-node"))
    _reconcile(private, "spread", passes=2)
    assert private.pods(NAMESPACE, "spread") == []
    placed = private.condition(NAMESPACE, "spread", conditions.PLACED)
    assert placed["status"] == "False" and placed["reason"] == conditions.CLAIM_NOT_SHARED
    assert "checkpoint.claimName one-node has accessModes ReadWriteOnce" in placed["message"]
    assert "2 nodes" in placed["message"]
    events = private.core.list_namespaced_event(NAMESPACE).items
    assert [e.reason for e in events if e.involved_object.name == "spread"].count(
        conditions.CLAIM_NOT_SHARED
    ) == 1
