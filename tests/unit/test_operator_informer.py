"""The informer store: newest version wins, tombstones, the job index, trimming (no API involved)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from meshtrain.operator.cluster import informer, owned
from meshtrain.operator.policy import capacity, feasibility, identity, naming


def _controller(job: str, uid: str) -> list[dict[str, Any]]:
    """The controller owner reference the operator puts on the pods of TrainingJob ``job``."""
    ref = {"apiVersion": naming.API_VERSION, "kind": "TrainingJob", "name": job, "uid": uid}
    return [{**ref, "controller": True}]


def _pod(name: str, version: int, job: str | None = None, **extra: Any) -> dict[str, Any]:
    """A pod; with ``job``, one of that TrainingJob's (its label and controller reference)."""
    labels = {"meshtrain.io/job": job} if job else {}
    owners = {"ownerReferences": _controller(job, f"uid-{job}")} if job else {}
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "resourceVersion": str(version),
            "labels": labels,
            **owners,
            **extra,
        },
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Pending"},
    }


def _store() -> informer.Store:
    return informer.Store(informer.trim_pod, by_job=True)


def test_an_older_version_never_replaces_a_newer_one():
    store = _store()
    store.upsert(_pod("a", 5, "j"))
    assert not store.upsert(_pod("a", 4, "j"))
    assert store.get(("ns", "a"))["metadata"]["resourceVersion"] == "5"
    store.upsert(_pod("a", 6, "j"))
    assert store.get(("ns", "a"))["metadata"]["resourceVersion"] == "6"
    assert store.upsert(_pod("a", 7, "j", annotations={"x": "y"}))  # a change the store keeps


def test_a_write_answer_after_the_deleted_event_does_not_revive_the_pod():
    store = _store()
    store.upsert(_pod("a", 5, "j"))
    store.remove(_pod("a", 7, "j"))  # the DELETED event
    assert not store.upsert(_pod("a", 7, "j", deletionTimestamp="now"))  # the DELETE answer
    assert store.get(("ns", "a")) is None and store.names_of_job("ns", "j") == []
    assert store.upsert(_pod("a", 9, "j"))  # re-created under the same name later


def test_the_job_index_follows_upserts_removals_and_relists():
    store = _store()
    store.upsert(_pod("a", 1, "j"))
    store.upsert(_pod("b", 2, "j"))
    store.upsert(_pod("c", 3, "other"))
    store.upsert(_pod("f", 4))
    assert store.names_of_job("ns", "j") == ["a", "b"]
    store.remove(_pod("a", 5, "j"))
    assert store.names_of_job("ns", "j") == ["b"]
    store.replace([_pod("c", 6, "other")])
    assert store.names_of_job("ns", "j") == [] and len(store) == 1


def test_foreign_pods_keep_only_what_capacity_reads_and_job_pods_stay_whole():
    foreign = _pod("f", 1, annotations={"meshtrain.io/planned-node": "n1", "other": "x"})
    foreign["spec"] = {
        "nodeName": "n1",
        "schedulerName": "default-scheduler",
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}},
        "containers": [{"name": "c", "image": "i", "env": [{"name": "A"}], "resources": {"x": 1}}],
        "initContainers": [{"name": "s", "restartPolicy": "Always", "resources": {"y": 2}}],
        "overhead": {"cpu": "1"},
        "volumes": [{"name": "v"}],
    }
    foreign["status"] = {"phase": "Running", "podIP": "10.0.0.1"}
    slim = informer.trim_pod(foreign)
    assert slim["spec"] == {
        "nodeName": "n1",
        "schedulerName": "default-scheduler",
        "overhead": {"cpu": "1"},
        "containers": [{"resources": {"x": 1}}],
        "initContainers": [{"resources": {"y": 2}, "restartPolicy": "Always"}],
    }
    assert "annotations" not in slim["metadata"]  # a foreign pod's annotation reserves nothing
    assert slim["status"] == {"phase": "Running"}
    own = _pod("o", 1, "j")
    assert informer.trim_pod(own) is own


def test_only_pods_a_training_job_controls_are_kept_whole_whatever_their_labels():
    """Labels are anyone's to write: a pod labelled with a job but controlled by no TrainingJob
    (or owned without being controlled, or controlled by another kind) is trimmed like any foreign
    pod, so large annotations or env on it cost the operator nothing (review finding 7)."""
    bulk = {"annotations": {"big": "x" * 100_000}}
    labelled = _pod("l", 1, "j", ownerReferences=[], **bulk)
    not_controller = _pod("n", 1, "j", **bulk)
    not_controller["metadata"]["ownerReferences"][0]["controller"] = False
    other_kind = _pod("k", 1, "j", **bulk)
    other_kind["metadata"]["ownerReferences"][0].update(kind="Job", apiVersion="batch/v1")
    for pod in (labelled, not_controller, other_kind):
        slim = informer.trim_pod(pod)
        assert set(slim["metadata"]) == {"name", "namespace", "resourceVersion"}, pod
    store = _store()
    for pod in (labelled, not_controller, other_kind, _pod("own", 1, "j", **bulk)):
        store.upsert(pod)
    assert store.names_of_job("ns", "j") == ["own"]  # only the job's children are its pods
    assert store.get(("ns", "own"))["metadata"]["annotations"] == bulk["annotations"]


def test_the_cache_learns_deletes_of_unbound_pods_as_gone_and_graceful_ones_as_terminating():
    cache = informer.Cache()
    cache.learn("create", _pod("a", 1, "j"))
    cache.learn("create", _pod("b", 2, "j"))
    cache.learn("delete", _pod("a", 3, "j", deletionTimestamp="t", deletionGracePeriodSeconds=0))
    cache.learn("delete", _pod("b", 4, "j", deletionTimestamp="t", deletionGracePeriodSeconds=30))
    pods = cache.job_pods("ns", "j")
    assert [p["metadata"]["name"] for p in pods] == ["b"]
    assert pods[0]["metadata"]["deletionTimestamp"] == "t"
    cache.learn("create", {"kind": "Event", "metadata": {"name": "e", "resourceVersion": "5"}})
    assert len(cache.pods) == 1
    # A finalizer keeps even an unbound pod: it exists (and may run) until its owner lets go.
    cache.learn("create", _pod("c", 6, "j"))
    held = _pod("c", 7, "j", deletionTimestamp="t", deletionGracePeriodSeconds=0, finalizers=["x"])
    cache.learn("delete", held)
    assert [p["metadata"]["name"] for p in cache.job_pods("ns", "j")] == ["b", "c"]


PLACED = {0: "n1"}
"""The placement of the jobs below unless told otherwise: pod 0 on n1."""


def _job(
    name: str,
    version: int,
    uid: str,
    phase: str | None = None,
    placement: dict[int, str] | None = None,
    restarts: int = 0,
) -> dict[str, Any]:
    """A TrainingJob whose status (the operator's: tenants cannot write it) places its pods."""
    planned = PLACED if placement is None else placement
    status: dict[str, Any] = {
        "restarts": restarts,
        "placement": [{"podIndex": i, "node": n} for i, n in planned.items()],
    }
    if phase:
        status["phase"] = phase
    return {
        "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": str(version)},
        "status": status,
    }


def _gang_pod(job: str, version: int, uid: str, attempt: int = 0, index: int = 0) -> dict[str, Any]:
    """The gated pod the operator creates for pod ``index`` of ``job``'s gang ``attempt``."""
    pod = _pod(
        naming.pod_name(job, attempt, index), version, job, ownerReferences=_controller(job, uid)
    )
    pod["metadata"]["labels"].update(
        {naming.LABEL_ATTEMPT: str(attempt), naming.LABEL_NODE_RANK: str(index)}
    )
    pod["spec"]["schedulingGates"] = [{"name": naming.GANG_GATE}]
    return pod


def test_the_cache_usage_kept_per_event_equals_adding_up_its_pods():
    """Incremental per-node usage against capacity.counted_node and feasibility.usage over what
    the stores hold, while pods change and jobs are created, finished, deleted and re-created
    (a namesake under another UID)."""
    rng = random.Random(7)
    cache = informer.Cache()
    version = 0
    placements = [{0: "c", 1: "c"}, {0: "e", 1: "c"}, {}]
    for _ in range(800):
        version += 1
        if rng.random() < 0.1:
            if rng.random() < 0.3:
                cache.jobs.remove(_job("j", version, "u0"))
            else:
                uid = rng.choice(["u1", "u1", "u2"])
                phase = rng.choice([None, "Running", "Succeeded"])
                placement, restarts = rng.choice(placements), rng.choice([0, 0, 1])
                cache.jobs.upsert(_job("j", version, uid, phase, placement, restarts))
            continue
        attempt, index = rng.choice([0, 0, 1]), rng.randrange(3)
        name = rng.choice([f"p{rng.randrange(40)}", naming.pod_name("j", attempt, index)])
        if rng.random() < 0.25:
            cache.pods.remove(_pod(name, version))
            continue
        if rng.random() < 0.5:
            pod = _gang_pod("j", version, rng.choice(["u1", "u1", "u2", "u3"]), attempt, index)
            pod["metadata"]["name"] = name
        else:
            pod = _pod(name, version, rng.choice([None, "j"]))
            pod["metadata"]["ownerReferences"] = _controller("j", rng.choice(["u1", "u2", "u3"]))
        if rng.random() < 0.5:  # meshtrain's own (the reservation counts them free), or a tenant's
            pod["metadata"]["labels"][naming.LABEL_MANAGED_BY] = naming.MANAGED_BY
        gates = pod["spec"].get("schedulingGates") if rng.random() < 0.8 else None
        pod["spec"] = {
            **({"schedulingGates": gates} if gates else {}),
            "nodeName": rng.choice(["a", "b", None]),
            "containers": [{"resources": {"requests": {"cpu": f"{rng.randrange(1, 9)}00m"}}}],
        }
        if pod["spec"]["nodeName"] is None:
            pod["metadata"]["annotations"] = {"meshtrain.io/planned-node": "c"}
            if rng.random() < 0.3:
                pod["status"]["nominatedNodeName"] = "d"
        pod["status"]["phase"] = rng.choice(["Pending", "Running", "Succeeded"])
        cache.pods.upsert(pod)
        if rng.random() < 0.1:  # read between changes: what was read must not go stale
            dict(cache.usage())
    # ends with a live job, whatever came before, and one of its gated pods (pod 1, on c)
    cache.jobs.upsert(_job("j", version + 1, "u1", placement=placements[0]))
    cache.pods.upsert(_gang_pod("j", version + 2, "u1", index=1))
    live = capacity.live_owner(cache.jobs.get(("ns", "j")) or {})
    skipped = cache.job_pods("ns", "j")
    ours = [p for p in cache.pods.values() if p["metadata"]["labels"].get(naming.LABEL_MANAGED_BY)]
    for left_out, ours_free in (([], False), (skipped, False), (ours, True)):
        by_node: dict[str, list[dict[str, Any]]] = {}
        for pod in cache.pods.values():
            owner = live if informer.job_of(pod) == "j" else None
            node = capacity.counted_node(pod, owner)
            if pod not in left_out and node:
                by_node.setdefault(node, []).append(pod)
        expected = {node: feasibility.usage(pods) for node, pods in by_node.items()}
        found = cache.usage(ours_free=True) if ours_free else cache.usage(without=left_out)
        assert {n: u for n, u in found.items() if u.pods} == {
            n: u for n, u in expected.items() if u.pods
        }
        if not left_out:  # the draw must end with own pods and a nominee counted
            assert "c" in expected and "d" in expected, expected


def test_own_gated_pods_stop_counting_when_their_job_goes_and_count_when_it_comes():
    """The pod list may arrive before the job list (start-up) and a job may be deleted or finish
    while its gated pods remain: the pods are counted again under the job's new answer."""
    cache = informer.Cache()
    pod = _gang_pod("j", 1, "u1")
    pod["metadata"]["annotations"] = {"meshtrain.io/planned-node": "n1"}
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "8"}}
    cache.pods.upsert(pod)
    assert "n1" not in cache.usage()  # no live job owns it yet
    cache.jobs.upsert(_job("j", 2, "u1"))
    assert cache.usage()["n1"].requested == {"nvidia.com/gpu": 8}
    cache.jobs.upsert(_job("j", 3, "u1", phase="Succeeded"))
    assert cache.usage()["n1"].pods == 0
    cache.jobs.upsert(_job("j", 4, "u1", phase="Running"))
    assert cache.usage()["n1"].pods == 1
    cache.jobs.remove(_job("j", 5, "u1"))
    assert cache.usage()["n1"].pods == 0
    cache.jobs.upsert(_job("j", 6, "u2"))  # a namesake: another UID owns nothing of it
    assert cache.usage()["n1"].pods == 0
    cache.jobs.replace([_job("j", 7, "u1")], version="7")  # a relist
    assert cache.usage()["n1"].pods == 1
    cache.jobs.remove(_job("j", 8, "u1"))
    # The operator's own status write (placement is written before the gang is created) tells
    # the cache of its job at once, before the watch's event: the next placement sees the nodes held.
    cache.learn("patch", _job("j", 9, "u1", phase="Placing"))
    assert cache.usage()["n1"].pods == 1


def test_an_own_pod_holds_the_node_its_jobs_status_places_it_on_and_no_forged_pod_holds_any():
    """The node comes from status.placement (the status subresource, which tenants cannot write),
    never from the pod: a pod a tenant creates with its own live job's label, controller reference
    and gate, pinned to another team's node, holds nothing there (review finding 1)."""
    cache = informer.Cache()
    gpus = {"limits": {"nvidia.com/gpu": "8"}}
    own = _gang_pod("j", 1, "u1")
    forged = _gang_pod("j", 2, "u1", index=1)  # pod 1 of a gang placed with pod 0 only
    renamed = _gang_pod("j", 3, "u1")  # a second pod for pod 0's entry
    renamed["metadata"]["name"] = "j-extra"
    for pod in (own, forged, renamed):
        pod["metadata"]["annotations"] = {"meshtrain.io/planned-node": "theirs"}
        pod["spec"]["containers"][0]["resources"] = gpus
        cache.pods.upsert(pod)
    cache.jobs.upsert(_job("j", 4, "u1"))
    usage = dict(cache.usage())
    assert "theirs" not in usage and usage["n1"].pods == 1
    cache.jobs.upsert(_job("j", 5, "u1", placement={0: "n2"}))  # the operator placed it again
    usage = dict(cache.usage())
    assert usage["n2"].pods == 1 and usage.get("n1", capacity.NOTHING).pods == 0
    cache.jobs.upsert(_job("j", 6, "u1", placement={0: "n2"}, restarts=1))  # a new attempt
    assert all(u.pods == 0 for u in cache.usage().values())


def _node(version: int, heartbeat: str, gpus: str = "8") -> dict[str, Any]:
    return {
        "kind": "Node",
        "metadata": {"name": "n0", "resourceVersion": str(version), "labels": {"a": "b"}},
        "spec": {},
        "status": {
            "allocatable": {"nvidia.com/gpu": gpus},
            "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": heartbeat}],
        },
    }


class _Counting:
    def __init__(self) -> None:
        self.waiting = 0

    def poke(self, key: tuple[str, str]) -> None:
        pass

    def poke_waiting(self) -> None:
        self.waiting += 1


def test_a_node_heartbeat_wakes_no_waiting_job_but_a_real_change_does():
    """Kubelets rewrite node status every few minutes; on 10,000 nodes every such write woke
    every job waiting for capacity into a full re-placement under the global lock."""
    events = [
        ("MODIFIED", _node(2, "t1")),  # heartbeat only: what the cache keeps is the same
        ("MODIFIED", _node(3, "t2")),
        ("MODIFIED", _node(4, "t2", gpus="4")),  # allocatable changed: waiting jobs re-place
    ]

    class _Client:
        on_write = None

        async def list_pods(self, **_: Any) -> tuple[list[Any], str]:
            return [], "1"

        async def list_nodes(self, **_: Any) -> tuple[list[Any], str]:
            return [_node(1, "t0")], "1"

        async def list_jobs(self, **_: Any) -> tuple[list[Any], str]:
            return [], "1"

        async def watch_jobs(self, **_: Any):
            await asyncio.Event().wait()
            yield  # pragma: no cover

        async def watch_pods(self, **_: Any):
            await asyncio.Event().wait()
            yield  # pragma: no cover

        async def watch_nodes(self, **_: Any):
            await go.wait()
            for event in events:
                yield event
            await asyncio.Event().wait()

    cache = informer.Cache()
    waker = _Counting()

    go = asyncio.Event()

    async def follow() -> tuple[int, int]:
        task = asyncio.create_task(cache.run(_Client(), waker))  # type: ignore[arg-type]
        await cache.synced.wait()
        after_list = (waker.waiting, cache.nodes.changes)
        go.set()
        for _ in range(20):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return waker.waiting - after_list[0], cache.nodes.changes - after_list[1]

    woken, changes = asyncio.run(follow())
    assert cache.nodes.get(("", "n0"))["metadata"]["resourceVersion"] == "4"
    assert (woken, changes) == (1, 1), (
        f"{woken} wake-up(s) and {changes} cache change(s) for two heartbeats and one allocatable change"
    )


def test_a_relist_keeps_what_the_operator_wrote_after_the_list_was_taken():
    """A relist (after 410 Gone) of 100,000 pods takes seconds; a gang the operator created
    meanwhile is newer than the list. Dropping it until the watch replays its ADDED events
    let the next placement see its GPUs free and plan another job onto them."""
    store = _store()
    store.upsert(_pod("old", 3, "j"))
    store.upsert(_pod("created-during-list", 12, "j"))  # learned from the create's answer
    store.upsert(_pod("deleted-during-list", 4, "j"))
    store.remove(_pod("deleted-during-list", 13, "j"))  # learned from the delete's answer
    store.replace([_pod("old", 3, "j"), _pod("deleted-during-list", 4, "j")], version="10")
    assert store.names_of_job("ns", "j") == ["created-during-list", "old"]
    store.replace([_pod("old", 3, "j")], version="20")  # a list newer than both writes
    assert store.names_of_job("ns", "j") == ["old"]


def test_the_cache_is_synced_once_the_jobs_of_every_watched_namespace_are_listed():
    """Own gated pods hold their nodes only while their job is known live: a placement before
    the TrainingJobs are listed would see those nodes free."""
    listed: list[str | None] = []
    release = asyncio.Event()

    class _Client:
        on_write = None

        async def list_pods(self, **_: Any) -> tuple[list[Any], str]:
            return [], "1"

        async def list_nodes(self, **_: Any) -> tuple[list[Any], str]:
            return [], "1"

        async def list_jobs(self, *, namespace: str | None, **_: Any) -> tuple[list[Any], str]:
            if namespace == "b":
                await release.wait()
            listed.append(namespace)
            job = _job("j", 1, "u1")
            job["metadata"]["namespace"] = namespace
            return [job], "1"

        async def _forever(self, **_: Any):
            await asyncio.Event().wait()
            yield  # pragma: no cover

        watch_pods = watch_nodes = watch_jobs = _forever

    cache = informer.Cache()

    async def follow() -> tuple[bool, bool]:
        task = asyncio.create_task(cache.run(_Client(), namespaces=["a", "b"]))  # type: ignore[arg-type]
        for _ in range(20):
            await asyncio.sleep(0)
        before = cache.synced.is_set()
        release.set()
        await asyncio.wait_for(cache.synced.wait(), 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return before, cache.synced.is_set()

    assert asyncio.run(follow()) == (False, True)
    assert listed == ["a", "b"]  # each watched namespace, never all of them
    # the list of b (after a's) replaced b's jobs only
    assert cache.jobs.get(("a", "j")) is not None and cache.jobs.get(("b", "j")) is not None


def _store_pod(name: str, version: int, job: str, **status: Any) -> dict[str, Any]:
    """A store pod of TrainingJob ``job`` (its label and controller reference) on node n9."""
    pod = _pod(name, version, job)
    pod["metadata"]["labels"][naming.LABEL_STORE] = "true"
    pod["spec"]["nodeName"] = "n9"
    pod["status"].update(status)
    return pod


def test_a_gone_store_pod_s_last_version_is_kept_for_its_job_s_next_pass():
    """``store_pod.loss`` reads it to tell PodGC's removal with a node from a user's deletion."""
    cache = informer.Cache()
    cache.jobs.upsert(_job("j", 1, "uid-j"))
    gc_mark = {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC"}
    store = _store_pod("j-r0-store", 3, "j", conditions=[gc_mark])
    store["spec"]["containers"][0]["env"] = [{"name": "BIG", "value": "x" * 10_000}]
    cache.pods.upsert(store)
    assert cache.departed(("ns", "j-r0-store")) is None  # there: nothing departed
    cache.pods.remove(_pod("j-r0-store", 4, "j"))  # the DELETED event
    last = cache.departed(("ns", "j-r0-store"))
    assert last is not None and last["spec"] == {"nodeName": "n9"}  # only what loss reads
    assert last["status"]["conditions"] == [gc_mark]
    assert last["metadata"]["ownerReferences"] == [{"uid": "uid-j"}]
    assert owned.departed_store(cache, identity.JobRef("j", "ns", "uid-j"), 0) == last
    namesake = identity.JobRef("j", "ns", "uid-new")  # deleted and made again since
    assert owned.departed_store(cache, namesake, 0) is None
    cache.pods.upsert(_store_pod("j-r0-store", 5, "j"))  # made again: no longer gone
    assert cache.departed(("ns", "j-r0-store")) is None


def test_only_the_store_pod_of_a_live_job_s_current_attempt_is_kept_when_it_goes():
    """Anyone may label a pod or give it a controller reference: a store pod is kept only when
    a live TrainingJob controls it and it is that job's current attempt's, one per job."""
    cache = informer.Cache()
    cache.jobs.upsert(_job("j", 1, "uid-j", restarts=1))
    for name, job in (("j-r0-0", "j"), ("j-r0-store", "j"), ("x-r0-store", "x")):
        pod = _store_pod(name, 3, job)  # a trainer pod, an earlier attempt's, no live job's
        cache.pods.upsert(pod)
        cache.pods.remove(_pod(name, 4, job))
        assert cache.departed(("ns", name)) is None, name
    forged = _store_pod("j-r1-store", 3, "j")
    forged["metadata"]["ownerReferences"][0]["uid"] = "uid-other"
    cache.pods.upsert(forged)
    cache.pods.remove(_pod("j-r1-store", 4, "j"))
    assert cache.departed(("ns", "j-r1-store")) is None
    cache.pods.upsert(_store_pod("j-r1-store", 5, "j"))
    cache.pods.remove(_pod("j-r1-store", 6, "j"))
    assert cache.departed(("ns", "j-r1-store")) is not None


def test_gone_store_pods_kept_are_bounded_in_number_and_time(monkeypatch):
    cache = informer.Cache()
    for i in range(informer.DEPARTED_LIMIT + 5):
        cache.jobs.upsert(_job(f"j{i}", 1, f"uid-j{i}"))
        cache.pods.upsert(_store_pod(f"j{i}-r0-store", 1, f"j{i}"))
        cache.pods.remove(_pod(f"j{i}-r0-store", 2, f"j{i}"))
    assert cache.departed(("ns", "j0-r0-store")) is None  # the oldest went first
    newest = ("ns", f"j{informer.DEPARTED_LIMIT + 4}-r0-store")
    assert cache.departed(newest) is not None
    later = informer.time.monotonic() + informer.DEPARTED_SECONDS + 1
    monkeypatch.setattr(informer.time, "monotonic", lambda: later)
    assert cache.departed(newest) is None
