"""In-place restarts: a trainer container the kubelet restarted is no failed gang, counted once in
status.recovery with its cause; the trainer's own records merged from its progress report; past
runPolicy.recovery.inPlaceLimit, or on exit code 75 or an OOM kill, the gang is rebuilt."""

from __future__ import annotations

import json
from typing import Any

import prometheus_client
import pytest

from meshtrain.api import exitcodes, loading
from meshtrain.operator.cluster import metrics
from meshtrain.operator.policy import (
    conditions,
    job_actions,
    lifecycle,
    pod_state,
    progress_report,
    progress_status,
    recovery_count,
)
from tests.builders import JobBuilder
from tests.unit.test_operator_lifecycle import at, job, kinds, placed_status, status_of
from tests.unit.test_progress_report import TRAINER_DOCUMENT

RUNNING = {"phase": "Running", "startTime": "2026-01-01T12:00:00Z"}


def manifest(
    index: int,
    *,
    uid: str | None = None,
    restarts: int = 0,
    last: dict[str, Any] | None = None,
    state: dict[str, Any] | None = None,
    phase: str = "Running",
) -> dict[str, Any]:
    """Pod ``index`` of attempt 0 as the kubelet reports it: its trainer container's restartCount,
    lastState.terminated and state (the fields of core/v1 ContainerStatus)."""
    trainer: dict[str, Any] = {
        "name": "trainer",
        "restartCount": restarts,
        "state": state or {"running": {"startedAt": "2026-01-01T12:00:05Z"}},
    }
    if last is not None:
        trainer["lastState"] = {"terminated": last}
    return {
        "metadata": {
            "name": f"j-r0-{index}",
            "uid": uid or f"uid-{index}",
            "labels": {"meshtrain.io/node-rank": str(index), "meshtrain.io/attempt": "0"},
            "creationTimestamp": "2026-01-01T12:00:00Z",
        },
        "spec": {"nodeName": f"n{index}", "containers": [{"name": "trainer"}]},
        "status": {**RUNNING, "podIP": f"10.0.0.{index + 1}", "containerStatuses": [trainer]},
    }


KILLED = {"exitCode": 137, "reason": "Error", "finishedAt": "2026-01-01T12:00:04Z"}


def gang(*pods: dict[str, Any]) -> list[pod_state.PodState]:
    read = [pod_state.read(p) for p in pods]
    assert all(p is not None for p in read)
    return [p for p in read if p is not None]


def running(**status: Any) -> dict[str, Any]:
    return placed_status(phase="Running", **status)


def spec(**recovery: Any) -> dict[str, Any]:
    return JobBuilder().layout(data=2, gpus_per_node=1).run_policy(recovery=recovery).raw()


def events(decision: job_actions.Decision, reason: str) -> list[str]:
    return [
        a.message
        for a in decision.actions
        if isinstance(a, job_actions.Emit) and a.reason == reason
    ]


def test_a_container_the_kubelet_restarted_is_counted_with_its_cause_not_a_failed_gang():
    pods = gang(manifest(0), manifest(1, restarts=1, last=KILLED))
    decision = lifecycle.decide(job(spec(), **running()), pods, at(10))
    assert "DeletePods" not in kinds(decision)
    recovery = status_of(decision)["recovery"]
    assert recovery["inPlaceRestarts"] == 1
    assert recovery["byTier"] == {"process": 0, "container": 1, "pod": 0}
    assert recovery["attemptRestarts"] == 1 and recovery["attempt"] == 0
    last = recovery["last"]
    assert (last["tier"], last["cause"], last["pod"], last["ranks"]) == (
        "container",
        "SIGKILL",
        "j-r0-1",
        [1],
    )
    assert last["failedAt"] == 1767268804.0  # lastState.terminated.finishedAt
    [told] = events(decision, recovery_count.RESTARTED)
    assert (
        "j-r0-1" in told and "SIGKILL" in told and "1 of runPolicy.recovery.inPlaceLimit=10" in told
    )


def test_each_restart_counts_once_whichever_pass_sees_it():
    pods = gang(manifest(0), manifest(1, restarts=1, last=KILLED))
    first = lifecycle.decide(job(spec(), **running()), pods, at(10))
    after = running(**{"recovery": status_of(first)["recovery"]})
    again = lifecycle.decide(job(spec(), **after), pods, at(20))
    assert "recovery" not in status_of(again) and not events(again, recovery_count.RESTARTED)
    # the same pod restarted again, and pod 0 replaced under the same name (a new UID) restarted
    later = gang(
        manifest(0, uid="uid-0-new", restarts=1, last={**KILLED, "exitCode": 1}),
        manifest(1, restarts=2, last={**KILLED, "exitCode": 139}),
    )
    third = lifecycle.decide(job(spec(), **after), later, at(30))
    recovery = status_of(third)["recovery"]
    assert recovery["inPlaceRestarts"] == 3 and recovery["byTier"]["container"] == 3
    assert {p["uid"] for p in recovery["countedPods"]} == {"uid-0-new", "uid-1"}
    told = events(third, recovery_count.RESTARTED)
    assert len(told) == 2 and any("exit 1" in t for t in told) and any("SIGSEGV" in t for t in told)


def test_past_the_in_place_budget_the_gang_is_rebuilt_and_backoff_counts_it():
    pods = gang(manifest(0, restarts=1, last=KILLED), manifest(1, restarts=1, last=KILLED))
    decision = lifecycle.decide(job(spec(inPlaceLimit=1), **running()), pods, at(10))
    status = status_of(decision)
    assert status["restarts"] == 1 and status["phase"] == "Restarting"
    assert status["recovery"]["attemptRestarts"] == 2
    assert "DeletePods" in kinds(decision)
    assert any(
        "2 in-place restarts of this gang exceed runPolicy.recovery.inPlaceLimit=1" in m
        for m in events(decision, recovery_count.EXHAUSTED)
    )
    # the next gang attempt starts its own count
    rebuilt = job(spec(inPlaceLimit=1), **running(restarts=1, recovery=status["recovery"]))
    assert recovery_count.book(rebuilt.status, 1)["attemptRestarts"] == 0
    assert recovery_count.book(rebuilt.status, 1)["inPlaceRestarts"] == 2
    out_of_backoff = lifecycle.decide(
        job(spec(inPlaceLimit=1) | {}, **running()),
        gang(manifest(0, restarts=2, last=KILLED), manifest(1)),
        at(10),
    )
    assert status_of(out_of_backoff)["phase"] == "Restarting"
    none_left = JobBuilder().layout(data=2, gpus_per_node=1)
    raw = none_left.run_policy(backoffLimit=0, recovery={"inPlaceLimit": 1}).raw()
    failed = lifecycle.decide(
        job(raw, **running()), gang(manifest(0, restarts=2, last=KILLED), manifest(1)), at(10)
    )
    assert status_of(failed)["phase"] == "Failed"
    reason = conditions.find(status_of(failed)["conditions"], conditions.FAILED)
    assert reason is not None and reason["reason"] == conditions.BACKOFF_LIMIT_EXCEEDED


def test_exit_code_75_asks_for_the_gang_rebuild_even_while_the_pod_runs():
    gave_up = {"terminated": {"exitCode": exitcodes.GANG_RESTART, "reason": "Error"}}
    for phase in ("Failed", "Running"):  # a sidecar may keep the pod Running
        pods = gang(manifest(0), manifest(1, state=gave_up, phase=phase))
        if phase == "Failed":
            pods[1] = pod_state.PodState(**{**pods[1].__dict__, "phase": "Failed"})
        decision = lifecycle.decide(job(spec(), **running()), pods, at(10))
        status = status_of(decision)
        assert status["restarts"] == 1, phase
        running_cond = conditions.find(status["conditions"], conditions.RUNNING)
        assert running_cond is not None and "exit code 75" in running_cond["message"]


def test_an_oom_kill_restarted_in_place_rebuilds_the_gang_named_oom_killed():
    oom = {**KILLED, "reason": "OOMKilled"}
    pods = gang(manifest(0), manifest(1, restarts=1, last=oom))
    decision = lifecycle.decide(job(spec(), **running()), pods, at(10))
    status = status_of(decision)
    assert status["restarts"] == 1
    assert status["recovery"]["inPlaceRestarts"] == 0, "an OOM kill is no in-place restart"
    cond = conditions.find(status["conditions"], conditions.RUNNING)
    assert cond is not None and cond["reason"] == "OOMKilled"
    assert "container trainer" in cond["message"]


def test_the_kubelet_signal_names_the_cause_over_the_exit_code():
    assert recovery_count.cause(pod_state.LastExit(137)) == "SIGKILL"
    assert recovery_count.cause(pod_state.LastExit(1)) == "exit 1"
    assert recovery_count.cause(pod_state.LastExit(2, signal=6)) == "SIGABRT"
    assert recovery_count.cause(pod_state.LastExit(137, reason="OOMKilled")) == "OOMKilled"
    assert recovery_count.cause(pod_state.LastExit(255)) == "signal 127"
    # KEP-5532 as the sandbox's v1.36.3 kubelet reported it after a SIGABRT of torchrun
    # (tests/e2e/test_sandbox_in_place.py): 137 and this reason on every container
    restarted_all = pod_state.LastExit(137, reason="RestartingAllContainers")
    assert recovery_count.cause(restarted_all) == recovery_count.POD_RESTART_CAUSE


RECORD = TRAINER_DOCUMENT["recovery"][0]
"""A process-tier record as the trainer writes it (its telemetry.recoveries)."""


def reported(*records: dict[str, Any]) -> dict[str, Any]:
    body = json.dumps({"step": 42, "recovery": list(records)}).encode()
    reading = progress_report.parse(body)
    assert reading.document is not None
    return reading.document


def parsed(raw: dict[str, Any]):
    return loading.parse_spec(raw)


def test_the_trainers_process_records_are_counted_once_and_its_container_ones_only_named():
    status = running()
    changes, told = progress_status.recovery_changes(status, reported(RECORD), parsed(spec()))
    recovery = changes["recovery"]
    assert recovery["byTier"] == {"process": 1, "container": 0, "pod": 0}
    assert recovery["last"]["resumedStep"] == 40 and recovery["last"]["source"] == "memory"
    assert recovery["countedGeneration"] == 1
    [event] = told
    assert "process tier" in event and "exit 1" in event
    status = {**status, **changes}
    assert progress_status.recovery_changes(status, reported(RECORD), parsed(spec())) == ({}, ())
    # a container restart the trainer recorded is the pods' to count: it only becomes ``last``
    container = {**RECORD, "generation": 2, "tier": "container", "cause": "SIGKILL"}
    changes, told = progress_status.recovery_changes(
        status, reported(RECORD, container), parsed(spec())
    )
    assert changes["recovery"]["byTier"]["container"] == 0
    assert changes["recovery"]["last"]["cause"] == "SIGKILL" and told == ()


def test_past_the_budget_by_the_trainers_records_the_next_pass_rebuilds_the_gang():
    records = [{**RECORD, "generation": g} for g in (1, 2)]
    changes, _ = progress_status.recovery_changes(
        running(), reported(*records), parsed(spec(inPlaceLimit=1))
    )
    decision = lifecycle.decide(
        job(spec(inPlaceLimit=1), **running(**changes)), gang(manifest(0), manifest(1)), at(10)
    )
    assert status_of(decision)["restarts"] == 1


HOSTILE = [
    {"generation": -1, "tier": "process", "cause": "x"},
    {"generation": 1, "tier": "everything", "cause": "x"},
    {"generation": 1, "tier": "process", "cause": 7},
    {**RECORD, "failedAt": float("inf")},
    {**RECORD, "source": "tape"},
    [RECORD] * 5,
]


@pytest.mark.parametrize("record", HOSTILE, ids=range(len(HOSTILE)))
def test_a_record_out_of_the_schema_drops_the_field_and_counts_nothing(record):
    records = record if isinstance(record, list) else [record]
    body = json.dumps({"step": 1, "recovery": records}).replace("Infinity", "1e999").encode()
    reading = progress_report.parse(body)
    assert reading.document is not None and "recovery" not in reading.document
    assert any("recovery" in note for note in reading.notes)
    assert progress_status.recovery_changes(running(), reading.document, parsed(spec())) == ({}, ())


def test_a_long_cause_is_cut_and_the_ranks_bounded():
    long = {**RECORD, "cause": "x" * 1000, "ranks": list(range(16))}
    document = reported(long)
    [kept] = document["recovery"]
    assert len(kept["cause"]) == progress_report.MAX_CAUSE and len(kept["ranks"]) == 16


def test_the_restarts_metric_counts_each_tier_from_the_status_written():
    registry = prometheus_client.REGISTRY
    key = {"namespace": "ns", "trainingjob": "tiers"}
    before = {"restarts": 0, "recovery": {"byTier": {"process": 1, "container": 0, "pod": 0}}}
    after = {"restarts": 1, "recovery": {"byTier": {"process": 3, "container": 1, "pod": 0}}}
    metrics.restarted("ns", "tiers", before, after)
    sample = registry.get_sample_value
    assert sample("meshtrain_operator_restarts_total", {**key, "tier": "gang"}) == 1
    assert sample("meshtrain_operator_restarts_total", {**key, "tier": "process"}) == 2
    assert sample("meshtrain_operator_restarts_total", {**key, "tier": "container"}) == 1
    assert sample("meshtrain_operator_gang_restarts_total", key) == 1
    metrics.forget("ns", "tiers")
    assert sample("meshtrain_operator_restarts_total", {**key, "tier": "process"}) is None
