"""Plan under the placement lock, create the pods outside it, against a real API server and
kube-scheduler: the planned gang is assumed in the cache until its pods exist, so a job planned
meanwhile never takes the same free node; a failed or crashed creation gives the node back; and
a gang's gates are lifted in the pass that created it.

The reconciler runs in this process, and the test holds one job's pod creation (its client's
``create``) while another job is planned: the window the placement lock no longer covers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from meshtrain.operator import reconciler
from meshtrain.operator.cluster import informer, kube
from meshtrain.operator.policy import conditions, naming
from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster, Reconciling, wait_for

pytestmark = pytest.mark.integration

NS = "assume"


@pytest.fixture(scope="module")
def private(control_plane_binaries) -> Iterator[Cluster]:
    with Cluster.private(control_plane_binaries) as found:
        found.core.create_namespace({"metadata": {"name": NS}})
        yield found


async def _held_creation(cluster: Cluster, held: str, other: str, end: str) -> BaseException | None:
    """Pass ``held`` until its first pod's create, then a pass of ``other``, then let ``held``'s
    creation go on (``end`` "go"), fail (``end`` "error": a 500) or its pass be cancelled
    (``end`` "cancel": the operator stopped mid-pass), and pass ``other`` again, in the same
    process (its cache, its assumptions), until it has pods (20 s at most: well within the 60 s
    an assumption may live).  Returns what ``held``'s pass raised."""
    client = await kube.Client.connect(kubeconfig=cluster.kubeconfig)
    cache = informer.Cache(follow_devices=True)  # as the operator (handlers.py)
    follow = asyncio.create_task(cache.run(client))
    try:
        worker = reconciler.Reconciler(client=client, cache=cache, settings=reconciler.Settings())
        entered, go = asyncio.Event(), asyncio.Event()
        create = client.create

        async def holding(*, manifest: dict[str, Any]) -> dict[str, Any] | None:
            labels = manifest["metadata"].get("labels") or {}
            if manifest["kind"] == "Pod" and labels.get(naming.LABEL_JOB) == held:
                entered.set()
                await go.wait()
                if end == "error":
                    raise kube.ApiError(500, "create", "pods", "etcd timed out")
            return await create(manifest=manifest)

        client.create = holding  # type: ignore[method-assign]
        first = asyncio.create_task(worker.reconcile(namespace=NS, name=held))
        await asyncio.wait_for(entered.wait(), 60)  # planned and written; the lock is free
        await worker.reconcile(namespace=NS, name=other)
        if end == "cancel":
            first.cancel()
        go.set()
        raised: BaseException | None = None
        try:
            await first
        except BaseException as err:  # noqa: BLE001 - what the held pass raised is the answer
            raised = err
        for _ in range(10):  # as its daemon would: again when the pass asks (a plan's spacing)
            outcome = await worker.reconcile(namespace=NS, name=other)
            if cache.job_pods(NS, other):
                break
            await asyncio.sleep(min(outcome.requeue_after or 0.5, 2.0))
        return raised
    finally:
        follow.cancel()
        await client.close()


def _bound(cluster: Cluster, job: str, node: str) -> None:
    """kube-scheduler bound every pod of ``job``, one, to ``node``."""

    def found() -> bool:
        pods = cluster.pods(NS, job)
        return len(pods) == 1 and pods[0].spec.node_name == node

    wait_for(f"{job}'s pod bound to {node} by kube-scheduler", found, timeout=60)


def test_a_job_planned_while_anothers_pods_are_created_does_not_take_its_node(private):
    node = private.add_node("one", gpus=8, name="one-a")
    private.apply(JobBuilder("early", NS, "one").layout(data=8).gpus(8))
    private.apply(JobBuilder("late", NS, "one").layout(data=8).gpus(8))
    assert asyncio.run(_held_creation(private, "early", "late", "go")) is None
    late = private.condition(NS, "late", conditions.PLACED)
    assert late["status"] == "False" and late["reason"] == "InsufficientGPUs", late
    assert private.pods(NS, "late") == []
    _bound(private, "early", node)  # the scheduler agrees: the node was early's to take
    assert private.condition(NS, "early", conditions.PLACED)["reason"] == conditions.GANG_PLACED


@pytest.mark.parametrize("end", ["error", "cancel"])
def test_a_failed_or_cancelled_creation_gives_the_node_back_at_once(private, end):
    pool = f"fail-{end}"
    node = private.add_node(pool, gpus=8, name=f"{pool}-a")
    private.apply(JobBuilder(f"broken-{end}", NS, pool).layout(data=8).gpus(8))
    private.apply(JobBuilder(f"next-{end}", NS, pool).layout(data=8).gpus(8))
    raised = asyncio.run(_held_creation(private, f"broken-{end}", f"next-{end}", end))
    expected = kube.ApiError if end == "error" else asyncio.CancelledError
    assert isinstance(raised, expected), raised
    assert private.pods(NS, f"broken-{end}") == []
    # next- was planned while broken-'s pod was assumed, and waited then.
    assert private.events(NS, f"next-{end}", "InsufficientGPUs")
    # The assumption ended with the failure: next-'s pass after it, in the same process, found
    # the node free (not after the assumption's 60 s).
    _bound(private, f"next-{end}", node)


def test_the_gates_are_lifted_in_the_pass_that_created_the_gang(private):
    nodes = [private.add_node("same", gpus=8, name=f"same-{i}") for i in range(2)]
    private.apply(JobBuilder("quick", NS, "same").layout(data=16).gpus(8))
    reconciling = Reconciling(private)
    try:
        reconciling.passes(NS, "quick", passes=1)
    finally:
        reconciling.close()
    pods = private.pods(NS, "quick")
    assert len(pods) == 2
    assert all(not p.spec.scheduling_gates for p in pods), "gates left for a later pass"
    placed = private.condition(NS, "quick", conditions.PLACED)
    assert placed["status"] == "True" and placed["reason"] == conditions.GANG_PLACED

    def bound() -> bool:
        return sorted(p.spec.node_name or "" for p in private.pods(NS, "quick")) == sorted(nodes)

    wait_for("the gang bound by kube-scheduler on its planned nodes", bound, timeout=60)


async def _pass_tainting(cluster: Cluster, job: str, node: str) -> None:
    """One pass of ``job`` whose pod creation is followed at once by a taint on ``node`` (the
    node changes between the creation and the gate lifting of the same pass)."""
    client = await kube.Client.connect(kubeconfig=cluster.kubeconfig)
    cache = informer.Cache(follow_devices=True)
    follow = asyncio.create_task(cache.run(client))
    try:
        worker = reconciler.Reconciler(client=client, cache=cache, settings=reconciler.Settings())
        create = client.create

        async def tainting(*, manifest: dict[str, Any]) -> dict[str, Any] | None:
            created = await create(manifest=manifest)
            if manifest["kind"] == "Pod":
                taint = {"key": "maint", "effect": "NoSchedule"}
                cluster.core.patch_node(node, {"spec": {"taints": [taint]}})
            return created

        client.create = tainting  # type: ignore[method-assign]
        await worker.reconcile(namespace=NS, name=job)
    finally:
        follow.cancel()
        await client.close()


def test_a_node_changed_between_creation_and_lifting_in_one_pass_is_still_caught(private):
    """The same pass lifts the gates only after the planned nodes are read again."""
    node = private.add_node("taint", gpus=8, name="taint-a")
    private.apply(JobBuilder("tainted", NS, "taint").layout(data=8).gpus(8))
    asyncio.run(_pass_tainting(private, "tainted", node))
    placed = private.condition(NS, "tainted", conditions.PLACED)
    assert placed["status"] == "False" and placed["reason"] == conditions.NODES_CHANGED, placed
    assert "taint-a: node(s) had untolerated taint(s)" in placed["message"]
    assert all(p.spec.scheduling_gates for p in private.pods(NS, "tainted"))  # never released
