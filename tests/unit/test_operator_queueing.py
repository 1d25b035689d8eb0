"""A job queued by Kueue: its Workload, Kueue's states, and the decisions they lead to (tables).

tests/integration/operator/test_operator_kueue.py runs the same flow against a real Kueue.
"""

from __future__ import annotations

from typing import Any

import pytest

from meshtrain.api import loading
from meshtrain.operator.policy import (
    builders,
    conditions,
    identity,
    job_actions,
    job_state,
    kueue_workload,
    lifecycle,
)
from tests.builders import JobBuilder
from tests.unit.test_operator_lifecycle import T0, at, job, placed_status, pod

REF = identity.JobRef(name="llm", namespace="team", uid="u-1")


def workload(*conds: tuple[str, str, str], admission: bool = False) -> dict[str, Any]:
    status: dict[str, Any] = {
        "conditions": [
            {"type": t, "status": s, "reason": r, "message": f"{r} message"} for t, s, r in conds
        ]
    }
    if admission:
        status["admission"] = {"clusterQueue": "research", "podSetAssignments": []}
    return {"metadata": {"name": "w", "generation": 1, "resourceVersion": "7"}, "status": status}


def test_the_queue_comes_from_kueues_labels():
    assert kueue_workload.queue_of({}) is None
    assert kueue_workload.queue_of({kueue_workload.QUEUE_LABEL: "q"}) == kueue_workload.Queue(
        "q", None
    )
    labels = {kueue_workload.QUEUE_LABEL: "q", kueue_workload.PRIORITY_CLASS_LABEL: "high"}
    assert kueue_workload.queue_of(labels) == kueue_workload.Queue("q", "high")


def test_the_workload_asks_for_the_gangs_requests_and_is_owned_by_the_job():
    spec = loading.parse_spec(
        JobBuilder()
        .layout(data=8, gpus_per_node=4)
        .resources(cpu="8", extraResources={"rdma/ib": "1"})
        .raw()
    )
    pod_manifest = builders.build_pod(REF, spec, 0, 0, "")
    priority = kueue_workload.workload_priority("high", 1000)
    body = kueue_workload.build_workload(
        REF, spec, kueue_workload.Queue("q", "high"), pod_manifest, priority
    )
    assert body["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert body["metadata"]["ownerReferences"][0]["controller"] is True
    [pod_set] = body["spec"]["podSets"]
    assert pod_set["count"] == spec.pods == 2
    requests = pod_set["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests == pod_manifest["spec"]["containers"][0]["resources"]["requests"]
    assert requests["nvidia.com/gpu"] == "4" and requests["rdma/ib"] == "1"
    assert body["spec"]["queueName"] == "q" and body["spec"]["priority"] == 1000
    assert body["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io",
        "kind": "WorkloadPriorityClass",
        "name": "high",
    }


def _priority_class(name: str, value: int, default: bool = False) -> dict[str, Any]:
    return {"metadata": {"name": name}, "value": value, "globalDefault": default}


def test_without_a_class_named_the_priority_is_the_global_default_pod_priority_or_zero():
    assert kueue_workload.default_priority([]) == kueue_workload.Priority(0)
    assert kueue_workload.default_priority(
        [_priority_class("high", 1000)]
    ) == kueue_workload.Priority(0)
    # Two classes claiming globalDefault (a race the API server allows): the lower one.
    classes = [
        _priority_class("high", 1000),
        _priority_class("normal", 50, default=True),
        _priority_class("batch", 10, default=True),
    ]
    assert kueue_workload.default_priority(classes) == kueue_workload.pod_priority("batch", 10)


def test_a_pod_priority_class_is_the_workloads_priority_class_ref():
    spec = loading.parse_spec(JobBuilder().pod(priorityClassName="team-high").raw())
    pod_manifest = builders.build_pod(REF, spec, 0, 0, "")
    body = kueue_workload.build_workload(
        REF,
        spec,
        kueue_workload.Queue("q", None),
        pod_manifest,
        kueue_workload.pod_priority("team-high", 500),
    )
    assert body["spec"]["priority"] == 500
    assert body["spec"]["priorityClassRef"] == {
        "group": "scheduling.k8s.io",
        "kind": "PriorityClass",
        "name": "team-high",
    }
    assert body["spec"]["podSets"][0]["template"]["spec"]["priorityClassName"] == "team-high"
    unranked = kueue_workload.build_workload(
        REF, spec, kueue_workload.Queue("q", None), pod_manifest, kueue_workload.Priority(0)
    )
    assert unranked["spec"]["priority"] == 0 and "priorityClassRef" not in unranked["spec"]


def test_a_missing_pod_priority_class_holds_the_job_and_names_the_field():
    held = kueue_workload.missing_pod_priority_class("team-high")
    decision = lifecycle.decide(job(), [], T0, kueue_workload.Gate(held))
    assert kueue_workload.CreateWorkload not in _types(decision)
    assert "spec.pod.priorityClassName" in _queued(decision)["message"]


@pytest.mark.parametrize(
    "body,expected",
    [
        (workload(("QuotaReserved", "False", "Pending")), kueue_workload.Waiting("Pending", "Pending message")),
        (
            workload(("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted"), admission=True),
            kueue_workload.Admitted("research"),
        ),
        (
            workload(("Evicted", "True", "Preempted"), ("Admitted", "True", "Admitted"), admission=True),
            kueue_workload.Evicted("Preempted", "Preempted message", holds_quota=True),
        ),
        (workload(("Evicted", "True", "Preempted")), kueue_workload.Evicted("Preempted", "Preempted message", holds_quota=False)),
        (workload(("Finished", "True", "Succeeded")), kueue_workload.Finished()),
    ],
)  # fmt: skip
def test_kueues_conditions_read_as_one_state(body, expected):
    assert kueue_workload.state(body) == expected


def test_release_gives_back_the_admission_and_requeues_after_a_preemption():
    body = workload(
        ("Evicted", "True", "Preempted"), ("Admitted", "True", "Admitted"), admission=True
    )
    patch = kueue_workload.release_patch(body, T0)["status"]
    assert patch["admission"] is None
    found = {c["type"]: c for c in patch["conditions"]}
    assert found["QuotaReserved"]["status"] == "False"
    assert found["Admitted"]["status"] == "False"
    assert found["Requeued"]["status"] == "True"
    assert found["Evicted"]["status"] == "True"  # Kueue's own condition is left as it is


def _types(decision: job_actions.Decision) -> list[type]:
    return [type(a) for a in decision.actions]


def _queued(decision: job_actions.Decision) -> dict[str, Any]:
    [status] = [a for a in decision.actions if isinstance(a, job_actions.SetStatus)]
    return conditions.find(status.changes["conditions"], conditions.QUEUED) or {}


def test_a_queued_job_without_a_workload_creates_one_and_places_nothing():
    decision = lifecycle.decide(job(), [], T0, kueue_workload.Gate(None))
    assert kueue_workload.CreateWorkload in _types(decision)
    assert job_actions.Place not in _types(decision)
    assert _queued(decision)["status"] == "True"


def test_queued_is_written_before_the_workload_is_created():
    """A job without its label is looked up in Kueue only when it was queued (its status says
    so): a Workload created before that status landed could outlive a label removed meanwhile."""
    kinds = _types(lifecycle.decide(job(), [], T0, kueue_workload.Gate(None)))
    assert kinds.index(job_actions.SetStatus) < kinds.index(kueue_workload.CreateWorkload)


def test_a_waiting_job_keeps_no_pods_and_says_kueues_reason():
    gate = kueue_workload.Gate(
        kueue_workload.Waiting("Pending", "insufficient quota for nvidia.com/gpu")
    )
    decision = lifecycle.decide(job(), [], T0, gate)
    assert job_actions.Place not in _types(decision)
    queued = _queued(decision)
    assert queued["reason"] == "Pending" and "insufficient quota" in queued["message"]
    # Nothing changes while Kueue says the same thing.
    again = job(**{"phase": "Pending", "conditions": [queued]})
    assert lifecycle.decide(again, [], at(5), gate).actions == ()


def test_an_admitted_job_is_placed_and_the_admission_recorded_once():
    gate = kueue_workload.Gate(kueue_workload.Admitted("research"))
    decision = lifecycle.decide(job(), [], T0, gate)
    assert job_actions.Place in _types(decision)
    assert _queued(decision)["status"] == "False"
    recorded = job(conditions=[_queued(decision)])
    assert job_actions.SetStatus not in _types(lifecycle.decide(recorded, [], at(1), gate))


def test_an_evicted_gang_stops_with_its_grace_period_without_counting_a_failure():
    gate = kueue_workload.Gate(
        kueue_workload.Evicted("Preempted", "preempted by urgent", holds_quota=True)
    )
    running = job(**placed_status(phase="Running"))
    decision = lifecycle.decide(running, [pod(0, "Running"), pod(1, "Running")], T0, gate)
    [delete] = [a for a in decision.actions if isinstance(a, job_actions.DeletePods)]
    assert delete.grace_seconds is None  # time to checkpoint the step they stop at
    [status] = [a for a in decision.actions if isinstance(a, job_actions.SetStatus)]
    assert status.changes["phase"] == "Pending" and status.changes["placement"] == []
    assert "restarts" not in status.changes
    assert kueue_workload.ReleaseQuota not in _types(decision), "not while the pods still run"
    # The exit codes of the stopped ranks are no failures either.
    stopped = [
        pod(0, "Failed", exit_code=143, deleting=True),
        pod(1, "Failed", exit_code=143, deleting=True),
    ]
    assert "restarts" not in str(lifecycle.decide(running, stopped, at(5), gate).actions)
    # Once the gang is gone the quota goes back.
    assert kueue_workload.ReleaseQuota in _types(lifecycle.decide(running, [], at(10), gate))


def test_a_finished_job_finishes_its_workload():
    done = job(phase="Succeeded", completionTime=conditions.timestamp(T0))
    decision = lifecycle.decide(
        done, [], T0, kueue_workload.Gate(kueue_workload.Admitted("research"))
    )
    [finish] = [a for a in decision.actions if isinstance(a, kueue_workload.FinishWorkload)]
    assert finish.succeeded
    closed = kueue_workload.Gate(kueue_workload.Finished())
    assert kueue_workload.FinishWorkload not in _types(lifecycle.decide(done, [], T0, closed))


def test_a_workload_is_finished_only_once_the_ended_gangs_pods_are_gone():
    failed = job(phase="Failed", completionTime=conditions.timestamp(T0))
    gate = kueue_workload.Gate(kueue_workload.Admitted("research"))
    stopping = [pod(0, "Running", deleting=True), pod(1, "Failed", exit_code=1)]
    waiting = lifecycle.decide(failed, stopping, T0, gate)
    assert kueue_workload.FinishWorkload not in _types(waiting)
    assert waiting.requeue_after is not None, "looks again: no pod event may come"
    stopped = [pod(0, "Failed", exit_code=143, deleting=True), pod(1, "Failed", exit_code=1)]
    assert kueue_workload.FinishWorkload in _types(lifecycle.decide(failed, stopped, at(5), gate))


def test_a_spare_pod_still_holding_its_gpus_keeps_the_quota():
    """A spare pod (runPolicy.recovery.spareNodes) is no pod of the gang, but it holds GPUs the
    Workload admitted: the quota waits for it too (review finding 13)."""
    failed = job(phase="Failed", completionTime=conditions.timestamp(T0))
    gate = kueue_workload.Gate(kueue_workload.Admitted("research"))
    waiting = lifecycle.decide(failed, [], T0, gate, spares_holding=1)
    assert kueue_workload.FinishWorkload not in _types(waiting) and waiting.requeue_after
    assert kueue_workload.FinishWorkload in _types(lifecycle.decide(failed, [], T0, gate))
    running = job(**placed_status(phase="Running", restarts=0))
    evicted = kueue_workload.Gate(kueue_workload.Evicted("Preempted", "", holds_quota=True))
    held = lifecycle.decide(running, [], at(10), evicted, spares_holding=1)
    assert kueue_workload.ReleaseQuota not in _types(held)
    assert kueue_workload.ReleaseQuota in _types(lifecycle.decide(running, [], at(10), evicted))


def _reported(decision: job_actions.Decision) -> list[bool]:
    return [a.ready for a in decision.actions if isinstance(a, kueue_workload.ReportPodsReady)]


def test_an_admitted_gang_reports_pods_ready_the_way_kueues_job_reconciler_does():
    running = job(**placed_status(phase="Running"))
    up = [pod(0, "Running"), pod(1, "Running")]
    admitted = workload(
        ("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted"), admission=True
    )
    gate = kueue_workload.Gate(kueue_workload.state(admitted))
    assert _reported(lifecycle.decide(running, up, T0, gate)) == [True]
    patch = kueue_workload.pods_ready_patch(admitted, ready=True, now=T0)
    assert patch is not None
    ready = conditions.find(patch["status"]["conditions"], "PodsReady")
    assert (ready["status"], ready["reason"]) == ("True", "Started")
    # Reported once: the workload now says it.
    admitted["status"]["conditions"] = patch["status"]["conditions"]
    gate = kueue_workload.Gate(kueue_workload.state(admitted))
    assert _reported(lifecycle.decide(running, up, at(1), gate)) == []
    assert kueue_workload.pods_ready_patch(admitted, ready=True, now=at(1)) is None
    # A rank that stops after the start: Kueue's recovery timeout runs from here.
    broken = [pod(0, "Running"), pod(1, "Pending")]
    assert _reported(lifecycle.decide(running, broken, at(2), gate)) == [False]
    patch = kueue_workload.pods_ready_patch(admitted, ready=False, now=at(2))
    assert patch is not None
    ready = conditions.find(patch["status"]["conditions"], "PodsReady")
    assert (ready["status"], ready["reason"]) == ("False", "WaitForRecovery")


def test_the_released_quota_leaves_pods_ready_waiting_for_the_next_start():
    body = workload(
        ("Evicted", "True", "PodsReadyTimeout"),
        ("Admitted", "True", "Admitted"),
        ("PodsReady", "True", "Started"),
        admission=True,
    )
    found = {c["type"]: c for c in kueue_workload.release_patch(body, T0)["status"]["conditions"]}
    assert (found["PodsReady"]["status"], found["PodsReady"]["reason"]) == ("False", "WaitForStart")
    assert found["Requeued"]["status"] == "False"  # Kueue requeues it after its backoff


def test_a_missing_workload_priority_class_creates_nothing_and_names_the_label():
    gate = kueue_workload.Gate(
        kueue_workload.missing_priority_class(kueue_workload.Queue("q", "urgent"))
    )
    decision = lifecycle.decide(job(), [], T0, gate)
    assert kueue_workload.CreateWorkload not in _types(decision)
    assert job_actions.Place not in _types(decision)
    queued = _queued(decision)
    assert queued["reason"] == kueue_workload.PRIORITY_CLASS_NOT_FOUND
    assert (
        kueue_workload.PRIORITY_CLASS_LABEL in queued["message"] and '"urgent"' in queued["message"]
    )
    [event] = [a for a in decision.actions if isinstance(a, job_actions.Emit)]
    assert event.type == "Warning"


def test_a_workload_of_the_jobs_name_that_another_object_owns_is_never_the_jobs():
    foreign = workload(("Admitted", "True", "Admitted"), admission=True)
    foreign["metadata"]["ownerReferences"] = [
        {"kind": "ConfigMap", "name": "other", "uid": "u-other", "controller": True}
    ]
    assert not kueue_workload.controlled_by(foreign, REF.uid)
    assert kueue_workload.controlled_by(
        {"metadata": {"ownerReferences": [{"uid": REF.uid, "controller": True}]}}, REF.uid
    )
    decision = lifecycle.decide(
        job(), [], T0, kueue_workload.Gate(kueue_workload.name_taken(foreign))
    )
    assert job_actions.Place not in _types(decision)
    assert kueue_workload.CreateWorkload not in _types(decision)
    queued = _queued(decision)
    assert queued["reason"] == kueue_workload.NAME_TAKEN and "ConfigMap/other" in queued["message"]


def test_a_workload_of_another_spec_is_outdated():
    spec = loading.parse_spec(JobBuilder().layout(data=2).raw())
    queue = kueue_workload.Queue("q", None)
    pod_manifest = builders.build_pod(REF, spec, 0, 0, "")
    body = kueue_workload.build_workload(REF, spec, queue, pod_manifest, kueue_workload.Priority(0))
    assert kueue_workload.outdated(body, identity.spec_hash(spec)) is None
    grown = loading.parse_spec(JobBuilder().layout(data=4).raw())
    assert kueue_workload.outdated(body, identity.spec_hash(grown)) is not None
    assert kueue_workload.queue_of_workload(body) == queue


def test_a_new_queue_moves_the_waiting_workload_and_nothing_else():
    gate = kueue_workload.Gate(
        kueue_workload.Waiting("Pending", "insufficient quota"), move_to="spare"
    )
    decision = lifecycle.decide(job(), [], T0, gate)
    assert kueue_workload.MoveWorkload("spare") in decision.actions
    assert kueue_workload.DeleteWorkload not in _types(
        decision
    ) and job_actions.Place not in _types(decision)
    reserved = workload(("QuotaReserved", "True", "QuotaReserved"), admission=True)
    assert kueue_workload.reserved(reserved) and not kueue_workload.reserved(workload())


def test_a_removed_queue_label_deletes_the_waiting_workload_then_the_job_leaves_kueue():
    waiting = job(conditions=[{"type": "Queued", "status": "True", "reason": "Pending"}])
    decision = lifecycle.decide(
        waiting, [], T0, kueue_workload.Gate(kueue_workload.queue_removed())
    )
    assert kueue_workload.DeleteWorkload in _types(decision)
    assert "queue-name" in _queued(decision)["message"]
    # The Workload is gone (no gate): the Queued condition goes, then the job is placed as any.
    gone = lifecycle.decide(waiting, [], at(1), None)
    [status] = [a for a in gone.actions if isinstance(a, job_actions.SetStatus)]
    assert all(c["type"] != "Queued" for c in status.changes["conditions"])
    left = job(conditions=status.changes["conditions"])
    assert job_actions.Place in _types(lifecycle.decide(left, [], at(2), None))


def test_an_outdated_workload_stops_the_gang_then_is_replaced():
    gate = kueue_workload.Gate(
        kueue_workload.Outdated("WorkloadOutdated", "the job's spec changed")
    )
    running = job(**placed_status(phase="Running"))
    decision = lifecycle.decide(running, [pod(0, "Running"), pod(1, "Running")], T0, gate)
    assert job_actions.DeletePods in _types(decision)
    assert kueue_workload.DeleteWorkload not in _types(decision), (
        "not while the old gang still runs"
    )
    assert _queued(decision)["reason"] == "WorkloadOutdated"
    assert kueue_workload.DeleteWorkload in _types(lifecycle.decide(running, [], at(5), gate))


def test_a_suspended_job_gives_its_workload_back_once_its_pods_are_gone():
    suspended = job(
        JobBuilder().layout(data=2, gpus_per_node=1).run_policy(suspend=True).raw(),
        **placed_status(phase="Running"),
    )
    gate = kueue_workload.Gate(kueue_workload.Admitted("research"))
    with_pods = lifecycle.decide(suspended, [pod(0, "Running"), pod(1, "Running")], T0, gate)
    assert kueue_workload.DeleteWorkload not in _types(with_pods)
    assert kueue_workload.DeleteWorkload in _types(lifecycle.decide(suspended, [], at(5), gate))
    assert kueue_workload.DeleteWorkload not in _types(lifecycle.decide(suspended, [], at(5), None))


def _flavor(name: str, labels: dict[str, str], tolerations: list[dict[str, str]]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"nodeLabels": labels, "tolerations": tolerations}}


def test_the_admitted_flavors_are_read_from_the_pod_sets_assignment():
    body = workload(("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted"))
    body["status"]["admission"] = {
        "clusterQueue": "research",
        "podSetAssignments": [
            {"name": "trainers", "flavors": {"nvidia.com/gpu": "h100", "cpu": "default"}},
            {"name": "other", "flavors": {"cpu": "elsewhere"}},
        ],
    }
    admitted = kueue_workload.state(body)
    assert isinstance(admitted, kueue_workload.Admitted)
    assert admitted.flavors == ("default", "h100")
    decision = lifecycle.decide(job(), [], T0, kueue_workload.Gate(admitted))
    [place] = [a for a in decision.actions if isinstance(a, job_actions.Place)]
    assert place.flavors == ("default", "h100")


def test_the_gangs_pods_carry_the_flavors_node_labels_and_tolerations():
    taint = {"key": "dedicated", "operator": "Equal", "value": "h100", "effect": "NoSchedule"}
    where = kueue_workload.assignment(
        [
            _flavor("h100", {"gpu": "h100"}, [taint]),
            _flavor("zone", {"zone": "a"}, [taint]),  # the same toleration once
        ]
    )
    assert where == kueue_workload.Assignment({"gpu": "h100", "zone": "a"}, (taint,))
    spec = loading.parse_spec(JobBuilder(pool="p").raw())
    pod_manifest = builders.build_pod(REF, spec, 0, 0, "")
    placed = kueue_workload.assign(pod_manifest, where)
    assert placed["spec"]["nodeSelector"] == {
        **pod_manifest["spec"]["nodeSelector"],
        "gpu": "h100",
        "zone": "a",
    }
    assert placed["spec"]["tolerations"][-1] == taint
    assert pod_manifest["spec"].get("tolerations") != placed["spec"]["tolerations"]  # a copy
    assert kueue_workload.assign(pod_manifest, kueue_workload.Assignment()) == pod_manifest
    with pytest.raises(kueue_workload.AssignmentConflict, match="spec.resources.nodeSelector"):
        kueue_workload.assign(placed, kueue_workload.Assignment({"gpu": "a100"}))


def _own(queue: str, *conds: tuple[str, str, str], owner: str = "u-1") -> dict[str, Any]:
    body = workload(
        *conds, admission=any(c[0] == "QuotaReserved" and c[1] == "True" for c in conds)
    )
    body["metadata"]["ownerReferences"] = [
        {"uid": owner, "controller": True, "kind": "TrainingJob"}
    ]
    body["metadata"]["annotations"] = {kueue_workload.SPEC_HASH_ANNOTATION: "h"}
    body["spec"] = {"queueName": queue}
    return body


WAITING = ("QuotaReserved", "False", "Pending")
RESERVED = (("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted"))
Q, SPARE = kueue_workload.Queue("q", None), kueue_workload.Queue("spare", None)


@pytest.mark.parametrize(
    "found,queue,expected",
    [
        # no Workload: one is created while labelled; without a label the job is not queued
        (None, Q, kueue_workload.Gate(None)),
        (None, None, None),
        # the same queue: Kueue's state, nothing moves
        (
            _own("q", WAITING),
            Q,
            kueue_workload.Gate(kueue_workload.Waiting("Pending", "Pending message")),
        ),
        # a new queue: moved while Kueue holds no quota ...
        (
            _own("q", WAITING),
            SPARE,
            kueue_workload.Gate(
                kueue_workload.Waiting("Pending", "Pending message"), move_to="spare"
            ),
        ),
        # ... and not while it does (Kueue's immutability while admitted)
        (_own("q", *RESERVED), SPARE, kueue_workload.Gate(kueue_workload.Admitted("research"))),
        # the label removed: before admission the Workload goes; after it, it still rules
        (_own("q", WAITING), None, kueue_workload.Gate(kueue_workload.queue_removed())),
        (_own("q", *RESERVED), None, kueue_workload.Gate(kueue_workload.Admitted("research"))),
        # another object's Workload of the job's name: never read as the job's
        (
            _own("q", WAITING, owner="other"),
            Q,
            kueue_workload.Gate(kueue_workload.name_taken(_own("q", WAITING, owner="other"))),
        ),
        (_own("q", WAITING, owner="other"), None, None),
    ],
)
def test_the_queue_label_follows_kueues_rules(found, queue, expected):
    assert kueue_workload.gate_for(found, "u-1", queue, "h") == expected


def test_a_changed_spec_outdates_even_an_admitted_workload():
    gate = kueue_workload.gate_for(_own("q", *RESERVED), "u-1", Q, "another-hash")
    assert gate is not None and isinstance(gate.state, kueue_workload.Outdated)


def _applied(
    raw: dict[str, Any], state: job_state.JobState, decision: job_actions.Decision
) -> job_state.JobState:
    """``state`` after the decision's status patch (a None value removes the field)."""
    status = dict(state.status)
    for action in decision.actions:
        if isinstance(action, job_actions.SetStatus):
            status.update(action.changes)
    return job(raw, **{k: v for k, v in status.items() if v is not None})


def test_time_waiting_in_the_queue_after_a_preemption_is_not_active_time():
    # Kubernetes clears a suspended Job's startTime; activeDeadlineSeconds counts only running time.
    raw = JobBuilder().layout(data=2, gpus_per_node=1).run_policy(activeDeadlineSeconds=3600).raw()
    running = job(raw, **placed_status(phase="Running"))
    evicted = kueue_workload.Gate(
        kueue_workload.Evicted("Preempted", "preempted by urgent", holds_quota=False)
    )
    waiting = _applied(raw, running, lifecycle.decide(running, [], at(10), evicted))
    assert "startTime" not in waiting.status
    readmitted = lifecycle.decide(
        waiting, [], at(7200), kueue_workload.Gate(kueue_workload.Admitted("q"))
    )
    assert job_actions.Place in _types(readmitted)
    assert "DeadlineExceeded" not in str(readmitted.actions)


@pytest.mark.parametrize("name", ["Team_Queue", "team queue", "-team", "team.", "t" * 254])
def test_a_queue_label_that_cannot_name_a_localqueue_holds_the_job_naming_the_label(name):
    gate = kueue_workload.gate_for(None, "u-1", kueue_workload.Queue(name, None), "h")
    assert gate is not None and isinstance(gate.state, kueue_workload.Waiting)
    decision = lifecycle.decide(job(), [], T0, gate)
    assert kueue_workload.CreateWorkload not in _types(decision)
    queued = _queued(decision)
    assert queued["reason"] == "InvalidQueueName"
    assert kueue_workload.QUEUE_LABEL in queued["message"] and repr(name) in queued["message"]
    [event] = [a for a in decision.actions if isinstance(a, job_actions.Emit)]
    assert event.type == "Warning"


@pytest.mark.parametrize("name", ["team-queue", "team.gpu-a100", "q1"])
def test_a_queue_label_naming_a_localqueue_creates_the_workload(name):
    assert kueue_workload.gate_for(
        None, "u-1", kueue_workload.Queue(name, None), "h"
    ) == kueue_workload.Gate(None)


def test_a_refused_workload_is_said_once_and_tried_again_without_rewriting_the_condition():
    why = kueue_workload.workload_rejected(422, 'spec.queueName: Invalid value: "Team_Queue"')
    backing_off = lifecycle.decide(
        job(),
        [],
        T0,
        kueue_workload.Gate(kueue_workload.Waiting(kueue_workload.WORKLOAD_REJECTED, why)),
    )
    assert kueue_workload.CreateWorkload not in _types(backing_off)
    assert _queued(backing_off)["reason"] == "WorkloadRejected"
    assert kueue_workload.QUEUE_LABEL in why and "Team_Queue" in why and "422" in why
    [event] = [a for a in backing_off.actions if isinstance(a, job_actions.Emit)]
    assert event.type == "Warning"
    said = job(phase="Pending", conditions=[_queued(backing_off)])
    retry = lifecycle.decide(said, [], at(2), kueue_workload.Gate(None, rejected=why))
    assert _types(retry) == [kueue_workload.CreateWorkload]


# Kueue's quota goes back once no pod of the gang holds resources on its node.  A pod
# that ended (Succeeded/Failed) holds none, even while a finalizer of another controller
# keeps the object (kube-scheduler and the kubelet count only non-terminal pods), nor does
# a deleted pod never bound (the scheduler skips it); a deleted pod whose containers run or
# start on its node keeps its GPUs until it is gone.  Where Kueue re-admits the job (evicted,
# outdated, suspended) the new gang re-uses the pod names, so every pod object of the
# attempt must be gone first; a finished or deleted job re-creates nothing.
_ENDED = [pod(0, "Succeeded", deleting=True), pod(1, "Failed", exit_code=143, deleting=True)]
_HOLDING = [
    ([pod(0, "Running", deleting=True)], "a deleted pod still running"),
    ([pod(0, "Pending", deleting=True, bound=True)], "a deleted bound pod still starting"),
    ([pod(0, "Running")], "a running pod"),
    ([pod(0, "Succeeded", deleting=True), pod(1, "Running", deleting=True)], "one of two ended"),
]
_NAME_TAKEN = [
    (_ENDED, "pods ended, kept by a finalizer"),
    ([pod(0, "Failed", exit_code=1), pod(1, "Succeeded")], "pods ended, not deleted yet"),
    ([pod(0, "Pending", deleting=True)], "a deleted pod never bound"),
]


def _release_cases() -> list[tuple[str, job_state.JobState, kueue_workload.Gate | None, type]]:
    running = job(**placed_status(phase="Running"))
    suspended = job(
        JobBuilder().layout(data=2, gpus_per_node=1).run_policy(suspend=True).raw(),
        **placed_status(phase="Running"),
    )
    done = job(phase="Succeeded", completionTime=conditions.timestamp(T0))
    evicted = kueue_workload.Evicted("Preempted", "preempted by urgent", holds_quota=True)
    outdated = kueue_workload.Outdated("WorkloadOutdated", "the job's spec changed")
    admitted = kueue_workload.Admitted("research")
    return [
        ("evicted", running, kueue_workload.Gate(evicted), kueue_workload.ReleaseQuota),
        ("outdated", running, kueue_workload.Gate(outdated), kueue_workload.DeleteWorkload),
        ("suspended", suspended, kueue_workload.Gate(admitted), kueue_workload.DeleteWorkload),
        ("finished", done, kueue_workload.Gate(admitted), kueue_workload.FinishWorkload),
    ]


_RECREATING = [c for c in _release_cases() if c[0] != "finished"]
_FINISHED = [c for c in _release_cases() if c[0] == "finished"]


@pytest.mark.parametrize("case", _release_cases(), ids=lambda c: c[0])
def test_quota_goes_back_once_no_pod_is_left(case):
    _, state, gate, release = case
    assert release in _types(lifecycle.decide(state, [], at(5), gate))


@pytest.mark.parametrize(("pods", "why"), _NAME_TAKEN, ids=[w for _, w in _NAME_TAKEN])
@pytest.mark.parametrize("case", _FINISHED, ids=lambda c: c[0])
def test_a_finished_job_gives_the_quota_back_once_no_pod_holds_resources(case, pods, why):
    _, state, gate, release = case
    decision = lifecycle.decide(state, pods, at(5), gate)
    assert release in _types(decision), f"quota kept with {why}"


@pytest.mark.parametrize(("pods", "why"), _NAME_TAKEN, ids=[w for _, w in _NAME_TAKEN])
@pytest.mark.parametrize("case", _RECREATING, ids=lambda c: c[0])
def test_quota_stays_while_a_pod_keeps_a_name_the_readmitted_gang_needs(case, pods, why):
    _, state, gate, release = case
    decision = lifecycle.decide(state, pods, at(5), gate)
    assert release not in _types(decision), f"quota given back with {why}"


@pytest.mark.parametrize(("pods", "why"), _HOLDING, ids=[w for _, w in _HOLDING])
@pytest.mark.parametrize("case", _release_cases(), ids=lambda c: c[0])
def test_quota_stays_while_a_pod_holds_resources(case, pods, why):
    _, state, gate, release = case
    decision = lifecycle.decide(state, pods, at(5), gate)
    assert release not in _types(decision), f"quota given back with {why}"


def test_an_ended_pod_of_an_earlier_attempt_does_not_keep_an_evicted_jobs_quota():
    restarted = job(**placed_status(phase="Running", restarts=1))
    evicted = kueue_workload.Evicted("Preempted", "preempted by urgent", holds_quota=True)
    kept = [pod(0, "Failed", exit_code=1, deleting=True, attempt=0)]
    decision = lifecycle.decide(restarted, kept, at(5), kueue_workload.Gate(evicted))
    assert kueue_workload.ReleaseQuota in _types(decision)
    assert decision.requeue_after is None
