"""The KWOK fleet of benchmarks/fleet on a real control plane: the real kube-scheduler binds pods
asking 8 ``nvidia.com/gpu`` to the fleet's nodes, and KWOK's Stages run them and end them when
their annotations say.

Needs the ``kwok`` binary the full bootstrap builds (``make bootstrap``); no sandbox node.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from benchmarks.fleet import kwok
from meshtrain.sandbox import controlplane

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SHAPE = kwok.Shape(nodes=4, nodes_per_rack=2, racks_per_block=1, nodes_per_clique=2)


@pytest.fixture(scope="module")
def fleet() -> Iterator[kubernetes.client.CoreV1Api]:
    kwok.binary()  # fails (never skips) naming `make bootstrap` when the full bootstrap has not run
    with (
        controlplane.ControlPlane(with_scheduler=True) as plane,
        kwok.Kwok(plane.kubeconfig_path),
    ):
        asyncio.run(kwok.create_nodes(plane.kubeconfig_path, SHAPE))
        api = kubernetes.config.new_client_from_config(config_file=str(plane.kubeconfig_path))
        yield kubernetes.client.CoreV1Api(api)


def _pod(name: str, annotations: dict[str, str], attempt: str = "0") -> dict[str, Any]:
    gpus = {kwok.GPU: str(kwok.GPUS_PER_NODE)}
    return {
        "metadata": {
            "name": name,
            "annotations": annotations,
            "labels": {kwok.ATTEMPT_LABEL: attempt},
        },
        "spec": {
            "containers": [{"name": "trainer", "image": "trainer", "resources": {"limits": gpus}}],
        },
    }


def _phases(
    core: kubernetes.client.CoreV1Api, names: list[str], until: dict[str, str]
) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        pods = {p.metadata.name: p for p in core.list_namespaced_pod("default").items}
        seen = {n: pods[n].status.phase for n in names if n in pods}
        if all(seen.get(n) == phase for n, phase in until.items()) or time.monotonic() > deadline:
            return pods
        time.sleep(0.5)


def test_nodes_carry_the_topology_labels_and_eight_gpus(fleet: kubernetes.client.CoreV1Api) -> None:
    nodes = {n.metadata.name: n for n in fleet.list_node().items}
    assert sorted(nodes) == [kwok.node_name(i) for i in range(SHAPE.nodes)]
    first, last = nodes[kwok.node_name(0)], nodes[kwok.node_name(3)]
    assert first.status.allocatable[kwok.GPU] == "8"
    assert first.metadata.labels[kwok.RACK_LABEL] != last.metadata.labels[kwok.RACK_LABEL]
    assert first.metadata.labels[kwok.BLOCK_LABEL] != last.metadata.labels[kwok.BLOCK_LABEL]
    assert first.metadata.labels[kwok.CLIQUE_LABEL].startswith(kwok.CLUSTER_UUID)


def test_scheduler_binds_and_stages_end_pods_as_annotated(
    fleet: kubernetes.client.CoreV1Api,
) -> None:
    plan = {
        "ok": (kwok.lifecycle_annotations(2.0, None), "0", "Succeeded"),
        "fails": (kwok.lifecycle_annotations(30.0, 1.0), "0", "Failed"),
        "restarted": (kwok.lifecycle_annotations(1.0, 1.0), "1", "Succeeded"),
        "long-0": (kwok.lifecycle_annotations(3600.0, None), "0", "Running"),
    }
    for name, (asked, attempt, _) in plan.items():
        fleet.create_namespaced_pod("default", _pod(name, asked, attempt))
    expected = {name: phase for name, (_, _, phase) in plan.items()}
    pods = _phases(fleet, list(plan), expected)
    assert {n: pods[n].status.phase for n in plan} == expected
    bound = [pods[n].spec.node_name for n in plan]
    assert sorted(bound) == [kwok.node_name(i) for i in range(SHAPE.nodes)]  # 8 GPUs: one a node
    assert pods["fails"].status.container_statuses[0].state.terminated.exit_code == 1


def test_a_pod_waits_for_gpus_and_takes_those_a_deletion_frees(
    fleet: kubernetes.client.CoreV1Api,
) -> None:
    """Ended pods hold no GPUs: three more long pods fill the fleet, the next one waits."""
    longs = [f"long-{i}" for i in range(1, 4)]
    for name in longs:
        fleet.create_namespaced_pod("default", _pod(name, kwok.lifecycle_annotations(3600.0, None)))
    _phases(fleet, longs, {n: "Running" for n in longs})
    fleet.create_namespaced_pod("default", _pod("no-room", kwok.lifecycle_annotations(1.0, None)))
    time.sleep(3.0)
    waiting = fleet.read_namespaced_pod("no-room", "default")
    assert waiting.status.phase == "Pending" and not waiting.spec.node_name
    fleet.delete_namespaced_pod("long-0", "default")  # no kubelet: KWOK's stage removes it
    pods = _phases(fleet, ["no-room"], {"no-room": "Succeeded"})
    assert "long-0" not in pods
    assert pods["no-room"].status.phase == "Succeeded"
