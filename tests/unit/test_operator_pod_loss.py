"""The pod tier: a pod lost from a running gang that rejoins is replaced alone; otherwise, and for
pod 0, the gang is rebuilt as before."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshtrain.operator import sparing
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
    store_pod,
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


def test_with_a_store_pod_pod_zero_is_replaced_alone():
    """``rendezvousStore: dedicated``: pod 0 hosts nothing, so its loss is the pod tier's."""
    dedicated = (
        JobBuilder()
        .layout(data=3, gpus_per_node=1)
        .run_policy(backoffLimit=1, recovery={"rendezvousStore": "dedicated"})
        .raw()
    )
    action = replace_of(
        lifecycle.decide(job(dedicated, **three()), gang(pod(0, "Running", deleting=True)), at(5))
    )
    assert action.indices == (0,) and action.causes == ((0, "j-r0-0", "pod deleted"),)
    # in place off: no store pod (nor rejoin), pod 0's loss rebuilds the gang
    off = (
        JobBuilder()
        .layout(data=3, gpus_per_node=1)
        .run_policy(backoffLimit=1, recovery={"rendezvousStore": "dedicated", "inPlace": False})
    )
    decision = lifecycle.decide(
        job(off.raw(), **three()), gang(pod(0, "Running", deleting=True)), at(5)
    )
    assert status_of(decision)["restarts"] == 1 and "ReplacePods" not in kinds(decision)


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
    # The other tiers' restarts of this attempt count too (status.recovery, recovery_count's book).
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


def test_a_replacement_gets_the_rejoin_timeout_from_its_own_creation():
    """The survivors wait rejoinTimeoutSeconds (120 s) for it, not startupTimeoutSeconds (600 s):
    a replacement not running by then rebuilds the gang (review finding 15)."""
    status = three()
    status["placement"][2] = {"podIndex": 2, "node": "n4", "pod": "j-r0-2-p1", "replaced": 1}
    new = dataclasses.replace(pod(2, "Pending", created=1000), name="j-r0-2-p1")
    state = job(spec(), **status)
    assert "restarts" not in status_of(lifecycle.decide(state, gang(new), at(1100)))
    assert status_of(lifecycle.decide(state, gang(new), at(1130)))["restarts"] == 1  # 120 s later


def test_a_replacement_is_written_into_placement_and_counted_in_recovery():
    state = job(spec(), **three(recovery={"inPlaceRestarts": 2, "byTier": {"process": 2}}))
    made = [replacement.Replaced(2, "j-r0-2", "pod deleted", "j-r0-2-p1", "n7", spare=True)]
    changes = replacement.status_changes(state, made, 1, at(5))
    assert changes["placement"][2] == {
        "podIndex": 2,
        "node": "n7",
        "pod": "j-r0-2-p1",
        "replaced": 1,
        "pending": True,  # recorded, not created yet (review finding 3)
        "previousNode": "n2",  # where the lost pod ran: its ranks' records may name it
    }
    assert changes["placement"][:2] == three()["placement"][:2]
    # planned again while pending (n7 was taken): it moves, and the lost pod's node stays
    moved = [replacement.Replaced(2, "j-r0-2", "pod deleted", "j-r0-2-p1", "n8", spare=False)]
    again = replacement.status_changes(job(spec(), **{**three(), **changes}), moved, 1, at(6))
    assert again["placement"][2]["node"] == "n8" and again["placement"][2]["previousNode"] == "n2"
    recovery = changes["recovery"]
    assert recovery["inPlaceRestarts"] == 3 and recovery["byTier"] == {
        "process": 2,
        "container": 0,
        "pod": 1,
    }
    assert recovery["attempt"] == 0 and recovery["attemptRestarts"] == 1  # none booked for it yet
    assert recovery["last"]["tier"] == "pod" and recovery["last"]["ranks"] == [2]
    assert recovery["last"]["nodes"] == [{"node": "n2", "ranks": [2]}]  # where the lost pod ran
    assert replacement.next_name("j", 0, changes["placement"][2], 2) == "j-r0-2-p2"
    assert naming.replacement_pod_name("j", 0, 2, 1) == "j-r0-2-p1"
    assert pod_loss.REPLACE_LOST in lifecycle.RULES


def test_a_pending_replacement_is_created_and_then_no_longer_pending():
    status = three()
    status["placement"][2] = {
        "podIndex": 2, "node": "n4", "pod": "j-r0-2-p1", "replaced": 1, "pending": True
    }  # fmt: skip
    placed = replacement.entries(status)
    assert replacement.pending(placed[2]) and not replacement.pending(placed[1])
    # Planned again while pending (its node was taken meanwhile): same name, counted once.
    assert replacement.planned_name("j", 0, placed[2], 2) == "j-r0-2-p1"
    assert replacement.planned_name("j", 0, placed[1], 1) == "j-r0-1-p1"
    state = job(spec(), **{**status, "recovery": {"attempt": 0, "attemptRestarts": 1}})
    moved = [replacement.Replaced(2, "j-r0-2", "pod deleted", "j-r0-2-p1", "n5", spare=False)]
    changes = replacement.status_changes(state, moved, 1, at(5))
    assert changes["placement"][2] == {**status["placement"][2], "node": "n5"}
    assert changes["recovery"]["attemptRestarts"] == 1
    done = replacement.created(status, [2])["placement"]
    assert done[2] == {"podIndex": 2, "node": "n4", "pod": "j-r0-2-p1", "replaced": 1}
    assert done[:2] == status["placement"][:2]


def test_a_pending_replacement_is_not_counted_twice_against_the_limit():
    """Recorded at the limit (10 of 10), not created yet: the next pass still creates it; once
    created and lost again, it is a new loss, refused past the limit (the gang is rebuilt)."""
    status = three(recovery={"attempt": 0, "attemptRestarts": 10})
    entry = {"podIndex": 2, "node": "n4", "pod": "j-r0-2-p1", "replaced": 1, "pending": True}
    status["placement"][2] = entry
    pods = [p for p in gang() if p.index != 2]  # the replacement does not exist yet
    assert "ReplacePods" in kinds(lifecycle.decide(job(spec(), **status), pods, at(5)))
    status["placement"][2] = {k: v for k, v in entry.items() if k != "pending"}
    decision = lifecycle.decide(job(spec(), **status), pods, at(5))
    assert "ReplacePods" not in kinds(decision) and status_of(decision)["restarts"] == 1


def _raw_pod(name: str, index: int, node: str, phase: str = "Running") -> dict[str, Any]:
    labels = {naming.LABEL_NODE_RANK: str(index), naming.LABEL_ATTEMPT: "0"}
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"nodeName": node},
        "status": {"phase": phase},
    }


def test_a_replacement_waits_until_its_lost_pod_stopped_or_its_node_is_dead():
    nodes = {
        "n2": {"metadata": {"name": "n2"}, "spec": {}},
        "n3": {"spec": {"taints": [{"key": replacement.OUT_OF_SERVICE, "effect": "NoExecute"}]}},
        "n5": {"spec": {"taints": [{"key": "node.kubernetes.io/unreachable"}]}},
    }
    new = _raw_pod("j-r0-2-p1", 2, "n7")
    other = _raw_pod("j-r0-1", 1, "n1")

    def holders(*pods: dict[str, Any]) -> list[str]:
        return replacement.holders([new, other, *pods], 0, 2, "j-r0-2-p1", nodes.get)

    assert holders(_raw_pod("j-r0-2", 2, "n2")) == ["j-r0-2"]  # running out its grace period
    assert holders(_raw_pod("j-r0-2", 2, "n5")) == ["j-r0-2"]  # unreachable: may still run
    assert holders(_raw_pod("j-r0-2", 2, "n2", "Failed")) == []  # stopped
    assert holders(_raw_pod("j-r0-2", 2, "n3")) == []  # out-of-service: known shut down
    assert holders(_raw_pod("j-r0-2", 2, "gone")) == []  # its Node object deleted
    assert holders() == []  # gone
    earlier = _raw_pod("j-r0-2", 2, "n2")
    earlier["metadata"]["labels"][naming.LABEL_ATTEMPT] = "1"
    assert holders(earlier) == []  # another attempt's pod holds no slot of this one


def test_rejoining_pods_tolerate_a_lost_node_a_third_of_the_rejoin_window():
    def tolerations(**recovery: Any) -> list[dict[str, Any]]:
        raw = JobBuilder().layout(data=3, gpus_per_node=1).run_policy(recovery=recovery).raw()
        state = job(raw)
        built = builders.build_pod(state.ref, state.spec, 0, 1, "n1")
        return [t for t in built["spec"].get("tolerations") or [] if "NoExecute" in str(t)]

    keys = ["node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"]
    found = tolerations()
    assert [t["key"] for t in found] == keys
    assert {t["tolerationSeconds"] for t in found} == {30}  # min(30, 120 / 3)
    assert {t["tolerationSeconds"] for t in tolerations(rejoinTimeoutSeconds=45)} == {15}
    assert tolerations(inPlace=False) == []  # the gang is rebuilt: the API server's 300 s stay


def test_spares_stay_within_what_kueue_admitted():
    """spareNodes raised on an admitted job (runPolicy is outside the Workload's spec hash, so no
    new Workload): no more spares than the admitted pod set counts beside the gang (finding 5)."""
    raw = JobBuilder().layout(data=3, gpus_per_node=1).run_policy(recovery={"spareNodes": 4}).raw()
    state = job(raw, **three())
    workload = {
        "status": {
            "conditions": [{"type": "Admitted", "status": "True"}],
            "admission": {
                "clusterQueue": "q",
                "podSetAssignments": [{"name": kueue_workload.POD_SET, "count": 4, "flavors": {}}],
            },
        }
    }
    admitted = kueue_workload.state(workload)
    assert isinstance(admitted, kueue_workload.Admitted) and admitted.count == 4
    assert sparing.wanted(state, admitted.count) == 1  # 4 admitted, 3 of them the gang's
    assert sparing.wanted(state, 3) == 0 and sparing.wanted(state, 2) == 0
    assert sparing.wanted(state) == 4  # no Kueue: spareNodes


def test_a_changed_recovery_policy_refuses_the_pod_tier():
    """runPolicy is outside the spec hash: an edit of runPolicy.recovery rebuilds no gang, so a
    replacement built now would run other settings than its gang; the pod tier is refused then
    (review finding 16)."""

    def built(**recovery: Any) -> dict[str, Any]:
        raw = JobBuilder().layout(data=3, gpus_per_node=1).run_policy(recovery=recovery).raw()
        state = job(raw)
        return builders.build_pod(state.ref, state.spec, 0, 0, "n0")

    pod0 = built()
    assert replacement.recovery_env(pod0)  # the supervisor's settings, read back
    assert not replacement.recovery_changed(pod0, built())
    assert not replacement.recovery_changed(None, built())
    assert not replacement.recovery_changed(pod0, built(spareNodes=2))  # not the trainer's
    assert replacement.recovery_changed(pod0, built(inPlaceLimit=3))
    assert replacement.recovery_changed(pod0, built(rejoinTimeoutSeconds=60))


def _runtime_lost(index: int) -> pod_state.PodState:
    """Pod ``index`` as the sandbox's real kubelet reported it after its node's kubelet and
    containerd were SIGKILLed with their shims and started again 20 s later (a pod of
    ``restartPolicy: Never`` on gpu-b0-l0-n1, 2026-12-01): Failed, its container terminated with
    reason Unknown and exit code 255."""
    manifest = builders.build_pod(job(spec()).ref, job(spec()).spec, 0, index, f"n{index}")
    manifest["status"] = {
        "phase": "Failed",
        "containerStatuses": [
            {
                "name": naming.CONTAINER,
                "state": {
                    "terminated": {
                        "containerID": "containerd://6a856be5c040",
                        "exitCode": 255,
                        "reason": "Unknown",
                        "startedAt": "2026-12-01T08:57:40Z",
                        "finishedAt": "2026-12-01T08:58:10Z",
                    }
                },
            }
        ],
    }
    read = pod_state.read(manifest)
    assert read is not None and read.runtime_lost
    return read


def test_a_pod_whose_container_its_runtime_lost_is_replaced_alone_as_a_disruption():
    """Not the trainer's exit: the node's runtime restarted under it.  Replaced alone where the
    gang rejoins (its node may take it back: it is Ready again), else the gang is rebuilt as a
    disruption, outside ``backoffLimit``."""
    lost = _runtime_lost(2)
    action = replace_of(lifecycle.decide(job(spec(), **three()), gang(lost), at(5)))
    assert action.causes == ((2, lost.name, "container runtime lost it"),)
    assert action.avoid == ()
    assert status_of(job_actions.Decision(action.otherwise))["disruptionRestarts"] == 1
    off = JobBuilder().layout(data=3, gpus_per_node=1).run_policy(recovery={"inPlace": False})
    decision = lifecycle.decide(job(off.raw(), **three()), gang(lost), at(5))
    status = status_of(decision)
    assert status["restarts"] == 1 and status["disruptionRestarts"] == 1, status
    crashed = pod(2, "Failed", exit_code=255)  # the trainer's own exit 255: its failure
    status = status_of(lifecycle.decide(job(off.raw(), **three()), gang(crashed), at(5)))
    assert status["restarts"] == 1 and not status.get("disruptionRestarts"), status


def test_a_container_the_kubelet_no_longer_finds_is_lost_by_the_node_and_a_store_pod_too():
    """``ContainerStatusUnknown`` (exit 137) is the kubelet's own words for a container the
    runtime no longer reports: not the trainer's exit.  A store pod the runtime lost is a
    disruption of the gang as well."""
    manifest = builders.build_pod(job(spec()).ref, job(spec()).spec, 0, 2, "n2")
    gone = {"exitCode": 137, "reason": "ContainerStatusUnknown", "message": "could not locate"}
    manifest["status"] = {
        "phase": "Failed",
        "containerStatuses": [{"name": naming.CONTAINER, "state": {"terminated": gone}}],
    }
    lost = pod_state.read(manifest)
    assert lost is not None and lost.runtime_lost
    action = replace_of(lifecycle.decide(job(spec(), **three()), gang(lost), at(5)))
    assert action.causes == ((2, lost.name, "container runtime lost it"),)
    dedicated = JobBuilder().layout(data=4, gpus_per_node=2)
    state = job(
        dedicated.run_policy(recovery={"rendezvousStore": "dedicated"}).raw(),
        **three(startTime="2026-01-01T00:00:00Z"),
    )
    store = builders.build_store_pod(state.ref, state.spec, 0, placed="2026-01-01T00:00:00Z")
    store["status"] = {
        "phase": "Failed",
        "containerStatuses": [
            {"name": "store", "state": {"terminated": {"exitCode": 255, "reason": "Unknown"}}}
        ],
    }
    failed = store_pod.loss([store], state.status, "j")
    assert failed is not None and failed.disruption and "ContainerRuntimeLost" in failed.message
    store["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] = "Error"
    own = store_pod.loss([store], state.status, "j")  # its own exit 255: a failure
    assert own is not None and not own.disruption
