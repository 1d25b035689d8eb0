"""``meshtrain plan --cluster`` on Kubernetes objects: the file's errors, and plain GPU requests
served from slices (the real-apiserver case is tests/integration/test_planner_from_slices.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from meshtrain.api import loading
from meshtrain.cli import cluster_objects
from meshtrain.planner import cluster
from tests.builders import JobBuilder

DRIVER = "gpu.sim.meshtrain.io"


def _slice(node: str, gpus: int) -> dict[str, object]:
    devices = [
        {"name": f"gpu-{i}", "attributes": {"cliqueId": {"string": "c"}}} for i in range(gpus)
    ]
    spec = {"driver": DRIVER, "nodeName": node, "pool": {"name": node, "resourceSliceCount": 1}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": node},
        "spec": {**spec, "devices": devices},
    }


def _node(name: str, gpus: int) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}},
    }


def _load(tmp_path: Path, document: object, job: dict | None = None) -> dict[str, int]:
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(document))
    spec = loading.parse_spec(job or JobBuilder().layout(data=8, gpus_per_node=4).raw())
    return {n.name: n.allocatable_gpus for n in cluster_objects.load(tmp_path / "c.yaml", spec)}


def test_a_list_of_nodes_and_slices_counts_each_gpu_once(tmp_path: Path) -> None:
    items = [_node("plugin", 8), _node("both", 8), _slice("both", 8), _slice("slices-only", 4)]
    found = _load(tmp_path, {"apiVersion": "v1", "kind": "List", "items": items})
    assert found == {"plugin": 8, "both": 8, "slices-only": 4}
    dra = JobBuilder().layout(data=8, gpus_per_node=4).dra(DRIVER).raw()
    assert _load(tmp_path, {"apiVersion": "v1", "kind": "List", "items": items}, dra) == {
        "plugin": 0,
        "both": 8,
        "slices-only": 4,
    }


def test_the_planners_own_format_still_reads(tmp_path: Path) -> None:
    assert _load(tmp_path, [{"name": "a", "gpus": 8}]) == {"a": 8}


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"apiVersion": "v1", "kind": "List", "items": []}, "a Kubernetes List without items"),
        (
            {"apiVersion": "v1", "kind": "List", "items": ["x"]},
            "items\\[0\\] is not a Kubernetes object",
        ),
        ({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {}}, "no Node and no ResourceSlice"),
    ],
)
def test_a_bad_object_file_is_one_clear_error(
    tmp_path: Path, document: object, message: str
) -> None:
    with pytest.raises(cluster.ClusterError, match=message):
        _load(tmp_path, document)
