"""The pod tier: a pod lost from a running gang that rejoins is replaced alone; otherwise, and for
pod 0, the gang is rebuilt as before."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshtrain.operator.policy import (
    builders,
    failure,
    job_actions,
    kueue_workload,
    lifecycle,
    naming,
    pod_loss,
    pod_state,
    replacement,
    situation,
)
from tests.builders import JobBuilder
from tests.unit.test_operator_lifecycle import at, job, kinds, placed_status, pod, status_of


def spec() -> dict[str, Any]:
    return JobBuilder().layout(data=3, gpus_per_node=1).run_policy(backoffLimit=1).raw()


def three(**extra: Any) -> dict[str, Any]:
    return placed_status(
        phase="Running",
        placement=[{"podIndex": i, "node": f"n{i}"} for i in range(3)],
        **extra,
    )


def gang(*changed: pod_state.PodState) -> list[pod_state.PodState]:
    """Three running pods that rejoin, ``changed`` in place of theirs."""
    pods = {i: dataclasses.replace(pod(i, "Running"), rejoins=True) for i in range(3)}
    for p in changed:
        pods[p.index] = dataclasses.replace(p, rejoins=True)
    return list(pods.values())


def replace_of(decision: job_actions.Decision) -> job_actions.ReplacePods:
    (action,) = decision.actions
    assert isinstance(action, job_actions.ReplacePods), decision
    return action


def test_built_pods_carry_the_rejoin_label_of_the_builtin_trainer_only():
    ref = job(spec()).ref
    built = builders.build_pod(ref, job(spec()).spec, 0, 1, "n1")
    assert pod_state.read(built).rejoins
    custom = JobBuilder().layout(data=3, gpus_per_node=1).trainer(type="custom", command=["x"])
    custom_job = job(custom.raw())
    assert not pod_state.read(builders.build_pod(ref, custom_job.spec, 0, 1, "n1")).rejoins


def test_a_deleted_pod_of_a_running_gang_is_replaced_alone():
    decision = lifecycle.decide(
        job(spec(), **three()), gang(pod(2, "Running", deleting=True)), at(5)
    )
    action = replace_of(decision)
    assert action.indices == (2,) and action.causes == ((2, "j-r0-2", "pod deleted"),)
    assert action.avoid == () and action.doomed == ()  # its node is fine; it is being deleted
    # Where no node takes it, the reconciler does what the gang rule decides this pass.
    seen = situation.Situation(
        job(spec(), **three()), tuple(gang(pod(2, "Running", deleting=True))), at(5)
    )
    assert action.otherwise == failure.restart_or_fail(seen, seen.failures).actions
    assert status_of(job_actions.Decision(action.otherwise))["restarts"] == 1


def test_a_pod_its_node_lost_is_replaced_away_from_that_node():
    decision = lifecycle.decide(job(spec(), **three()), gang(pod(1, "Unknown")), at(5))
    action = replace_of(decision)
    assert action.avoid == ("n1",) and action.doomed == ("j-r0-1",)
    assert action.causes == ((1, "j-r0-1", "node lost"),)
    vanished = [p for p in gang() if p.index != 1]
    action = replace_of(
        lifecycle.decide(job(spec(), **three()), vanished, at(5), None, frozenset({"n1"}))
    )
    assert action.causes == ((1, "", "pod vanished"),) and action.indices == (1,)


def test_pod_zero_a_crash_an_old_gang_or_a_custom_trainer_rebuild_the_gang():
    state = job(spec(), **three())
    rebuilt = [
        gang(pod(0, "Running", deleting=True)),  # the rendezvous store goes with pod 0
        gang(pod(2, "Failed", exit_code=1)),  # its own trainer failed: not a lost pod
        [dataclasses.replace(p, rejoins=False) for p in gang(pod(2, "Running", deleting=True))],
    ]
    for pods in rebuilt:
        decision = lifecycle.decide(state, pods, at(5))
        assert status_of(decision)["restarts"] == 1 and "ReplacePods" not in kinds(decision)
    custom = JobBuilder().layout(data=3, gpus_per_node=1).trainer(type="custom", command=["x"])
    decision = lifecycle.decide(
        job(custom.raw(), **three()), gang(pod(2, "Running", deleting=True)), at(5)
    )
    assert status_of(decision)["restarts"] == 1


def test_recovery_in_place_off_or_a_smaller_limit_rebuild_the_gang():
    lost = gang(pod(2, "Running", deleting=True))
    for recovery in ({"inPlace": False}, {"inPlaceLimit": 0}):
        raw = JobBuilder().layout(data=3, gpus_per_node=1).run_policy(recovery=recovery).raw()
        decision = lifecycle.decide(job(raw, **three()), lost, at(5))
        assert status_of(decision)["restarts"] == 1 and "ReplacePods" not in kinds(decision)
    off = JobBuilder().layout(data=3, gpus_per_node=1).run_policy(recovery={"inPlace": False})
    assert not pod_state.read(
        builders.build_pod(job(off.raw()).ref, job(off.raw()).spec, 0, 1, "n1")
    ).rejoins


def test_a_spare_pod_holds_a_gang_pods_gpus_and_is_no_pod_of_the_gang():
    raw = JobBuilder().layout(data=3, gpus_per_node=1).run_policy(recovery={"spareNodes": 1}).raw()
    state = job(raw)
    spare = builders.build_spare_pod(state.ref, state.spec, 2, 0, "n9")
    gang_pod = builders.build_pod(state.ref, state.spec, 2, 0, "n9")
    assert spare["metadata"]["name"] == "j-r2-s0" and pod_state.read(spare) is None
    (container,) = spare["spec"]["containers"]
    assert container["resources"] == gang_pod["spec"]["containers"][0]["resources"]
    assert container["command"][:2] == ["python", "-c"] and not spare["spec"]["volumes"]
    assert spare["spec"]["affinity"] == gang_pod["spec"]["affinity"]  # pinned to its node
    assert not spare["spec"].get("schedulingGates")
    workload = kueue_workload.build_workload(
        state.ref, state.spec, kueue_workload.Queue("q", None), gang_pod, kueue_workload.Priority(0)
    )
    assert workload["spec"]["podSets"][0]["count"] == 3 + 1  # the quota counts the spare


def test_the_in_place_limit_bounds_the_replacements_of_an_attempt():
    used = three()
    used["placement"][2] = {"podIndex": 2, "node": "n5", "pod": "j-r0-2-p10", "replaced": 10}
    lost = dataclasses.replace(pod(1, "Running", deleting=True))
    kept = dataclasses.replace(pod(2, "Running"), name="j-r0-2-p10")
    decision = lifecycle.decide(job(spec(), **used), gang(lost, kept), at(5))
    assert status_of(decision)["restarts"] == 1  # 10 replaced: recovery.inPlaceLimit's default
    # The other tiers' restarts of this attempt count too (status.recovery, gp-kubelet's book).
    booked = three(recovery={"attempt": 0, "attemptRestarts": 10})
    decision = lifecycle.decide(job(spec(), **booked), gang(lost), at(5))
    assert status_of(decision)["restarts"] == 1
    older = three(recovery={"attempt": 7, "attemptRestarts": 10})  # of another attempt: not these
    assert "ReplacePods" in kinds(lifecycle.decide(job(spec(), **older), gang(lost), at(5)))


def test_a_superseded_pod_is_stale_and_the_replacement_is_the_gang():
    status = three()
    status["placement"][2] = {"podIndex": 2, "node": "n4", "pod": "j-r0-2-p1", "replaced": 1}
    old = pod(2, "Failed", exit_code=137)  # the lost pod, still there: no failure of the gang
    new = dataclasses.replace(pod(2, "Running", created=300), name="j-r0-2-p1", node="n4")
    pods = [*gang(new), dataclasses.replace(old, rejoins=True)]
    decision = lifecycle.decide(job(spec(), **status), pods, at(400))
    assert job_actions.DeletePods(("j-r0-2",)) in decision.actions
    assert "SetStatus" not in kinds(decision) or status_of(decision).get("restarts") is None


def test_a_replacement_gets_the_startup_timeout_from_its_own_creation():
    status = three()
    status["placement"][2] = {"podIndex": 2, "node": "n4", "pod": "j-r0-2-p1", "replaced": 1}
    new = dataclasses.replace(pod(2, "Pending", created=1000), name="j-r0-2-p1")
    state = job(spec(), **status)
    assert "restarts" not in status_of(lifecycle.decide(state, gang(new), at(1500)))
    assert status_of(lifecycle.decide(state, gang(new), at(1700)))["restarts"] == 1  # 600 s later


def test_a_replacement_is_written_into_placement_and_counted_in_recovery():
    state = job(spec(), **three(recovery={"inPlaceRestarts": 2, "byTier": {"process": 2}}))
    made = [replacement.Replaced(2, "j-r0-2", "pod deleted", "j-r0-2-p1", "n7", spare=True)]
    changes = replacement.status_changes(state, made, 1, at(5))
    assert changes["placement"][2] == {
        "podIndex": 2,
        "node": "n7",
        "pod": "j-r0-2-p1",
        "replaced": 1,
    }
    assert changes["placement"][:2] == three()["placement"][:2]
    recovery = changes["recovery"]
    assert recovery["inPlaceRestarts"] == 3 and recovery["byTier"] == {
        "process": 2,
        "container": 0,
        "pod": 1,
    }
    assert recovery["attempt"] == 0 and recovery["attemptRestarts"] == 1  # none booked for it yet
    assert recovery["last"]["tier"] == "pod" and recovery["last"]["ranks"] == [2]
    assert replacement.next_name("j", 0, changes["placement"][2], 2) == "j-r0-2-p2"
    assert naming.replacement_pod_name("j", 0, 2, 1) == "j-r0-2-p1"
    assert pod_loss.REPLACE_LOST in lifecycle.RULES
