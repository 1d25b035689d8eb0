"""The operator's device verdict against the real kube-scheduler, which allocates DRA claims itself.

Random small clusters publish ResourceSlices by hand (no driver runs: a slice is an API object
with a driver name and a nodeName; a pool in one slice or two, one of two missing at times, an
older generation beside the newest at times) with random GPUs (product, memory, NVLink clique, PCIe root; a few tainted),
and random claims already hold some of them (an allocation written to the claim's status, as
the scheduler writes it), and admin-access claims (a monitoring agent's) see all of them while
holding none.  For every node, a probe pod pinned to it asks, through a
ResourceClaim, a random number of devices of a random DeviceClass with random CEL selectors
and, at random, a ``matchAttribute`` constraint: the pod and the claim the operator's own
ResourceClaimTemplate makes for a random DRA job.  kube-scheduler binding the probe (it allocated
the claim) or reporting it Unschedulable is the truth; ``capacity.verdict`` with the devices the
operator's own cache read (``informer.Cache.inventory``) must agree on every node.  With a
DeviceClass serving ``nvidia.com/gpu`` (KEP-5004), plain GPU pods get the same comparison, and so
does a second gang's pod on a node where a first gang's pod was gated when the operator looked.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
import pytest

from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.operator.cluster import informer, kube
from meshtrain.operator.policy import (
    builders,
    capacity,
    device_claims,
    devices,
    feasibility,
    identity,
    naming,
)
from tests.builders import JobBuilder
from tests.integration.operator.cluster import GROUP, PLURAL, VERSION, Cluster, wait_for
from tests.integration.operator.test_feasibility_vs_scheduler import (
    _ignore_missing,
    _scheduler_verdict,
)

pytestmark = pytest.mark.integration

ROUNDS = 10
DRIVER = "gpu.sim.meshtrain.io"
CLASSES = {
    DRIVER: [f'device.driver == "{DRIVER}"'],
    "h200.sim.meshtrain.io": [
        f'device.driver == "{DRIVER}"',
        f'device.attributes["{DRIVER}"].productName == "NVIDIA H200"',
    ],
}
"""The DeviceClasses: the driver's own, and one selecting a product."""
SELECTORS = (
    f'device.attributes["{DRIVER}"].productName == "NVIDIA H200"',
    f'device.capacity["{DRIVER}"].memory.compareTo(quantity("100Gi")) >= 0',
    f'device.capacity["{DRIVER}"].memory.isLessThan(quantity("100Gi"))',
    f'device.attributes["{DRIVER}"].index >= 2',
    f'device.attributes["{DRIVER}"].cliqueId == "clique-0"',
    f'device.attributes["{DRIVER}"].productName.startsWith("NVIDIA")',
)
"""Request selectors (what ``resources.dra.selectors`` holds)."""
MATCH = (None, None, devices.PCIE_ROOT, f"{DRIVER}/cliqueId")
"""A request's matchAttribute (often none)."""


@pytest.fixture(scope="module")
def scheduled(control_plane_binaries) -> Iterator[Cluster]:
    """An API server with kube-scheduler and the TrainingJob CRD (the operator's cache lists
    TrainingJobs), the DeviceClasses and a namespace for the probes."""
    with Cluster.private(control_plane_binaries) as found:
        api = found.core.api_client
        resource = kubernetes.client.ResourceV1Api(api)
        # admin-access claims (DRAAdminAccess) are allowed only in a namespace so labelled
        labels = {"resource.kubernetes.io/admin-access": "true"}
        found.core.create_namespace({"metadata": {"name": "probe", "labels": labels}})
        for name, selectors in CLASSES.items():
            spec = {"selectors": [{"cel": {"expression": s}} for s in selectors]}
            resource.create_device_class({"metadata": {"name": name}, "spec": spec})
        wait_for(
            "namespace active",
            lambda: found.core.read_namespace("probe").status.phase == "Active",
        )
        yield found


def _slice(rng: random.Random, node: str) -> dict[str, Any]:
    """A slice of 1-8 random GPUs on ``node``, as a DRA driver would publish them."""
    product = rng.choice(["NVIDIA H200", "NVIDIA A100"])
    gpus: list[dict[str, Any]] = []
    for index in range(rng.randint(1, 8)):
        attributes = {
            "type": {"string": "gpu"},
            "index": {"int": index},
            "uuid": {"string": f"GPU-{uuid.uuid4()}"},
            "productName": {"string": product if rng.random() < 0.8 else "NVIDIA L40S"},
            "cliqueId": {"string": rng.choice(["clique-0", "clique-1"])},
            "numaNode": {"int": index // 4},
            devices.PCIE_ROOT: {"string": f"pci0000:{rng.choice(['00', '40'])}"},
        }
        memory = {"memory": {"value": rng.choice(["80Gi", "141Gi"])}}
        device = {"name": f"gpu-{index}", "attributes": attributes, "capacity": memory}
        if rng.random() < 0.3:  # DRADeviceTaints (beta, on): the scheduler allocates it to no one
            device["taints"] = [{"key": "example.com/unhealthy", "effect": "NoSchedule"}]
        gpus.append(device)
    spec = {
        "driver": DRIVER,
        "nodeName": node,
        "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
        "devices": gpus,
    }
    return {"metadata": {"name": f"{node}-gpus"}, "spec": spec}


def _pool(rng: random.Random, node: str) -> list[dict[str, Any]]:
    """The slices of ``node``'s pool as a driver may leave them: one slice, or the newest
    generation in two slices (one of them missing at times: an incomplete pool while the driver
    republishes), beside an older generation's slice at times."""
    newest = _slice(rng, node)
    pool = newest["spec"]["pool"]
    published = [newest]
    if rng.random() < 0.4:
        second = _slice(rng, node)
        second["metadata"]["name"] = f"{node}-gpus-b"
        for device in second["spec"]["devices"]:
            device["name"] = f"b-{device['name']}"
        pool["resourceSliceCount"] = 2
        second["spec"]["pool"] = pool
        published.append(second)
        if rng.random() < 0.4:  # the second slice not published yet
            published.pop(rng.randrange(2))
    if rng.random() < 0.3:
        pool["generation"] = 2
        older = _slice(rng, node)
        older["metadata"]["name"] = f"{node}-gpus-old"
        published.append(older)
    return published


def _claim(
    name: str,
    device_class: str,
    count: int,
    selectors: list[str],
    match: str | None,
    admin: bool = False,
) -> dict[str, Any]:
    exactly: dict[str, Any] = {
        "deviceClassName": device_class,
        "allocationMode": "ExactCount",
        "count": count,
    }
    if admin:
        exactly["adminAccess"] = True
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpus", "exactly": exactly}]}}
    if match:
        spec["devices"]["constraints"] = [{"requests": ["gpus"], "matchAttribute": match}]
    return {"metadata": {"name": name}, "spec": spec}


def _hold(
    resource: kubernetes.client.ResourceV1Api, node: str, gpus: list[str], admin: bool = False
) -> str:
    """A claim whose allocation (written as the scheduler writes it) holds ``gpus`` of ``node``;
    with ``admin`` an admin-access claim (a monitoring agent's), which holds them for no one."""
    name = f"held-{uuid.uuid4().hex[:8]}"
    resource.create_namespaced_resource_claim(
        "probe", _claim(name, DRIVER, len(gpus), [], None, admin)
    )
    results = [{"request": "gpus", "driver": DRIVER, "pool": node, "device": g} for g in gpus]
    if admin:
        results = [{**r, "adminAccess": True} for r in results]
    selector = {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        ]
    }
    allocation = {"devices": {"results": results}, "nodeSelector": selector}
    resource.patch_namespaced_resource_claim_status(
        name, "probe", {"status": {"allocation": allocation}}
    )
    return name


def _probe_extended(
    core: kubernetes.client.CoreV1Api, node: str, spec: api_spec.TrainingJobSpec
) -> dict[str, Any]:
    """The operator's pod 0 of a job asking ``nvidia.com/gpu``, planned onto ``node``, ungated."""
    ref = identity.JobRef(name=f"j{uuid.uuid4().hex[:6]}", namespace="probe", uid="")
    pod = builders.build_pod(ref, spec, 0, 0, node)
    pod["metadata"].pop("ownerReferences")
    pod["spec"].pop("schedulingGates")
    core.create_namespaced_pod("probe", pod)
    return pod


def _probe(
    core: kubernetes.client.CoreV1Api,
    resource: kubernetes.client.ResourceV1Api,
    node: str,
    spec: api_spec.TrainingJobSpec,
) -> tuple[dict[str, Any], str]:
    """The operator's gated pod 0 of a DRA job, planned onto ``node``, with its claim made from the
    job's ResourceClaimTemplate spec as the resourceclaim controller makes it (none runs here);
    then its gate lifted as the operator lifts it.  The pod and its claim's name."""
    ref = identity.JobRef(name=f"j{uuid.uuid4().hex[:6]}", namespace="probe", uid="")
    pod = builders.build_pod(ref, spec, 0, 0, node)
    pod["metadata"].pop("ownerReferences")
    made = core.create_namespaced_pod("probe", pod)
    claim = f"{made.metadata.name}-{naming.GPU_CLAIM}"
    owner = {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": made.metadata.name,
        "uid": made.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    metadata = {
        "name": claim,
        "ownerReferences": [owner],
        "annotations": {"resource.kubernetes.io/pod-claim-name": naming.GPU_CLAIM},
    }
    body = {"metadata": metadata, "spec": device_claims.template_spec(spec)["spec"]}
    resource.create_namespaced_resource_claim("probe", body)
    statuses = [{"name": naming.GPU_CLAIM, "resourceClaimName": claim}]
    core.patch_namespaced_pod_status(
        made.metadata.name, "probe", {"status": {"resourceClaimStatuses": statuses}}
    )
    lift = [{"name": naming.GANG_GATE, "$patch": "delete"}]  # as kube.Client.lift_gates
    core.patch_namespaced_pod(made.metadata.name, "probe", {"spec": {"schedulingGates": lift}})
    return pod, claim


def _operator_view(kubeconfig: str) -> tuple[devices.Inventory, dict[str, feasibility.Usage]]:
    """The devices and usage the operator's own cache reads from the API server."""

    async def read() -> tuple[devices.Inventory, dict[str, feasibility.Usage]]:
        client = await kube.Client.connect(kubeconfig=kubeconfig)
        cache = informer.Cache(follow_devices=True)
        follow = asyncio.create_task(cache.run(client))
        try:
            await asyncio.wait_for(cache.synced.wait(), 30)
            return cache.inventory(), dict(cache.usage())
        finally:
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)
            await client.close()

    return asyncio.run(read())


def _decided(core: kubernetes.client.CoreV1Api, pods: dict[str, str]) -> dict[str, Any]:
    """Node -> kube-scheduler's (binds, message) on the pod there."""
    return {
        name: wait_for(
            f"scheduler decision on {pod}", lambda p=pod: _scheduler_verdict(core, p), timeout=30
        )
        for name, pod in pods.items()
    }


def _compare(
    core: kubernetes.client.CoreV1Api,
    probes: dict[str, str],
    asked: dict[str, api_spec.TrainingJobSpec],
    inventory: devices.Inventory,
    usage: dict[str, feasibility.Usage],
) -> list[dict[str, Any]]:
    """For each node's probe: the scheduler's verdict and the operator's from its view."""
    api = core.api_client
    results = []
    for name, truth in _decided(core, probes).items():
        pod = api.sanitize_for_serialization(core.read_namespaced_pod(probes[name], "probe"))
        node_obj = api.sanitize_for_serialization(core.read_node(name))
        ask = devices.ask_of(asked[name], inventory)
        reason = capacity.verdict(
            feasibility.demand_of(pod), node_obj, usage.get(name, capacity.NOTHING), ask
        )
        results.append(
            {
                "node": name,
                "request": ask.request,
                "scheduler_binds": truth[0],
                "scheduler_message": truth[1],
                "operator_reason": reason,
            }
        )
    return results


def _random_job(rng: random.Random) -> api_spec.TrainingJobSpec:
    """A DRA job of one pod: random class, selectors, GPUs per pod and matchAttribute."""
    gpus = rng.choice([1, 2, 2, 4])
    selectors = rng.sample(SELECTORS, rng.choice([0, 0, 1, 1, 2]))
    job = JobBuilder().layout(data=gpus, gpus_per_node=gpus).resources(cpu="100m")
    job.dra(rng.choice(list(CLASSES)), *selectors, match_attribute=rng.choice(MATCH))
    return loading.parse_spec(job.raw())


def _round(
    cluster: Cluster,
    rng: random.Random,
    job: Callable[[random.Random], api_spec.TrainingJobSpec],
) -> list[dict[str, Any]]:
    """One random cluster; every node's verdicts (the operator's and the scheduler's) on the
    pod of a ``job``."""
    core = cluster.core
    api = core.api_client
    resource = kubernetes.client.ResourceV1Api(api)
    names = [f"n{uuid.uuid4().hex[:6]}" for _ in range(rng.randint(3, 5))]
    claims: list[str] = []
    probes: dict[str, str] = {}
    asked: dict[str, api_spec.TrainingJobSpec] = {}
    try:
        for name in names:
            cluster.add_node("dra", gpus=0, name=name)  # no extended-resource GPU
            published = _pool(rng, name)
            for found in published:
                resource.create_resource_slice(found)
            gpus = [d["name"] for d in published[0]["spec"]["devices"]]
            if rng.random() < 0.6:
                claims.append(_hold(resource, name, rng.sample(gpus, rng.randint(1, len(gpus)))))
            if rng.random() < 0.4:  # a monitoring agent's admin-access claim on every GPU
                claims.append(_hold(resource, name, gpus, admin=True))
        time.sleep(1.0)  # the scheduler's informers follow slices and claims
        inventory, usage = _operator_view(cluster.kubeconfig)
        for name in names:
            asked[name] = job(rng)
            if asked[name].resources.dra is None:
                probes[name] = _probe_extended(core, name, asked[name])["metadata"]["name"]
                continue
            pod, claim = _probe(core, resource, name, asked[name])
            probes[name] = pod["metadata"]["name"]
            claims.append(claim)
        return _compare(core, probes, asked, inventory, usage)
    finally:
        for pod in probes.values():
            _ignore_missing(core.delete_namespaced_pod, pod, "probe", grace_period_seconds=0)
        for claim in claims:
            # no controller-manager deallocates: the scheduler's delete protection is lifted here
            _ignore_missing(
                resource.patch_namespaced_resource_claim,
                claim,
                "probe",
                {"metadata": {"finalizers": None}},
            )
            _ignore_missing(resource.delete_namespaced_resource_claim, claim, "probe")
        for name in names:
            for suffix in ("", "-b", "-old"):
                _ignore_missing(resource.delete_resource_slice, f"{name}-gpus{suffix}")
            _ignore_missing(core.delete_node, name)


def test_operator_device_verdict_equals_the_scheduler_on_every_node(scheduled):
    rng = random.Random(20261130)
    results: list[dict[str, Any]] = []
    for _ in range(ROUNDS):
        results.extend(_round(scheduled, rng, _random_job))
    wrong = [r for r in results if r["scheduler_binds"] is (r["operator_reason"] is not None)]
    assert wrong == [], wrong
    refused = [r for r in results if not r["scheduler_binds"]]
    # the scheduler's message names the same filter: its DynamicResources plugin
    assert all(devices.CANNOT_ALLOCATE in r["scheduler_message"] for r in refused), refused
    # both answers, with selectors and with matchAttribute, or agreement proves little
    assert len(refused) >= 5 and len(results) - len(refused) >= 5, collections.Counter(
        r["operator_reason"] for r in results
    )
    constrained = [r for r in results if r["request"].match_attribute]
    assert {r["scheduler_binds"] for r in constrained} == {True, False}, constrained


SERVING = "plain.sim.meshtrain.io"
"""A DeviceClass serving ``nvidia.com/gpu`` from slices (KEP-5004, beta and on in 1.36)."""


def _extended_job(rng: random.Random) -> api_spec.TrainingJobSpec:
    """A job of one pod asking 1-4 ``nvidia.com/gpu`` the usual way (no ``resources.dra``)."""
    gpus = rng.choice([1, 2, 2, 4])
    job = JobBuilder().layout(data=gpus, gpus_per_node=gpus).resources(cpu="100m")
    return loading.parse_spec(job.raw())


def _served_rounds(
    cluster: Cluster, seed: int, rounds: int, one: Callable[[random.Random], list[dict[str, Any]]]
) -> None:
    """``rounds`` of ``one`` while a DeviceClass serves ``nvidia.com/gpu`` from the slices; the
    operator must agree with the scheduler on every node, which must both bind and refuse."""
    resource = kubernetes.client.ResourceV1Api(cluster.core.api_client)
    spec = {
        "selectors": [{"cel": {"expression": s}} for s in CLASSES[DRIVER]],
        "extendedResourceName": "nvidia.com/gpu",
    }
    resource.create_device_class({"metadata": {"name": SERVING}, "spec": spec})
    try:
        rng = random.Random(seed)
        results: list[dict[str, Any]] = []
        for _ in range(rounds):
            results.extend(one(rng))
    finally:
        resource.delete_device_class(SERVING)
    wrong = [r for r in results if r["scheduler_binds"] is (r["operator_reason"] is not None)]
    assert wrong == [], wrong
    refused = sum(1 for r in results if not r["scheduler_binds"])
    assert refused >= 3 and len(results) - refused >= 3, results


def test_a_plain_gpu_request_served_from_slices_gets_the_schedulers_verdict(scheduled):
    """Nodes whose GPUs only DRA publishes; a DeviceClass with extendedResourceName
    nvidia.com/gpu lets kube-scheduler allocate a plain GPU request from them."""
    _served_rounds(scheduled, 20261201, ROUNDS // 2, lambda r: _round(scheduled, r, _extended_job))


def _gated_gang(cluster: Cluster, node: str, spec: api_spec.TrainingJobSpec) -> str:
    """A TrainingJob whose status plans its pod 0 onto ``node``, and that pod, gated, as the
    operator leaves it until its gang is complete: the pod's name."""
    name = f"g{uuid.uuid4().hex[:6]}"
    gpus = spec.resources.gpus_per_node
    job = JobBuilder(name, "probe").layout(data=gpus, gpus_per_node=gpus).resources(cpu="100m")
    made = cluster.apply(job)
    status = {"restarts": 0, "placement": [{"podIndex": 0, "node": node}]}
    cluster.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, "probe", PLURAL, name, {"status": status}
    )
    ref = identity.JobRef(name=name, namespace="probe", uid=made["metadata"]["uid"])
    pod = builders.build_pod(ref, spec, 0, 0, node)
    cluster.core.create_namespaced_pod("probe", pod)
    return str(pod["metadata"]["name"])


def _two_gangs_round(cluster: Cluster, rng: random.Random) -> list[dict[str, Any]]:
    """Per node, a first gang's gated pod planned there (the operator's view is read while it is
    gated), then released and bound by the scheduler; then a second gang's pod: the scheduler's
    verdict on the second against the operator's, read while the first was still gated."""
    core = cluster.core
    api = core.api_client
    resource = kubernetes.client.ResourceV1Api(api)
    names = [f"n{uuid.uuid4().hex[:6]}" for _ in range(rng.randint(3, 5))]
    firsts: dict[str, str] = {}
    seconds: dict[str, str] = {}
    asked: dict[str, api_spec.TrainingJobSpec] = {}
    jobs: list[str] = []
    try:
        for name in names:
            cluster.add_node("dra", gpus=0, name=name)
            resource.create_resource_slice(_slice(rng, name))
        time.sleep(1.0)
        for name in names:
            first = _extended_job(rng)
            firsts[name] = _gated_gang(cluster, name, first)
            jobs.append(firsts[name].rsplit("-r0-", 1)[0])
        inventory, usage = _operator_view(cluster.kubeconfig)
        lift = [{"name": naming.GANG_GATE, "$patch": "delete"}]
        for pod in firsts.values():
            core.patch_namespaced_pod(pod, "probe", {"spec": {"schedulingGates": lift}})
        bound = {name: binds for name, (binds, _) in _decided(core, firsts).items()}
        for name in names:
            if bound[name]:  # the operator planned it there: it fitted
                asked[name] = _extended_job(rng)
                seconds[name] = _probe_extended(core, name, asked[name])["metadata"]["name"]
        return _compare(core, seconds, asked, inventory, usage)
    finally:
        for pod in [*firsts.values(), *seconds.values()]:
            _ignore_missing(core.delete_namespaced_pod, pod, "probe", grace_period_seconds=0)
        for job in jobs:
            _ignore_missing(
                cluster.custom.delete_namespaced_custom_object, GROUP, VERSION, "probe", PLURAL, job
            )
        for name in names:
            _ignore_missing(resource.delete_resource_slice, f"{name}-gpus")
            _ignore_missing(core.delete_node, name)


def test_gated_plain_gpu_gangs_hold_the_devices_a_class_serves_them_from(scheduled):
    """KEP-5004 with two gangs on one node: the first gang's pod, gated, has no claim yet (the
    scheduler makes and allocates it when it binds the pod); the operator must count its GPUs as
    held, or it would plan the second gang onto devices the first takes once released."""
    _served_rounds(scheduled, 20261202, ROUNDS, lambda r: _two_gangs_round(scheduled, r))
