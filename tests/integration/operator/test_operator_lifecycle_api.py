"""Job lifecycle against a real API server, as tables of steps: change -> expected state.

Pod state changes are status patches made by the test (no kubelet runs).
"""

from __future__ import annotations

import http.server
import json
import threading

import pytest
import yaml

from meshtrain.sandbox.controlplane.ports import pick_free_port
from tests.builders import JobBuilder
from tests.integration.operator.cluster import wait_for

pytestmark = pytest.mark.integration


def _fail_pod(cluster, namespace, job, index=0, exit_code=1, attempt=0):
    cluster.set_pod_phase(namespace, f"{job}-r{attempt}-{index}", "Failed", exit_code=exit_code)


def test_a_lost_node_does_not_use_the_backoff_limit(cluster, operator, namespace, pool):
    cluster.add_node(pool, gpus=8)
    cluster.apply(
        JobBuilder("lost", namespace, pool).layout(data=4).gpus(2).run_policy(backoffLimit=0)
    )
    cluster.wait_gang(namespace, "lost", 2)
    # What the node lifecycle controller writes on the pods of a node gone NotReady for good.
    cluster.core.patch_namespaced_pod_status(
        "lost-r0-1",
        namespace,
        {"status": {"phase": "Failed", "reason": "NodeLost", "message": "node gone"}},
    )
    pods = cluster.wait_gang(namespace, "lost", 2, attempt=1)
    assert [p.metadata.name for p in pods] == ["lost-r1-0", "lost-r1-1"]
    status = cluster.status(namespace, "lost")
    assert status["restarts"] == 1 and status["disruptionRestarts"] == 1, status
    # The job's own failure still counts: backoffLimit 0 allows none.
    _fail_pod(cluster, namespace, "lost", index=0, exit_code=1, attempt=1)
    status = cluster.wait_phase(namespace, "lost", "Failed")
    assert cluster.condition(namespace, "lost", "Failed")["reason"] == "BackoffLimitExceeded"


def test_a_pod_gone_with_its_deleted_node_does_not_use_the_backoff_limit(
    cluster, operator, namespace, pool
):
    """PodGC force-deletes the pods of a deleted Node: the operator sees the pod gone, not failed."""
    first = cluster.add_node(pool, gpus=4)
    cluster.apply(
        JobBuilder("vanished", namespace, pool).layout(data=4).gpus(2).run_policy(backoffLimit=0)
    )
    cluster.wait_gang(namespace, "vanished", 2)
    spare = cluster.add_node(pool, gpus=4)
    cluster.core.delete_node(first)
    cluster.core.delete_namespaced_pod("vanished-r0-1", namespace, grace_period_seconds=0)
    cluster.wait_gang(namespace, "vanished", 2, attempt=1)
    status = cluster.status(namespace, "vanished")
    assert status["restarts"] == 1 and status["disruptionRestarts"] == 1, status
    assert {p["node"] for p in status["placement"]} == {spare}


def test_pod_failure_restarts_the_gang_until_the_backoff_limit(cluster, operator, namespace, pool):
    cluster.add_node(pool, gpus=8)
    cluster.apply(
        JobBuilder("flaky", namespace, pool).layout(data=4).gpus(2).run_policy(backoffLimit=1)
    )
    cluster.wait_gang(namespace, "flaky", 2)
    # step 1: a retryable failure (killed by SIGKILL) -> new gang, restarts 1
    _fail_pod(cluster, namespace, "flaky", index=1, exit_code=137)
    pods = cluster.wait_gang(namespace, "flaky", 2, attempt=1)
    assert [p.metadata.name for p in pods] == ["flaky-r1-0", "flaky-r1-1"]
    assert cluster.status(namespace, "flaky")["restarts"] == 1
    # step 2: another failure with no restart left -> Failed, BackoffLimitExceeded, GPUs freed
    _fail_pod(cluster, namespace, "flaky", index=0, exit_code=1, attempt=1)
    status = cluster.wait_phase(namespace, "flaky", "Failed")
    assert status["restarts"] == 1 and status["completionTime"]
    assert cluster.condition(namespace, "flaky", "Failed")["reason"] == "BackoffLimitExceeded"
    wait_for(
        "non-failed pods deleted",
        lambda: [p.metadata.name for p in cluster.pods(namespace, "flaky")] == ["flaky-r1-0"],
    )
    assert "meshtrain_operator_gang_restarts_total" in operator.metrics()


def test_exit_code_2_fails_at_once(cluster, operator, namespace, pool):
    cluster.add_node(pool, gpus=8)
    cluster.apply(JobBuilder("badconf", namespace, pool).layout(data=2).gpus(1))
    cluster.wait_gang(namespace, "badconf", 2)
    _fail_pod(cluster, namespace, "badconf", exit_code=2)
    status = cluster.wait_phase(namespace, "badconf", "Failed")
    assert status["restarts"] == 0
    assert cluster.condition(namespace, "badconf", "Failed")["reason"] == "PermanentFailure"


def test_invalid_spec_that_only_python_can_judge_fails_with_an_event(
    cluster, operator, namespace, pool
):
    cluster.add_node(pool, gpus=8)
    # preset tiny has 4 heads: tensor=8 passes every CEL rule but not the Python one
    cluster.apply(JobBuilder("presetbad", namespace, pool).layout(tensor=8).gpus(8))
    cluster.wait_phase(namespace, "presetbad", "Failed")
    failed = cluster.condition(namespace, "presetbad", "Failed")
    assert failed["reason"] == "InvalidSpec" and "heads=" in failed["message"]
    events = wait_for(
        "InvalidSpec event",
        lambda: [
            e
            for e in cluster.core.list_namespaced_event(namespace).items
            if e.reason == "InvalidSpec"
        ],
    )
    assert events[0].involved_object.name == "presetbad"
    assert cluster.pods(namespace, "presetbad") == []


def test_suspend_removes_pods_keeps_status_and_resume_places_again(
    cluster, operator, namespace, pool
):
    cluster.add_node(pool, gpus=8)
    cluster.apply(JobBuilder("pausable", namespace, pool).layout(data=2).gpus(1))
    cluster.wait_gang(namespace, "pausable", 2)
    cluster.patch_job(namespace, "pausable", {"runPolicy": {"suspend": True}})
    status = cluster.wait_phase(namespace, "pausable", "Suspended")
    wait_for("pods removed", lambda: cluster.pods(namespace, "pausable") == [])
    assert status["layout"] == "dp2·pp1·tp1" and status["restarts"] == 0
    cluster.patch_job(namespace, "pausable", {"runPolicy": {"suspend": False}})
    cluster.wait_gang(namespace, "pausable", 2)
    assert cluster.condition(namespace, "pausable", "Suspended")["status"] == "False"


def test_spec_change_rebuilds_the_gang_from_the_new_spec(cluster, operator, namespace, pool):
    cluster.add_node(pool, gpus=8)
    cluster.apply(JobBuilder("reshape", namespace, pool).layout(data=2).gpus(1))
    old_uids = {p.metadata.uid for p in cluster.wait_gang(namespace, "reshape", 2)}
    old_hash = cluster.status(namespace, "reshape")["specHash"]
    cluster.patch_job(namespace, "reshape", {"parallelism": {"data": 4}})
    pods = wait_for(
        "the gang rebuilt as dp4",
        lambda: (
            (gang := cluster.wait_gang(namespace, "reshape", 4))
            and not old_uids & {p.metadata.uid for p in gang}
            and gang
        ),
    )
    status = cluster.status(namespace, "reshape")
    assert status["restarts"] == 0 and status["layout"] == "dp4·pp1·tp1"
    assert status["specHash"] != old_hash
    assert {p.metadata.labels["meshtrain.io/spec-hash"] for p in pods} == {status["specHash"]}
    config = cluster.core.read_namespaced_config_map("reshape-spec", namespace)
    assert yaml.safe_load(config.data["job.yaml"])["spec"]["parallelism"]["data"] == 4
    events = wait_for(
        "SpecChanged event",
        lambda: [
            e
            for e in cluster.core.list_namespaced_event(namespace).items
            if e.reason == "SpecChanged"
        ],
    )
    assert "dp4·pp1·tp1" in events[0].message


def test_delete_removes_every_child(cluster, operator, namespace, pool):
    cluster.add_node(pool, gpus=8)
    cluster.apply(JobBuilder("gone", namespace, pool).layout(data=4).gpus(2))
    cluster.wait_gang(namespace, "gone", 2)
    cluster.delete_job(namespace, "gone")
    wait_for("job deleted", lambda: cluster.job(namespace, "gone") is None)
    wait_for(
        "children deleted",
        lambda: (
            not cluster.pods(namespace, "gone")
            and not cluster.core.list_namespaced_service(namespace).items
            and not cluster.core.list_namespaced_config_map(
                namespace, label_selector="meshtrain.io/job=gone"
            ).items
        ),
    )


def test_success_then_ttl_cleanup(cluster, operator, namespace, pool):
    cluster.add_node(pool, gpus=8)
    cluster.apply(
        JobBuilder("short", namespace, pool)
        .layout(data=2)
        .gpus(1)
        .run_policy(ttlSecondsAfterFinished=2)
    )
    pods = cluster.wait_gang(namespace, "short", 2)
    for pod in pods:
        cluster.set_pod_phase(namespace, pod.metadata.name, "Running", ip="127.0.0.1")
    cluster.wait_phase(namespace, "short", "Running")
    for pod in pods:
        cluster.set_pod_phase(namespace, pod.metadata.name, "Succeeded")
    status = cluster.wait_phase(namespace, "short", "Succeeded")
    assert status["completionTime"]
    wait_for("TTL deletes the job", lambda: cluster.job(namespace, "short") is None, timeout=20)
    wait_for("and its pods", lambda: cluster.pods(namespace, "short") == [])


def test_progress_of_rank_zero_reaches_the_status(cluster, operator, namespace, pool):
    report = {
        "step": 17,
        "loss": 3.25,
        "tokens_per_second": 1234.5,
        "last_checkpoint_step": 10,
        "updated_at": "2026-01-01T00:00:00Z",
    }

    class Progress(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # http.server API
            body = json.dumps(report).encode()
            self.send_response(200 if self.path == "/progress" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    port = pick_free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Progress)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cluster.add_node(pool, gpus=8)
        cluster.apply(
            JobBuilder("talks", namespace, pool).layout(data=2).gpus(1).metrics(port=port)
        )
        for pod in cluster.wait_gang(namespace, "talks", 2):
            cluster.set_pod_phase(namespace, pod.metadata.name, "Running", ip="127.0.0.1")
        status = wait_for(
            "progress in status",
            lambda: (s := cluster.status(namespace, "talks")).get("progress") and s,
        )
        assert status["phase"] == "Running"
        assert status["progress"] == {
            "step": 17,
            "loss": 3.25,
            "tokensPerSecond": 1234.5,
            "updatedAt": "2026-01-01T00:00:00Z",
        }
        assert status["lastCheckpointStep"] == 10
        result = cluster.kubectl("get", "tj", "talks", "-n", namespace)
        assert "dp2·pp1·tp1" in result.stdout and "17" in result.stdout, result.stdout
    finally:
        server.shutdown()


def test_final_progress_from_rank_zero_termination_message_on_success(
    cluster, operator, namespace, pool
):
    cluster.add_node(pool, gpus=8)
    cluster.apply(JobBuilder("ends", namespace, pool).layout(data=2).gpus(1).training(steps=40))
    pods = cluster.wait_gang(namespace, "ends", 2)
    container = pods[0].spec.containers[0]
    assert container.termination_message_path == "/dev/termination-log"
    assert container.termination_message_policy == "FallbackToLogsOnError"
    assert {e.name: e.value for e in container.env}[
        "MESHTRAIN_TERMINATION_LOG"
    ] == "/dev/termination-log"
    for pod in (
        pods
    ):  # no IP: nothing is polled, the last report before the end is all the operator could know
        cluster.set_pod_phase(namespace, pod.metadata.name, "Running")
    cluster.wait_phase(namespace, "ends", "Running")
    final = {
        "step": 40,
        "loss": 1.75,
        "tokens_per_second": 2048.0,
        "last_checkpoint_step": 40,
        "updated_at": "2026-01-01T00:01:00Z",
    }
    cluster.set_pod_phase(namespace, "ends-r0-1", "Succeeded", message="not rank 0\n")
    cluster.set_pod_phase(namespace, "ends-r0-0", "Succeeded", message=json.dumps(final) + "\n")
    status = cluster.wait_phase(namespace, "ends", "Succeeded")
    assert status["progress"] == {
        "step": 40,
        "loss": 1.75,
        "tokensPerSecond": 2048.0,
        "updatedAt": "2026-01-01T00:01:00Z",
    }
    assert status["lastCheckpointStep"] == 40
    assert "40" in cluster.kubectl("get", "tj", "ends", "-n", namespace).stdout
