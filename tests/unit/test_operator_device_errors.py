"""A GPU's device error outlives its gang: the operator keeps it by node in ``status.deviceErrors``
and tells the next pod placed there, whose supervisor then takes the GPU for bad at one more.

The failure reports and recovery records are the trainer's own (``exitcodes.failure_report``,
``recoveries.Recovery.to_json``, as the supervisor and rank 0 write them), read back from what a
kubelet reports; the supervisor's end of it, the real processes, runs in
``tests/trainer/test_supervise.py``.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest

from meshtrain.api import exitcodes
from meshtrain.operator.policy import (
    builders,
    conditions,
    device_errors,
    lifecycle,
    naming,
    pod_state,
    progress_report,
    progress_status,
    replacement,
)
from meshtrain.trainer.recovery import device_fault
from meshtrain.trainer.telemetry import recoveries
from tests.builders import JobBuilder
from tests.unit.test_operator_bad_gpu import _terminated
from tests.unit.test_operator_lifecycle import at, job, status_of
from tests.unit.test_operator_pod_loss import spec, three

WINDOW = exitcodes.DEVICE_SUSPECT_WINDOW_S


def _gave_up(
    raw: dict[str, Any],
    index: int,
    ranks: tuple[int, ...],
    attempt: int = 0,
    finished: str = "2026-01-01T12:00:04Z",
) -> pod_state.PodState:
    """Pod ``index`` of gang ``attempt`` whose supervisor exited 75 for a gang rebuild, its report
    naming ``ranks`` (the halt's device error ranks, which every pod's report repeats)."""
    report = exitcodes.failure_report(
        exitcodes.GANG_RESTART, "rank 1 failed (exit 78); in-place recovery is off", ranks
    )
    container = _terminated(exitcodes.GANG_RESTART, report)
    container["state"]["terminated"]["finishedAt"] = finished
    return _reported(raw, index, attempt, "Failed", container)


def _reported(
    raw: dict[str, Any], index: int, attempt: int, phase: str, trainer: dict[str, Any]
) -> pod_state.PodState:
    """Pod ``index`` of gang ``attempt`` on node ``n{index}`` as its kubelet reports it."""
    state = job(raw)
    manifest = builders.build_pod(state.ref, state.spec, attempt, index, f"n{index}")
    manifest["spec"].pop("schedulingGates", None)
    manifest["spec"]["nodeName"] = f"n{index}"
    manifest["status"] = {"phase": phase, "containerStatuses": [trainer]}
    pod = pod_state.read(manifest)
    assert pod is not None
    return pod


def _env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}


def test_a_gang_rebuilt_after_a_device_error_keeps_its_node_and_tells_the_next_pod_there():
    """In-place recovery off: rank 1's GPU on n1 failed (78), its supervisor gave up (75) and
    halted the gang; every pod's report names rank 1.  The rebuild is the node's doing (a
    disruption: ``backoffLimit`` 0 is not spent), n1 is not excluded for one error, but the next
    pod on n1 is told when it failed, and its supervisor takes one more for bad."""
    raw = spec()
    raw["runPolicy"]["backoffLimit"] = 0
    pods = [_gave_up(raw, i, (1,)) for i in range(3)]
    decision = lifecycle.decide(job(raw, **three()), pods, at(5))
    status = status_of(decision)
    assert status["restarts"] == 1 and status["disruptionRestarts"] == 1, status
    assert "excludedNodes" not in status, status
    # the node of the failed GPU disrupted the gang, not the nodes of the pods that followed it
    disrupted = [(e["node"], e["reason"]) for e in status["disruptions"]["nodes"]]
    assert disrupted == [("n1", device_errors.REASON)], status["disruptions"]
    [entry] = status["deviceErrors"]
    assert (entry["node"], entry["time"], entry["ranks"]) == ("n1", "2026-01-01T12:00:04Z", [1])

    state = job(raw, **{**three(), **status})
    now = at(600)
    told = device_errors.newest_by_node(state.status, now)
    gang = builders.build_pods(state.ref, state.spec, 1, ["n2", "n1", "n0"], device_errors=told)
    envs = [_env(p) for p in gang]
    assert [exitcodes.DEVICE_ERROR_AT_ENV in e for e in envs] == [False, True, False], envs
    # the supervisor of the pod on n1 reads it: its first device error is the node's second
    wall = now.timestamp()
    since = device_fault.node_error_since(envs[1], 1000.0, wall)
    assert since is not None and abs((1000.0 - since) - 596) < 1.0, since
    failures = device_fault.DeviceFailures(on_node=since)
    assert failures.failed(0, 1000.0) and failures.struck_by_node
    # the pod on n0 was told nothing: one device error there is its first
    assert device_fault.node_error_since(envs[2], 1000.0, wall) is None
    assert not device_fault.DeviceFailures().failed(0, 1000.0)


def test_a_second_rebuild_for_a_device_error_on_the_same_node_excludes_that_node_alone():
    """The error kept from the first rebuild and a second one on n1 within the hour (a pod told
    too late, or a report read after the pod was gone): n1 is excluded as a bad GPU's node, with
    an Event on it; n0 and n2, whose pods only followed the halt, are neither excluded nor
    charged."""
    raw = spec()
    first = status_of(
        lifecycle.decide(job(raw, **three()), [_gave_up(raw, i, (1,)) for i in range(3)], at(5))
    )
    later = {**first, **three(), "restarts": 1}
    again = [_gave_up(raw, i, (1,), attempt=1, finished="2026-01-01T12:30:00Z") for i in range(3)]
    decision = lifecycle.decide(job(raw, **later), again, at(1900))
    status = status_of(decision)
    assert [e["node"] for e in status["deviceErrors"]] == ["n1", "n1"], status["deviceErrors"]
    bad = [(e["node"], e["reason"]) for e in status["excludedNodes"]]
    assert ("n1", "BadGPU") in bad and {n for n, _ in bad} == {"n1"}, bad
    [(node, count)] = [(e["node"], e["count"]) for e in status["disruptions"]["nodes"]]
    assert (node, count) == ("n1", 2), status["disruptions"]
    told = [a for a in decision.actions if type(a).__name__ == "EmitOnNode"]
    assert [a.node for a in told] == ["n1"], told  # type: ignore[attr-defined]


def test_a_bare_75_waits_for_the_pod_whose_report_names_the_device_error():
    """A peer halted the gang, bare, before rank 1's supervisor named its device error: pod 0's
    report names nothing.  While pod 1 still runs its trainer the operator waits; its report
    then makes the rebuild a disruption with n1's error kept."""
    raw = spec()
    raw["runPolicy"]["backoffLimit"] = 0
    bare = _gave_up(raw, 0, ())
    trainer = {"name": naming.CONTAINER, "state": {"running": {}}, "restartCount": 0}
    running = [_reported(raw, i, 0, "Running", trainer) for i in (1, 2)]
    early = lifecycle.decide(job(raw, **three()), [bare, *running], at(5))
    assert early.actions == () and early.requeue_after, early
    named = [bare, _gave_up(raw, 1, (1,)), _gave_up(raw, 2, ())]
    status = status_of(lifecycle.decide(job(raw, **three()), named, at(7)))
    assert status["disruptionRestarts"] == 1, status
    assert [e["node"] for e in status["deviceErrors"]] == ["n1"], status


def test_a_custom_programs_report_of_a_device_error_is_its_own_failure():
    """A custom trainer writes whatever it likes to its termination log: a device error it
    claims is no disruption and keeps nothing."""
    raw = spec()
    raw["trainer"] = {"type": "custom", "command": ["python", "train.py"]}
    pods = [_gave_up(raw, i, (1,)) for i in range(3)]
    status = status_of(lifecycle.decide(job(raw, **three()), pods, at(5)))
    assert status["restarts"] == 1 and "disruptionRestarts" not in status, status
    assert "deviceErrors" not in status, status


def test_a_gang_without_a_device_error_in_its_reports_spends_its_backoff_and_keeps_nothing():
    raw = spec()
    pods = [_gave_up(raw, i, ()) for i in range(3)]
    status = status_of(lifecycle.decide(job(raw, **three()), pods, at(5)))
    assert status["restarts"] == 1 and "disruptionRestarts" not in status, status
    assert "deviceErrors" not in status, status


def _record(
    generation: int,
    cause: str,
    ranks: tuple[int, ...],
    failed_at: float,
    nodes: dict[str, tuple[int, ...]] | None = None,
) -> Any:
    return recoveries.Recovery(
        generation=generation,
        tier="process",
        cause=cause,
        ranks=ranks,
        failed_at=failed_at,
        detected_at=failed_at + 1,
        rejoined_at=failed_at + 2,
        restored_at=failed_at + 3,
        resumed_step=10,
        source="memory",
        lost_steps=1,
        nodes=nodes or {},
    ).to_json()


@pytest.mark.parametrize("gpus", [1, 8])
def test_a_device_error_is_charged_to_the_node_its_record_names_not_the_pods_replacements(gpus):
    """Every rank of pod 2 failed with a device error on n2 and was recovered in place; by the
    time the operator reads the record, pod 2 was replaced on n9 (the operator's own replacement
    write keeps n2 as its ``previousNode``).  The record, read through the operator's parser of
    the progress document, names n2 for the ranks its supervisor reported (at most 4 of them):
    n2 is charged for every rank of the pod, n9 for none.  A name the job never held for that pod
    (another tenant's node, or one of its own for another pod) is not believed and charges no
    node; a record of an older trainer, without nodes, goes by the placement, as before."""
    raw = JobBuilder().layout(data=3 * gpus, gpus_per_node=gpus).run_policy(backoffLimit=1).raw()
    lost = replacement.Replaced(2, "pod-2", "pod deleted", "pod-2-again", "n9", spare=False)
    moved = replacement.status_changes(job(raw, **three()), [lost], gpus, at(5))
    assert moved["placement"][2]["previousNode"] == "n2", moved
    state = job(raw, **{**three(), **moved})
    failed_at = at(3).timestamp()
    pod2 = tuple(range(2 * gpus, 3 * gpus))

    def charged(nodes: dict[str, tuple[int, ...]] | None) -> list[tuple[str, list[int]]]:
        record = _record(1, exitcodes.DEVICE_ERROR_CAUSE, pod2, failed_at, nodes=nodes or {})
        if nodes is None:
            del record["nodes"]  # not written before stop 60
        body = json.dumps({"recovery": [record], "recovery_counts": {"process": 1}}).encode()
        report = progress_report.parse(body)
        assert report.document is not None and report.notes == (), report
        changes, _ = progress_status.recovery_changes(
            state.status, report.document, state.spec, at(10)
        )
        assert changes["recovery"]["last"]["nodes"] == report.document["recovery"][0].get("nodes")
        return [(e["node"], e["ranks"]) for e in changes.get("deviceErrors", [])]

    assert charged({"n2": pod2}) == [("n2", list(pod2))]
    assert charged({"other-tenants-node": pod2}) == []  # not believed: n9 is where it did not fail
    assert charged({"n0": pod2}) == []
    assert charged(None) == [("n9", list(pod2))]  # an older trainer: the placement is all there is
    if gpus > 1:  # both of the pod's nodes named in one round: each for the ranks it lists
        both = {"n2": pod2[:1], "n9": pod2[1:2]}
        assert charged(both) == [("n2", [pod2[0]]), ("n9", [pod2[1]])]


@pytest.mark.parametrize(
    "nodes",
    [
        "n2",
        [{"node": "n2"}],
        [{"node": "N2 with spaces", "ranks": [2]}],
        [{"node": "n" * 254, "ranks": [2]}],
        [{"node": "n2", "ranks": [True]}],
        [{"node": "n2", "ranks": [-1]}],
        [{"node": "n2", "ranks": list(range(17))}],
        [{"node": f"n{i}", "ranks": [i]} for i in range(3)],
    ],
)
def test_a_record_whose_nodes_break_the_schema_is_kept_without_them_with_a_note(nodes):
    """The record still counts (its restart, its device error by the placement); only the names
    that no Node could have, or the malformed list, are left out."""
    record = {**_record(1, exitcodes.DEVICE_ERROR_CAUSE, (2,), at(3).timestamp()), "nodes": nodes}
    report = progress_report.parse(json.dumps({"recovery": [record]}).encode())
    assert report.document is not None, report
    [kept] = report.document["recovery"]
    assert kept["ranks"] == [2] and "nodes" not in kept, kept
    assert report.notes == ("recovery[0].nodes: out of the schema, ignored",), report.notes


def test_an_in_place_recovery_from_a_device_error_is_kept_by_its_ranks_node_once():
    """Rank 0's report carries its newest records: one of a device error on rank 2 (pod 2, n2)
    and one of a SIGKILL on rank 0.  Only the first is a device error; read again, nothing new."""
    raw = spec()
    failed_at = at(3).timestamp()
    report = {
        "recovery": [
            _record(1, exitcodes.DEVICE_ERROR_CAUSE, (2,), failed_at),
            _record(2, "SIGKILL", (0,), failed_at + 5),
        ],
        "recovery_counts": {"process": 2},
    }
    state = job(raw, **three())
    changes, _ = progress_status.recovery_changes(state.status, report, state.spec, at(10))
    [entry] = changes["deviceErrors"]
    assert (entry["node"], entry["ranks"]) == ("n2", [2]), entry
    assert entry["time"] == "2026-01-01T12:00:03Z", entry
    again, _ = progress_status.recovery_changes(
        {**state.status, **changes}, report, state.spec, at(20)
    )
    assert again == {}, again
    # a round that recovered a device error and another failure together charges no node
    mixed = {"recovery": [_record(3, f"{exitcodes.DEVICE_ERROR_CAUSE}, exit 1", (0, 2), failed_at)]}
    merged, _ = progress_status.recovery_changes(
        {**state.status, **changes}, mixed, state.spec, at(30)
    )
    assert "recovery" in merged and "deviceErrors" not in merged, merged
    # a second one on n2 within the hour is kept; the next rebuild judges it (excluding n2),
    # while the pod lives on under its supervisor's own count by GPU
    second = {"recovery": [_record(3, exitcodes.DEVICE_ERROR_CAUSE, (2,), failed_at + 60)]}
    twice, _ = progress_status.recovery_changes(
        {**state.status, **changes}, second, state.spec, at(70)
    )
    assert [e["node"] for e in twice["deviceErrors"]] == ["n2", "n2"], twice
    assert "excludedNodes" not in twice, twice
    assert list(device_errors.twice_within(twice["deviceErrors"], at(70))) == ["n2"]
    # a record from a node clock running fast, or from no clock at all
    ahead = {"recovery": [_record(4, exitcodes.DEVICE_ERROR_CAUSE, (1,), at(9000).timestamp())]}
    kept = {**state.status, **twice}
    fast, _ = progress_status.recovery_changes(kept, ahead, state.spec, at(80))
    assert fast["deviceErrors"][-1]["time"] == conditions.timestamp(at(80)), fast
    never = {"recovery": [_record(5, exitcodes.DEVICE_ERROR_CAUSE, (1,), 1e300)]}
    none, _ = progress_status.recovery_changes({**kept, **fast}, never, state.spec, at(90))
    assert "deviceErrors" not in none, none


def test_the_memory_is_bounded_and_only_an_error_within_the_window_is_told():
    now = datetime.datetime(2026, 1, 1, 12, tzinfo=datetime.UTC)

    def entry(node: str, seconds_ago: float) -> dict[str, Any]:
        when = now - datetime.timedelta(seconds=seconds_ago)
        return device_errors._entry(node, when, [0], "test")

    many = [entry(f"n{i}", i) for i in range(device_errors.KEPT + 10)]
    kept = device_errors.recorded({}, many, now)
    assert kept is not None and len(kept) == device_errors.KEPT
    assert kept[-1]["node"] == f"n{device_errors.KEPT + 9}"  # the newest written are kept
    assert device_errors.recorded({"deviceErrors": kept}, kept[-3:], now) is None  # nothing new
    # one written past the window is dropped with the next write
    old = device_errors.recorded({"deviceErrors": [entry("x", WINDOW + 1)]}, [entry("y", 1)], now)
    assert [e["node"] for e in old or []] == ["y"], old
    status = {
        "deviceErrors": [
            entry("a", WINDOW - 60),
            entry("a", 30),
            entry("b", WINDOW + 60),
            {"node": "c", "time": "not a time"},
            {"node": "d", "time": "2026-01-01T11:59:00"},  # no zone: skipped, never a crash
            "garbage",
            {"time": "2026-01-01T11:59:00Z"},
        ]
    }
    told = device_errors.newest_by_node(status, now)
    assert told == {"a": int((now - datetime.timedelta(seconds=30)).timestamp())}, told


def test_a_hostile_report_names_no_more_than_the_bound_of_valid_ranks():
    text = '{"exitCode": 75, "message": "x", "deviceErrorRanks": [1, -2, "3", true, 4.5, 5]}'
    assert exitcodes.reported_device_error_ranks(text) == (1, 5)
    flood = exitcodes.failure_report(75, "x", tuple(range(10_000)))
    assert len(exitcodes.reported_device_error_ranks(flood)) == exitcodes.MAX_DEVICE_ERROR_RANKS
    for broken in ("", "[]", '{"deviceErrorRanks": {"a": 1}}', "not json"):
        assert exitcodes.reported_device_error_ranks(broken) == ()
    for raw in ("", "nan", "inf", "-5", "soon"):
        assert device_fault.node_error_since({exitcodes.DEVICE_ERROR_AT_ENV: raw}, 1.0, 2.0) is None
    # a time ahead of this node's clock counts as now, never as a time to come
    ahead = device_fault.node_error_since({exitcodes.DEVICE_ERROR_AT_ENV: "500"}, 10.0, 100.0)
    assert ahead == 10.0
