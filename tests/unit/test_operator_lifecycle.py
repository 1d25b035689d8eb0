"""The TrainingJob state machine, table-driven: (job, pods, now) -> actions."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from typing import Any

import pydantic
import pytest

from meshtrain.operator.policy import (
    builders,
    conditions,
    failure,
    identity,
    job_actions,
    job_state,
    lifecycle,
    placement_status,
    pod_failure,
    pod_state,
    situation,
)
from tests.builders import JobBuilder

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def job(spec: dict[str, Any] | None = None, **status: Any) -> job_state.JobState:
    """A job of 2 pods (dp2, 1 GPU per pod) unless ``spec`` says otherwise."""
    raw = spec if spec is not None else JobBuilder().layout(data=2, gpus_per_node=1).raw()
    body = {
        "metadata": {"name": "j", "namespace": "ns", "uid": "u1", "generation": 3},
        "spec": raw,
        "status": status,
    }
    return job_state.read(body)


def placed_status(**extra: Any) -> dict[str, Any]:
    """A placed gang whose pods all exist (Placed=True)."""
    placed = conditions.set(
        [], conditions.PLACED, conditions.TRUE, conditions.GANG_PLACED, "2 pod(s) on 2 node(s)", T0
    )
    return {
        "phase": "Placing",
        "conditions": placed,
        "placement": [{"podIndex": 0, "node": "n0"}, {"podIndex": 1, "node": "n1"}],
        "startTime": conditions.timestamp(T0),
        **extra,
    }


def pod(
    index: int,
    phase: str = "Pending",
    *,
    attempt: int = 0,
    gated: bool = False,
    deleting: bool = False,
    exit_code: int | None = None,
    created: float = 0,
    ip: str | None = None,
    disrupted: bool = False,
    message: str | None = None,
    bound: bool = False,
) -> pod_state.PodState:
    return pod_state.PodState(
        name=f"j-r{attempt}-{index}",
        index=index,
        attempt=attempt,
        phase=phase,
        gated=gated,
        deleting=deleting,
        created_at=at(created),
        node=f"n{index}",
        ip=ip,
        exit_code=exit_code,
        disrupted=disrupted,
        termination_message=message,
        bound=bound,
    )


def kinds(decision: job_actions.Decision) -> list[str]:
    return [type(a).__name__ for a in decision.actions]


def status_of(decision: job_actions.Decision) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for action in decision.actions:
        if isinstance(action, job_actions.SetStatus):
            merged.update(action.changes)
    return merged


def condition(decision: job_actions.Decision, type_: str) -> dict[str, Any] | None:
    return conditions.find(status_of(decision).get("conditions") or [], type_)


def running_gang(**kw: Any) -> list[pod_state.PodState]:
    return [pod(0, "Running", ip="10.0.0.1", **kw), pod(1, "Running", **kw)]


CASES = [
    # name, job, pods, now, expected action kinds, expected status fields
    ("new job is placed", job(), [], 0, ["Place"], {}),
    (
        "placed gang still gated: gates lifted",
        job(**placed_status()),
        [pod(0, gated=True), pod(1, gated=True)],
        1,
        ["LiftGates"],
        {},
    ),
    (
        "crash mid-creation: missing pod re-created",
        job(**placed_status()),
        [pod(0, gated=True)],
        1,
        ["Place"],
        {},
    ),
    (
        "all running: phase Running and progress polled",
        job(**placed_status()),
        running_gang(),
        5,
        ["SetStatus", "PollProgress"],
        {"phase": "Running"},
    ),
    (
        "running stays running: only progress",
        job(**placed_status(phase="Running")),
        running_gang(),
        5,
        ["PollProgress"],
        {},
    ),
    (
        "all exited 0: Succeeded",
        job(**placed_status(phase="Running")),
        [pod(0, "Succeeded"), pod(1, "Succeeded")],
        9,
        ["SetStatus", "Emit"],
        {"phase": "Succeeded"},
    ),
    (
        "all exited 0: rank 0's final progress recorded with Succeeded",
        job(**placed_status(phase="Running", progress={"step": 34}, lastCheckpointStep=30)),
        [
            pod(0, "Succeeded", message='{"step": 40, "loss": 1.5, "last_checkpoint_step": 40}'),
            pod(1, "Succeeded", message='{"step": 7}'),
        ],
        9,
        ["SetStatus", "Emit"],
        {"phase": "Succeeded", "progress": {"step": 40, "loss": 1.5}, "lastCheckpointStep": 40},
    ),
    (
        "retryable failure restarts the gang",
        job(**placed_status(phase="Running")),
        [pod(0, "Running"), pod(1, "Failed", exit_code=137)],
        9,
        ["SetStatus", "Emit", "DeletePods"],
        {"phase": "Restarting", "restarts": 1, "placement": []},
    ),
    (
        "permanent exit code 2 fails at once",
        job(**placed_status(phase="Running")),
        [pod(0, "Running"), pod(1, "Failed", exit_code=2)],
        9,
        ["SetStatus", "Emit", "DeletePods"],
        {"phase": "Failed"},
    ),
    (
        "loss guard stop (exit 5) fails at once",
        job(**placed_status(phase="Running")),
        [pod(0, "Failed", exit_code=5), pod(1, "Running")],
        9,
        ["SetStatus", "Emit", "DeletePods"],
        {"phase": "Failed"},
    ),
    (
        "backoff exhausted fails",
        job(**placed_status(phase="Running", restarts=3)),
        [pod(0, "Running", attempt=3), pod(1, "Failed", attempt=3, exit_code=1)],
        9,
        ["SetStatus", "Emit", "DeletePods"],
        {"phase": "Failed"},
    ),
    (
        "evicted pod restarts",
        job(**placed_status(phase="Running")),
        [pod(0, "Running"), pod(1, "Running", disrupted=True)],
        9,
        ["SetStatus", "Emit", "DeletePods"],
        {"phase": "Restarting", "restarts": 1},
    ),
    (
        "pod vanished from a released gang restarts",
        job(**placed_status(phase="Running")),
        [pod(0, "Running")],
        9,
        ["SetStatus", "Emit", "DeletePods"],
        {"restarts": 1},
    ),
    (
        "after a restart the old gang is stale and deleted, then re-placed",
        job(phase="Restarting", restarts=1),
        [pod(0, "Running"), pod(1, "Failed", exit_code=1)],
        10,
        ["DeletePods", "Place"],
        {},
    ),
    (
        "startup timeout counts as a failed start",
        job(**placed_status()),
        [pod(0, "Running"), pod(1, "Pending")],
        601,
        ["SetStatus", "Emit", "DeletePods"],
        {"phase": "Restarting", "restarts": 1},
    ),
    (
        "suspend removes pods and keeps status",
        job(
            JobBuilder().layout(data=2, gpus_per_node=1).raw() | {"runPolicy": {"suspend": True}},
            **placed_status(phase="Running", restarts=1),
        ),
        running_gang(attempt=1),
        9,
        ["DeletePods", "SetStatus", "Emit"],
        {"phase": "Suspended", "placement": []},
    ),
    (
        "resume waits until the suspended pods are gone",
        job(phase="Suspended"),
        [pod(0, "Running", deleting=True)],
        9,
        [],
        {},
    ),
    (
        "resume goes back to Pending",
        job(phase="Suspended", startTime="2026-01-01T00:00:00Z"),
        [],
        9,
        ["SetStatus", "Emit"],
        {"phase": "Pending", "startTime": None},
    ),
    (
        "active deadline fails the job",
        job(
            JobBuilder().layout(data=2, gpus_per_node=1).raw()
            | {"runPolicy": {"activeDeadlineSeconds": 60}},
            **placed_status(phase="Running"),
        ),
        running_gang(),
        61,
        ["SetStatus", "Emit", "DeletePods"],
        {"phase": "Failed"},
    ),
    (
        "invalid spec fails with InvalidSpec",
        job(JobBuilder().layout(tensor=2, gpus_per_node=2).model(heads=3).raw()),
        [],
        0,
        ["SetStatus", "Emit"],
        {"phase": "Failed"},
    ),
    (
        "finished job: nothing to do",
        job(phase="Succeeded", completionTime=conditions.timestamp(T0)),
        [],
        99,
        [],
        {},
    ),
    (
        "TTL elapsed deletes the job",
        job(
            JobBuilder().raw() | {"runPolicy": {"ttlSecondsAfterFinished": 30}},
            phase="Failed",
            completionTime=conditions.timestamp(T0),
        ),
        [],
        31,
        ["DeleteJob"],
        {},
    ),
]


@pytest.mark.parametrize(
    ("name", "state", "pods", "now", "expected", "fields"), CASES, ids=[c[0] for c in CASES]
)
def test_decide(name, state, pods, now, expected, fields):
    decision = lifecycle.decide(state, pods, at(now))
    assert kinds(decision) == expected
    status = status_of(decision)
    for key, value in fields.items():
        assert status[key] == value, key


def test_invalid_spec_condition_names_the_rule():
    decision = lifecycle.decide(
        job(JobBuilder().layout(tensor=2, gpus_per_node=2).model(heads=3).raw()), [], T0
    )
    failed = condition(decision, conditions.FAILED)
    assert failed["reason"] == conditions.INVALID_SPEC
    assert "heads=3 is not divisible by tensor=2" in failed["message"]
    emitted = [a for a in decision.actions if isinstance(a, job_actions.Emit)]
    assert emitted[0].type == "Warning" and emitted[0].reason == conditions.INVALID_SPEC


def test_permanent_failure_is_not_retried_even_with_backoff_left():
    decision = lifecycle.decide(
        job(**placed_status(phase="Running")), [pod(0, "Failed", exit_code=2), pod(1)], at(3)
    )
    assert condition(decision, conditions.FAILED)["reason"] == conditions.PERMANENT_FAILURE
    assert status_of(decision).get("restarts") is None


def test_backoff_message_says_how_many_restarts_were_used():
    state = job(**placed_status(phase="Running", restarts=3))
    decision = lifecycle.decide(
        state, [pod(0, "Failed", attempt=3, exit_code=1), pod(1, attempt=3)], at(3)
    )
    assert "backoffLimit=3" in condition(decision, conditions.FAILED)["message"]


def test_restart_is_counted_once_even_if_applied_twice():
    state = job(**placed_status(phase="Running"))
    gang = [pod(0, "Running"), pod(1, "Failed", exit_code=1)]
    first = lifecycle.decide(state, gang, at(5))
    after = job(**{**placed_status(phase="Running"), **status_of(first)})
    second = lifecycle.decide(after, gang, at(6))  # old pods still listed: now stale
    assert kinds(second) == ["DeletePods", "Place"]
    assert status_of(second) == {}


def test_gates_are_not_lifted_while_a_pod_is_missing():
    decision = lifecycle.decide(job(**placed_status()), [pod(1, gated=True)], at(1))
    assert kinds(decision) == ["Place"]
    assert decision.actions[0] == job_actions.Place(attempt=0, missing=(0,))


def test_missing_pods_are_counted_on_their_recorded_nodes():
    state = job(**placed_status())
    assert placement_status.missing_per_node(state, (0, 1)) == {"n0": 1, "n1": 1}
    assert placement_status.missing_per_node(job(phase="Placing"), (0,)) == {"": 1}


def test_missing_pods_are_recreated_where_the_recorded_nodes_still_take_them():
    recovery = placement_status.recover_missing(job(**placed_status()), (1,), {}, at(1))
    assert recovery == placement_status.Recreate(nodes=((1, "n1"),))


def test_a_blocked_recorded_node_drops_the_placement_to_plan_again():
    recovery = placement_status.recover_missing(
        job(**placed_status()), (0,), {"n0": "node deleted"}, at(1)
    )
    assert isinstance(recovery, placement_status.Replan)
    assert recovery.status["placement"] == []
    placed = conditions.find(recovery.status["conditions"], conditions.PLACED)
    assert placed["status"] == conditions.FALSE
    assert "n0: node deleted" in placed["message"]


def test_startup_timeout_requeues_for_the_remaining_time():
    decision = lifecycle.decide(
        job(**placed_status()), [pod(0, "Running"), pod(1, "Pending")], at(100)
    )
    assert decision.requeue_after == pytest.approx(500)


def test_ttl_requeues_until_due():
    state = job(
        JobBuilder().raw() | {"runPolicy": {"ttlSecondsAfterFinished": 30}},
        phase="Succeeded",
        completionTime=conditions.timestamp(T0),
    )
    assert lifecycle.decide(state, [], at(10)).requeue_after == pytest.approx(20)


def test_finished_job_frees_gpus_of_pods_still_running():
    state = job(phase="Failed", completionTime=conditions.timestamp(T0))
    decision = lifecycle.decide(state, [pod(0, "Running"), pod(1, "Failed")], at(1))
    assert decision.actions == (job_actions.DeletePods(("j-r0-0",)),)


def test_every_status_change_records_the_observed_generation():
    decision = lifecycle.decide(job(**placed_status()), running_gang(), at(5))
    assert status_of(decision)["observedGeneration"] == 3


def _spec_of(data: int, **run_policy: Any) -> dict[str, Any]:
    raw = JobBuilder().layout(data=data, gpus_per_node=1).raw()
    return raw | {"runPolicy": run_policy} if run_policy else raw


def _hash_of(raw: dict[str, Any]) -> str:
    return identity.spec_hash(job(raw).spec)


def test_a_broken_gang_is_deleted_quickly_a_healthy_one_with_time_to_save():
    failed = lifecycle.decide(
        job(**placed_status(phase="Running")),
        [pod(0, "Running"), pod(1, "Failed", exit_code=137)],
        at(9),
    )
    [deleted] = [a for a in failed.actions if isinstance(a, job_actions.DeletePods)]
    assert (
        deleted.names == ("j-r0-0", "j-r0-1")
        and deleted.grace_seconds == failure.BROKEN_GANG_GRACE_SECONDS
    )
    suspended = lifecycle.decide(
        job(_spec_of(2) | {"runPolicy": {"suspend": True}}, **placed_status(phase="Running")),
        running_gang(),
        at(9),
    )
    [deleted] = [a for a in suspended.actions if isinstance(a, job_actions.DeletePods)]
    assert deleted.grace_seconds is None


def test_changed_spec_rebuilds_the_gang_without_counting_a_restart():
    state = job(
        _spec_of(4),
        **placed_status(phase="Running", specHash=_hash_of(_spec_of(2)), lastCheckpointStep=20),
    )
    decision = lifecycle.decide(state, running_gang(), at(9))
    assert kinds(decision) == ["SetStatus", "Emit", "DeletePods"]
    status = status_of(decision)
    assert (
        status["phase"] == "Restarting" and status["placement"] == [] and status["specHash"] is None
    )
    assert "restarts" not in status
    placed_condition = condition(decision, conditions.PLACED)
    assert placed_condition["reason"] == conditions.SPEC_CHANGED
    assert "dp4·pp1·tp1" in placed_condition["message"] and "step 20" in placed_condition["message"]
    assert decision.actions[2].names == ("j-r0-0", "j-r0-1")


def test_rebuilt_gang_waits_for_the_old_pods_then_places_the_new_spec():
    state = job(_spec_of(4), phase="Restarting")
    waiting = lifecycle.decide(state, [pod(0, "Running", deleting=True)], at(10))
    assert kinds(waiting) == ["SetStatus"]  # nothing left to delete: say what it waits for
    placed = conditions.find(status_of(waiting)["conditions"], conditions.PLACED)
    assert placed is not None and placed["reason"] == conditions.OLD_PODS_TERMINATING
    assert waiting.requeue_after == situation.LEAVING_RECHECK_SECONDS  # woken by the deletion
    assert kinds(lifecycle.decide(state, [pod(0, "Running")], at(10)))[0] == "DeletePods"
    assert kinds(lifecycle.decide(state, [], at(11))) == ["Place"]
    assert placement_status.placed(state, ["n0"] * 4, {}, at(12))["specHash"] == _hash_of(
        _spec_of(4)
    )


def test_run_policy_changes_do_not_rebuild_the_gang():
    assert _hash_of(_spec_of(2, backoffLimit=9, activeDeadlineSeconds=60)) == _hash_of(_spec_of(2))
    state = job(
        _spec_of(2, backoffLimit=9),
        **placed_status(phase="Running", specHash=_hash_of(_spec_of(2))),
    )
    assert kinds(lifecycle.decide(state, running_gang(), at(9))) == ["PollProgress"]


def test_a_finished_gang_is_not_rebuilt_for_a_late_spec_change():
    state = job(_spec_of(4), **placed_status(phase="Running", specHash=_hash_of(_spec_of(2))))
    decision = lifecycle.decide(state, [pod(0, "Succeeded"), pod(1, "Succeeded")], at(9))
    assert status_of(decision)["phase"] == "Succeeded"


def test_placed_and_unschedulable_status():
    state = job()
    fields = placement_status.placed(
        state, ["a", "b"], {"nvlink": 0.0, "kubernetes.io/hostname": 10.0}, T0
    )
    assert fields["phase"] == "Placing"
    assert fields["placement"] == [{"podIndex": 0, "node": "a"}, {"podIndex": 1, "node": "b"}]
    assert fields["layout"] == "dp2·pp1·tp1" and fields["worldSize"] == 2
    assert fields["startTime"] == conditions.timestamp(T0)
    waiting = placement_status.unschedulable(state, "InsufficientGPUs", "need 2, free 1", T0)
    assert waiting["phase"] == "Pending"
    placed_condition = conditions.find(waiting["conditions"], conditions.PLACED)
    assert (
        placed_condition["reason"] == "InsufficientGPUs"
        and placed_condition["message"] == "need 2, free 1"
    )


def test_decisions_are_stable_once_applied():
    """Applying a decision's status and deciding again asks for no further status change."""
    state = job(**placed_status())
    gang = running_gang()
    first = lifecycle.decide(state, gang, at(5))
    again = lifecycle.decide(job(**{**placed_status(), **status_of(first)}), gang, at(6))
    assert status_of(again) == {}


def test_pod_state_reads_labels_gates_and_exit_code():
    manifest = {
        "metadata": {
            "name": "j-r1-3",
            "labels": {"meshtrain.io/node-rank": "3", "meshtrain.io/attempt": "1"},
            "creationTimestamp": "2026-01-01T12:00:00Z",
        },
        "spec": {"schedulingGates": [{"name": "meshtrain.io/gang"}], "nodeName": "n7"},
        "status": {
            "phase": "Failed",
            "containerStatuses": [{"name": "trainer", "state": {"terminated": {"exitCode": 139}}}],
        },
    }
    state = pod_state.read(manifest)
    assert dataclasses.astuple(state)[:6] == ("j-r1-3", 3, 1, "Failed", True, False)
    assert state.node == "n7" and state.exit_code == 139
    assert pod_state.read({"metadata": {"name": "other"}}) is None


@pytest.mark.parametrize(
    ("phase", "code", "permanent", "text"),
    [
        ("Failed", 2, True, "rejected its configuration"),
        ("Failed", 127, True, "not found"),
        ("Failed", 137, False, "signal 9"),
        ("Failed", 1, False, "exited with code 1"),
        ("Failed", None, False, "failed"),
        ("Unknown", None, False, "lost"),
    ],
)
def test_failure_classification(phase, code, permanent, text):
    found = pod_failure.classify(pod(0, phase, exit_code=code))
    assert found.permanent is permanent and text in found.message


@pytest.mark.parametrize("phase", ["Pending", "Running", "Succeeded"])
def test_healthy_pods_are_not_failures(phase):
    assert pod_failure.classify(pod(0, phase)) is None


def test_success_without_a_termination_message_keeps_the_polled_progress():
    state = job(**placed_status(phase="Running", progress={"step": 34}, lastCheckpointStep=30))
    decision = lifecycle.decide(
        state, [pod(0, "Succeeded", message=""), pod(1, "Succeeded")], at(9)
    )
    fields = status_of(decision)
    assert (
        fields["phase"] == "Succeeded"
        and "progress" not in fields
        and "lastCheckpointStep" not in fields
    )


def test_pod_state_reads_the_termination_message():
    manifest = {
        "metadata": {
            "name": "j-r0-0",
            "labels": {"meshtrain.io/node-rank": "0", "meshtrain.io/attempt": "0"},
        },
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [
                {
                    "name": "trainer",
                    "state": {"terminated": {"exitCode": 0, "message": '{"step": 40}\n'}},
                }
            ],
        },
    }
    assert pod_state.read(manifest).termination_message == '{"step": 40}\n'


def test_wont_fit_fails_the_job_with_the_numbers_and_keeps_the_plan():
    state = job(phase="Pending")
    fields = placement_status.wont_fit(
        state,
        "stage 0 needs 104.36 GiB per GPU but the GPU has 80.00 GiB",
        T0,
        {"fits": False, "memoryPerGpuBytes": 112},
    )
    assert fields["phase"] == "Failed" and fields["completionTime"] == conditions.timestamp(T0)
    assert fields["plan"] == {"fits": False, "memoryPerGpuBytes": 112}
    for type_, status in (
        (conditions.WONT_FIT, "True"),
        (conditions.FAILED, "True"),
        (conditions.PLACED, "False"),
    ):
        found = conditions.find(fields["conditions"], type_)
        assert (found["status"], found["reason"]) == (status, "WontFit") and "80.00 GiB" in found[
            "message"
        ]
    # final: the next pass only waits for the TTL, it never places the job
    assert kinds(lifecycle.decide(job(**fields), [], at(5))) == []


def test_placed_and_unschedulable_publish_the_plan():
    plan = {"profile": "h100-sxm", "fits": True}
    assert placement_status.placed(job(), ["a", "b"], {}, T0, plan)["plan"] == plan
    assert placement_status.unschedulable(job(), "InsufficientGPUs", "m", T0, plan)["plan"] == plan
    assert "plan" not in placement_status.placed(
        job(), ["a", "b"], {}, T0
    )  # not judged: status.plan untouched


def test_a_release_adding_a_defaulted_spec_field_keeps_every_jobs_hash():
    spec = job(_spec_of(2)).spec
    assert spec is not None
    grown = pydantic.create_model(  # the spec model of a release with one more field
        "NextTrainingJobSpec",
        __base__=type(spec),
        new_knob=(int, pydantic.Field(0, alias="newKnob")),
    )
    upgraded = grown.model_validate(spec.model_dump(by_alias=True))
    assert identity.spec_hash(upgraded) == identity.spec_hash(spec)
    assert identity.spec_hash(upgraded.model_copy(update={"new_knob": 1})) != identity.spec_hash(
        spec
    )


def test_a_gang_stamped_with_the_hash_of_the_previous_release_is_not_rebuilt():
    spec = job(_spec_of(2)).spec
    assert spec is not None
    # What releases before stamped: every field, defaults included.
    dumped = spec.model_dump(mode="json", by_alias=True, exclude={"run_policy"})
    legacy = hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest()[:16]
    assert legacy != identity.spec_hash(spec)
    state = job(_spec_of(2), **placed_status(phase="Running", specHash=legacy))
    decision = lifecycle.decide(state, running_gang(), at(9))
    assert "DeletePods" not in kinds(decision)
    assert conditions.SPEC_CHANGED not in str(decision.actions)


def test_a_pod_recreated_into_a_gang_of_the_previous_release_joins_its_pod_group():
    spec = job(_spec_of(2)).spec
    assert spec is not None
    dumped = spec.model_dump(mode="json", by_alias=True, exclude={"run_policy"})
    legacy = hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest()[:16]
    ref = identity.JobRef("j", "ns", "u1")
    group = builders.build_pod_group(ref, spec, 0, legacy)["metadata"]["name"]
    assert group == f"j-r0-{legacy[:10]}"
    assert (
        builders.build_pod_group(ref, spec, 0, "0" * 16)["metadata"]["name"] != f"j-r0-{'0' * 10}"
    )


def test_the_pass_that_fails_a_job_at_its_deadline_is_due_at_the_deadline() -> None:
    """The reconciler passes again when ``activeDeadlineSeconds`` runs out, not at the next
    resync (a backfilled job's declared end counts on it, ``reservation.end_bound``); the pass
    then fails the job (the table above)."""
    limited = JobBuilder().layout(data=2, gpus_per_node=1).raw() | {
        "runPolicy": {"activeDeadlineSeconds": 60}
    }
    running = job(limited, **placed_status(phase="Running"))  # started at T0
    later = datetime.timedelta(seconds=45)
    assert failure.pass_at_deadline(running, "Running", T0 + later) == 15.0
    assert failure.pass_at_deadline(running, "Running", T0 + 2 * later) == 0.0  # overdue: now
    assert failure.pass_at_deadline(running, "Failed", T0) is None  # finished
    assert failure.pass_at_deadline(running, "Suspended", T0 + 2 * later) is None  # no hot loop
    suspending = limited | {"runPolicy": {"activeDeadlineSeconds": 60, "suspend": True}}
    asked = job(suspending, **placed_status(phase="Running"))
    assert failure.pass_at_deadline(asked, "Running", T0 + 2 * later) is None
    assert failure.pass_at_deadline(job(limited), "Pending", T0) is None  # not started
    unlimited = job(JobBuilder().layout(data=2, gpus_per_node=1).raw(), **placed_status())
    assert failure.pass_at_deadline(unlimited, "Running", T0) is None


def test_a_backfilled_job_ends_at_the_deadline_it_backfilled_with_whatever_its_spec_says_later():
    """``status.backfill.deadlineAt`` holds: a deadline raised (or removed) after the job took
    nodes reserved for another is not the one that fails it; the pass is due then, and the job
    fails saying why."""
    kept = {
        "holder": "ns/big",
        "deadlineAt": conditions.timestamp(T0 + datetime.timedelta(seconds=60)),
    }
    for policy in ({"activeDeadlineSeconds": 3600}, {}):
        raised = JobBuilder().layout(data=2, gpus_per_node=1).raw() | {"runPolicy": policy}
        state = job(raised, **placed_status(phase="Running", backfill=kept))
        assert (
            failure.pass_at_deadline(state, "Running", T0 + datetime.timedelta(seconds=45)) == 15.0
        )
        decision = lifecycle.decide(state, running_gang(), at(61))
        assert kinds(decision) == ["SetStatus", "Emit", "DeletePods"]
        assert status_of(decision)["phase"] == "Failed"
        (emit,) = [a for a in decision.actions if isinstance(a, job_actions.Emit)]
        assert emit.reason == "DeadlineExceeded" and "status.backfill.deadlineAt" in emit.message
        early = lifecycle.decide(state, running_gang(), at(59))
        assert "Failed" not in str(status_of(early).get("phase"))
