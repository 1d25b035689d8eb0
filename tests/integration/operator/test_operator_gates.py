"""The gang gate against a real API server: only ours is lifted, and only onto nodes that still fit.

The reconciler runs in this process, one pass at a time, on a private API
server (no operator subprocess races it), so the test can change the cluster
between the pass that creates the gated gang and the pass that lifts its gates
(a pass lifts them itself once it created the gang: :func:`_created_gated` ends it
before, as an operator that crashed there).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import kubernetes
import pytest

from meshtrain.operator import reconciler
from meshtrain.operator.cluster import informer, kube
from meshtrain.operator.policy import (
    conditions,
    failure,
    naming,
    pod_state,
    rescheduling,
    situation,
)
from meshtrain.operator.reconciler import Outcome
from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster, Reconciling, reconcile_passes, wait_for

pytestmark = pytest.mark.integration

OTHER_GATE = "kueue.x-k8s.io/admission"


@pytest.fixture(scope="module")
def private(control_plane_binaries) -> Iterator[Cluster]:
    with Cluster.private(control_plane_binaries) as found:
        found.core.create_namespace({"metadata": {"name": "gates"}})
        yield found


def _pass(cluster: Cluster, name: str, passes: int = 1) -> None:
    reconcile_passes(cluster, "gates", name, passes)


def _created_gated(cluster: Cluster, name: str) -> None:
    """One pass that creates the gated gang and ends there (``stop_before_gates``)."""
    reconcile_passes(cluster, "gates", name, stop_before_gates=True)


def test_lifting_removes_our_gate_and_keeps_another_controllers(private):
    pod = {
        "metadata": {"name": "two-gates", "labels": {naming.LABEL_JOB: "x"}},
        "spec": {
            "schedulingGates": [{"name": OTHER_GATE}, {"name": naming.GANG_GATE}],
            "containers": [{"name": "c", "image": "pause"}],
        },
    }
    created = private.core.create_namespaced_pod("gates", pod)

    async def lift() -> None:
        client = await kube.Client.connect(kubeconfig=private.kubeconfig)
        try:
            await client.lift_gates(namespace="gates", uids={"two-gates": created.metadata.uid})
        finally:
            await client.close()

    asyncio.run(lift())
    read = private.core.read_namespaced_pod("two-gates", "gates")
    assert [g.name for g in read.spec.scheduling_gates] == [OTHER_GATE]
    state = pod_state.read(
        {
            **private.core.api_client.sanitize_for_serialization(read),
            "metadata": {
                "name": "two-gates",
                "labels": {naming.LABEL_NODE_RANK: "0", naming.LABEL_ATTEMPT: "0"},
            },
        }
    )
    assert state is not None and not state.gated  # another controller's gate is not ours


def test_lifting_by_uid_leaves_a_pod_that_took_the_name_since_gated(private):
    """The cache still holds the job's pod; the name now belongs to another pod, which stays gated."""
    pod = {
        "metadata": {"name": "renamed", "labels": {naming.LABEL_JOB: "x"}},
        "spec": {
            "schedulingGates": [{"name": naming.GANG_GATE}],
            "containers": [{"name": "c", "image": "pause"}],
        },
    }
    ours = private.core.create_namespaced_pod("gates", pod)
    private.core.delete_namespaced_pod("renamed", "gates", grace_period_seconds=0)
    wait_for(
        "pod renamed deleted",
        lambda: (
            not [
                p
                for p in private.core.list_namespaced_pod("gates").items
                if p.metadata.name == "renamed"
            ]
        ),
    )
    namesake = private.core.create_namespaced_pod("gates", pod)

    async def lift() -> list[str]:
        client = await kube.Client.connect(kubeconfig=private.kubeconfig)
        try:
            return await client.lift_gates(namespace="gates", uids={"renamed": ours.metadata.uid})
        finally:
            await client.close()

    lifted = asyncio.run(lift())
    read = private.core.read_namespaced_pod("renamed", "gates")
    assert read.metadata.uid == namesake.metadata.uid
    assert [g.name for g in read.spec.scheduling_gates or []] == [naming.GANG_GATE], (
        "the gate of another pod that took the name was lifted"
    )
    assert lifted == []


def test_a_planned_node_tainted_before_the_gates_lift_gets_the_gang_placed_again(private):
    pool = "replace"
    first = private.add_node(pool, gpus=4, name="replace-a")
    private.apply(JobBuilder("moved", "gates", pool).layout(data=4).gpus(4))
    _created_gated(private, "moved")  # plans onto the only node and creates the gated pod
    [pod] = private.pods("gates", "moved")
    assert (
        pod.spec.scheduling_gates
        and private.status("gates", "moved")["placement"][0]["node"] == first
    )

    private.core.patch_node(first, {"spec": {"taints": [{"key": "maint", "effect": "NoSchedule"}]}})
    second = private.add_node(pool, gpus=4, name="replace-b")
    _pass(private, "moved")  # would lift the gate: re-verifies the node instead
    placed = private.condition("gates", "moved", conditions.PLACED)
    assert placed["status"] == "False" and placed["reason"] == conditions.NODES_CHANGED
    assert "replace-a: node(s) had untolerated taint(s)" in placed["message"]
    events = private.core.list_namespaced_event("gates").items
    assert any(e.reason == conditions.NODES_CHANGED for e in events)

    _pass(private, "moved", passes=4)  # old pod gone, placed again, gate lifted
    [pod] = private.pods("gates", "moved")
    assert pod.metadata.annotations[naming.ANNOTATION_NODE] == second
    assert not pod.spec.scheduling_gates
    status = private.status("gates", "moved")
    assert status.get("restarts", 0) == 0  # a re-placement, not a restart


def test_a_pod_the_scheduler_cannot_bind_is_reported_with_its_message_at_once(private):
    private.add_node("claim", gpus=2, name="claim-a")
    job = JobBuilder("noclaim", "gates", "claim").layout(data=2).gpus(2)
    private.apply(job.checkpoint(claimName="missing-claim"))
    _pass(private, "noclaim", passes=2)  # placed, then the gate lifted: the scheduler tries it

    def reported() -> dict | None:
        _pass(private, "noclaim")
        found = private.condition("gates", "noclaim", conditions.PODS_SCHEDULED)
        return found if found.get("reason") == conditions.FAILED_SCHEDULING else None

    scheduled = wait_for("PodsScheduled=False/FailedScheduling", reported, timeout=20, interval=0.5)
    assert scheduled["status"] == "False"
    assert 'persistentvolumeclaim "missing-claim" not found' in scheduled["message"]
    # No other node would help (kube-scheduler's PreFilter refused the pod, not a node): kept, not re-placed.
    _pass(private, "noclaim", passes=2)
    assert len(private.pods("gates", "noclaim")) == 1
    placed = private.condition("gates", "noclaim", conditions.PLACED)
    assert placed["reason"] == conditions.GANG_PLACED
    events = private.core.list_namespaced_event("gates").items
    assert any(
        e.reason == conditions.FAILED_SCHEDULING and "missing-claim" in e.message for e in events
    )


def _shunning_pod(node: str) -> dict:
    """Another tenant's pod on ``node`` whose anti-affinity keeps every TrainingJob pod off it
    (a filter of kube-scheduler the operator does not model)."""
    return {
        "metadata": {"name": f"shuns-{node}"},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "image": "pause"}],
            "affinity": {
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "labelSelector": {
                                "matchExpressions": [
                                    {"key": naming.LABEL_JOB, "operator": "Exists"}
                                ]
                            },
                            "namespaceSelector": {},  # every namespace's pods
                            "topologyKey": "kubernetes.io/hostname",
                        }
                    ]
                }
            },
        },
    }


def test_a_released_pod_the_scheduler_refuses_gets_the_gang_placed_again_elsewhere(
    private, monkeypatch
):
    refused = private.add_node("refused", gpus=4, name="refused-a")
    private.core.create_namespaced_pod("default", _shunning_pod(refused))
    private.apply(JobBuilder("shunned", "gates", "refused").layout(data=4).gpus(4))
    reconciling = Reconciling(private)
    try:
        reconciling.passes("gates", "shunned", passes=2)  # placed on the only node, gate lifted
        [pod] = private.pods("gates", "shunned")
        assert (
            not pod.spec.scheduling_gates
            and pod.metadata.annotations[naming.ANNOTATION_NODE] == refused
        )

        # A refusal is reported at once but acted on only once it lasted: the pass looks again then.
        monkeypatch.setattr(rescheduling, "PERSISTS_SECONDS", 3600.0)

        def reported() -> Outcome | None:
            outcome = reconciling.passes("gates", "shunned")
            found = private.condition("gates", "shunned", conditions.PODS_SCHEDULED)
            return outcome if found.get("reason") == conditions.FAILED_SCHEDULING else None

        outcome = wait_for(
            "PodsScheduled=False/FailedScheduling", reported, timeout=60, interval=0.5
        )
        assert [p.metadata.uid for p in private.pods("gates", "shunned")] == [pod.metadata.uid]
        assert outcome.requeue_after is not None and 0 < outcome.requeue_after <= 3600
        monkeypatch.setattr(rescheduling, "PERSISTS_SECONDS", 0.0)

        def replaced() -> dict | None:
            reconciling.passes("gates", "shunned")
            found = private.condition("gates", "shunned", conditions.PLACED)
            return found if found.get("reason") == conditions.SCHEDULER_REFUSED else None

        placed = wait_for("Placed=False/SchedulerRefused", replaced, timeout=60, interval=0.5)
        assert placed["status"] == "False"
        assert "refused-a: 0/" in placed["message"] and "anti-affinity" in placed["message"]

        # No loop: the refused node is left out, so the job waits instead of re-creating its gang there.
        reconciling.passes("gates", "shunned", passes=6)
        assert private.pods("gates", "shunned") == []
        waiting = private.condition("gates", "shunned", conditions.PLACED)
        assert waiting["status"] == "False" and "excluded for this job" in waiting["message"]
        assert "refused-a" in waiting["message"]

        other = private.add_node("refused", gpus=4, name="refused-b")

        def bound() -> list | None:
            reconciling.passes("gates", "shunned")
            pods = private.pods("gates", "shunned")
            return pods if len(pods) == 1 and pods[0].spec.node_name == other else None

        [moved] = wait_for(
            "the gang bound by kube-scheduler to refused-b", bound, timeout=60, interval=0.5
        )

        # Once it ran where it was placed, the refusals are forgotten: refused-a (no longer
        # shunned) takes the restarted gang when refused-b is cordoned.
        private.set_pod_phase("gates", moved.metadata.name, "Running")
        reconciling.passes("gates", "shunned")
        assert private.status("gates", "shunned")["phase"] == "Running"
        private.core.delete_namespaced_pod(f"shuns-{refused}", "default", grace_period_seconds=0)
        private.core.patch_node(other, {"spec": {"unschedulable": True}})
        private.set_pod_phase("gates", moved.metadata.name, "Failed", exit_code=137)

        def back_on_refused_a() -> list | None:
            reconciling.passes("gates", "shunned")
            placement = private.status("gates", "shunned").get("placement") or []
            return placement if [p["node"] for p in placement] == [refused] else None

        wait_for(
            "the restarted gang placed on refused-a", back_on_refused_a, timeout=60, interval=0.5
        )
    finally:
        reconciling.close()
    events = private.core.list_namespaced_event("gates").items
    refusals = [e for e in events if e.reason == conditions.SCHEDULER_REFUSED]
    assert len(refusals) == 1 and "refused-a" in refusals[0].message
    assert private.status("gates", "shunned")["restarts"] == 1  # the re-placement was none


def test_a_pod_nominated_to_a_planned_node_before_the_gates_lift_gets_the_gang_placed_again(
    private,
):
    """kube-scheduler holds a node's resources for a pod it nominated there (preemption made room)."""
    first = private.add_node("nominated", gpus=4, name="nominated-a")
    private.apply(JobBuilder("outranked", "gates", "nominated").layout(data=4).gpus(4))
    _created_gated(private, "outranked")  # the gated pod, planned onto the only node
    nominee = {  # gated, kube-scheduler leaves it alone: only its nomination is at play
        "metadata": {"name": "nominee"},
        "spec": {
            "schedulingGates": [{"name": OTHER_GATE}],
            "containers": [
                {"name": "c", "image": "pause", "resources": {"limits": {"nvidia.com/gpu": "4"}}}
            ],
        },
    }
    private.core.create_namespaced_pod("default", nominee)
    private.core.patch_namespaced_pod_status(
        "nominee", "default", {"status": {"nominatedNodeName": first}}
    )
    second = private.add_node("nominated", gpus=4, name="nominated-b")
    _pass(private, "outranked")  # would lift the gate: the nominee takes the node's GPUs
    placed = private.condition("gates", "outranked", conditions.PLACED)
    assert placed["reason"] == conditions.NODES_CHANGED
    assert "nominated-a: Insufficient nvidia.com/gpu" in placed["message"]

    _pass(private, "outranked", passes=4)
    [pod] = private.pods("gates", "outranked")
    assert pod.metadata.annotations[naming.ANNOTATION_NODE] == second
    assert not pod.spec.scheduling_gates


def test_a_refusal_after_part_of_the_gang_was_bound_waits_for_the_bound_pods_to_stop(
    private, monkeypatch
):
    """The bound pod may have started its containers: it gets a short grace period, and the new
    gang waits for it to be gone instead of being planned onto GPUs it still holds."""
    first = private.add_node("half", gpus=4, name="half-a")
    shunned = private.add_node("half", gpus=4, name="half-b")
    private.core.create_namespaced_pod("default", _shunning_pod(shunned))
    private.apply(JobBuilder("halved", "gates", "half").layout(data=8).gpus(4))
    monkeypatch.setattr(rescheduling, "PERSISTS_SECONDS", 0.0)  # acted on at once
    reconciling = Reconciling(private)
    try:

        def refused() -> dict | None:
            reconciling.passes("gates", "halved")
            found = private.condition("gates", "halved", conditions.PLACED)
            return found if found.get("reason") == conditions.SCHEDULER_REFUSED else None

        wait_for("Placed=False/SchedulerRefused", refused, timeout=60, interval=0.5)
        [stopping] = private.pods("gates", "halved")  # the unbound pod went at once
        assert stopping.spec.node_name == first and stopping.metadata.deletion_timestamp
        assert stopping.metadata.deletion_grace_period_seconds == 5

        private.add_node("half", gpus=4, name="half-c")
        outcome = reconciling.passes("gates", "halved", passes=3)
        assert [p.metadata.uid for p in private.pods("gates", "halved")] == [stopping.metadata.uid]
        assert not private.status("gates", "halved").get("placement")
        # Said, and woken by the pod's deletion (a slow safety recheck only, no 1 s poll).
        waiting = private.condition("gates", "halved", conditions.PLACED)
        assert waiting["reason"] == conditions.OLD_PODS_TERMINATING
        assert f"{stopping.metadata.name} (terminating on {first})" in waiting["message"]
        assert outcome.requeue_after == situation.LEAVING_RECHECK_SECONDS

        private.core.delete_namespaced_pod(  # the kubelet confirms the containers stopped
            stopping.metadata.name,
            "gates",
            body=kubernetes.client.V1DeleteOptions(
                grace_period_seconds=0,
                preconditions=kubernetes.client.V1Preconditions(uid=stopping.metadata.uid),
            ),
        )

        def bound() -> list | None:
            reconciling.passes("gates", "halved")
            pods = private.pods("gates", "halved")
            nodes = {p.spec.node_name for p in pods}
            return pods if len(pods) == 2 and nodes == {first, "half-c"} else None

        wait_for("the new gang bound on half-a and half-c", bound, timeout=60, interval=0.5)
    finally:
        reconciling.close()
    assert private.status("gates", "halved").get("restarts", 0) == 0


def test_a_released_pod_the_scheduler_preempts_for_on_its_planned_node_is_left_to_it(
    private, monkeypatch
):
    """kube-scheduler reports Insufficient nvidia.com/gpu while it evicts a lower-priority pod
    from the planned node for the gang (nominatedNodeName): the gang stays, and gets the node."""
    kubernetes.client.SchedulingV1Api(private.core.api_client).create_priority_class(
        {"metadata": {"name": "gates-high"}, "value": 1000}
    )
    node = private.add_node("preempt", gpus=4, name="preempt-a")
    job = JobBuilder("preempting", "gates", "preempt").layout(data=4).gpus(4)
    private.apply(job.pod(priorityClassName="gates-high"))
    _created_gated(private, "preempting")  # the gated pod, planned onto the only node
    [pod] = private.pods("gates", "preempting")
    assert pod.spec.scheduling_gates and pod.metadata.annotations[naming.ANNOTATION_NODE] == node
    victim = {  # bound to a node with no kubelet: it stays Terminating until the test ends it
        "metadata": {"name": "victim"},
        "spec": {
            "nodeName": node,
            "containers": [
                {"name": "c", "image": "pause", "resources": {"limits": {"nvidia.com/gpu": "4"}}}
            ],
        },
    }
    private.core.create_namespaced_pod("default", victim)

    async def lift() -> None:  # as the operator would have, a moment before the victim bound
        client = await kube.Client.connect(kubeconfig=private.kubeconfig)
        try:
            await client.lift_gates(namespace="gates", uids={pod.metadata.name: pod.metadata.uid})
        finally:
            await client.close()

    asyncio.run(lift())

    def nominated() -> object | None:
        read = private.core.read_namespaced_pod(pod.metadata.name, "gates")
        evicted = private.core.read_namespaced_pod("victim", "default").metadata.deletion_timestamp
        return read if read.status.nominated_node_name == node and evicted else None

    read = wait_for("the gang pod nominated to preempt-a", nominated, timeout=60, interval=0.5)
    scheduled = next(c for c in read.status.conditions if c.type == "PodScheduled")
    assert scheduled.status == "False" and "Insufficient nvidia.com/gpu" in scheduled.message

    monkeypatch.setattr(rescheduling, "PERSISTS_SECONDS", 0.0)  # the refusal counts as lasting
    reconciling = Reconciling(private)
    try:
        reconciling.passes("gates", "preempting", passes=3)
        assert [p.metadata.uid for p in private.pods("gates", "preempting")] == [pod.metadata.uid]
        placed = private.condition("gates", "preempting", conditions.PLACED)
        assert placed["reason"] == conditions.GANG_PLACED

        private.core.delete_namespaced_pod(  # the kubelet confirms the victim stopped
            "victim", "default", body=kubernetes.client.V1DeleteOptions(grace_period_seconds=0)
        )

        def bound() -> object | None:
            reconciling.passes("gates", "preempting")
            [found] = private.pods("gates", "preempting")
            return found if found.spec.node_name == node else None

        bound_pod = wait_for("the gang pod bound to preempt-a", bound, timeout=60, interval=0.5)
    finally:
        reconciling.close()
    assert bound_pod.metadata.uid == pod.metadata.uid
    events = private.core.list_namespaced_event("gates").items
    assert not [
        e
        for e in events
        if e.reason == conditions.SCHEDULER_REFUSED and e.involved_object.name == "preempting"
    ]
    assert private.status("gates", "preempting").get("restarts", 0) == 0


def test_a_re_placement_from_a_cache_that_missed_the_binding_gives_the_bound_pod_its_grace(
    private,
):
    """The cache still holds the pod gated and unbound; the scheduler has bound it since (its
    containers may be up).  A force-delete would free GPUs its kubelet still uses."""
    node = private.add_node("lagging", gpus=4, name="lagging-a")
    private.apply(JobBuilder("lagged", "gates", "lagging").layout(data=4).gpus(4))
    _created_gated(private, "lagged")  # the gated pod, planned onto the only node
    [pod] = private.pods("gates", "lagged")
    stale = {"kind": "Pod", **private.core.api_client.sanitize_for_serialization(pod)}

    async def lift() -> None:
        client = await kube.Client.connect(kubeconfig=private.kubeconfig)
        try:
            await client.lift_gates(namespace="gates", uids={pod.metadata.name: pod.metadata.uid})
        finally:
            await client.close()

    asyncio.run(lift())
    wait_for(
        "the pod bound to lagging-a",
        lambda: private.core.read_namespaced_pod(pod.metadata.name, "gates").spec.node_name,
        timeout=60,
        interval=0.5,
    )
    private.core.patch_node(node, {"spec": {"taints": [{"key": "maint", "effect": "NoSchedule"}]}})

    async def reconcile_from_stale_cache() -> None:
        client = await kube.Client.connect(kubeconfig=private.kubeconfig)
        try:
            cache = informer.Cache()
            cache.pods.upsert(stale)  # still gated and unbound: the binding was missed
            cache.synced.set()
            worker = reconciler.Reconciler(
                client=client, cache=cache, settings=reconciler.Settings()
            )
            await worker.reconcile(namespace="gates", name="lagged")  # lifting finds the taint
        finally:
            await client.close()

    asyncio.run(reconcile_from_stale_cache())
    placed = private.condition("gates", "lagged", conditions.PLACED)
    assert placed["reason"] == conditions.NODES_CHANGED
    [stopping] = private.pods("gates", "lagged")  # not force-deleted
    assert stopping.metadata.uid == pod.metadata.uid and stopping.spec.node_name == node
    assert stopping.metadata.deletion_grace_period_seconds == failure.BROKEN_GANG_GRACE_SECONDS


def _refuse_dropping_the_placement_of(job: str) -> tuple[dict, dict]:
    """An admission policy that refuses any status write emptying ``job``'s placement (a write the
    operator cannot make: a lost leadership, a crash, an API server refusing it)."""
    policy = {
        "metadata": {"name": f"keep-placement-{job}"},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": ["meshtrain.io"],
                        "apiVersions": ["*"],
                        "operations": ["UPDATE"],
                        "resources": ["trainingjobs/status"],
                    }
                ]
            },
            "validations": [
                {
                    "expression": f"object.metadata.name != '{job}' || "
                    "(has(object.status.placement) && size(object.status.placement) > 0)",
                    "message": "placement kept by the test",
                }
            ],
        },
    }
    binding = {
        "metadata": {"name": f"keep-placement-{job}"},
        "spec": {"policyName": f"keep-placement-{job}", "validationActions": ["Deny"]},
    }
    return policy, binding


def test_a_re_placement_whose_status_write_fails_leaves_the_pods_alone(private):
    """The dropped placement is written before any pod is deleted: pods deleted first and a
    write that never lands leave the next leader a placed gang with missing pods (a restart,
    or pods recreated on the very nodes that could not take them)."""
    node = private.add_node("unwritten", gpus=4, name="unwritten-a")
    private.apply(JobBuilder("unwritten", "gates", "unwritten").layout(data=4).gpus(4))
    _created_gated(private, "unwritten")  # the gated pod, planned onto the only node
    [pod] = private.pods("gates", "unwritten")
    admission = kubernetes.client.AdmissionregistrationV1Api(private.core.api_client)
    policy, binding = _refuse_dropping_the_placement_of("unwritten")
    admission.create_validating_admission_policy(policy)
    admission.create_validating_admission_policy_binding(binding)
    custom = kubernetes.client.CustomObjectsApi(private.core.api_client)

    def enforced() -> bool:
        try:
            custom.patch_namespaced_custom_object_status(
                "meshtrain.io",
                "v1alpha1",
                "gates",
                "trainingjobs",
                "unwritten",
                {"status": {"placement": []}},
                dry_run="All",
            )
        except kubernetes.client.ApiException as err:
            return err.status in (403, 422) and "placement kept by the test" in str(err.body)
        return False

    try:
        wait_for("the admission policy enforced", enforced, timeout=60, interval=0.5)
        private.core.patch_node(
            node, {"spec": {"taints": [{"key": "maint", "effect": "NoSchedule"}]}}
        )
        with pytest.raises(kube.ApiError, match="placement kept by the test"):
            _pass(private, "unwritten")  # would lift the gate: re-places instead, cannot write it
    finally:
        admission.delete_validating_admission_policy_binding(binding["metadata"]["name"])
        admission.delete_validating_admission_policy(policy["metadata"]["name"])
    [kept] = private.pods("gates", "unwritten")
    assert kept.metadata.uid == pod.metadata.uid and kept.metadata.deletion_timestamp is None
    assert private.status("gates", "unwritten")["placement"][0]["node"] == node
