"""The node-set reservation on a real API server and kube-scheduler (the test plays the kubelet).

A gang of four pods that requires one leaf waits while a meshtrain job holds a node of the only
leaf with four nodes, though the fleet has five free nodes (the slot count that used to be
reserved): once it has waited past the threshold, that leaf is reserved for it.  Small jobs that
fit beside it place on the other leaf (backfill); one that would need a reserved node waits; a
running job's spare node is not taken from the reserved leaf; an operator restart keeps the wait
(the holder holds again at once, before the threshold could have passed anew).  When the meshtrain
job holding the leaf ends, the gang is bound on the four nodes kept for it: had any other path
taken one, it could not be.  A running gang's lost pod is replaced outside the reserved nodes
when another node can take it.
"""

from __future__ import annotations

import contextlib
import datetime
import time
import uuid
from collections.abc import Iterator

import pytest

from meshtrain.operator.policy import reservation
from tests.builders import POOL_LABEL, JobBuilder
from tests.integration.operator.cluster import Cluster, OperatorProcess, wait_for
from tests.integration.operator.test_operator_chaos import Kubelet

pytestmark = pytest.mark.integration

LEAF = "meshtrain.test/leaf"
RESERVE_AFTER = 15
"""The threshold under test (``--reserve-after-seconds`` through its env): long enough that a
restart that forgot the wait could not hold again before the test looks."""
HOLDS = "holds the reservation"
"""The operator's log line when it planned a holder's node set."""


def _bound_nodes(cluster: Cluster, namespace: str, job: str) -> set[str]:
    """The nodes of ``job``'s pods, once kube-scheduler bound every one."""

    def bound() -> set[str] | None:
        pods = [p for p in cluster.pods(namespace, job) if not p.metadata.deletion_timestamp]
        nodes = [p.spec.node_name for p in pods]
        return set(nodes) if pods and all(nodes) else None

    return wait_for(f"{namespace}/{job} bound", bound, 60)


def _seconds(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _holds(log: str) -> int:
    with open(log) as lines:
        return sum(HOLDS in line for line in lines)


@contextlib.contextmanager
def _operated(
    control_plane_binaries, log: str, reserve_after: float
) -> Iterator[tuple[Cluster, OperatorProcess, str, str]]:
    """A private control plane, a stand-in kubelet, an operator whose reservation threshold is
    ``reserve_after`` seconds (through its env), a namespace and a node pool name."""
    with Cluster.private(control_plane_binaries) as cluster, Kubelet(cluster):
        env = {"MESHTRAIN_RESERVE_AFTER_SECONDS": str(reserve_after)}
        operator = OperatorProcess(cluster.kubeconfig, log, env=env, resync_seconds=1)
        operator.start()
        try:
            namespace, pool = f"res-{uuid.uuid4().hex[:6]}", f"p{uuid.uuid4().hex[:6]}"
            cluster.core.create_namespace({"metadata": {"name": namespace}})
            yield cluster, operator, namespace, pool
        finally:
            operator.stop()


def test_a_waiting_gang_gets_its_node_set_and_only_what_fits_beside_it_places(
    control_plane_binaries, tmp_path
):
    log = str(tmp_path / "operator.log")
    with _operated(control_plane_binaries, log, RESERVE_AFTER) as (
        cluster,
        operator,
        namespace,
        pool,
    ):
        leaf_a = {cluster.add_node(pool, gpus=2, labels={LEAF: "a"}) for _ in range(4)}
        leaf_b = {cluster.add_node(pool, gpus=2, labels={LEAF: "b"}) for _ in range(2)}
        filler = JobBuilder("filler", namespace, pool).layout(data=2).gpus(2)
        cluster.apply(filler.resources(nodeSelector={POOL_LABEL: pool, LEAF: "a"}))
        assert _bound_nodes(cluster, namespace, "filler") <= leaf_a

        big = JobBuilder("big", namespace, pool).layout(data=8).gpus(2)  # 4 pods of 2 GPUs
        cluster.apply(big.topology(levels=[{"label": LEAF, "mode": "required"}]))
        wait_for(
            "the gang waits",
            lambda: cluster.condition(namespace, "big", "Placed").get("status") == "False",
        )
        wait_for("its node set reserved", lambda: _holds(log) > 0, RESERVE_AFTER + 60)
        (event,) = cluster.events(namespace, "big", "NodesReserved")
        assert event.message.endswith(", ".join(sorted(leaf_a)))  # the only leaf of four

        for name in ("small-1", "small-2"):  # backfill: the other leaf takes them
            job = JobBuilder(name, namespace, pool).layout(data=2).gpus(2)
            if name == "small-2":  # and its spare node may not come from the reserved leaf
                job.run_policy(recovery={"spareNodes": 1})
            cluster.apply(job)
            assert _bound_nodes(cluster, namespace, name) <= leaf_b
        cluster.wait_phase(namespace, "small-2", "Running", timeout=60)

        held = _holds(log)
        operator.stop()
        operator.start()
        restarted = time.monotonic()
        wait_for("the holder holds again", lambda: _holds(log) > held, 60)
        assert time.monotonic() - restarted < RESERVE_AFTER  # not a wait counted anew
        cluster.apply(JobBuilder("small-3", namespace, pool).layout(data=2).gpus(2))
        cluster.wait_reason(namespace, "small-3", "Placed", "ReservedForLongestWaiting")
        assert not cluster.pods(namespace, "small-3")  # three reserved nodes are free

        cluster.delete_job(namespace, "filler")  # the meshtrain job on the leaf ends
        assert _bound_nodes(cluster, namespace, "big") == leaf_a

        cluster.delete_job(namespace, "big")  # the leaf frees: the spare and small-3 take it
        spares = wait_for(
            "a spare node reserved",
            lambda: cluster.status(namespace, "small-2").get("spares"),
            150,  # its tries back off while there was no room
        )
        assert {s["node"] for s in spares} <= leaf_a
        assert _bound_nodes(cluster, namespace, "small-3") <= leaf_a


def test_a_lost_pod_is_replaced_outside_the_reserved_nodes_when_another_node_can_take_it(
    control_plane_binaries, tmp_path
):
    """A running gang of two in leaf a loses pod 1 while leaf a is reserved for a waiting gang:
    the replacement goes to the node of leaf c, though leaf a's free node is nearer its survivor
    (where the fabric cost model alone puts it)."""
    log = str(tmp_path / "operator.log")
    with _operated(control_plane_binaries, log, 3) as (cluster, operator, namespace, pool):
        leaf_a = {cluster.add_node(pool, gpus=2, labels={LEAF: "a"}) for _ in range(3)}
        (leaf_c,) = {cluster.add_node(pool, gpus=2, labels={LEAF: "c"})}
        keep = JobBuilder("keep", namespace, pool).layout(data=4).gpus(2)
        cluster.apply(keep.topology(levels=[{"label": LEAF, "mode": "preferred"}]))
        assert _bound_nodes(cluster, namespace, "keep") < leaf_a  # one leaf: the cheapest
        cluster.wait_phase(namespace, "keep", "Running", timeout=60)

        big = JobBuilder("big", namespace, pool).layout(data=6).gpus(2)  # 3 pods in leaf a
        cluster.apply(big.topology(levels=[{"label": LEAF, "mode": "required"}]))
        wait_for("leaf a reserved", lambda: _holds(log) > 0, 60)
        (event,) = cluster.events(namespace, "big", "NodesReserved")
        assert event.message.endswith(", ".join(sorted(leaf_a)))

        cluster.core.delete_namespaced_pod("keep-r0-1", namespace)
        replaced = wait_for(
            "pod 1 replaced and bound",
            lambda: next(
                (
                    p.spec.node_name
                    for p in cluster.pods(namespace, "keep")
                    if p.metadata.name == "keep-r0-1-p1" and p.spec.node_name
                ),
                None,
            ),
            60,
        )
        assert replaced == leaf_c


def test_a_job_whose_deadline_ends_it_before_the_reserved_nodes_clear_backfills_them(
    control_plane_binaries, tmp_path
):
    """Leaf a's four nodes are reserved for a gang of four while a job whose
    ``activeDeadlineSeconds`` is 600 holds one of them: by the declared limits the gang cannot
    start there for about 11 minutes.  A one-pod job without a deadline, or with one that would
    outlast that, waits for the reservation; one whose 20 s deadline ends it in time is placed on
    a reserved node (a ``Backfilled`` Event) and is failed at its deadline, its node given back,
    though its tenant raised the deadline once it was there."""
    log = str(tmp_path / "operator.log")
    with _operated(control_plane_binaries, log, 3) as (cluster, operator, namespace, pool):
        leaf_a = {cluster.add_node(pool, gpus=2, labels={LEAF: "a"}) for _ in range(4)}
        filler = JobBuilder("filler", namespace, pool).layout(data=2).gpus(2)
        cluster.apply(filler.run_policy(activeDeadlineSeconds=600))
        assert _bound_nodes(cluster, namespace, "filler") <= leaf_a

        big = JobBuilder("big", namespace, pool).layout(data=8).gpus(2)  # 4 pods of 2 GPUs
        cluster.apply(big.topology(levels=[{"label": LEAF, "mode": "required"}]))
        wait_for("leaf a reserved", lambda: _holds(log) > 0, 60)

        for name, deadline in (("unlimited", None), ("too-long", 3600)):
            job = JobBuilder(name, namespace, pool).layout(data=2).gpus(2)
            cluster.apply(job.run_policy(activeDeadlineSeconds=deadline) if deadline else job)
            cluster.wait_reason(namespace, name, "Placed", "ReservedForLongestWaiting")
            message = cluster.condition(namespace, name, "Placed")["message"]
            assert "runPolicy.activeDeadlineSeconds" in message  # says how to backfill

        short = JobBuilder("short", namespace, pool).layout(data=2).gpus(2)
        cluster.apply(short.run_policy(activeDeadlineSeconds=20))
        assert _bound_nodes(cluster, namespace, "short") <= leaf_a
        (event,) = cluster.events(namespace, "short", "Backfilled")
        assert f"reserved for {namespace}/big, the job that has waited longest" in event.message
        assert cluster.status(namespace, "short")["backfill"]["holder"] == f"{namespace}/big"
        # its tenant raises the deadline once on the reserved node: the one it came with holds
        cluster.patch_job(namespace, "short", {"runPolicy": {"activeDeadlineSeconds": 3600}})
        failed = cluster.wait_reason(namespace, "short", "Failed", "DeadlineExceeded", timeout=90)
        assert "status.backfill.deadlineAt" in failed["message"]
        started = cluster.status(namespace, "short")["startTime"]
        ran = _seconds(failed["lastTransitionTime"]) - _seconds(started)
        assert 20 <= ran <= 20 + reservation.ENFORCE_SLACK_SECONDS, ran  # its bound held
        for name in ("unlimited", "too-long", "big"):  # nothing else took the reserved nodes
            assert not [p for p in cluster.pods(namespace, name) if p.spec.node_name], name


def test_the_reserved_node_set_is_the_one_that_clears_soonest_by_the_declared_limits(
    control_plane_binaries, tmp_path
):
    """Three nodes of a pool: a and c in leaf a, b in leaf b (and free nodes of another pool); a
    job with a one-hour limit holds a, one with
    a ten-minute limit holds b.  A gang of two that prefers one leaf is reserved b and c, which
    are clear within about eleven minutes by the limits, not a and c, one leaf but clear only in
    an hour: the set EASY backfill keeps for the job at the head of the queue."""
    log = str(tmp_path / "operator.log")
    with _operated(control_plane_binaries, log, 3) as (cluster, operator, namespace, pool):
        a = cluster.add_node(pool, gpus=2, labels={LEAF: "a"})
        c = cluster.add_node(pool, gpus=2, labels={LEAF: "a"})
        b = cluster.add_node(pool, gpus=2, labels={LEAF: "b"})
        for _ in range(3):  # free, but not the gang's pool: no end of theirs counts
            cluster.add_node(f"{pool}x", gpus=2, labels={LEAF: "a"})
        for name, node, deadline in (("hour", a, 3600), ("minutes", b, 600)):
            job = JobBuilder(name, namespace, pool).layout(data=2).gpus(2)
            job.resources(nodeSelector={POOL_LABEL: pool, "kubernetes.io/hostname": node})
            cluster.apply(job.run_policy(activeDeadlineSeconds=deadline))
            assert _bound_nodes(cluster, namespace, name) == {node}
        big = JobBuilder("big", namespace, pool).layout(data=4).gpus(2)  # 2 pods of 2 GPUs
        cluster.apply(big.topology(levels=[{"label": LEAF, "mode": "preferred"}]))
        wait_for("its node set reserved", lambda: _holds(log) > 0, 60)
        (event,) = cluster.events(namespace, "big", "NodesReserved")
        assert event.message.endswith(", ".join(sorted({b, c})))
        # it says when they clear: at the ten-minute job's end, its grace and the slack after
        said = event.message.split(f"{reservation.CLEAR_BY} ", 1)[1].split(" ", 1)[0]
        began = _seconds(cluster.status(namespace, "minutes")["startTime"])
        after = reservation.DEFAULT_GRACE_SECONDS + reservation.ENFORCE_SLACK_SECONDS
        assert _seconds(said) == began + 600 + after, (said, began)
