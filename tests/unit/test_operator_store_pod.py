"""The store pod (``rendezvousStore: dedicated``): built from the job, and deleted only once no
gang needs it (an earlier attempt's or a job with no placement, after its trainer pods ended)."""

from __future__ import annotations

from typing import Any

from meshtrain.operator.policy import (
    builders,
    kubelet_tier,
    lifecycle,
    naming,
    pod_state,
    store_pod,
)
from tests.builders import JobBuilder
from tests.unit.test_operator_lifecycle import at, job, kinds, pod, status_of
from tests.unit.test_operator_pod_loss import gang, three


def _dedicated(**recovery: Any) -> dict[str, Any]:
    raw = JobBuilder().layout(data=4, gpus_per_node=2)
    return raw.run_policy(recovery={"rendezvousStore": "dedicated", **recovery}).raw()


def test_the_store_pod_runs_the_store_host_without_gpus_and_the_gang_names_it():
    state = job(_dedicated())
    ref, spec = state.ref, state.spec
    store = builders.build_store_pod(ref, spec, 3)
    assert store["metadata"]["name"] == naming.store_pod_name(ref.name, 3) == "j-r3-store"
    assert pod_state.read(store) is None  # no node rank: never a pod of the gang
    [container] = store["spec"]["containers"]
    assert container["command"] == list(builders.STORE_COMMAND)
    assert "--nnodes=2" in container["args"] and "--nproc-per-node=2" in container["args"]
    assert not any("gpu" in key for key in container["resources"]["requests"])
    assert store["spec"]["restartPolicy"] == "Never" and "restartPolicyRules" not in container
    gang = builders.build_pod(ref, spec, 3, 0, "n0")
    env = {e["name"]: e.get("value") for e in gang["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == f"j-r3-store.{naming.service_name(ref.name)}.{ref.namespace}.svc"
    assert gang["spec"]["containers"][0]["restartPolicyRules"]  # pod 0 restarts in place too
    assert env[kubelet_tier.ENV_RENDEZVOUS_STORE] == "dedicated"


def test_a_store_pod_of_another_placement_or_going_away_is_never_reused():
    state = job(_dedicated())
    made = builders.build_store_pod(state.ref, state.spec, 1, placed="2026-01-01T00:00:00Z")
    assert not store_pod.stale({**made, "status": {"phase": "Running"}}, made)
    evicted = builders.build_store_pod(state.ref, state.spec, 1, placed="2026-01-02T00:00:00Z")
    assert store_pod.stale(made, evicted)  # the same attempt placed again: a new start
    assert store_pod.stale({**made, "status": {"phase": "Succeeded"}}, made)
    going = {**made, "metadata": {**made["metadata"], "deletionTimestamp": "2026-01-01T00:01:00Z"}}
    assert store_pod.stale(going, made)


def test_the_store_pod_prefers_nodes_off_the_gang_s_plan():
    state = job(_dedicated())
    store = builders.build_store_pod(state.ref, state.spec, 0, avoid=["n1", "n0", "n1", ""])
    [preferred] = store["spec"]["affinity"]["nodeAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert preferred["preference"]["matchFields"] == [
        {"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in ("n0", "n1")
    ]


def test_without_in_place_recovery_pod_0_hosts_the_store():
    state = job(_dedicated(inPlace=False))
    assert not kubelet_tier.store_pod(state.spec)
    env = {
        e["name"]: e.get("value")
        for e in builders.build_pod(state.ref, state.spec, 0, 1, "n1")["spec"]["containers"][0][
            "env"
        ]
    }
    assert env["MASTER_ADDR"].startswith("j-r0-0.")


def _pod(
    name: str,
    attempt: int,
    *,
    index: int | None = None,
    phase: str = "Running",
    deleting: bool = False,
) -> dict[str, Any]:
    labels = {naming.LABEL_ATTEMPT: str(attempt)}
    labels[naming.LABEL_STORE if index is None else naming.LABEL_NODE_RANK] = (
        "true" if index is None else str(index)
    )
    metadata: dict[str, Any] = {"name": name, "labels": labels}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": metadata, "status": {"phase": phase}}


PLACED = {"restarts": 1, "phase": "Running", "placement": [{"podIndex": 0, "node": "n0"}]}


def test_an_earlier_attempt_s_store_goes_once_its_trainer_pods_ended():
    old, new = _pod("j-r0-store", 0), _pod("j-r1-store", 1)
    stopping = _pod("j-r0-0", 0, index=0, deleting=True)
    assert store_pod.doomed([old, new, stopping, _pod("j-r1-0", 1, index=0)], PLACED) == []
    ended = _pod("j-r0-0", 0, index=0, phase="Failed")
    assert store_pod.doomed([old, new, ended], PLACED) == ["j-r0-store"]
    assert store_pod.doomed([_pod("j-r0-store", 0, deleting=True)], PLACED) == []
    # one that left by itself (its gang finished or halted) goes too; the current one stays
    done = [_pod("j-r0-store", 0, phase="Succeeded"), _pod("j-r1-store", 1, phase="Succeeded")]
    assert store_pod.doomed(done, PLACED) == ["j-r0-store"]


def test_the_current_store_goes_when_the_job_has_no_placement_or_is_over():
    store = _pod("j-r1-store", 1)
    assert store_pod.doomed([store], PLACED) == []  # placed: its gang is being created or runs
    for status in ({**PLACED, "placement": []}, {**PLACED, "phase": "Succeeded"}):
        assert store_pod.doomed([store], status) == ["j-r1-store"]
        assert store_pod.doomed([store, _pod("j-r1-0", 1, index=0)], status) == []
    # one that ended by itself with its finished gang stays, as the gang's ended pods do
    ended = _pod("j-r1-store", 1, phase="Succeeded")
    assert store_pod.doomed([ended], {**PLACED, "phase": "Succeeded"}) == []


def _store_status(**status: Any) -> dict[str, Any]:
    return {"phase": "Running", "restarts": 0, "startTime": "2026-01-01T00:00:00Z", **status}


def _placed_store(**state: Any) -> dict[str, Any]:
    made = builders.build_store_pod(
        job(_dedicated()).ref, job(_dedicated()).spec, 0, placed="2026-01-01T00:00:00Z"
    )
    return {**made, "status": {"phase": "Running", **state}}


def test_a_store_pod_that_serves_is_no_loss_and_an_earlier_placement_s_is_not_this_gang_s():
    placed = _store_status(placement=[{"podIndex": 0, "node": "n0"}])
    assert store_pod.loss([_placed_store()], placed, "j") is None
    going = _placed_store()
    going["metadata"] = {**going["metadata"], "deletionTimestamp": "2026-01-01T00:05:00Z"}
    assert store_pod.loss([going], placed, "j").message.endswith("is being deleted")
    later = {**placed, "startTime": "2026-01-02T00:00:00Z"}  # placed again: another store's
    assert store_pod.loss([going], later, "j") is None
    assert store_pod.loss([going], {**placed, "placement": []}, "j") is None


def test_a_disrupted_store_pod_is_a_disruption_of_the_gang_and_its_ranks_75_follow_from_it():
    """Its node drained: the gang is rebuilt as a disruption (backoffLimit untouched), though
    the ranks already exited 75 (they lost the store); pod 0 lost with it is not replaced alone."""
    evicted = _placed_store(
        conditions=[
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
        ]
    )
    state = job(_dedicated(), **three(startTime="2026-01-01T00:00:00Z"))
    lost = store_pod.loss([evicted], state.status, "j")
    assert lost is not None and lost.disruption, lost
    gave_up = gang(pod(1, "Failed", exit_code=75))
    status = status_of(lifecycle.decide(state, gave_up, at(5), store_loss=lost))
    assert status["restarts"] == 1 and status["disruptionRestarts"] == 1, status
    deleted = gang(pod(0, "Running", deleting=True))  # replaced alone, but for the store's loss
    assert "ReplacePods" in kinds(lifecycle.decide(state, deleted, at(5)))
    decision = lifecycle.decide(state, deleted, at(5), store_loss=lost)
    assert "ReplacePods" not in kinds(decision) and status_of(decision)["restarts"] == 1
    # without the store's loss in view the same exits count against backoffLimit
    status = status_of(lifecycle.decide(state, gave_up, at(5)))
    assert status["restarts"] == 1 and not status.get("disruptionRestarts"), status


def test_a_finished_gang_s_store_loss_is_no_failure():
    """Every rank Succeeded and the store pod drained before the operator wrote Succeeded: the job
    succeeds, it is not rebuilt."""
    evicted = _placed_store(
        conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "Drain"}]
    )
    state = job(_dedicated(), **three(startTime="2026-01-01T00:00:00Z"))
    lost = store_pod.loss([evicted], state.status, "j")
    done = [pod(i, "Succeeded", exit_code=0) for i in range(3)]
    assert status_of(lifecycle.decide(state, done, at(5), store_loss=lost))["phase"] == "Succeeded"


def test_a_store_pod_gone_is_lost_for_a_gang_made_to_meet_it_and_one_on_a_lost_node_disrupted():
    state = job(_dedicated(), **three(startTime="2026-01-01T00:00:00Z"))
    made = [builders.build_pod(state.ref, state.spec, 0, i, f"n{i}") for i in range(2)]
    gone = store_pod.loss(made, state.status, "j")
    assert gone is not None and not gone.disruption and gone.pod == "j-r0-store", gone
    pod0_gang = job(JobBuilder().layout(data=4, gpus_per_node=2).raw(), **three())
    theirs = [builders.build_pod(state.ref, pod0_gang.spec, 0, i, f"n{i}") for i in range(2)]
    assert store_pod.loss(theirs, state.status, "j") is None  # pod 0 hosts that gang's store
    running = {**_placed_store(), "spec": {**_placed_store()["spec"], "nodeName": "n9"}}
    assert store_pod.loss([running], state.status, "j") is None
    lost = store_pod.loss([running], state.status, "j", frozenset({"n9"}))
    assert lost is not None and lost.disruption and "n9" in lost.message


def test_a_store_pod_gone_with_its_node_is_a_disruption_and_one_deleted_is_not():
    """Its last version seen (``Cache.departed``) tells them apart: PodGC marks the pods of a
    deleted node ``DisruptionTarget`` before it removes them; a user's deletion marks nothing."""
    state = job(_dedicated(), **three(startTime="2026-01-01T00:00:00Z"))
    made = [builders.build_pod(state.ref, state.spec, 0, i, f"n{i}") for i in range(2)]
    on_n9 = {**_placed_store(), "spec": {**_placed_store()["spec"], "nodeName": "n9"}}
    with_node = store_pod.loss(made, state.status, "j", frozenset({"n9"}), on_n9)
    assert (
        with_node is not None and with_node.disruption and "with its node n9" in with_node.message
    )
    collected = _placed_store(
        conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC"}]
    )
    by_podgc = store_pod.loss(made, state.status, "j", departed=collected)
    assert by_podgc is not None and by_podgc.disruption and "DeletionByPodGC" in by_podgc.message
    deleted = store_pod.loss(made, state.status, "j", departed=on_n9)  # its node is Ready
    assert deleted is not None and not deleted.disruption, deleted
    earlier = {**collected, "metadata": {**collected["metadata"], "annotations": {}}}
    other = store_pod.loss(made, state.status, "j", frozenset({"n9"}), earlier)
    assert other is not None and not other.disruption  # another placement's: says nothing
    status = status_of(
        lifecycle.decide(state, gang(pod(1, "Failed", exit_code=75)), at(5), store_loss=by_podgc)
    )
    assert status["restarts"] == 1 and status["disruptionRestarts"] == 1, status


def test_a_store_pod_of_another_spec_is_stale_and_a_terminating_one_holds_its_name():
    state = job(_dedicated())
    made = builders.build_store_pod(state.ref, state.spec, 0)
    resized = job(_dedicated(warmSpares=0))  # runPolicy is outside the hash: same
    assert not store_pod.stale(made, builders.build_store_pod(resized.ref, resized.spec, 0))
    other = job(
        JobBuilder()
        .layout(data=2, gpus_per_node=2)
        .run_policy(recovery={"rendezvousStore": "dedicated"})
        .raw()
    )
    assert store_pod.stale(made, builders.build_store_pod(other.ref, other.spec, 0))
    going = {**made, "metadata": {**made["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert store_pod.terminating([going], 0) == ["j-r0-store"]
    assert store_pod.terminating([going], 1) == [] and store_pod.terminating([made], 0) == []
