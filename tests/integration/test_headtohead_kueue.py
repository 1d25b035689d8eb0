"""The head to head's Kueue side on a real API server, Job controller and Kueue v0.17.0.

A TrainingJob becomes an Indexed batch Job with TAS annotations (benchmarks/fleet/kueue_tas.py);
Kueue must accept its stage slices, admit it with a topologyAssignment and ungate its pods onto
nodes (no scheduler runs: the ungated pods' hostname selectors are Kueue's binding).  Eight nodes
of 8 GPUs in two blocks of two racks; one node of racks b0-r0 and b1-r0 each is taken by a bound
pod, so a 16-GPU stage fits racks b0-r1 and b1-r1 only, and no block holds a 32-GPU job whole.
The tests run in file order: the second finds the first's job holding two racks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from benchmarks.fleet import kueue_tas
from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.placement import fabric_cost, values
from meshtrain.planner import placement_request
from meshtrain.sandbox import controlplane
from meshtrain.sandbox.controlplane import kueue
from tests.builders import POOL_LABEL, JobBuilder
from tests.integration.operator.cluster import Cluster, wait_for

pytestmark = pytest.mark.integration

NS, QUEUE, POOL = "h2h", "h2h", "h2h"
BLOCK, RACK = "cloud.provider.com/topology-block", "cloud.provider.com/topology-rack"
SIZES = {BLOCK: 32, RACK: 16, kueue_tas.HOSTNAME: 8}
TAKEN = ("b0-r0-n0", "b1-r0-n0")


def _spec(data: int, pipeline: int) -> api_spec.TrainingJobSpec:
    builder = JobBuilder(pool=POOL).layout(data=data, pipeline=pipeline, tensor=8, gpus_per_node=8)
    builder = builder.model({"layers": 8, "hidden": 64, "heads": 8, "vocab": 256, "seqLen": 32})
    return loading.parse_spec(builder.topology(levels=[{"label": BLOCK}, {"label": RACK}]).raw())


@pytest.fixture(scope="module")
def cluster(control_plane_binaries, tmp_path_factory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("h2h-kueue")
    with contextlib.ExitStack() as stack:
        plane = stack.enter_context(
            controlplane.ControlPlane(binaries=control_plane_binaries, with_controller_manager=True)
        )
        api = kubernetes.config.new_client_from_config(config_file=str(plane.kubeconfig_path))
        stack.callback(api.close)
        found = Cluster(api, str(plane.kubeconfig_path), str(control_plane_binaries.kubectl))
        found.core.create_namespace({"metadata": {"name": NS}})
        stack.enter_context(kueue.Kueue(plane, work, [], frameworks=["batch/job"]))
        fabric = kueue_tas.fabric_for(_spec(2, 2), SIZES)
        for body in kueue_tas.queue_objects(fabric, QUEUE, NS, 64, node_labels={POOL_LABEL: POOL}):
            found.create_kueue_object(body, NS)
        for block in range(2):
            for rack in range(2):
                for node in range(2):
                    labels = {BLOCK: f"b{block}", RACK: f"b{block}-r{rack}"}
                    name = f"b{block}-r{rack}-n{node}"
                    found.add_node(POOL, gpus=8, labels=labels, name=name)
        gpus = {"nvidia.com/gpu": "8"}
        container = {"name": "c", "image": "none", "resources": {"requests": gpus, "limits": gpus}}
        for node in TAKEN:
            found.core.create_namespaced_pod(
                NS,
                {
                    "metadata": {"name": f"taken-{node}"},
                    "spec": {"nodeName": node, "containers": [container]},
                },
            )
        wait_for(
            "the default ServiceAccount",
            lambda: found.core.list_namespaced_service_account(NS).items,
            timeout=60,
        )
        yield found


def _workload(cluster: Cluster, job: str) -> dict[str, Any] | None:
    listed = cluster.custom.list_namespaced_custom_object(
        "kueue.x-k8s.io", "v1beta2", NS, "workloads"
    )
    for workload in listed["items"]:
        owners = workload["metadata"].get("ownerReferences") or []
        if any(owner["kind"] == "Job" and owner["name"] == job for owner in owners):
            return dict(workload)
    return None


def _binding(cluster: Cluster, job: str, count: int) -> list[str]:
    def read() -> list[str] | None:
        pods = cluster.core.list_namespaced_pod(NS, label_selector=f"job-name={job}").items
        gated = [pod for pod in pods if pod.spec.scheduling_gates]
        if gated:
            return None
        return kueue_tas.pod_nodes(
            [cluster.core.api_client.sanitize_for_serialization(p) for p in pods], count
        )

    return list(wait_for(f"{job}'s pods ungated onto nodes by Kueue", read, timeout=120))


def _run(cluster: Cluster, name: str, job: api_spec.TrainingJobSpec) -> list[str]:
    fabric = kueue_tas.fabric_for(job, SIZES)
    body = kueue_tas.batch_job(name, NS, QUEUE, job, fabric)
    kubernetes.client.BatchV1Api(cluster.core.api_client).create_namespaced_job(NS, body)
    return _binding(cluster, name, job.parallelism.layout.pods(8))


def _racks(cluster: Cluster, nodes: list[str]) -> list[str]:
    labels = {n.metadata.name: n.metadata.labels for n in cluster.core.list_node().items}
    return [labels[node][RACK] for node in nodes]


def test_each_stage_is_a_slice_kueue_keeps_in_one_rack(cluster: Cluster) -> None:
    job = _spec(2, 2)  # 4 pods; each stage 2 pods, 16 GPUs: a whole rack
    nodes = _run(cluster, "staged", job)
    workload = wait_for("staged's Workload", lambda: _workload(cluster, "staged"))
    [pod_set] = workload["spec"]["podSets"]
    assert pod_set["topologyRequest"]["podSetSliceRequiredTopology"] == RACK
    assert pod_set["topologyRequest"]["podSetSliceSize"] == 2
    racks = _racks(cluster, nodes)
    # the only racks with room for a whole stage; a job-wide preference alone can split a stage
    assert sorted(racks) == ["b0-r1", "b0-r1", "b1-r1", "b1-r1"], racks
    assert racks[0] == racks[1] and racks[2] == racks[3], racks  # Kueue kept each slice whole
    # the binding priced by the planner's model: each stage's gradient rings stay in its rack
    request = placement_request.request_from_spec(job)
    listed = cluster.core.list_node().items
    bound = fabric_cost.bound(
        request,
        [values.Node(n.metadata.name, 8, dict(n.metadata.labels)) for n in listed],
        nodes,
    )
    assert bound.nodes == tuple(nodes) and bound.level_bytes[RACK] + bound.level_bytes[BLOCK] > 0


def _pending_message(cluster: Cluster, job: str) -> str | None:
    workload = _workload(cluster, job) or {}
    for condition in (workload.get("status") or {}).get("conditions") or []:
        if condition["type"] == "QuotaReserved" and condition["status"] == "False":
            return str(condition.get("message") or "") or None
    return None


def test_a_one_stage_job_is_required_in_one_rack(cluster: Cluster) -> None:
    # 2 pods, 16 GPUs, required in one rack: 16 GPUs are free, 8 in each of two racks
    job = _spec(2, 1)
    fabric = kueue_tas.fabric_for(job, SIZES)
    batch = kubernetes.client.BatchV1Api(cluster.core.api_client)
    batch.create_namespaced_job(NS, kueue_tas.batch_job("flat", NS, QUEUE, job, fabric))
    message = wait_for("flat pending on topology", lambda: _pending_message(cluster, "flat"))
    assert "topology" in message.lower(), message
    workload = wait_for("flat's Workload", lambda: _workload(cluster, "flat"))
    [pod_set] = workload["spec"]["podSets"]
    assert pod_set["topologyRequest"]["required"] == RACK
    batch.delete_namespaced_job("staged", NS, propagation_policy="Background")
    nodes = _binding(cluster, "flat", 2)  # a rack freed: admitted there, whole
    assert len(set(_racks(cluster, nodes))) == 1
