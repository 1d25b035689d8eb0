"""The informer store: newest version wins, tombstones, the job index, trimming (no API involved)."""

from __future__ import annotations

import random
from typing import Any

from meshtrain.operator import feasibility, informer


def _pod(name: str, version: int, job: str | None = None, **extra: Any) -> dict[str, Any]:
    labels = {"meshtrain.io/job": job} if job else {}
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "resourceVersion": str(version),
            "labels": labels,
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
    assert store.upsert(_pod("a", 6, "j"))


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
        "containers": [{"name": "c", "image": "i", "env": [{"name": "A"}], "resources": {"x": 1}}],
        "initContainers": [{"name": "s", "restartPolicy": "Always", "resources": {"y": 2}}],
        "overhead": {"cpu": "1"},
        "volumes": [{"name": "v"}],
    }
    foreign["status"] = {"phase": "Running", "podIP": "10.0.0.1"}
    slim = informer.trim_pod(foreign)
    assert slim["spec"] == {
        "nodeName": "n1",
        "overhead": {"cpu": "1"},
        "containers": [{"resources": {"x": 1}}],
        "initContainers": [{"resources": {"y": 2}, "restartPolicy": "Always"}],
    }
    assert slim["metadata"]["annotations"] == {"meshtrain.io/planned-node": "n1"}
    assert slim["status"] == {"phase": "Running"}
    own = _pod("o", 1, "j")
    assert informer.trim_pod(own) is own


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


def test_the_cache_usage_kept_per_event_equals_adding_up_its_pods():
    """Incremental per-node usage against feasibility.usage over what the store holds."""
    rng = random.Random(7)
    cache = informer.Cache()
    version = 0
    for _ in range(600):
        version += 1
        name = f"p{rng.randrange(40)}"
        if rng.random() < 0.25:
            cache.pods.remove(_pod(name, version))
            continue
        pod = _pod(name, version, rng.choice([None, "j"]))
        pod["spec"] = {
            "nodeName": rng.choice(["a", "b", None]),
            "containers": [{"resources": {"requests": {"cpu": f"{rng.randrange(1, 9)}00m"}}}],
        }
        if pod["spec"]["nodeName"] is None:
            pod["metadata"]["annotations"] = {"meshtrain.io/planned-node": "c"}
        pod["status"] = {"phase": rng.choice(["Pending", "Running", "Succeeded"])}
        cache.pods.upsert(pod)
    skipped = cache.job_pods("ns", "j")
    by_node: dict[str, list[dict[str, Any]]] = {}
    for pod in cache.pods.values():
        if pod not in skipped:
            node = pod["spec"].get("nodeName") or "c"
            by_node.setdefault(node, []).append(pod)
    expected = {node: feasibility.usage(pods) for node, pods in by_node.items()}
    found = cache.usage(without=skipped)
    assert {n: u for n, u in found.items() if u.pods} == {
        n: u for n, u in expected.items() if u.pods
    }
