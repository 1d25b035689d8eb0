"""``meshtrain plan --from-cluster`` against a real kube-apiserver: nodes read with the client, then placed."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest
import yaml

from meshtrain.cli import cluster_nodes, main
from tests.builders import JobBuilder

pytestmark = pytest.mark.integration

BLOCK = "network.topology.nvidia.com/block"


@pytest.fixture
def gpu_nodes(kube_api: kubernetes.client.ApiClient) -> Iterator[list[str]]:
    """Three Node objects with 4 GPUs each: two in one block, one in another."""
    core = kubernetes.client.CoreV1Api(kube_api)
    suffix = f"s{uuid.uuid4().hex[:6]}"  # a letter first: 13e303 would read as a number (YAML 1.2, as kubectl reads it)
    names = [f"plan-{suffix}-{i}" for i in range(3)]
    for name, block in zip(names, ("b1", "b1", "b2")):
        labels = {BLOCK: f"{block}-{suffix}", "meshtrain.io/test": suffix}
        core.create_node(
            kubernetes.client.V1Node(
                metadata=kubernetes.client.V1ObjectMeta(name=name, labels=labels)
            )
        )
        core.patch_node_status(
            name,
            {
                "status": {
                    "capacity": {"nvidia.com/gpu": "4"},
                    "allocatable": {"nvidia.com/gpu": "4"},
                }
            },
        )
    yield names
    for name in names:
        core.delete_node(name)


def test_list_nodes_and_plan_from_cluster(
    gpu_nodes: list[str],
    control_plane,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(control_plane.kubeconfig_path))
    nodes = {n.name: n for n in cluster_nodes.list_nodes()}
    assert all(nodes[name].allocatable_gpus == 4 for name in gpu_nodes)
    assert nodes[gpu_nodes[2]].labels[BLOCK].startswith("b2-")

    suffix = nodes[gpu_nodes[0]].labels["meshtrain.io/test"]
    raw = (
        JobBuilder()
        .layout(2, 2, 2, gpus_per_node=4)
        .parallelism(microBatches=4)
        .resources(nodeSelector={"meshtrain.io/test": suffix})
        .raw()
    )
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "meshtrain.io/v1alpha1",
                "kind": "TrainingJob",
                "metadata": {"name": "p"},
                "spec": raw,
            }
        )
    )
    assert main.main(["plan", str(job), "--from-cluster", "--json"]) == 0
    placement = json.loads(capsys.readouterr().out)["placement"]
    assert placement["schedulable"]
    # Both pods land in the block with two nodes: no bytes cross the block level.
    assert sorted(placement["nodes"]) == sorted(gpu_nodes[:2])


def test_unreachable_cluster_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "x",
        "clusters": [{"name": "x", "cluster": {"server": "https://127.0.0.1:1"}}],
        "contexts": [{"name": "x", "context": {"cluster": "x", "user": "x"}}],
        "users": [{"name": "x", "user": {"token": "nope"}}],
    }
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(JobBuilder().raw()))
    assert main.main(["plan", str(job), "--from-cluster"]) == 2
    assert "cannot list nodes of the cluster" in capsys.readouterr().err
