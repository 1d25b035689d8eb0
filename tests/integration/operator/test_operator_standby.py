"""A replica that is not (or no longer) the leader writes nothing, and never holds up a job's deletion.

The reconciler and the deletion handler run in this process on a private API
server (no operator subprocess acts beside them), with the ``leading`` flag
that leader election would hold set or cleared by the test.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from typing import Any

import kopf
import kubernetes
import pytest

from meshtrain.operator import handlers, reconciler
from meshtrain.operator.cluster import informer, kube, leadership
from meshtrain.operator.policy import naming
from tests.builders import JobBuilder
from tests.integration.operator.cluster import GROUP, PLURAL, VERSION, Cluster, wait_for

pytestmark = pytest.mark.integration

NAMESPACE = "standby"


@pytest.fixture(scope="module")
def private(control_plane_binaries) -> Iterator[Cluster]:
    with Cluster.private(control_plane_binaries) as found:
        found.core.create_namespace({"metadata": {"name": NAMESPACE}})
        yield found


def test_a_pass_that_loses_the_lease_midway_creates_no_pods(private):
    """The Lease is lost right after the pass recorded its placement: the gang's creates are not sent."""
    private.add_node("fence", gpus=4, name="fence-a")
    private.apply(JobBuilder("fenced", NAMESPACE, "fence").layout(data=4).gpus(2))
    leading = {"now": True}

    async def run() -> BaseException | None:
        client = await kube.Client.connect(kubeconfig=private.kubeconfig)
        cache = informer.Cache()
        follow = asyncio.create_task(cache.run(client))
        try:
            await cache.synced.wait()
            learn = client.on_write

            def deposed_after_placing(verb: str, answer: dict[str, Any]) -> None:
                if learn is not None:
                    learn(verb, answer)
                if answer.get("kind") == "TrainingJob" and (answer.get("status") or {}).get(
                    "placement"
                ):
                    leading["now"] = False  # the Lease is lost while the pass goes on

            client.on_write = deposed_after_placing
            client.lease_left = lambda: math.inf if leading["now"] else 0.0
            worker = reconciler.Reconciler(
                client=client, cache=cache, settings=reconciler.Settings()
            )
            try:
                for _ in range(3):
                    await worker.reconcile(namespace=NAMESPACE, name="fenced")
            except kube.NotLeading as err:
                return err
            return None
        finally:
            follow.cancel()
            await client.close()

    stopped = asyncio.run(run())
    assert private.status(NAMESPACE, "fenced").get("placement"), "the pass never placed the job"
    created = [p.metadata.name for p in private.pods(NAMESPACE, "fenced")]
    assert not created, f"a replica that had lost the Lease created pods {created}"
    services = private.core.list_namespaced_service(NAMESPACE).items
    assert not [s.metadata.name for s in services if s.metadata.name.startswith("fenced")]
    assert isinstance(stopped, kube.NotLeading), "the pass did not stop at its first unsent write"


def _doomed_job_with_a_pod(cluster: Cluster, name: str) -> tuple[str, str]:
    """A job carrying the operator's finalizer and one pod it owns, deleted (waiting on the finalizer)."""
    body = JobBuilder(name, NAMESPACE).manifest()
    body["metadata"]["finalizers"] = [f"{naming.GROUP}/cleanup"]
    job = cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)
    uid = job["metadata"]["uid"]
    pod = {
        "metadata": {
            "name": f"{name}-0-0",
            "labels": {naming.LABEL_JOB: name},
            "ownerReferences": [
                {
                    "apiVersion": naming.API_VERSION,
                    "kind": "TrainingJob",
                    "name": name,
                    "uid": uid,
                    "controller": True,
                }
            ],
        },
        "spec": {"containers": [{"name": "c", "image": "pause"}]},
    }
    cluster.core.create_namespaced_pod(NAMESPACE, pod)
    cluster.delete_job(NAMESPACE, name)
    return uid, pod["metadata"]["name"]


def _finalize(cluster: Cluster, name: str) -> None:
    """What the leader's kopf does once its deletion handler is done."""
    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, name, {"metadata": {"finalizers": None}}
    )


def _pod_exists(cluster: Cluster, name: str) -> bool:
    try:
        found = cluster.core.read_namespaced_pod(name, NAMESPACE)
    except kubernetes.client.ApiException as err:
        if err.status == 404:
            return False
        raise
    return found.metadata.deletion_timestamp is None


async def _standby(cluster: Cluster) -> tuple[kopf.Memo, asyncio.Task[None], kube.Client]:
    client = await kube.Client.connect(kubeconfig=cluster.kubeconfig)
    cache = informer.Cache()
    memo = kopf.Memo()
    memo.leading = asyncio.Event()  # not held
    client.lease_left = lambda: math.inf if memo.leading.is_set() else 0.0
    memo.reconciler = reconciler.Reconciler(
        client=client, cache=cache, settings=reconciler.Settings()
    )
    memo.wakeups = handlers.Wakeups()
    follow = asyncio.create_task(cache.run(client))
    await cache.synced.wait()
    return memo, follow, client


def test_a_standbys_deletion_handler_returns_once_the_leader_has_deleted_the_job(private):
    uid, pod = _doomed_job_with_a_pod(private, "left")

    async def run() -> None:
        memo, follow, client = await _standby(private)
        try:
            handler = asyncio.create_task(
                handlers.delete_children(namespace=NAMESPACE, name="left", uid=uid, memo=memo)
            )
            await asyncio.sleep(1.0)
            assert not handler.done(), (
                "a standby finished a deletion it did not do (kopf would drop the finalizer)"
            )
            assert _pod_exists(private, pod), "a standby deleted a child"
            _finalize(private, "left")
            try:
                await asyncio.wait_for(handler, handlers.STANDBY_POLL_SECONDS * 3 + 5)
            except TimeoutError:
                raise AssertionError(
                    "the standby's deletion handler still waits after the job was deleted"
                ) from None
        finally:
            follow.cancel()
            await client.close()

    asyncio.run(run())
    assert private.job(NAMESPACE, "left") is None


def test_a_standby_that_takes_the_lease_during_a_deletion_deletes_the_children(private):
    uid, pod = _doomed_job_with_a_pod(private, "taken")

    async def run() -> None:
        memo, follow, client = await _standby(private)
        try:
            handler = asyncio.create_task(
                handlers.delete_children(namespace=NAMESPACE, name="taken", uid=uid, memo=memo)
            )
            await asyncio.sleep(0.5)
            memo.leading.set()  # the leader died: this replica now holds the Lease
            await asyncio.wait_for(handler, 20)
        finally:
            follow.cancel()
            await client.close()

    asyncio.run(run())
    wait_for(f"pod {pod} deleted", lambda: not _pod_exists(private, pod), timeout=10)
    _finalize(private, "taken")


def _outcome(task: asyncio.Task[Any]) -> str:
    """How a finished task ended, without raising for a cancelled one."""
    if task.cancelled():
        return "cancelled"
    return repr(task.exception())


def test_a_replica_whose_lease_ran_out_mid_deletion_leaves_it_to_the_new_leader(private):
    """``leading`` still set, but the tenure is over (the watchdog has not cleared the flag yet).

    Every write of the deletion is refused as NotLeading: the handler must delete no child,
    not return while the job exists (kopf would drop the finalizer the leader relies on),
    not spin on the refusals, and return once the new leader has finished the deletion.
    """
    uid, pod = _doomed_job_with_a_pod(private, "deposed")

    async def run() -> None:
        memo, follow, client = await _standby(private)
        memo.leading.set()
        client.lease_left = lambda: 0.0
        attempts = refused = 0
        delete_children = memo.reconciler.delete_children

        async def counted(**kwargs: Any) -> int:
            nonlocal attempts, refused
            attempts += 1
            try:
                return await delete_children(**kwargs)
            except kube.NotLeading:
                refused += 1
                raise

        memo.reconciler.delete_children = counted
        try:
            started = time.monotonic()
            handler = asyncio.create_task(
                handlers.delete_children(namespace=NAMESPACE, name="deposed", uid=uid, memo=memo)
            )
            await asyncio.sleep(1.0)
            elapsed = time.monotonic() - started
            assert not handler.done(), (
                "a replica without the Lease ended the deletion handler "
                f"({_outcome(handler)}): kopf would drop the finalizer"
            )
            assert _pod_exists(private, pod), "a replica without the Lease deleted a child"
            assert refused == attempts >= 1, (
                f"{attempts} deletion tries, {refused} refused as NotLeading: "
                "every try of a replica whose tenure is over must be refused"
            )
            most = elapsed / leadership.WATCHDOG_SECONDS + 2
            assert attempts <= most, (
                f"{attempts} tries in {elapsed:.1f} s: the handler spins on NotLeading "
                f"(at most one per watchdog tick, {most:.0f})"
            )
            memo.leading.clear()  # the watchdog noticed; the new leader deletes and finalizes
            tried = attempts
            private.core.delete_namespaced_pod(pod, NAMESPACE, grace_period_seconds=0)
            _finalize(private, "deposed")
            try:
                await asyncio.wait_for(handler, handlers.STANDBY_POLL_SECONDS * 3 + 5)
            except TimeoutError:
                raise AssertionError(
                    "the deposed replica's deletion handler still waits after the job was deleted"
                ) from None
            assert attempts == tried, "a standby tried the deletion the leader handles"
        finally:
            follow.cancel()
            await client.close()

    asyncio.run(run())
    assert private.job(NAMESPACE, "deposed") is None
