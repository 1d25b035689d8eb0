"""The operator's feasibility verdict against the real kube-scheduler, node by node.

Random small clusters (taints, Ready states, cordons, labels, allocatable cpu,
memory, ephemeral storage, GPUs, RDMA devices and pod capacity) get random
foreign pods bound to their nodes (containers, init containers, sidecars,
finished pods).  For every node, a probe — the pod the operator would create
for a random TrainingJob, ungated, pinned to that node — is handed to
kube-scheduler.  The scheduler binding it or reporting it Unschedulable is the
truth; ``feasibility.verdict`` on the same objects read back from the API
server must agree for every node.  Hostile pods (annotations, affinities,
nominations, forged owner references, and gated pods a tenant makes for its own live job
on a node outside that job's status.placement) are judged the same way, with the usage the
operator's own cache reads from the API server.
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
from meshtrain.operator.cluster import informer, kube
from meshtrain.operator.policy import builders, capacity, feasibility, identity, naming
from meshtrain.sandbox import controlplane
from tests.builders import JobBuilder
from tests.integration.operator.cluster import GROUP, PLURAL, VERSION, Cluster, wait_for

pytestmark = pytest.mark.integration

ROUNDS = 12
NODE_TAINTS = (
    {"key": "dedicated", "value": "other", "effect": "NoSchedule"},
    {"key": "dedicated", "value": "train", "effect": "NoSchedule"},
    {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
    {"key": "maintenance", "value": "soon", "effect": "NoExecute"},
    {"key": "spot", "value": "yes", "effect": "PreferNoSchedule"},
)
JOB_TOLERATIONS = (
    {"key": "dedicated", "operator": "Equal", "value": "train", "effect": "NoSchedule"},
    {"key": "nvidia.com/gpu", "operator": "Exists"},
    {"key": "maintenance", "operator": "Exists", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
)
NOT_READY_TAINTS = {
    "False": {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"},
    "Unknown": {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
}
"""What the node lifecycle controller adds for a Ready condition that is not True."""


@pytest.fixture(scope="module")
def scheduled(control_plane_binaries) -> Iterator[kubernetes.client.CoreV1Api]:
    """An API server with kube-scheduler and no controller-manager (nobody rewrites node state)."""
    with controlplane.ControlPlane(binaries=control_plane_binaries, with_scheduler=True) as plane:
        api = kubernetes.config.new_client_from_config(config_file=str(plane.kubeconfig_path))
        core = kubernetes.client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": "probe"}})
        wait_for(
            "default service account not needed; namespace active",
            lambda: core.read_namespace("probe").status.phase == "Active",
        )
        yield core
        api.close()


def _random_node(rng: random.Random, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(Node object, status patch)."""
    ready = rng.choices(["True", "False", "Unknown"], weights=[12, 1, 1])[0]
    taints: list[dict[str, str]] = []
    for taint in NODE_TAINTS:  # unique by (key, effect), as the API requires
        if rng.random() < 0.12 and all(t["key"] != taint["key"] for t in taints):
            taints.append(dict(taint))
    if ready in NOT_READY_TAINTS:
        taints.append(dict(NOT_READY_TAINTS[ready]))
    node = {
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "pool": rng.choice(["a", "b"])},
        },
        "spec": {"unschedulable": rng.random() < 0.1, "taints": taints},
    }
    allocatable = {
        "cpu": rng.choice(["4", "8", "15500m"]),
        "memory": rng.choice(["16Gi", "64Gi", "100000Mi"]),
        "pods": rng.choice(["2", "4", "110"]),
        "nvidia.com/gpu": rng.choice(["0", "2", "4", "8"]),
    }
    if rng.random() < 0.7:
        allocatable["ephemeral-storage"] = rng.choice(["20Gi", "100Gi"])
    if rng.random() < 0.5:
        allocatable["rdma/ib"] = rng.choice(["1", "4"])
    status = {
        "capacity": dict(allocatable),
        "allocatable": allocatable,
        "conditions": [
            {
                "type": "Ready",
                "status": ready,
                "reason": "KubeletReady" if ready == "True" else "Simulated",
                "message": "simulated node",
                "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ],
    }
    return node, {"status": status}


def _requests(rng: random.Random) -> dict[str, str]:
    amounts: dict[str, str] = {}
    if rng.random() < 0.7:
        amounts["cpu"] = rng.choice(["250m", "1", "2500m", "4"])
    if rng.random() < 0.7:
        amounts["memory"] = rng.choice(["512Mi", "4Gi", "16Gi", "30Gi"])
    if rng.random() < 0.3:
        amounts["ephemeral-storage"] = rng.choice(["1Gi", "10Gi", "60Gi"])
    if rng.random() < 0.3:
        amounts["nvidia.com/gpu"] = rng.choice(["1", "2", "4"])
    if rng.random() < 0.15:
        amounts["rdma/ib"] = "1"
    return amounts


def _container(rng: random.Random, name: str) -> dict[str, Any]:
    requests = _requests(rng)
    extended = {k: v for k, v in requests.items() if "/" in k}
    resources: dict[str, Any] = {"requests": requests}
    if extended:
        resources["limits"] = extended  # extended resources need limit == request
    return {"name": name, "image": "pause", "resources": resources}


def _foreign_pod(rng: random.Random, node: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "nodeName": node,
        "containers": [_container(rng, f"c{i}") for i in range(rng.randint(1, 2))],
    }
    init = []
    for i in range(rng.choice([0, 0, 1, 2])):
        container = _container(rng, f"i{i}")
        if rng.random() < 0.5:
            container["restartPolicy"] = "Always"  # a sidecar
        init.append(container)
    if init:
        spec["initContainers"] = init
    return {"metadata": {"name": f"foreign-{uuid.uuid4().hex[:8]}"}, "spec": spec}


def _probe(rng: random.Random, node: str) -> dict[str, Any]:
    """The pod the operator would create for a random job, pinned to ``node``, without its gate."""
    gpus = rng.choice([1, 2, 4])
    job = JobBuilder().layout(data=gpus)
    if rng.random() < 0.6:
        job.resources(cpu=rng.choice(["1", "3", "8"]))
    if rng.random() < 0.6:
        job.resources(memory=rng.choice(["2Gi", "20Gi", "48Gi"]))
    if rng.random() < 0.3:
        job.resources(extraResources={"rdma/ib": "1"})
    if rng.random() < 0.5:
        job.resources(tolerations=[t for t in JOB_TOLERATIONS if rng.random() < 0.5])
    if rng.random() < 0.3:
        job.resources(nodeSelector={"pool": "a"})
    spec = loading.parse_spec(job.raw())
    ref = identity.JobRef(name=f"j{uuid.uuid4().hex[:6]}", namespace="probe", uid="")
    pod = builders.build_pod(ref, spec, 0, 0, node)
    pod["metadata"].pop("ownerReferences")
    pod["spec"].pop("schedulingGates")
    if rng.random() < 0.3:
        requests = pod["spec"]["containers"][0]["resources"]["requests"]
        requests["ephemeral-storage"] = rng.choice(["5Gi", "50Gi"])
    return pod


def _scheduler_verdict(core: kubernetes.client.CoreV1Api, name: str) -> tuple[bool, str] | None:
    return _scheduler_verdict_in(core, name, "probe")


def _scheduler_verdict_in(
    core: kubernetes.client.CoreV1Api, name: str, namespace: str
) -> tuple[bool, str] | None:
    """(bound, "") or (False, the scheduler's message) once kube-scheduler decided; else None."""
    pod = core.read_namespaced_pod(name, namespace)
    if pod.spec.node_name:
        return True, ""
    for condition in pod.status.conditions or []:
        if (
            condition.type == "PodScheduled"
            and condition.status == "False"
            and condition.reason == "Unschedulable"
        ):
            return False, condition.message or ""
    return None


def _ignore_missing(call: Any, *args: Any, **kwargs: Any) -> None:
    try:
        call(*args, **kwargs)
    except kubernetes.client.ApiException as err:
        if err.status != 404:
            raise


def _round(
    core: kubernetes.client.CoreV1Api,
    rng: random.Random,
    probe: Callable[[random.Random, str], dict[str, Any]] = _probe,
    labels: Callable[[random.Random], dict[str, str]] | None = None,
) -> list[dict[str, Any]]:
    """One random cluster; every node's verdicts (operator's and scheduler's) on ``probe``'s pods,
    the nodes labelled by ``labels`` too when given."""
    api = core.api_client
    names = [f"n{uuid.uuid4().hex[:6]}" for _ in range(rng.randint(3, 6))]
    foreign: list[str] = []
    probes: dict[str, str] = {}
    try:
        for name in names:
            node, status = _random_node(rng, name)
            if labels is not None:
                node["metadata"]["labels"].update(labels(rng))
            core.create_node(node)
            # the TaintNodesByCondition admission plugin taints every new node not-ready; the
            # node lifecycle controller would lift it once Ready is True (there is none here)
            core.patch_node(name, {"spec": {"taints": node["spec"]["taints"]}})
            core.patch_node_status(name, status)
        for name in names:
            for _ in range(rng.randint(0, 4)):
                pod = core.create_namespaced_pod("probe", _foreign_pod(rng, name))
                foreign.append(pod.metadata.name)
                if rng.random() < 0.25:
                    core.patch_namespaced_pod_status(
                        pod.metadata.name, "probe", {"status": {"phase": "Succeeded"}}
                    )
        time.sleep(1.0)  # the scheduler's cache follows the pod watch
        for name in names:
            made = probe(rng, name)
            core.create_namespaced_pod("probe", made)
            probes[name] = made["metadata"]["name"]
        results = []
        for name in names:
            truth = wait_for(
                f"scheduler decision on {probes[name]}",
                lambda n=name: _scheduler_verdict(core, probes[n]),
                timeout=30,
            )
            node_obj = api.sanitize_for_serialization(core.read_node(name))
            pods = [
                api.sanitize_for_serialization(p)
                for p in core.list_namespaced_pod(
                    "probe", field_selector=f"spec.nodeName={name}"
                ).items
                if p.metadata.name != probes[name]
            ]
            probe_obj = api.sanitize_for_serialization(
                core.read_namespaced_pod(probes[name], "probe")
            )
            reason = feasibility.verdict(
                feasibility.demand_of(probe_obj), node_obj, feasibility.usage(pods)
            )
            results.append(
                {
                    "node": name,
                    "scheduler_binds": truth[0],
                    "scheduler_message": truth[1],
                    "operator_reason": reason,
                }
            )
        return results
    finally:
        for pod in [*foreign, *probes.values()]:
            _ignore_missing(core.delete_namespaced_pod, pod, "probe", grace_period_seconds=0)
        for name in names:
            _ignore_missing(core.delete_node, name)


def test_operator_verdict_equals_the_scheduler_on_every_node_of_random_clusters(scheduled):
    rng = random.Random(20261123)
    results = [verdict for _ in range(ROUNDS) for verdict in _round(scheduled, rng)]
    disagreements = [r for r in results if r["scheduler_binds"] != (r["operator_reason"] is None)]
    assert not disagreements, disagreements
    reasons = collections.Counter(r["operator_reason"] for r in results)
    # the clusters must exercise both answers and several filters, or agreement proves little
    assert reasons[None] >= 5 and len(results) - reasons[None] >= 5, reasons
    assert len(reasons) >= 5, reasons


# The job's own required node affinity (issue #33 item 1): podTemplateOverride's terms, ANDed
# with the operator's pin to the planned node, judged as kube-scheduler judges them.

REQUIREMENTS = (
    {"key": "pool", "operator": "In", "values": ["a"]},
    {"key": "pool", "operator": "In", "values": ["a", "b"]},
    {"key": "pool", "operator": "NotIn", "values": ["b"]},
    {"key": "gen", "operator": "Gt", "values": ["2"]},
    {"key": "gen", "operator": "Lt", "values": ["3"]},
    {"key": "ssd", "operator": "Exists"},
    {"key": "ssd", "operator": "DoesNotExist"},
    {"key": "missing", "operator": "NotIn", "values": ["x"]},
)
"""Requirements on node labels (every operator of a NodeSelectorRequirement)."""


def _affinity_labels(rng: random.Random) -> dict[str, str]:
    """Labels the requirements read: a generation that is a number or not, or none; an SSD or not."""
    labels = {}
    gen = rng.choice(["1", "2", "3", "4", "07", "x", None])
    if gen is not None:
        labels["gen"] = gen
    if rng.random() < 0.5:
        labels["ssd"] = "true"
    return labels


def _term(rng: random.Random, node: str) -> dict[str, Any]:
    term: dict[str, Any] = {
        "matchExpressions": [dict(r) for r in rng.sample(REQUIREMENTS, rng.randint(1, 2))]
    }
    if rng.random() < 0.25:  # the job names nodes too: this one or not
        operator = rng.choice(["In", "NotIn"])
        value = rng.choice([node, "elsewhere"])  # the API allows one value on a field
        term["matchFields"] = [{"key": "metadata.name", "operator": operator, "values": [value]}]
    return term


def _affinity_probe(rng: random.Random, node: str) -> dict[str, Any]:
    """The pod the operator would create for a small job whose podTemplateOverride requires one of
    one to three random node selector terms (and prefers another), pinned to ``node``."""
    terms = [_term(rng, node) for _ in range(rng.randint(1, 3))]
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms},
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": _term(rng, node)}
            ],
        }
    }
    job = (
        JobBuilder()
        .layout(data=1)
        .resources(cpu="250m", tolerations=list(JOB_TOLERATIONS))
        .pod_template({"affinity": affinity})
    )
    spec = loading.parse_spec(job.raw())
    ref = identity.JobRef(name=f"j{uuid.uuid4().hex[:6]}", namespace="probe", uid="")
    pod = builders.build_pod(ref, spec, 0, 0, node)
    pod["metadata"].pop("ownerReferences")
    pod["spec"].pop("schedulingGates")
    return pod


def test_required_node_affinity_of_the_job_is_judged_as_the_scheduler_judges_it(scheduled):
    rng = random.Random(20261129)
    results = [
        verdict
        for _ in range(ROUNDS)
        for verdict in _round(scheduled, rng, _affinity_probe, _affinity_labels)
    ]
    disagreements = [r for r in results if r["scheduler_binds"] != (r["operator_reason"] is None)]
    assert not disagreements, disagreements
    reasons = collections.Counter(r["operator_reason"] for r in results)
    # both answers, and many refusals for the affinity alone, or agreement proves little
    assert reasons[None] >= 5 and reasons[feasibility.SELECTOR_MISMATCH] >= 5, reasons


# Hostile foreign pods (issue #32 item 3): what a pod says of itself reserves nothing.

NEVER = {"meshtrain.io/no-such-node": "x"}
"""A nodeSelector no node matches: the pod stays Pending for good."""


@pytest.fixture(scope="module")
def tenants(control_plane_binaries) -> Iterator[Cluster]:
    """A control plane with kube-scheduler and the TrainingJob CRD, and two tenants' namespaces."""
    with Cluster.private(control_plane_binaries) as found:
        for namespace in ("tenant-a", "tenant-b"):
            found.core.create_namespace({"metadata": {"name": namespace}})
        yield found


def _gpu_pod(name: str, gpus: int, **spec: Any) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": str(gpus)}
    return {
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "c", "image": "pause", "resources": {"limits": limits}}]}
        | spec,
    }


def _gang_pod(ref: identity.JobRef, node: str, index: int = 0) -> dict[str, Any]:
    """The gated 8-GPU pod ``index`` the operator builds for ``ref``, planned onto ``node``."""
    spec = loading.parse_spec(JobBuilder().layout(data=16, gpus_per_node=8).gpus(8).raw())
    return builders.build_pod(ref, spec, 0, index, node)


def _place(cluster: Cluster, namespace: str, name: str, node: str) -> None:
    """Record pod 0 of the job's gang attempt 0 on ``node``, through the status subresource as
    the operator does (tenants cannot write it)."""
    status = {"restarts": 0, "placement": [{"podIndex": 0, "node": node}]}
    cluster.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, {"status": status}
    )


def _hostile_pods(cluster: Cluster, nodes: dict[str, str]) -> dict[str, str]:
    """One hostile pod per case in tenant-a, each aimed at its own node; the case -> its pod's name."""
    uid = {}
    for namespace, name in (("tenant-a", "ours"), ("tenant-b", "theirs"), ("tenant-a", "gone")):
        uid[name] = cluster.apply(JobBuilder(name, namespace).layout(data=8).gpus(8))["metadata"][
            "uid"
        ]
    cluster.delete_job("tenant-a", "gone")  # no finalizer without an operator: gone at once
    _place(cluster, "tenant-a", "ours", nodes["own"])
    ours = identity.JobRef("ours", "tenant-a", uid["ours"])
    pin = _gang_pod(identity.JobRef("x", "tenant-a", ""), nodes["affinity"])["spec"]["affinity"]
    pods = {
        "annotation": _gpu_pod("annotated", 8, nodeSelector=NEVER),  # marked below
        "affinity": _gpu_pod("pinned", 16, affinity=pin),  # never fits its one node
        "nominated-elsewhere": _gpu_pod("elsewhere", 8, schedulerName="another-scheduler"),
        "nominated": _gpu_pod("nominee", 8, schedulingGates=[{"name": "example.com/hold"}]),
        "other-tenants-uid": _gang_pod(
            identity.JobRef("ours", "tenant-a", uid["theirs"]), nodes["other-tenants-uid"]
        ),
        "deleted-jobs-uid": _gang_pod(
            identity.JobRef("gone", "tenant-a", uid["gone"]), nodes["deleted-jobs-uid"]
        ),
        "own": _gang_pod(ours, nodes["own"]),
        # gated pods the tenant makes for its own live job: every label, the owner reference and
        # the gate as the operator writes them, pinned to a node the job's placement does not hold
        "own-jobs-unplaced-pod": _gang_pod(ours, nodes["own-jobs-unplaced-pod"], index=1),
        "own-jobs-second-pod": _gang_pod(ours, nodes["own-jobs-second-pod"]),
    }
    pods["annotation"]["metadata"]["annotations"] = {naming.ANNOTATION_NODE: nodes["annotation"]}
    for case in ("other-tenants-uid", "deleted-jobs-uid", "own-jobs-second-pod"):
        pods[case]["metadata"]["name"] = f"gang-{case}"
    for case, pod in pods.items():
        cluster.core.create_namespaced_pod("tenant-a", pod)
        if case.startswith("nominated"):
            cluster.core.patch_namespaced_pod_status(
                pod["metadata"]["name"], "tenant-a", {"status": {"nominatedNodeName": nodes[case]}}
            )
    return {case: pod["metadata"]["name"] for case, pod in pods.items()}


def _operator_usage(cluster: Cluster) -> dict[str, feasibility.Usage]:
    """What the operator's own cache (listing pods, nodes and TrainingJobs) says each node holds."""

    async def read() -> dict[str, feasibility.Usage]:
        client = await kube.Client.connect(kubeconfig=cluster.kubeconfig)
        cache = informer.Cache()
        follow = asyncio.create_task(cache.run(client))
        try:
            await asyncio.wait_for(cache.synced.wait(), 30)
            return dict(cache.usage())
        finally:
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)
            await client.close()

    return asyncio.run(read())


def test_hostile_foreign_pods_reserve_on_a_node_what_the_scheduler_counts_and_no_more(tenants):
    """On an empty 8-GPU node each, a hostile pod: a never-schedulable pod with the operator's
    planned-node annotation; a one-node matchFields affinity; a nomination another scheduler's
    pod carries, and one kube-scheduler honours (a gated pod nominated there); gang pods with
    forged owner references, naming a live job of the namespace but another tenant's job UID, or
    a deleted job's UID; gated gang pods the tenant makes for its own live job, pinned to a node
    its status.placement does not hold (a pod index not placed; a second pod for a placed index).
    A probe asking for all 8 GPUs, pinned to the node, gets kube-scheduler's verdict; the
    operator's cache must give the same.  The operator's own gated pod of a live job holds the
    node its status.placement names (the scheduler does not know the gang's plan)."""
    cases = (
        "annotation",
        "affinity",
        "nominated-elsewhere",
        "nominated",
        "other-tenants-uid",
        "deleted-jobs-uid",
        "own",
        "own-jobs-unplaced-pod",
        "own-jobs-second-pod",
    )
    nodes = {case: tenants.add_node("hostile", gpus=8, name=f"hostile-{case}") for case in cases}
    _hostile_pods(tenants, nodes)
    time.sleep(2.0)  # kube-scheduler tries the pods it may schedule (and keeps them Pending)
    usage = _operator_usage(tenants)
    api = tenants.core.api_client
    probes = {}
    for case, node in nodes.items():
        probe = _gang_pod(identity.JobRef(f"probe-{case}", "tenant-a", ""), node)
        probe["metadata"].pop("ownerReferences")
        probe["spec"].pop("schedulingGates")
        probes[case] = api.sanitize_for_serialization(
            tenants.core.create_namespaced_pod("tenant-a", probe)
        )
    verdicts = {}
    for case, node in nodes.items():
        name = probes[case]["metadata"]["name"]
        truth = wait_for(
            f"scheduler decision on {name}",
            lambda n=name: _scheduler_verdict_in(tenants.core, n, "tenant-a"),
            timeout=30,
        )
        node_obj = api.sanitize_for_serialization(tenants.core.read_node(node))
        reason = feasibility.verdict(
            feasibility.demand_of(probes[case]), node_obj, usage.get(node, capacity.NOTHING)
        )
        verdicts[case] = (truth[0], reason, truth[1])
    own = verdicts.pop("own")
    assert own[:2] == (True, "Insufficient nvidia.com/gpu"), own
    disagreements = {c: v for c, v in verdicts.items() if v[0] != (v[1] is None)}
    assert not disagreements, disagreements
    # both answers occur, or agreement proves little
    assert {v[0] for v in verdicts.values()} == {True, False}, verdicts
