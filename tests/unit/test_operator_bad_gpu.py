"""A pod whose supervisor took one of its GPUs for bad (exit 79): replaced alone on another node,
or the gang rebuilt, and the node excluded from the job either way.

The pods are read from what a kubelet reports (``pod_state.read`` of a built pod with its
container statuses); the supervisor's end, which exits 79, runs in
``tests/trainer/test_supervise.py``.
"""

from __future__ import annotations

from typing import Any

from meshtrain.api import exitcodes
from meshtrain.operator.policy import (
    bad_gpus,
    builders,
    conditions,
    excluded_nodes,
    failure,
    job_actions,
    lifecycle,
    naming,
    pod_state,
)
from tests.builders import JobBuilder
from tests.unit.test_operator_lifecycle import at, condition, job, kinds, status_of
from tests.unit.test_operator_pod_loss import replace_of, spec, three

WHY = "rank 2's GPU (local rank 0) failed twice within 3600 s: taking it for bad"


def _terminated(code: int, message: str | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {"exitCode": code, "reason": "Error"}
    if message is not None:
        state["message"] = message
    return {"name": naming.CONTAINER, "state": {"terminated": state}, "restartCount": 0}


def _pod(
    raw: dict[str, Any], index: int, phase: str, *containers: dict[str, Any]
) -> pod_state.PodState:
    """Pod ``index`` of attempt 0 on node ``n{index}`` as its kubelet reports it."""
    state = job(raw)
    manifest = builders.build_pod(state.ref, state.spec, 0, index, f"n{index}")
    manifest["spec"].pop("schedulingGates", None)
    manifest["spec"]["nodeName"] = f"n{index}"
    running = [{"name": naming.CONTAINER, "state": {"running": {}}, "restartCount": 0}]
    manifest["status"] = {"phase": phase, "containerStatuses": list(containers) or running}
    read = pod_state.read(manifest)
    assert read is not None
    return read


def _gang(raw: dict[str, Any], **changed: pod_state.PodState) -> list[pod_state.PodState]:
    pods = {i: _pod(raw, i, "Running") for i in range(3)}
    pods.update({int(k[1:]): p for k, p in changed.items()})
    return list(pods.values())


def _left(raw: dict[str, Any], index: int, phase: str = "Failed") -> pod_state.PodState:
    report = exitcodes.failure_report(exitcodes.DEVICE_SUSPECT, WHY)
    return _pod(raw, index, phase, _terminated(exitcodes.DEVICE_SUSPECT, report))


def test_a_pod_that_left_a_bad_gpu_is_replaced_alone_and_its_node_excluded_at_once():
    raw = spec()
    decision = lifecycle.decide(job(raw, **three()), _gang(raw, p2=_left(raw, 2)), at(5))
    assert kinds(decision) == ["SetStatus", "EmitOnNode", "ReplacePods"], decision
    [entry] = status_of(decision)["excludedNodes"]
    assert (entry["node"], entry["reason"]) == ("n2", bad_gpus.REASON)
    assert WHY in entry["message"], entry
    # the node's administrator is told which rank's GPU, on the node itself
    told = decision.actions[1]
    assert isinstance(told, job_actions.EmitOnNode) and told.node == "n2"
    assert (told.note.type, told.note.reason) == ("Warning", bad_gpus.REASON)
    assert WHY in told.note.message, told
    replace = decision.actions[2]
    assert isinstance(replace, job_actions.ReplacePods)
    assert replace.indices == (2,) and replace.avoid == ("n2",)
    assert replace.causes == ((2, "j-r0-2", "a GPU taken for bad"),)
    # No room for it alone: the rebuild excludes the node too, and spends no backoffLimit.
    fallback = status_of(job_actions.Decision(replace.otherwise))
    assert fallback["restarts"] == 1 and fallback["disruptionRestarts"] == 1, fallback
    assert [e["node"] for e in fallback["excludedNodes"]] == ["n2"]
    assert "EmitOnNode" not in kinds(job_actions.Decision(replace.otherwise)), "told once"
    # The next pass (the pod still stopping) writes the exclusion no second time.
    excluded = three(excludedNodes=status_of(decision)["excludedNodes"])
    again = lifecycle.decide(job(raw, **excluded), _gang(raw, p2=_left(raw, 2)), at(6))
    assert kinds(again) == ["ReplacePods"], again
    assert "n2" in excluded_nodes.excluded(excluded, at(6))


def test_the_trainer_containers_exit_counts_while_a_sidecar_keeps_the_pod_running():
    raw = spec()
    sidecar = {"name": "log-shipper", "state": {"running": {}}, "restartCount": 0}
    report = exitcodes.failure_report(exitcodes.DEVICE_SUSPECT, WHY)
    left = _pod(raw, 1, "Running", _terminated(exitcodes.DEVICE_SUSPECT, report), sidecar)
    assert left.left_bad_gpu and not left.terminal
    decision = lifecycle.decide(job(raw, **three()), _gang(raw, p1=left), at(5))
    replace = replace_of(job_actions.Decision(decision.actions[2:]))
    assert replace.avoid == ("n1",) and replace.doomed == ("j-r0-1",)  # the sidecar is stopped
    assert [e["node"] for e in status_of(decision)["excludedNodes"]] == ["n1"]


def _pod_zero_left(raw: dict[str, Any]) -> list[pod_state.PodState]:
    """Pod 0, the store's host, left a bad GPU and halted the gang: the others exited 75."""
    gave_up = exitcodes.failure_report(exitcodes.GANG_RESTART, "the gang was halted")
    return _gang(
        raw,
        p0=_left(raw, 0),
        p1=_pod(raw, 1, "Failed", _terminated(exitcodes.GANG_RESTART, gave_up)),
        p2=_pod(raw, 2, "Failed", _terminated(exitcodes.GANG_RESTART, gave_up)),
    )


def test_pod_zero_hosting_the_store_rebuilds_the_gang_without_its_node_as_a_disruption():
    """Its supervisor halted the gang (the store leaves with it): the others exit 75, which
    follows from pod 0's leaving; no ``backoffLimit`` is spent, even at 0."""
    raw = JobBuilder().layout(data=3, gpus_per_node=1).run_policy(backoffLimit=0).raw()
    decision = lifecycle.decide(job(raw, **three()), _pod_zero_left(raw), at(5))
    status = status_of(decision)
    assert "ReplacePods" not in kinds(decision)
    assert status["restarts"] == 1 and status["disruptionRestarts"] == 1, status
    assert [(e["node"], e["reason"]) for e in status["excludedNodes"]] == [("n0", "BadGPU")]
    # the node told right after the status write, before the pods' deletion can fail
    assert kinds(decision)[:3] == ["SetStatus", "EmitOnNode", "Emit"], decision
    assert decision.actions[1] == job_actions.EmitOnNode(
        "n0",
        job_actions.Emit("Warning", bad_gpus.REASON, f"pod j-r0-0: {WHY}; excluded from the job"),
    )
    running = condition(decision, conditions.RUNNING)
    assert running is not None and running["reason"] == conditions.BAD_GPU, running
    assert "n0 excluded: a GPU there taken for bad" in running["message"], running


def test_a_job_failed_by_its_disruption_budget_still_tells_the_bad_gpus_node():
    """No exclusion is written for a failed job, but the node's administrator is told all the
    same: the GPU is as bad as on a job that goes on."""
    raw = JobBuilder().layout(data=3, gpus_per_node=1).run_policy(disruptionRestartLimit=0).raw()
    decision = lifecycle.decide(job(raw, **three()), _pod_zero_left(raw), at(5))
    assert status_of(decision)["phase"] == "Failed", status_of(decision)
    assert kinds(decision)[:3] == ["SetStatus", "EmitOnNode", "Emit"], decision
    told = decision.actions[1]
    assert isinstance(told, job_actions.EmitOnNode) and told.node == "n0"
    assert WHY in told.note.message, told


def test_a_workers_device_error_is_never_a_pods_and_other_exits_exclude_nothing():
    """78 and 80 are a worker's codes that its supervisor handles, and 79 without the
    supervisor's report is a custom program's own: a pod exiting with any of them failed by its
    own doing (counted, no node excluded)."""
    raw = spec()
    for code in (exitcodes.DEVICE_ERROR, exitcodes.DEVICE_LOST, exitcodes.DEVICE_SUSPECT, 1):
        pods = _gang(raw, p2=_pod(raw, 2, "Failed", _terminated(code)))
        decision = lifecycle.decide(job(raw, **three()), pods, at(5))
        status = status_of(decision)
        assert status["restarts"] == 1 and "disruptionRestarts" not in status, status
        assert "excludedNodes" not in status, status


def _gave_up(raw: dict[str, Any], index: int, finished: str) -> pod_state.PodState:
    report = exitcodes.failure_report(exitcodes.GANG_RESTART, "the gang was halted")
    container = _terminated(exitcodes.GANG_RESTART, report)
    container["state"]["terminated"]["finishedAt"] = finished
    return _pod(raw, index, "Failed", container)


def test_the_others_exit_75_waits_a_moment_for_pod_zeros_own_exit_which_names_the_cause():
    """Pod 0 hosting the store halts the gang when its GPU failed twice and leaves after the
    others read the halt: their 75 comes first.  Decided at once, it would spend
    ``backoffLimit`` and exclude nothing; the operator waits (bounded) for pod 0's exit."""
    raw = JobBuilder().layout(data=3, gpus_per_node=1).run_policy(backoffLimit=0).raw()
    first = conditions.timestamp(at(4))  # when the others' trainers exited 75
    others = {"p1": _gave_up(raw, 1, first), "p2": _gave_up(raw, 2, first)}
    early = lifecycle.decide(job(raw, **three()), _gang(raw, **others), at(5))
    assert early.actions == () and early.requeue_after is not None, early
    assert 0 < early.requeue_after <= failure.GANG_EXIT_SECONDS, early
    # pod 0's exit arrives: a disruption by its node, no backoffLimit spent
    left = lifecycle.decide(job(raw, **three()), _gang(raw, p0=_left(raw, 0), **others), at(7))
    status = status_of(left)
    assert status["restarts"] == 1 and status["disruptionRestarts"] == 1, status
    assert [e["node"] for e in status["excludedNodes"]] == ["n0"]
    # pod 0 never exits (or was not the cause): the gang is rebuilt after the wait, as before
    late = at(4 + failure.GANG_EXIT_SECONDS + 1)
    stuck = lifecycle.decide(job(raw, **three()), _gang(raw, **others), late)
    assert condition(stuck, conditions.FAILED) is not None  # backoffLimit 0: the job's own failure


def test_a_pod_whose_trainer_exited_while_a_sidecar_runs_is_no_survivor_to_wait_for():
    """Pod 2 left a bad GPU and pod 1's trainer exited 75 with its sidecar still running: only a
    pod whose trainer runs can meet pod 2's replacement, so the gang is rebuilt."""
    raw = spec()
    sidecar = {"name": "log-shipper", "state": {"running": {}}, "restartCount": 0}
    report = exitcodes.failure_report(exitcodes.GANG_RESTART, "the gang was halted")
    halted = _pod(raw, 1, "Running", _terminated(exitcodes.GANG_RESTART, report), sidecar)
    decision = lifecycle.decide(job(raw, **three()), _gang(raw, p1=halted, p2=_left(raw, 2)), at(5))
    assert "ReplacePods" not in kinds(decision), decision
    status = status_of(decision)
    assert status["restarts"] == 1 and [e["node"] for e in status["excludedNodes"]] == ["n2"]


def test_no_wait_where_no_running_pod_can_name_a_cause():
    """A custom trainer (its report is its own say), a pod 0 not running yet, and an exit time
    from a node clock far ahead of the operator's: the 75s are decided at once.  A store pod of
    its own changes nothing: pod 0 still runs and may name the cause, so it is waited for."""
    plain = JobBuilder().layout(data=3, gpus_per_node=1).run_policy(backoffLimit=2)
    dedicated = (
        JobBuilder()
        .layout(data=3, gpus_per_node=1)
        .run_policy(backoffLimit=2, recovery={"rendezvousStore": "dedicated"})
    )
    custom = plain.raw()
    custom["trainer"] = {"type": "custom", "command": ["python", "train.py"]}
    now = conditions.timestamp(at(4))
    ahead = conditions.timestamp(at(4 + failure.CLOCK_SKEW_SECONDS + 60))
    cases = [
        (custom, "Running", now),
        (plain.raw(), "Pending", now),
        (plain.raw(), "Running", ahead),
    ]
    for raw, host_phase, finished in cases:
        others = {"p1": _gave_up(raw, 1, finished), "p2": _gave_up(raw, 2, finished)}
        host = _pod(raw, 0, host_phase)
        decision = lifecycle.decide(job(raw, **three()), _gang(raw, p0=host, **others), at(5))
        assert status_of(decision).get("restarts") == 1, (host_phase, finished, decision)
    raw = dedicated.raw()
    others = {"p1": _gave_up(raw, 1, now), "p2": _gave_up(raw, 2, now)}
    waiting = lifecycle.decide(job(raw, **three()), _gang(raw, **others), at(5))
    assert waiting.actions == () and waiting.requeue_after, waiting
