"""Chaos with both kinds of GPU: device-plugin nodes and DRA nodes, plain and DRA jobs, random faults.

A private kube-apiserver + etcd + kube-scheduler + kube-controller-manager (its ResourceClaim
controller makes each pod's claim from the job's template and deallocates it when the pod is gone;
its garbage collectors delete a deleted node's slices and pods): no kubelet, no driver.  Half the
nodes advertise ``nvidia.com/gpu`` (a device plugin), half publish their GPUs in ResourceSlices; a
DeviceClass with ``extendedResourceName: nvidia.com/gpu`` (KEP-5004) lets plain jobs take DRA
nodes' devices too.  TrainingJobs of both kinds run while faults strike at random, from a seed:
the operator SIGKILLed, nodes cordoned, deleted and added, pools republished with a new
generation (in two slices, the second a moment late: an incomplete newest generation) or
unpublished and published again, claims and pods deleted.

What must hold comes from the API server: no device in two claims' allocations and no node's
``nvidia.com/gpu`` over-committed by bound pods (sampled all along); at the end every job placed
whole or waiting with a reason; and the operator's free GPUs per node, read by its own cache and
verdict, equal what the real kube-scheduler and its DRA allocator decide: per node, a probe pod
of that many GPUs binds and one of one more does not.  The seed is printed;
``MESHTRAIN_DRA_CHAOS_SEED=<seed>`` reruns it.
"""

from __future__ import annotations

import collections
import os
import pathlib
import random
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import (
    builders,
    capacity,
    device_claims,
    devices,
    feasibility,
    identity,
    naming,
)
from meshtrain.placement import values as placement_values
from meshtrain.sandbox import controlplane
from tests.builders import POOL_LABEL, JobBuilder
from tests.integration.operator import test_operator_chaos as operator_chaos
from tests.integration.operator.cluster import (
    SIM_DRIVER,
    Cluster,
    OperatorProcess,
    settle,
    wait_for,
)
from tests.integration.operator.test_devices_vs_scheduler import _operator_view
from tests.integration.operator.test_feasibility_vs_scheduler import (
    _ignore_missing,
    _scheduler_verdict,
)

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("MESHTRAIN_DRA_CHAOS_SEED", time.time_ns() % 100_000))
POOL = "drachaos"
GPUS = 8
"""GPUs of every node (advertised or published)."""
KINDS = ("plugin", "plugin", "plugin", "dra", "dra", "dra")
"""The nodes at the start: three of each kind."""
JOBS = 9
FAULTS = ["kill"] * 2 + ["cordon", "delete_node", "add_node", "delete_claim", "delete_pod"]
FAULTS += ["republish"] * 3 + ["unpublish", "delete_job", "delete_job", "kill"]
SETTLE_SECONDS = 90
"""How long the jobs get to settle after the last fault."""
SERVING = "plain.sim.meshtrain.io"
"""The KEP-5004 DeviceClass serving ``nvidia.com/gpu`` from the simulated driver's devices."""
RESOURCE = "nvidia.com/gpu"
CONTROLLERS = (
    "resourceclaim-controller,garbage-collector-controller,pod-garbage-collector-controller,"
    "serviceaccount-controller,namespace-controller"
)
"""kube-controller-manager's controllers here: no node lifecycle (no kubelet heartbeats)."""


@pytest.fixture(scope="module")
def plane(control_plane_binaries) -> Iterator[Cluster]:
    with controlplane.ControlPlane(
        binaries=control_plane_binaries,
        with_scheduler=True,
        with_controller_manager=True,
        extra_controller_manager_args=[f"--controllers={CONTROLLERS}"],
    ) as started:
        api = kubernetes.config.new_client_from_config(config_file=str(started.kubeconfig_path))
        try:
            found = Cluster(api, str(started.kubeconfig_path), str(control_plane_binaries.kubectl))
            found.install_crds()
            resource = kubernetes.client.ResourceV1Api(api)
            selectors = [{"cel": {"expression": f'device.driver == "{SIM_DRIVER}"'}}]
            resource.create_device_class(
                {"metadata": {"name": SIM_DRIVER}, "spec": {"selectors": selectors}}
            )
            serving = {"selectors": selectors, "extendedResourceName": RESOURCE}
            resource.create_device_class({"metadata": {"name": SERVING}, "spec": serving})
            yield found
        finally:
            api.close()


def _slices(node: Any, generation: int, parts: int) -> list[dict[str, Any]]:
    """The pool of ``node`` (a V1Node) at ``generation`` in ``parts`` slices, owned by the node
    (as the kubelet plugin library publishes them: its garbage collector follows the node)."""
    name = node.metadata.name
    owner = {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node.metadata.uid}
    attributes = {
        "productName": {"string": "NVIDIA H200"},
        "cliqueId": {"string": f"{name}.0"},
        devices.PCIE_ROOT: {"string": "pci0000:00"},
    }
    gpus = [
        {"name": f"gpu-{i}", "attributes": attributes, "capacity": {"memory": {"value": "141Gi"}}}
        for i in range(GPUS)
    ]
    share = GPUS // parts
    return [
        {
            "metadata": {
                "name": f"{name}-g{generation}-{part}",
                "labels": {POOL_LABEL: POOL},
                "ownerReferences": [owner],
            },
            "spec": {
                "driver": SIM_DRIVER,
                "nodeName": name,
                "pool": {"name": name, "generation": generation, "resourceSliceCount": parts},
                "devices": gpus[part * share : (part + 1) * share],
            },
        }
        for part in range(parts)
    ]


def _job(rng: random.Random, namespace: str, index: int) -> JobBuilder:
    """1-2 pods of 2, 4 or 8 GPUs, through DRA claims (half the jobs) or ``nvidia.com/gpu``."""
    per_node, pods = rng.choice((2, 4, 4, 8)), rng.choice((1, 1, 2))
    job = (
        JobBuilder(f"j{index:02d}", namespace, POOL)
        .layout(data=pods * per_node, gpus_per_node=per_node)
        .resources(cpu="100m")
        .run_policy(backoffLimit=20, startupTimeoutSeconds=600)
    )
    if rng.random() < 0.5:
        match = rng.choice((None, f"{SIM_DRIVER}/cliqueId", devices.PCIE_ROOT))
        job.dra(SIM_DRIVER, match_attribute=match)
    return job


class Chaos(operator_chaos.Chaos):
    """The faults of both kinds of GPU; ``kill``, ``cordon`` and ``run`` as the plain chaos test's."""

    def __init__(
        self,
        cluster: Cluster,
        rng: random.Random,
        operator: OperatorProcess,
        kubelet: operator_chaos.Kubelet,
        namespace: str,
    ) -> None:
        super().__init__(cluster, rng, operator, kubelet, namespace, [])
        self.core = cluster.core
        self.resource = kubernetes.client.ResourceV1Api(cluster.core.api_client)
        self.kinds: dict[str, str] = {}
        """Live node -> its kind."""
        self.generation: dict[str, int] = {}
        """DRA node -> its pool's generation."""
        self.jobs: list[JobBuilder] = []
        """Jobs not deleted."""

    def add(self, kind: str) -> str:
        node = self.cluster.add_node(POOL, gpus=GPUS if kind == "plugin" else 0)
        self.nodes.append(node)
        self.kinds[node] = kind
        if kind == "dra":
            self.publish(node, 1, 1)
        return node

    def publish(self, node: str, generation: int, parts: int) -> None:
        self.generation[node] = generation
        found = self.core.read_node(node)
        for part in _slices(found, generation, parts):
            self.resource.create_resource_slice(part)
            time.sleep(self.rng.uniform(0.0, 0.5))  # the pool is incomplete meanwhile

    def _unpublish(self, node: str, below: int) -> None:
        for found in self.resource.list_resource_slice(
            field_selector=f"spec.nodeName={node}"
        ).items:
            if found.spec.pool.generation < below:
                _ignore_missing(self.resource.delete_resource_slice, found.metadata.name)

    def _dra_node(self) -> str | None:
        live = sorted(n for n in self.nodes if self.kinds[n] == "dra")
        return self.rng.choice(live) if live else None

    def delete_node(self) -> bool:
        node = self.rng.choice(self.nodes)
        self.nodes.remove(node)
        kind = self.kinds[node]
        self.core.delete_node(node)
        self.kubelet.lose(node)
        self.faults.append(f"delete node {node} ({kind})")
        return True

    def add_node(self) -> bool:
        kind = self.rng.choice(("plugin", "dra"))
        self.faults.append(f"add node {self.add(kind)} ({kind})")
        return True

    def republish(self) -> bool:
        """The driver republishes its pool: a new generation in 1-2 slices, then the old goes."""
        node = self._dra_node()
        if node is None:
            return False
        generation, parts = self.generation[node] + 1, self.rng.choice((1, 2))
        self.publish(node, generation, parts)
        self._unpublish(node, generation)
        self.faults.append(f"republish {node} generation {generation} in {parts} slice(s)")
        return True

    def unpublish(self) -> bool:
        """The driver stops (its slices go) and starts again a moment later."""
        node = self._dra_node()
        if node is None:
            return False
        generation = self.generation[node] + 1
        self._unpublish(node, generation)
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.publish(node, generation, 1)
        self.faults.append(f"unpublish {node}, publish generation {generation}")
        return True

    def delete_claim(self) -> bool:
        claims = self.resource.list_resource_claim_for_all_namespaces().items
        held = sorted(
            (c.metadata.namespace, c.metadata.name) for c in claims if c.status.allocation
        )
        if not held:
            return False
        namespace, name = self.rng.choice(held)
        _ignore_missing(self.resource.delete_namespaced_resource_claim, name, namespace)
        self.faults.append(f"delete claim {namespace}/{name}")
        return True

    def delete_pod(self) -> bool:
        pods = self.core.list_pod_for_all_namespaces(label_selector=naming.LABEL_JOB).items
        bound = sorted((p.metadata.namespace, p.metadata.name) for p in pods if p.spec.node_name)
        if not bound:
            return False
        namespace, name = self.rng.choice(bound)
        _ignore_missing(self.core.delete_namespaced_pod, name, namespace)
        self.faults.append(f"delete pod {namespace}/{name}")
        return True

    def delete_job(self) -> bool:
        """A job goes (its pods and claims with it): capacity frees, waiting jobs place."""
        if not self.jobs:
            return False
        job = self.jobs.pop(self.rng.randrange(len(self.jobs)))
        body = job.manifest()["metadata"]
        self.cluster.delete_job(body["namespace"], body["name"])
        self.faults.append(f"delete job {body['name']}")
        return True


class Sampler(operator_chaos._Background):
    """Reads the API server twice a second: a device in two claims' allocations, or a node whose
    bound pods request more ``nvidia.com/gpu`` than it advertises, is a violation."""

    def __init__(self, cluster: Cluster) -> None:
        self.core = cluster.core
        self.resource = kubernetes.client.ResourceV1Api(cluster.core.api_client)
        self.violations: list[str] = []
        self.samples = 0
        super().__init__()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.check()

    def check(self) -> None:
        api = self.core.api_client
        claims = api.sanitize_for_serialization(
            self.resource.list_resource_claim_for_all_namespaces().items
        )
        holders: dict[devices.Key, list[str]] = collections.defaultdict(list)
        for claim in claims:
            for key in devices.allocated_devices(claim):
                holders[key].append(claim["metadata"]["name"])
        twice = {k: v for k, v in holders.items() if len(v) > 1}
        if twice:
            self.violations.append(f"devices allocated twice: {twice}")
        advertised = {
            n.metadata.name: int((n.status.allocatable or {}).get(RESOURCE, "0"))
            for n in self.core.list_node().items
        }
        taken: collections.Counter[str] = collections.Counter()
        for pod in api.sanitize_for_serialization(self.core.list_pod_for_all_namespaces().items):
            node = pod["spec"].get("nodeName")
            if node and (pod.get("status") or {}).get("phase") not in capacity.FINISHED_PHASES:
                taken[node] += feasibility.pod_requests(pod).get(RESOURCE, 0)
        for node, amount in taken.items():
            # a node advertising none serves the resource from slices (KEP-5004): claims count it
            if advertised.get(node, 0) > 0 and amount > advertised[node]:
                self.violations.append(f"{node}: {amount} {RESOURCE} bound, {advertised[node]}")
        self.samples += 1


def _unsettled(cluster: Cluster, jobs: list[JobBuilder]) -> list[str]:
    """Jobs neither placed whole (Running, every pod of the attempt bound) nor waiting with a
    reason; empty when all have settled."""
    waiting_reasons = (placement_values.INSUFFICIENT_GPUS, placement_values.TOPOLOGY_UNSATISFIABLE)
    unsettled = []
    for job in jobs:
        body = job.manifest()
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        status = cluster.status(namespace, name)
        placed = cluster.condition(namespace, name, "Placed")
        expected = len(status.get("placement") or [])
        attempt = str(status.get("restarts", 0))
        bound = [
            p
            for p in cluster.pods(namespace, name)
            if p.metadata.labels.get(naming.LABEL_ATTEMPT) == attempt
            and p.spec.node_name
            and not p.metadata.deletion_timestamp
        ]
        whole = status.get("phase") == "Running" and expected and len(bound) == expected
        waiting = (
            status.get("phase") in ("Pending", "Restarting")
            and placed.get("status") == "False"
            and placed.get("reason") in waiting_reasons
            and placed.get("message")
        )
        if not whole and not waiting:
            unsettled.append(
                f"{name}: {status.get('phase')} {placed.get('reason')} {len(bound)}/{expected}"
            )
    return unsettled


def _outcome(cluster: Cluster, job: JobBuilder) -> str:
    body = job.manifest()["metadata"]
    placed = cluster.condition(body["namespace"], body["name"], "Placed")
    phase = cluster.status(body["namespace"], body["name"]).get("phase")
    return f"{phase} {placed.get('reason')}: {placed.get('message', '')[:300]}"


def _quiet(cluster: Cluster, namespace: str) -> None:
    """The operator stopped: its gated pods go, and the claim controller settles (claims of gone
    pods deallocated and deleted) before the probes."""
    core = cluster.core
    for pod in core.list_namespaced_pod(namespace).items:
        if pod.spec.scheduling_gates:
            _ignore_missing(core.delete_namespaced_pod, pod.metadata.name, namespace)
    resource = kubernetes.client.ResourceV1Api(core.api_client)

    def settled() -> bool:
        pods = {p.metadata.uid for p in core.list_namespaced_pod(namespace).items}
        for claim in resource.list_namespaced_resource_claim(namespace).items:
            owners = {o.uid for o in claim.metadata.owner_references or []}
            if owners and not owners & pods:
                return False
        return True

    wait_for("claims of gone pods deleted", settled, timeout=60, interval=0.5)


def _probe_spec(kind: str, gpus: int) -> api_spec.TrainingJobSpec:
    job = JobBuilder().layout(data=gpus, gpus_per_node=gpus).resources(cpu="100m")
    if kind == "dra":
        job.dra(SIM_DRIVER)
    return loading.parse_spec(job.raw())


def _probe_pod(kind: str, node: str, gpus: int) -> tuple[dict[str, Any], api_spec.TrainingJobSpec]:
    """The operator's pod 0 of a one-pod job of ``gpus`` GPUs of ``kind``, planned onto ``node``."""
    spec = _probe_spec(kind, gpus)
    ref = identity.JobRef(name=f"q{uuid.uuid4().hex[:6]}", namespace="probe", uid="")
    pod = builders.build_pod(ref, spec, 0, 0, node)
    pod["metadata"].pop("ownerReferences")
    pod["spec"].pop("schedulingGates")
    return pod, spec


def _operator_free(cluster: Cluster, node: str, kind: str, view: Any) -> int:
    """The most GPUs of ``kind`` one pod may take on ``node`` by the operator's own verdict."""
    inventory, usage = view
    found = cluster.core.api_client.sanitize_for_serialization(cluster.core.read_node(node))
    for gpus in range(GPUS, 0, -1):
        pod, spec = _probe_pod(kind, node, gpus)
        ask = devices.ask_of(spec, inventory)
        used = usage.get(node, capacity.NOTHING)
        if capacity.verdict(feasibility.demand_of(pod), found, used, ask) is None:
            return gpus
    return 0


def _probe(cluster: Cluster, kind: str, node: str, gpus: int) -> str:
    """A probe pod of ``gpus`` GPUs of ``kind`` pinned to ``node``; a DRA one claims them through
    a claim of the job's template spec, made here: its name."""
    pod, spec = _probe_pod(kind, node, gpus)
    if kind == "dra":
        resource = kubernetes.client.ResourceV1Api(cluster.core.api_client)
        claim = f"{pod['metadata']['name']}-{naming.GPU_CLAIM}"
        body = {"metadata": {"name": claim}, "spec": device_claims.template_spec(spec)["spec"]}
        resource.create_namespaced_resource_claim("probe", body)
        pod["spec"]["resourceClaims"] = [{"name": naming.GPU_CLAIM, "resourceClaimName": claim}]
    cluster.core.create_namespaced_pod("probe", pod)
    return str(pod["metadata"]["name"])


def _differential(cluster: Cluster, rng: random.Random, kinds: dict[str, str]) -> list[str]:
    """Per node, the operator's free GPUs (of a kind the node serves: DRA nodes also plain GPUs
    through the KEP-5004 class) against kube-scheduler: one more does not bind, that many do."""
    view = _operator_view(cluster.kubeconfig)
    asked = {
        node: rng.choice(("dra", "plain")) if kind == "dra" else "plain"
        for node, kind in kinds.items()
    }
    free = {node: _operator_free(cluster, node, asked[node], view) for node in kinds}
    print(f"operator's free GPUs: { {n: (kinds[n], asked[n], f) for n, f in free.items()} }")
    wrong = []
    for more, expected in ((1, False), (0, True)):
        probes = {
            node: _probe(cluster, asked[node], node, free[node] + more)
            for node in kinds
            if free[node] + more > 0
        }
        for node, pod in probes.items():
            binds, message = wait_for(
                f"scheduler decision on {pod}", lambda p=pod: _scheduler_verdict(cluster.core, p)
            )
            if binds is not expected:
                wrong.append(f"{node} ({asked[node]}): {free[node] + more} GPUs {message}")
        for pod in probes.values():
            _ignore_missing(
                cluster.core.delete_namespaced_pod, pod, "probe", grace_period_seconds=0
            )
        wait_for(
            "probes gone",
            lambda: not cluster.core.list_namespaced_pod("probe").items,
            timeout=30,
        )
        resource = kubernetes.client.ResourceV1Api(cluster.core.api_client)
        resource.delete_collection_namespaced_resource_claim("probe")
    return wrong


def test_both_kinds_of_gpu_through_chaos_match_the_scheduler(plane):
    rng = random.Random(SEED)
    print(f"dra chaos seed {SEED} (MESHTRAIN_DRA_CHAOS_SEED={SEED} reruns it)")
    namespace = f"dchaos-{SEED}"
    for name in (namespace, "probe"):
        plane.core.create_namespace({"metadata": {"name": name}})
    wait_for(
        "default service account",
        lambda: plane.core.list_namespaced_service_account(namespace).items,
    )
    # not under pytest's basetemp, which a concurrent pytest run may prune
    log = pathlib.Path(tempfile.mkdtemp(prefix="meshtrain-drachaos-")) / "operator.log"
    print(f"operator log: {log}")
    operator = OperatorProcess(plane.kubeconfig, str(log))
    jobs = [_job(rng, namespace, i) for i in range(JOBS)]
    with operator_chaos.Kubelet(plane, namespace) as kubelet, Sampler(plane) as sampler:
        chaos = Chaos(plane, rng, operator, kubelet, namespace)
        for kind in KINDS:
            chaos.add(kind)
        operator.start()
        try:
            for job in jobs:
                plane.apply(job)
            chaos.jobs = list(jobs)
            plan = list(FAULTS)
            rng.shuffle(plan)
            chaos.run(plan)
            unsettled = settle(lambda: _unsettled(plane, chaos.jobs), SETTLE_SECONDS)
        finally:
            operator.stop()
        sampler.check()
    print(f"faults: {'; '.join(chaos.faults)}; {sampler.samples} samples")
    print(f"jobs: { {j.manifest()['metadata']['name']: _outcome(plane, j) for j in chaos.jobs} }")
    assert sampler.violations == [], f"seed {SEED}: {sampler.violations[:5]}"
    assert unsettled == [], f"seed {SEED}: {unsettled}"
    _quiet(plane, namespace)
    wrong = _differential(plane, rng, {n: chaos.kinds[n] for n in chaos.nodes})
    assert wrong == [], (
        f"seed {SEED}: the operator's free GPUs differ from the scheduler's: {wrong}"
    )
