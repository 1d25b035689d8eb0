"""Who disrupted a gang decides what the restart costs: a node-caused disruption spends
runPolicy.disruptionRestartLimit and a node that does it twice is excluded; a preemption spends
neither, but repeated preemptions are spaced too (issue #32 item 5, review findings 5 and 6).

Each pod carries the status its disrupter writes, taken from the Kubernetes source: the kubelet's
admission rejection (``rejectPod``: phase Failed, its reason, "Pod was rejected: " + message), and
the ``DisruptionTarget`` condition of kube-scheduler's preemption, the taint manager, PodGC, the
Eviction API and the kubelet's node-pressure eviction.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from meshtrain.api.spec import status as api_status
from meshtrain.operator.policy import (
    capacity_queue,
    conditions,
    disruption_budget,
    excluded_nodes,
    lifecycle,
    placement_status,
    queue_order,
)
from tests.unit.test_operator_container_reasons import (
    EVICTED,
    at,
    disruption_target,
    job,
    kubelet_pod,
    read,
    running,
    spec,
    status_of,
    terminated,
)

# (status.reason, message) of a pod the kubelet refused at admission (pkg/kubelet/lifecycle,
# cm/topologymanager TopologyAffinityError, cm/cpumanager SMTAlignmentError).
ADMISSION_REJECTIONS = (
    ("TopologyAffinityError", "Resources cannot be allocated with Topology locality"),
    ("SMTAlignmentError", "SMT Alignment Error: requested 3 cpus not multiple cpus per core = 2"),
    ("NodeAffinity", "Predicate NodeAffinity failed"),
    ("UnexpectedAdmissionError", "Allocate failed due to no healthy devices present"),
)
# DisruptionTarget (reason, message) of a pod taken back for other work, the node healthy.
PREEMPTIONS = (
    ("PreemptionByScheduler", "default-scheduler: preempting to accommodate a higher priority pod"),
    ("EvictionByEvictionAPI", "Eviction API: evicting"),
)
# DisruptionTarget (reason, message) of a pod its node ended.
NODE_CAUSED = (
    ("DeletionByTaintManager", "Taint manager: deleting due to NoExecute taint"),
    ("DeletionByPodGC", "PodGC: node no longer exists"),
    ("TerminationByKubelet", EVICTED),
)


def rejected(node_index: int, attempt: int, reason: str, message: str) -> dict[str, Any]:
    """Pod 1 of ``attempt`` on node ``n<node_index>`` refused by that node's kubelet."""
    pod = kubelet_pod(1, phase="Failed", attempt=attempt, reason=reason)
    pod["status"]["message"] = f"Pod was rejected: {message}"
    pod["spec"]["nodeName"] = f"n{node_index}"
    pod["status"].pop("podIP")
    return pod


def disrupted(attempt: int, reason: str, message: str, node: str = "n1") -> dict[str, Any]:
    """Pod 1 of ``attempt``, running on ``node``, marked DisruptionTarget and being deleted."""
    pod = kubelet_pod(1, phase="Running", attempt=attempt, **running())
    pod["spec"]["nodeName"] = node
    pod["metadata"]["deletionTimestamp"] = conditions.timestamp(at(29))
    pod["status"]["conditions"] = [disruption_target(reason, message)]
    return pod


def cycle(
    raw: dict[str, Any], status: dict[str, Any], seconds: float, failed: dict[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """One pass at ``seconds`` over the gang of ``status``: pod 0 running, pod 1 ``failed``."""
    attempt = int(status.get("restarts") or 0)
    node = failed["spec"]["nodeName"]
    placement = [{"podIndex": 0, "node": "n0"}, {"podIndex": 1, "node": node}]
    state = job(raw, **{**status, "placement": placement, "phase": "Placing"})
    pods = read(kubelet_pod(0, phase="Running", attempt=attempt, **running()), failed)
    decision = lifecycle.decide(state, pods, at(seconds))
    return decision, {**status, **status_of(decision)}


def first_status() -> dict[str, Any]:
    return {"conditions": job().status["conditions"], "startTime": conditions.timestamp(at(0))}


@pytest.mark.parametrize(("reason", "message"), ADMISSION_REJECTIONS)
def test_a_kubelet_admission_rejection_is_a_disruption_and_twice_excludes_the_node(reason, message):
    raw = spec(backoffLimit=0)
    _, status = cycle(raw, first_status(), 30, rejected(1, 0, reason, message))
    assert status["phase"] == "Restarting" and status["disruptionRestarts"] == 1
    assert status["disruptions"]["nodes"][0]["reason"] == reason
    _, status = cycle(raw, status, 60, rejected(1, 1, reason, message))
    assert status["phase"] == "Restarting" and status["disruptions"]["streak"] == 2
    assert excluded_nodes.excluded(status, at(61)) == {"n1"}
    [excluded] = status["excludedNodes"]
    assert excluded["reason"] == disruption_budget.REASON and reason in excluded["message"]


@pytest.mark.parametrize(("reason", "message"), PREEMPTIONS)
def test_a_preemption_spends_no_budget_excludes_no_node_and_is_spaced_when_repeated(
    reason, message
):
    raw = spec(backoffLimit=0, disruptionRestartLimit=1)
    status, second, waits = first_status(), 30.0, []
    for attempt in range(4):
        decision, status = cycle(raw, status, second, disrupted(attempt, reason, message))
        assert status["phase"] == "Restarting", status.get("conditions")
        waits.append(decision.requeue_after or 0.0)
        second += waits[-1] + 1
    record = status["disruptions"]
    assert record["streak"] == 0 and record["preemptions"] == 4 and record["nodes"] == []
    assert "excludedNodes" not in status and status["disruptionRestarts"] == 4
    assert api_status.TrainingJobStatus.model_validate(status).disruptions is not None
    assert waits[0] == 0 and all(w > 0 for w in waits[1:]) and waits[1:] == sorted(waits[1:])
    shown = conditions.find(status["conditions"], conditions.RUNNING)
    assert shown is not None and reason in shown["message"]
    assert "not counted against disruptionRestartLimit=1" in shown["message"]


@pytest.mark.parametrize(("reason", "message"), NODE_CAUSED)
def test_a_node_caused_disruption_target_spends_the_budget_and_excludes_the_node(reason, message):
    raw = spec(backoffLimit=0, disruptionRestartLimit=1)
    _, status = cycle(raw, first_status(), 30, disrupted(0, reason, message))
    assert status["phase"] == "Restarting" and status["disruptions"]["streak"] == 1
    [entry] = status["disruptions"]["nodes"]
    assert entry["node"] == "n1" and entry["reason"] == reason
    _, status = cycle(raw, status, 60, disrupted(1, reason, message))
    assert status["phase"] == "Failed"
    failed = conditions.find(status["conditions"], conditions.FAILED)
    assert failed is not None and failed["reason"] == disruption_budget.LIMIT_EXCEEDED


def test_the_condition_reason_is_what_is_recorded_when_the_pod_has_none():
    _, status = cycle(spec(), first_status(), 30, disrupted(0, *NODE_CAUSED[0]))
    assert status["disruptions"]["nodes"][0]["reason"] == "DeletionByTaintManager"


def test_a_preemption_after_node_disruptions_waits_longer_but_leaves_their_count():
    raw = spec(backoffLimit=0)
    taint = NODE_CAUSED[0]
    _, status = cycle(raw, first_status(), 30, disrupted(0, *taint))
    decision, status = cycle(raw, status, 40, disrupted(1, *PREEMPTIONS[0], node="n2"))
    record = status["disruptions"]
    assert record["streak"] == 1 and record["preemptions"] == 1
    assert [n["node"] for n in record["nodes"]] == ["n1"]  # the preempting node is not counted
    assert decision.requeue_after is not None and decision.requeue_after >= 5


def test_a_gang_rebuilt_for_a_disruption_keeps_its_place_among_the_waiting_and_its_own_failure_does_not():
    """Placed after waiting since T0 - 10 min, ``queuedSince`` records that wait.  A node lost (a
    disruption, not the job's doing) rebuilds the gang: it waits from T0 - 10 min again, ahead of
    jobs that came later, as Kueue keeps a preempted workload's creation time, and its next
    placement keeps that time.  Its spec edited while it waits (a new generation) waits from the
    rebuild instead.  Its trainer failing (its own doing) rebuilds it too, but it waits from that
    failure."""
    began = at(-600)
    waiting = conditions.set([], conditions.PLACED, conditions.FALSE, "InsufficientGPUs", "", began)
    unplaced = job(conditions=waiting, placement=[])
    placed = placement_status.placed(unplaced, ["n0", "n1"], {}, at(0))
    assert placed["queuedSince"] == conditions.timestamp(began)
    assert placed["queuedGeneration"] == unplaced.generation == 1
    status = {**first_status(), **queue_order.queued(unplaced.status, at(0), 1)}
    _, lost = cycle(spec(), status, 30, disrupted(0, *NODE_CAUSED[0]))
    assert lost["phase"] == "Restarting" and lost["queuedSince"] == conditions.timestamp(began)
    assert queue_order.since_of(lost, at(31), 1) == began.timestamp()
    again = placement_status.placed(job(**lost), ["n2", "n1"], {}, at(40))
    assert again["queuedSince"] == conditions.timestamp(began)
    edited = dataclasses.replace(job(**lost), generation=2)  # its spec changed while it waited
    assert queue_order.since_of(lost, at(31), 2) == at(30).timestamp()
    assert placement_status.placed(edited, ["n2", "n1"], {}, at(40))["queuedSince"] == (
        conditions.timestamp(at(30))
    )
    own = kubelet_pod(1, phase="Failed", attempt=0, **terminated("Error", 1))
    _, failed = cycle(spec(), status, 30, own)
    assert failed["phase"] == "Restarting" and failed.get("queuedSince") is None
    assert queue_order.since_of(failed, at(31), 1) == at(30).timestamp()


def test_the_job_that_kept_its_place_holds_the_reservation_before_a_later_one():
    """Of two jobs waiting now, the one rebuilt for a disruption (its wait kept from an hour ago)
    holds the reservation before the one that began to wait ten minutes ago."""
    now = at(3600)
    kept = {
        "conditions": conditions.set([], conditions.PLACED, conditions.FALSE, "x", "", at(3000)),
        **queue_order.queued({}, at(0), 1),
    }
    fresh = {"conditions": kept["conditions"]}
    need = capacity_queue.Need("shape", 8, 4)
    rebuilt = capacity_queue.Waiting("rebuilt", need, queue_order.since_of(kept, now, 1))
    later = capacity_queue.Waiting("later", need, queue_order.since_of(fresh, now, 1) - 1)
    assert capacity_queue.holder([later, rebuilt], now.timestamp()) == rebuilt
