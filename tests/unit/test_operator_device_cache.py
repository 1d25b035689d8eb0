"""The informer's device caches: bound pods hold devices until their claims show allocated, the
allocated set kept per claim event equals a rebuild, and device changes wake only the waiting jobs
they could admit (the differential tests against kube-scheduler are in
tests/integration/operator/test_devices_vs_scheduler.py and test_dra_chaos.py)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from meshtrain.api import loading
from meshtrain.operator import device_wake, handlers, waiting
from meshtrain.operator.cluster import device_cache, informer
from meshtrain.operator.policy import builders, devices, feasibility, identity
from tests.builders import JobBuilder
from tests.unit.test_operator_devices import CLASS, DRIVER, gpu, slice_of


def _node(name: str) -> dict[str, Any]:
    allocatable = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    return {
        "metadata": {"name": name, "resourceVersion": "1"},
        "status": {
            "allocatable": allocatable,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def _claim(name: str, node: str | None, *gpus: str, version: int = 1) -> dict[str, Any]:
    """A claim in namespace ns; allocated on ``node`` (None: not allocated) to ``gpus``."""
    metadata = {"name": name, "namespace": "ns", "resourceVersion": str(version)}
    if node is None:
        return {"metadata": metadata, "status": {}}
    results = [{"request": "gpus", "driver": DRIVER, "pool": node, "device": g} for g in gpus]
    selector = {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        ]
    }
    allocation = {"devices": {"results": results}, "nodeSelector": selector}
    return {"metadata": metadata, "status": {"allocation": allocation}}


def _dra_spec(gpus: int) -> Any:
    job = JobBuilder("j", "ns").layout(data=gpus, gpus_per_node=gpus).dra(DRIVER)
    return loading.parse_spec(job.resources(cpu="100m").raw())


def _bound_pod(node: str, claim: str | None, gpus: int = 4) -> dict[str, Any]:
    """The operator's DRA pod bound to ``node``; its claim named ``claim`` in its status (None:
    the resourceclaim controller has not named it yet)."""
    pod = builders.build_pod(identity.JobRef("j", "ns", "u1"), _dra_spec(gpus), 0, 0, node)
    pod["metadata"]["resourceVersion"] = "5"
    pod["spec"].pop("schedulingGates", None)
    pod["spec"]["nodeName"] = node
    statuses = [] if claim is None else [{"name": "gpus", "resourceClaimName": claim}]
    pod["status"] = {"phase": "Running", "resourceClaimStatuses": statuses}
    return pod


def _cache() -> informer.Cache:
    cache = informer.Cache(follow_devices=True)
    cache.nodes.upsert(_node("n1"))
    cache.dra["resourceslices"].upsert(
        {**slice_of("n1", [gpu(i) for i in range(8)]), "metadata": {"name": "s1"}}
    )
    cache.dra["deviceclasses"].upsert(CLASS)
    return cache


def _held(cache: informer.Cache, node: str) -> int:
    used = cache.usage().get(node, feasibility.Usage())
    return used.requested.get(devices.HELD, 0)


def test_a_bound_pod_holds_its_devices_until_its_claim_shows_allocated():
    cache = _cache()
    cache.pods.upsert(_bound_pod("n1", None))  # bound before its claim is even named
    assert _held(cache, "n1") == 4
    cache.pods.upsert(
        {
            **_bound_pod("n1", "c1"),
            "metadata": {**_bound_pod("n1", "c1")["metadata"], "resourceVersion": "6"},
        }
    )
    cache.dra["resourceclaims"].upsert(_claim("c1", None))  # made, not allocated yet
    assert _held(cache, "n1") == 4
    assert devices.fit(devices.Request(DRIVER, (), 1), cache.inventory(), "n1", 4).free == 4
    cache.dra["resourceclaims"].upsert(
        _claim("c1", "n1", "gpu-0", "gpu-1", "gpu-2", "gpu-3", version=2)
    )
    assert _held(cache, "n1") == 0  # its allocation counts now, once
    assert devices.fit(devices.Request(DRIVER, (), 1), cache.inventory(), "n1").free == 4
    finished = _bound_pod("n1", "c1")
    finished["metadata"]["resourceVersion"] = "7"
    finished["status"]["phase"] = "Succeeded"
    cache.dra["resourceclaims"].upsert(_claim("c1", None, version=3))
    cache.pods.upsert(finished)
    assert _held(cache, "n1") == 0


def test_a_plain_pod_a_class_served_holds_its_devices_until_the_schedulers_claim_shows_allocated():
    spec = loading.parse_spec(JobBuilder("j", "ns").layout(data=4, gpus_per_node=4).raw())
    pod = builders.build_pod(identity.JobRef("j", "ns", "u1"), spec, 0, 0, "n1")
    pod["metadata"]["resourceVersion"] = "5"
    pod["spec"].pop("schedulingGates", None)
    pod["spec"]["nodeName"] = "n1"
    claim = {"resourceClaimName": "j-r0-0-extended-resources-x", "requestMappings": []}
    pod["status"] = {"phase": "Running", "extendedResourceClaimStatus": claim}
    cache = _cache()
    cache.pods.upsert(pod)
    assert _held(cache, "n1") == 4
    allocated = _claim("j-r0-0-extended-resources-x", "n1", "gpu-0", "gpu-1", "gpu-2", "gpu-3")
    cache.dra["resourceclaims"].upsert(allocated)
    assert _held(cache, "n1") == 0


def test_the_allocated_set_kept_per_claim_event_equals_a_rebuild():
    rng = random.Random(11)
    cache = _cache()
    for version in range(1, 400):
        name = f"c{rng.randrange(12)}"
        if rng.random() < 0.2:
            cache.dra["resourceclaims"].remove(_claim(name, None, version=version))
        else:
            taken = rng.sample([f"gpu-{i}" for i in range(8)], rng.randint(0, 3))
            node = None if not taken else "n1"
            cache.dra["resourceclaims"].upsert(_claim(name, node, *taken, version=version))
        if rng.random() < 0.3:
            claims = cache.dra["resourceclaims"].values()
            rebuilt = devices.inventory(
                cache.dra["resourceslices"].values(), claims, cache.dra["deviceclasses"].values()
            )
            assert cache.inventory() == rebuilt


def test_only_freed_or_published_devices_name_nodes_to_wake():
    allocated = device_cache.trim_claim(_claim("c1", "n1", "gpu-0"))
    pending = device_cache.trim_claim(_claim("c1", None))
    assert device_cache.changed_nodes("resourceclaims", pending, allocated) == frozenset()
    assert device_cache.changed_nodes("resourceclaims", allocated, pending) == {"n1"}
    assert device_cache.changed_nodes("resourceclaims", allocated, None) == {"n1"}
    published = slice_of("n2", [gpu(0)])
    assert device_cache.changed_nodes("resourceslices", None, published) == {"n2"}
    assert device_cache.changed_nodes("deviceclasses", None, CLASS) is None


def test_a_device_change_wakes_only_the_waiting_jobs_that_could_use_those_nodes():
    cache = _cache()
    cache.nodes.upsert(_node("n2"))
    queue = waiting.Queue(cache)
    small, large = identity.JobRef("small", "ns", "u1"), identity.JobRef("large", "ns", "u2")
    demand = feasibility.demand_of(_bound_pod("n1", None))
    queue.enter(small, _dra_spec(4), demand)
    queue.enter(large, _dra_spec(8), demand)
    keys = [("ns", "large"), ("ns", "small")]
    cache.dra["resourceclaims"].upsert(_claim("c1", "n1", "gpu-0", "gpu-1"))
    # n1 has 6 free devices: the 4-device job could use them, the 8-device one could not
    assert device_wake.admitted(queue, keys, frozenset({"n1"})) == [("ns", "small")]
    assert device_wake.admitted(queue, keys, frozenset({"n2"})) == []  # no devices there

    async def wakes(nodes: frozenset[str] | None) -> list[tuple[str, str]]:
        woken: list[tuple[str, str]] = []
        wakeups = handlers.Wakeups(
            admit=lambda k: k, admit_devices=lambda k, n: device_wake.admitted(queue, k, n)
        )
        for key in keys:
            wakeups.event(key)
            wakeups.set_waiting(key, True)
        wakeups.poke = woken.append  # type: ignore[method-assign]
        wakeups.poke_devices(nodes)
        await asyncio.sleep(handlers.WAKE_COALESCE_SECONDS + 0.1)
        return woken

    assert asyncio.run(wakes(frozenset({"n1"}))) == [("ns", "small")]
    assert asyncio.run(wakes(frozenset())) == []  # a claim allocated: nothing freed
    assert asyncio.run(wakes(None)) == keys  # a class changed: the broad rule
