"""runPolicy.elastic on a real control plane (apiserver, etcd, kube-scheduler): a node is deleted
under a running gang and no equal replacement exists, so the job resumes at the largest
data-parallel degree that fits with the same global batch; the node comes back and, at the
next checkpoint, the gang grows back.  The test plays the kubelet (a bound pod runs; the pods of
a deleted node fail) and rank 0's /progress (a new gang first reports the checkpoint it restored)."""

from __future__ import annotations

import time

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from meshtrain.api import loading
from meshtrain.operator.policy import conditions, resizing
from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster, OperatorProcess, wait_for
from tests.integration.operator.test_operator_stragglers import _checkpoint_volume, simulated

pytestmark = pytest.mark.integration

POOL = "elastic"
NAMESPACE = "elastic"


def _running_spec(cluster: Cluster) -> object:
    """The spec the pods are given (the ConfigMap the trainer reads), validated like the trainer does."""
    document = yaml.safe_load(
        cluster.core.read_namespaced_config_map("grow-spec", NAMESPACE).data["job.yaml"]
    )
    return loading.parse_spec(document["spec"])


def _gang_running(cluster: Cluster, pods: int) -> dict:
    def ready() -> dict | None:
        status = cluster.status(NAMESPACE, "grow")
        live = [p for p in cluster.pods(NAMESPACE, "grow") if not p.metadata.deletion_timestamp]
        running = [p for p in live if p.status.phase == "Running" and p.spec.node_name]
        if status.get("phase") == "Running" and len(live) == len(running) == pods:
            return status
        return None

    return wait_for(f"{pods} pod(s) of grow Running", ready, timeout=90)


AT_ONCE = {"growStableSeconds": 0, "minResizeIntervalSeconds": 0}
"""Grow at the first check that finds room (the waiting periods have a test of their own)."""

NOTHING_YET = {"step": 0, "updated_at": None}
"""What rank 0 serves before its first step: the operator sees no checkpoint from it."""


def _report(step: int) -> dict:
    """Rank 0's /progress at ``step`` with a checkpoint there (restored or saved)."""
    return {
        "step": step,
        "loss": 4.0,
        "updated_at": "2026-01-01T00:00:00Z",
        "last_checkpoint_step": step,
    }


def _seen(cluster: Cluster, field: str, step: int) -> None:
    wait_for(
        f"{field} {step}", lambda: cluster.status(NAMESPACE, "grow").get(field) == step, timeout=60
    )


def _resizes(operator: OperatorProcess) -> dict[str, float]:
    return {
        sample.labels["direction"]: sample.value
        for family in text_string_to_metric_families(operator.metrics())
        for sample in family.samples
        if sample.name == "meshtrain_operator_elastic_resizes_total"
        and sample.labels["trainingjob"] == "grow"
    }


def _unchanged_through_grow_checks(cluster: Cluster) -> None:
    """Two grow checks pass and the gang is the same pods."""
    gang = {p.metadata.uid for p in cluster.pods(NAMESPACE, "grow")}
    deadline = time.monotonic() + 2 * resizing.GROW_CHECK_SECONDS + 2
    while time.monotonic() < deadline:
        assert {p.metadata.uid for p in cluster.pods(NAMESPACE, "grow")} == gang
        time.sleep(1)
    reasons = {e.reason for e in cluster.core.list_namespaced_event(NAMESPACE).items}
    assert "ElasticGrowing" not in reasons


def test_a_gang_is_not_rebuilt_for_a_size_no_placement_would_pick(control_plane_binaries, tmp_path):
    """dp6 fits three 4-GPU nodes but breaks the hierarchical all-reduce rule: the gang stays at dp4."""
    with simulated(control_plane_binaries, NAMESPACE, tmp_path / "operator.log") as sim:
        cluster, progress, operator = sim.cluster, sim.progress, sim.operator
        _checkpoint_volume(cluster, NAMESPACE)  # runPolicy.elastic needs checkpoint.claimName
        for i in range(3):
            cluster.add_node(POOL, gpus=4, name=f"gpu-{i}")
        operator.start()
        progress.document = _report(50)
        cluster.apply(
            JobBuilder("grow", NAMESPACE, POOL)
            .layout(data=8, pipeline=2, gpus_per_node=4)  # two replicas per pod
            .parallelism(microBatches=4, allReduce="hierarchical")
            .checkpoint(claimName="ckpt")
            .run_policy(elastic={"minData": 2, "maxData": 8, **AT_ONCE})
            .metrics(port=progress.port)
        )
        status = _gang_running(cluster, 2)
        assert status["elastic"]["data"] == 4
        _seen(cluster, "lastCheckpointStep", 50)
        progress.document = _report(100)
        _seen(cluster, "lastCheckpointStep", 100)
        _unchanged_through_grow_checks(cluster)  # they find room for dp6 only

        cluster.add_node(POOL, gpus=4, name="gpu-3")
        wait_for(
            "the gang rebuilt at dp8",
            lambda: cluster.status(NAMESPACE, "grow").get("elastic", {}).get("data") == 8,
            timeout=60,
        )
        assert _gang_running(cluster, 4)["restarts"] == 0


def test_lost_node_shrinks_keeping_the_global_batch_and_the_gang_grows_back(
    control_plane_binaries, tmp_path
):
    with simulated(control_plane_binaries, NAMESPACE, tmp_path / "operator.log") as sim:
        cluster, progress, kubelet, operator = sim.cluster, sim.progress, sim.kubelet, sim.operator
        _checkpoint_volume(cluster, NAMESPACE)  # runPolicy.elastic needs checkpoint.claimName
        nodes = [cluster.add_node(POOL, gpus=2, name=f"gpu-{i}") for i in range(4)]
        operator.start()
        job = (
            JobBuilder("grow", NAMESPACE, POOL)
            .layout(data=4, tensor=2, gpus_per_node=2)  # one pod of 2 GPUs per replica
            .parallelism(microBatches=3)
            .training(microBatch=2, lrScaling={"rule": "linear", "referenceBatch": 24})
            .checkpoint(claimName="ckpt")
            .run_policy(elastic={"minData": 2, "maxData": 4, **AT_ONCE})
            .metrics(port=progress.port)
        )
        declared = loading.parse_spec(job.raw())
        progress.document = _report(100)
        cluster.apply(job)
        status = _gang_running(cluster, 4)
        assert status["elastic"]["data"] == 4 and status["layout"] == "dp4·pp1·tp2"
        _seen(cluster, "lastCheckpointStep", 100)
        assert _resizes(operator) == {
            "shrink": 0.0,
            "grow": 0.0,
        }  # both series before any resize
        # The old gang saves step 120 before it stops, and no poll sees it.
        progress.document = NOTHING_YET

        cluster.core.delete_node(nodes[3])
        kubelet.lose(nodes[3])
        status = _gang_running(cluster, 3)
        running = _running_spec(cluster)
        assert running.parallelism.data == 3 and status["layout"] == "dp3·pp1·tp2"
        assert running.global_batch == declared.global_batch == 24
        assert status["elastic"]["microBatches"] == running.parallelism.micro_batches == 4
        assert status["elastic"]["globalBatch"] == 24
        assert status["elastic"]["learningRate"] == pytest.approx(
            declared.training.learning_rates(declared.parallelism)[0]
        )
        resized = cluster.condition(NAMESPACE, "grow", "Resized")
        assert resized["status"] == "True" and resized["reason"] == "ElasticShrunk"
        assert status["restarts"] == 1  # the lost node's gang failed once
        reasons = {e.reason for e in cluster.core.list_namespaced_event(NAMESPACE).items}
        assert "ElasticShrunk" in reasons

        progress.document = _report(120)  # the new gang restored 120: newer than the status said
        _seen(cluster, "lastCheckpointStep", 120)
        kubelet.gone.discard(nodes[3])
        cluster.add_node(POOL, gpus=2, name=nodes[3])
        _unchanged_through_grow_checks(cluster)  # room again, but it waits for its next checkpoint
        progress.document = _report(170)
        status = _gang_running(cluster, 4)
        assert _running_spec(cluster).parallelism.data == 4
        assert status["elastic"]["data"] == 4 and status["restarts"] == 1
        resized = cluster.condition(NAMESPACE, "grow", "Resized")
        assert resized["status"] == "False" and resized["reason"] == "DeclaredSize"
        assert _resizes(operator) == {"shrink": 1.0, "grow": 1.0}


STABLE, INTERVAL = 20, 60
"""growStableSeconds and minResizeIntervalSeconds of the test below: the interval outlasts the first
room's stable period, so the node can be taken away again before any grow may happen."""


def _events(cluster: Cluster, reason: str) -> list:
    return [e for e in cluster.core.list_namespaced_event(NAMESPACE).items if e.reason == reason]


def _room_since(cluster: Cluster) -> str | None:
    return cluster.status(NAMESPACE, "grow").get("elastic", {}).get("roomSince")


def test_a_gang_grows_back_only_after_stable_room_and_the_resize_interval(
    control_plane_binaries, tmp_path
):
    """Shrunk at T0; room comes back, goes (the node deleted again) and comes back at R: the gang
    grows no earlier than R + growStableSeconds and T0 + minResizeIntervalSeconds."""
    with simulated(control_plane_binaries, NAMESPACE, tmp_path / "operator.log") as sim:
        cluster, progress, kubelet, operator = sim.cluster, sim.progress, sim.kubelet, sim.operator
        _checkpoint_volume(cluster, NAMESPACE)
        nodes = [cluster.add_node(POOL, gpus=2, name=f"gpu-{i}") for i in range(4)]
        operator.start()
        progress.document = _report(100)
        cluster.apply(
            JobBuilder("grow", NAMESPACE, POOL)
            .layout(data=4, tensor=2, gpus_per_node=2)
            .parallelism(microBatches=3)
            .training(microBatch=2)
            .checkpoint(claimName="ckpt")
            .run_policy(
                elastic={
                    "minData": 2,
                    "maxData": 4,
                    "growStableSeconds": STABLE,
                    "minResizeIntervalSeconds": INTERVAL,
                }
            )
            .metrics(port=progress.port)
        )
        _gang_running(cluster, 4)
        _seen(cluster, "lastCheckpointStep", 100)
        progress.document = NOTHING_YET
        cluster.core.delete_node(nodes[3])
        kubelet.lose(nodes[3])
        status = _gang_running(cluster, 3)
        shrunk_at = conditions.parse_time(status["elastic"]["resizedAt"])
        assert shrunk_at is not None and status["elastic"].get("roomSince") is None
        gang = {p.metadata.uid for p in cluster.pods(NAMESPACE, "grow")}

        progress.document = _report(120)
        _seen(cluster, "lastCheckpointStep", 120)
        kubelet.gone.discard(nodes[3])
        cluster.add_node(POOL, gpus=2, name=nodes[3])
        progress.document = _report(170)  # a checkpoint since the shrink: only the periods hold it
        first = wait_for("room found", lambda: _room_since(cluster), timeout=60)
        [pending] = wait_for(
            "the pending grow's Event", lambda: _events(cluster, "ElasticGrowPending")
        )
        assert f"growStableSeconds={STABLE}" in pending.message

        cluster.core.delete_node(nodes[3])  # the room goes before it lasted: it must last again
        wait_for("room lost", lambda: _room_since(cluster) is None, timeout=60)
        assert {p.metadata.uid for p in cluster.pods(NAMESPACE, "grow")} == gang
        cluster.add_node(POOL, gpus=2, name=nodes[3])
        again = wait_for("room found again", lambda: _room_since(cluster), timeout=60)
        assert again != first

        status = _gang_running(cluster, 4)
        assert status["elastic"]["data"] == 4 and status["restarts"] == 1
        [growing] = wait_for("the grow's Event", lambda: _events(cluster, "ElasticGrowing"))
        grew_at = growing.first_timestamp
        room_at = conditions.parse_time(again)
        assert room_at is not None
        assert (grew_at - room_at).total_seconds() >= STABLE
        assert (grew_at - shrunk_at).total_seconds() >= INTERVAL
        assert status["elastic"]["resizedAt"] >= conditions.timestamp(grew_at)
