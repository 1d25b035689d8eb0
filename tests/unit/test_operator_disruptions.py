"""A gang restart caused by the infrastructure (node lost, eviction, preemption, drain) does not use
runPolicy.backoffLimit; one caused by the job's own failures does."""

from __future__ import annotations

import dataclasses

import pytest

from meshtrain.operator.policy import conditions, job_actions, lifecycle, pod_failure, pod_state
from tests.builders import JobBuilder
from tests.unit.test_operator_container_reasons import kubelet_pod, read, terminated
from tests.unit.test_operator_lifecycle import at, job, kinds, placed_status, pod, status_of


def spec(limit: int) -> dict:
    return JobBuilder().layout(data=2, gpus_per_node=1).run_policy(backoffLimit=limit).raw()


def node_lost(index: int) -> pod_state.PodState:
    return dataclasses.replace(pod(index, "Failed", attempt=1), reason="NodeLost")


def test_a_lost_node_restarts_the_gang_even_with_the_backoff_limit_used_up():
    state = job(spec(1), **placed_status(phase="Running", restarts=1))
    decision = lifecycle.decide(state, [pod(0, "Running", attempt=1), node_lost(1)], at(5))
    status = status_of(decision)
    assert status["phase"] == "Restarting", status
    assert status["restarts"] == 2 and status["disruptionRestarts"] == 1
    assert "not counted against backoffLimit=1" in next(
        a.message for a in decision.actions if isinstance(a, job_actions.Emit)
    )


def test_disrupted_and_unknown_pods_are_disruptions_but_a_crash_is_not():
    evicted = pod(1, "Running", disrupted=True)
    assert pod_failure.classify(evicted).disruption
    assert pod_failure.classify(pod(1, "Unknown")).disruption
    assert not pod_failure.classify(pod(1, "Failed", exit_code=1)).disruption
    assert not pod_failure.classify(
        pod(1, "Failed", exit_code=3)
    ).disruption  # permanent stays permanent


def test_own_failures_still_exhaust_the_limit_and_disruptions_do_not_hide_them():
    # 3 restarts so far, 2 of them disruptions: 1 of backoffLimit 1 used by the job itself.
    state = job(spec(1), **placed_status(phase="Running", restarts=3, disruptionRestarts=2))
    crashed = [pod(0, "Running", attempt=3), pod(1, "Failed", attempt=3, exit_code=1)]
    decision = lifecycle.decide(state, crashed, at(5))
    assert status_of(decision)["phase"] == "Failed"
    reasons = [a.reason for a in decision.actions if isinstance(a, job_actions.Emit)]
    assert reasons == [conditions.BACKOFF_LIMIT_EXCEEDED]
    # With one disruption fewer the job's own restart is still within the limit.
    state = job(spec(2), **placed_status(phase="Running", restarts=3, disruptionRestarts=2))
    decision = lifecycle.decide(state, crashed, at(5))
    assert status_of(decision)["phase"] == "Restarting" and "DeletePods" in kinds(decision)
    assert "disruptionRestarts" not in status_of(decision)


def test_a_pod_that_vanished_with_its_node_is_a_disruption():
    """PodGC force-deletes the pods of a deleted Node: the pod is simply gone, its node too."""
    state = job(spec(1), **placed_status(phase="Running", restarts=1))
    survivors = [pod(0, "Running", attempt=1)]
    decision = lifecycle.decide(state, survivors, at(5), None, frozenset({"n1"}))
    status = status_of(decision)
    assert status["phase"] == "Restarting" and status["disruptionRestarts"] == 1
    # The node still there: the pod's disappearance is the job's own failure (limit used up).
    decision = lifecycle.decide(state, survivors, at(5), None, frozenset({"n0"}))
    assert status_of(decision)["phase"] == "Failed"


# Reasons the kubelet gives a pod it refuses at admission (kubernetes pkg/kubelet/lifecycle
# predicate.go: "OutOf" + the resource name; the device manager's allocation failure:
# UnexpectedAdmissionError): the pod never ran, the node refused it.
KUBELET_REJECTIONS = ("OutOfnvidia.com/gpu", "OutOfcpu", "OutOfpods", "UnexpectedAdmissionError")


def test_a_pod_refused_by_the_kubelet_at_admission_is_a_disruption():
    for reason in KUBELET_REJECTIONS:
        refused = dataclasses.replace(pod(1, "Failed"), reason=reason)
        found = pod_failure.classify(refused)
        assert found is not None and found.disruption, reason
    for reason in ("OutOf", "DeadlineExceeded", None):
        failed = dataclasses.replace(pod(1, "Failed"), reason=reason)
        assert not pod_failure.classify(failed).disruption, reason


def test_a_gang_refused_by_a_kubelet_restarts_without_using_the_backoff_limit():
    state = job(spec(1), **placed_status(phase="Running", restarts=1))
    refused = dataclasses.replace(pod(1, "Failed", attempt=1), reason="OutOfnvidia.com/gpu")
    decision = lifecycle.decide(state, [pod(0, "Running", attempt=1), refused], at(5))
    status = status_of(decision)
    assert status["phase"] == "Restarting", status
    assert status["restarts"] == 2 and status["disruptionRestarts"] == 1


# What the real kubelet (v1.36, the e2e sandbox: tests/e2e/test_sandbox_disruptions.py) wrote on a
# running pod it refused after its node's nvidia.com/gpu capacity dropped to 0 and it restarted:
# the pod's reason and message, and the trainer container killed by it (torchrun exits 1 on SIGTERM).
REFUSED_BY_THE_KUBELET = {
    "reason": "OutOfnvidia.com/gpu",
    "message": (
        "Pod was rejected: Node didn't have enough resource: nvidia.com/gpu, "
        "requested: 1, used: 0, capacity: 0"
    ),
}
TORCHRUN_ON_SIGTERM = (
    "torch.distributed.elastic.multiprocessing.api.SignalException: Process 1 got signal: 15\n"
)


@pytest.mark.parametrize("code", [1, 2, 137])
def test_a_running_pod_the_kubelet_refuses_is_a_disruption_named_by_the_kubelet(code):
    # Whatever its killed container exited with: even a code that would be permanent (2) is the
    # consequence of the refusal, not the job's own failure.
    manifest = kubelet_pod(
        0,
        phase="Failed",
        attempt=1,
        **REFUSED_BY_THE_KUBELET,
        **terminated("Error", code, TORCHRUN_ON_SIGTERM),
    )
    [refused] = read(manifest)
    found = pod_failure.classify(refused)
    assert found is not None and found.disruption and not found.permanent, found
    assert found.message == (
        f"pod {refused.name} ended by node n0: OutOfnvidia.com/gpu: "
        + REFUSED_BY_THE_KUBELET["message"]
    )
    assert found.reason is None, "a condition reason may not hold '.' or '/'"
