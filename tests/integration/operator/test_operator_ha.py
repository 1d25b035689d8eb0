"""Two operator replicas on the real API server: one leads through a Lease, the other takes over.

:class:`invariants.Invariants` checks every pod and node event: no slot (job,
node rank) ever holds two pods, no node more GPUs than it has.
The session operator is stopped for the test (it would act too) and started
again at the end.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import kubernetes
import pytest

from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster, OperatorProcess, wait_for
from tests.integration.operator.invariants import Invariants

pytestmark = pytest.mark.integration


@pytest.fixture
def replicas(cluster, operator, namespace, tmp_path) -> Iterator[list[OperatorProcess]]:
    operator.stop()
    made = [
        OperatorProcess(
            cluster.kubeconfig,
            str(tmp_path / f"{who}.log"),
            scope=("--namespace", namespace),
            lease=f"ha-{namespace}",
            identity=f"{who}-{namespace}",
        )
        for who in ("a", "b")
    ]
    try:
        yield made
    finally:
        for replica in made:
            replica.stop()
        operator.start()


def _holder(cluster: Cluster, lease: str) -> str | None:
    coordination = kubernetes.client.CoordinationV1Api(cluster.core.api_client)
    try:
        return coordination.read_namespaced_lease(lease, "default").spec.holder_identity
    except kubernetes.client.ApiException:
        return None


def _ranks(cluster: Cluster, namespace: str, job: str) -> list[str]:
    return sorted(
        p.metadata.labels["meshtrain.io/node-rank"]
        for p in cluster.pods(namespace, job)
        if not p.metadata.deletion_timestamp
    )


def test_standby_takes_over_mid_placement_and_restarts_count_once(
    cluster, namespace, pool, replicas
):
    first, second = replicas
    lease = first.lease
    for _ in range(8):
        cluster.add_node(pool, gpus=8)
    first.start()
    wait_for("a leads", lambda: _holder(cluster, lease) == first.identity)
    second.start()
    invariants = Invariants(cluster.core).start()
    try:
        cluster.apply(JobBuilder("ha", namespace, pool).layout(data=64).gpus(1))
        wait_for("the leader creates pods", lambda: cluster.pods(namespace, "ha"), interval=0.01)
        first.kill()  # mid-placement: the gang is partly created, its gates still on
        created = len(cluster.pods(namespace, "ha"))
        cluster.wait_gang(namespace, "ha", 64, timeout=60)
        assert _holder(cluster, lease) == second.identity
        assert _ranks(cluster, namespace, "ha") == sorted(str(i) for i in range(64))
        assert cluster.status(namespace, "ha").get("restarts", 0) == 0

        # One pod fails; the leader dies right after it: the restart is counted exactly once.
        first.start()  # back as a standby
        cluster.set_pod_phase(namespace, "ha-r0-5", "Failed", exit_code=1)
        second.kill()
        cluster.wait_gang(namespace, "ha", 64, timeout=60, attempt=1)
        assert _holder(cluster, lease) == first.identity
        time.sleep(2)  # a second count would show up within a few passes
        assert cluster.status(namespace, "ha")["restarts"] == 1
        assert _ranks(cluster, namespace, "ha") == sorted(str(i) for i in range(64))
    finally:
        invariants.stop()
    assert invariants.events > 0 and invariants.violations == [], invariants.violations
    print(f"leader killed with {created}/64 pods created; {invariants.events} events checked")


def test_a_crash_restarted_leader_resumes_at_once(cluster, namespace, pool, tmp_path, replicas):
    """With a 60 s Lease, resuming before it expires shows the restart did not wait for it."""
    leader = OperatorProcess(
        cluster.kubeconfig,
        str(tmp_path / "long.log"),
        scope=("--namespace", namespace),
        lease=f"long-{namespace}",
        lease_seconds=60,
    )
    cluster.add_node(pool, gpus=8)
    try:
        leader.start()
        wait_for("it leads", lambda: _holder(cluster, leader.lease) == leader.identity)
        leader.kill()
        restarted = time.monotonic()
        leader.start()
        cluster.apply(JobBuilder("again", namespace, pool).layout(data=2).gpus(1))
        cluster.wait_gang(namespace, "again", 2, timeout=40)
        assert time.monotonic() - restarted < 40  # the dead leader's Lease had 60 s left
    finally:
        leader.stop()


def test_a_replica_whose_health_port_was_taken_since_it_was_picked_starts_on_new_ports(
    cluster, replicas
):
    """The test harness's ports are free "a moment ago"; CI once lost one to another process
    between the pick and the operator's bind, and every test of the session failed with it."""
    replica = replicas[0]
    taken = replica.health_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        replica.start()
        assert replica.health_port != taken
        with open(replica.log_path, encoding="utf-8") as log:
            assert "address already in use" in log.read()
    assert replica.alive()
