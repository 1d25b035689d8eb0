"""A TrainingJob in a Kueue queue whose ResourceFlavor has a TAS Topology: Kueue's
topologyAssignment bounds meshtrain's placement, on a real Kueue v0.17.0 and API server.

Eight nodes of 8 GPUs in two blocks of two leaves (NVIDIA's network.topology labels, which
both meshtrain and Kueue's Topology read), the lowest Topology level the hostname.  The job's
Workload asks Kueue for topology (its required leaf), Kueue admits it with a topologyAssignment,
and the gang's planned nodes (status.placement, and each pod's node affinity) lie in Kueue's
domains with Kueue's counts, read from the Workload's status.  A job requiring a level the
Topology does not have gets no Workload (Kueue could not keep it) and waits, saying why.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from meshtrain.operator.policy import conditions, kueue_topology, kueue_workload
from meshtrain.sandbox import controlplane
from meshtrain.sandbox.controlplane import kueue
from tests.builders import POOL_LABEL, JobBuilder
from tests.integration.operator.cluster import Cluster, OperatorProcess, wait_for

pytestmark = pytest.mark.integration

NS, QUEUE, POOL = "tas-team", "tas-queue", "tas"
BLOCK, LEAF = "network.topology.nvidia.com/block", "network.topology.nvidia.com/leaf"
HOST = "kubernetes.io/hostname"
ZONE = "example.com/power-zone"
"""A label meshtrain may require that Kueue's Topology does not know (the conflict case)."""


@pytest.fixture(scope="module")
def tas(control_plane_binaries, tmp_path_factory) -> Iterator[tuple[Cluster, OperatorProcess]]:
    work = tmp_path_factory.mktemp("kueue-tas")
    with contextlib.ExitStack() as stack:
        plane = stack.enter_context(controlplane.ControlPlane(binaries=control_plane_binaries))
        api = kubernetes.config.new_client_from_config(config_file=str(plane.kubeconfig_path))
        stack.callback(api.close)
        cluster = Cluster(api, str(plane.kubeconfig_path), str(control_plane_binaries.kubectl))
        cluster.install_crds()
        cluster.core.create_namespace({"metadata": {"name": NS}})
        stack.enter_context(kueue.Kueue(plane, work, [kueue_workload.EXTERNAL_FRAMEWORK]))
        levels = [{"nodeLabel": label} for label in (BLOCK, LEAF, HOST)]
        gpu_quota = [{"name": "nvidia.com/gpu", "nominalQuota": 64}]
        for body in (
            {"kind": "Topology", "metadata": {"name": "fabric"}, "spec": {"levels": levels}},
            {
                "kind": "ResourceFlavor",
                "metadata": {"name": "tas-gpus"},
                "spec": {"nodeLabels": {POOL_LABEL: POOL}, "topologyName": "fabric"},
            },
            {
                "kind": "ClusterQueue",
                "metadata": {"name": "tas-cq"},
                "spec": {
                    "namespaceSelector": {},
                    "resourceGroups": [
                        {
                            "coveredResources": ["nvidia.com/gpu"],
                            "flavors": [{"name": "tas-gpus", "resources": gpu_quota}],
                        }
                    ],
                },
            },
            {"kind": "LocalQueue", "metadata": {"name": QUEUE}, "spec": {"clusterQueue": "tas-cq"}},
        ):
            cluster.create_kueue_object(body, NS)
        for block in range(2):
            for leaf in range(2):
                for node in range(2):
                    labels = {
                        BLOCK: f"b{block}",
                        LEAF: f"b{block}-l{leaf}",
                        ZONE: f"z{node}",  # each leaf's two nodes sit in two power zones
                    }
                    cluster.add_node(POOL, gpus=8, labels=labels, name=f"b{block}-l{leaf}-n{node}")
        process = OperatorProcess(str(plane.kubeconfig_path), str(work / "operator.log"))
        process.start()
        stack.callback(process.stop)
        yield cluster, process


def _job(name: str, levels: list[dict[str, str]]) -> dict[str, Any]:
    # dp8 x pp2 on 4-GPU pods: 4 pods, two per node: a whole leaf.
    body = JobBuilder(name, NS, pool=POOL).layout(data=8, pipeline=2, gpus_per_node=4)
    body = body.topology(levels=levels).manifest()
    body["metadata"]["labels"] = {kueue_workload.QUEUE_LABEL: QUEUE}
    return body


def _apply(cluster: Cluster, body: dict[str, Any]) -> None:
    cluster.custom.create_namespaced_custom_object(
        "meshtrain.io", "v1alpha1", NS, "trainingjobs", body
    )


def _topology_request(cluster: Cluster, job: str) -> Any:
    """What the job's Workload asks Kueue for (its one pod set's topologyRequest)."""
    workload = wait_for(f"{job}'s Workload", lambda: cluster.workload(NS, job), timeout=60)
    [pod_set] = workload["spec"]["podSets"]
    return pod_set.get("topologyRequest")


def _admitted_assignment(cluster: Cluster, job: str) -> kueue_topology.Assignment:
    def read() -> Any:
        workload = cluster.workload(NS, job) or {}
        for pod_set in ((workload.get("status") or {}).get("admission") or {}).get(
            "podSetAssignments"
        ) or []:
            if pod_set.get("topologyAssignment"):
                return pod_set["topologyAssignment"]
        return None

    raw = wait_for(f"{job} admitted by Kueue with a topologyAssignment", read, timeout=90)
    found = kueue_topology.read(raw)
    assert found is not None
    return found


def _node_labels(cluster: Cluster) -> dict[str, dict[str, str]]:
    return {
        n.metadata.name: dict(n.metadata.labels or {})
        for n in cluster.core.list_node(label_selector=f"{POOL_LABEL}={POOL}").items
    }


def _per_domain(
    nodes: list[str], labels: dict[str, dict[str, str]], assignment: kueue_topology.Assignment
) -> Counter[tuple[str, ...]]:
    return Counter(tuple(labels[n][level] for level in assignment.levels) for n in nodes)


def _placed(cluster: Cluster, job: str) -> list[dict[str, Any]]:
    """The job's ``status.placement`` once it names its 4 pods."""

    def read() -> Any:
        placement = cluster.status(NS, job).get("placement") or []
        return len(placement) == 4 and placement

    return list(wait_for(f"{job} placed", read, timeout=60))


def _affinity_node(pod: Any) -> str:
    terms = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    values = [
        value
        for term in terms.node_selector_terms
        for requirement in term.match_fields or []
        if requirement.key == "metadata.name"
        for value in requirement.values
    ]
    assert len(set(values)) == 1, values  # one pin, repeated in every term
    return str(values[0])


def _blocker(cluster: Cluster) -> kueue_topology.Assignment:
    """A Workload with no pods that Kueue admits into a leaf: Kueue counts that leaf as used,
    the nodes show it free, so Kueue's choice for the next job differs from a blind plan's."""
    container = {"name": "c", "image": "none", "resources": {"requests": {"nvidia.com/gpu": "4"}}}
    cluster.custom.create_namespaced_custom_object(
        kueue_workload.GROUP,
        kueue_workload.VERSION,
        NS,
        "workloads",
        {
            "apiVersion": kueue_workload.API_VERSION,
            "kind": "Workload",
            "metadata": {"name": "trainingjob-blocker"},
            "spec": {
                "queueName": QUEUE,
                "podSets": [
                    {
                        "name": "main",
                        "count": 4,
                        "template": {"spec": {"containers": [container], "restartPolicy": "Never"}},
                        "topologyRequest": {"required": LEAF},
                    }
                ],
            },
        },
    )
    return _admitted_assignment(cluster, "blocker")


def test_the_gang_lies_in_kueue_s_assigned_domains_with_kueue_s_counts(tas) -> None:
    cluster, _ = tas
    labels = _node_labels(cluster)
    held = _blocker(cluster)
    held_leaves = {labels[d.values[-1]][LEAF] for d in held.domains}
    _apply(cluster, _job("fits", [{"label": BLOCK}, {"label": LEAF, "mode": "required"}]))
    assert _topology_request(cluster, "fits") == {"required": LEAF}
    assignment = _admitted_assignment(cluster, "fits")
    expected = Counter({d.values: d.count for d in assignment.domains})
    assert sum(expected.values()) == 4

    placed = _placed(cluster, "fits")
    planned = [entry["node"] for entry in placed]
    assert _per_domain(planned, labels, assignment) == expected
    wait_for("fits' pods", lambda: len(cluster.pods(NS, "fits")) == 4, timeout=60)
    pods = cluster.pods(NS, "fits")
    assert _per_domain([_affinity_node(p) for p in pods], labels, assignment) == expected
    # Kueue's required leaf, kept by both: every planned node in one leaf, not the held one.
    assert len({labels[n][LEAF] for n in planned}) == 1
    assert not {labels[n][LEAF] for n in planned} & held_leaves
    for pod in pods:
        assert pod.metadata.annotations[kueue_topology.TAS_POD_ANNOTATION] == "true"
        workload = pod.metadata.annotations[kueue_topology.WORKLOAD_ANNOTATION]
        assert workload == kueue_workload.workload_name("fits")


def test_a_required_level_kueue_s_topology_lacks_is_never_queued(tas) -> None:
    # meshtrain requires one power zone, which Kueue's Topology does not know: Kueue could only
    # be asked to prefer the leaf, admit the gang across two zones and hold the quota while the
    # gang can never be placed there, so no Workload is created and the job waits, saying why.
    cluster, _ = tas
    _apply(cluster, _job("split", [{"label": LEAF}, {"label": ZONE, "mode": "required"}]))
    queued = cluster.wait_reason(
        NS, "split", conditions.QUEUED, kueue_workload.WORKLOAD_REJECTED, timeout=60
    )
    assert queued["status"] == "True", queued
    assert "spec.topology.levels[1].label" in queued["message"] and ZONE in queued["message"]
    assert cluster.workload(NS, "split") is None
    assert cluster.pods(NS, "split") == []


def test_kueue_accepts_the_per_stage_slice_request_and_the_gang_keeps_its_counts(tas) -> None:
    # Each pipeline stage (two 4-GPU pods) a PodSet slice required in one NVLink domain, here
    # the host (a level of the Topology, at the request's own level): Kueue v0.17.0 accepts
    # the request and admits the job with an assignment the gang then fills exactly.
    cluster, _ = tas
    body = JobBuilder("sliced", NS, pool=POOL).layout(data=8, pipeline=2, gpus_per_node=4)
    body = body.topology(nvlinkDomainLabel=HOST).manifest()
    body["metadata"]["labels"] = {kueue_workload.QUEUE_LABEL: QUEUE}
    _apply(cluster, body)
    assert _topology_request(cluster, "sliced") == {
        "preferred": HOST,
        "podSetSliceRequiredTopology": HOST,
        "podSetSliceSize": 2,
    }
    assignment = _admitted_assignment(cluster, "sliced")
    expected = Counter({d.values: d.count for d in assignment.domains})
    assert sum(expected.values()) == 4 and all(count % 2 == 0 for count in expected.values())
    placed = _placed(cluster, "sliced")
    labels = _node_labels(cluster)
    assert _per_domain([e["node"] for e in placed], labels, assignment) == expected


def test_kueue_accepts_a_stage_scoped_level_as_a_slice_and_keeps_each_stage_in_one_leaf(
    tas,
) -> None:
    # The job required in one block and each stage (two 4-GPU pods) in one leaf: the Workload
    # asks Kueue for the block, with a PodSet slice of 2 pods in the leaf below it; Kueue v0.17.0
    # accepts it (a slice level above the pod set's would never be admitted) and the gang fills
    # the assignment with each stage's nodes in one leaf, read from the Node objects.
    cluster, _ = tas
    levels = [
        {"label": BLOCK, "mode": "required"},
        {"label": LEAF, "mode": "required", "scope": "stage"},
    ]
    _apply(cluster, _job("staged", levels))
    assert _topology_request(cluster, "staged") == {
        "required": BLOCK,
        "podSetSliceRequiredTopology": LEAF,
        "podSetSliceSize": 2,
    }
    assignment = _admitted_assignment(cluster, "staged")
    expected = Counter({d.values: d.count for d in assignment.domains})
    placed = sorted(_placed(cluster, "staged"), key=lambda entry: entry["podIndex"])
    labels = _node_labels(cluster)
    nodes = [entry["node"] for entry in placed]
    assert _per_domain(nodes, labels, assignment) == expected
    assert len({labels[n][BLOCK] for n in nodes}) == 1
    for stage in range(2):
        assert len({labels[n][LEAF] for n in nodes[2 * stage : 2 * stage + 2]}) == 1, nodes
