"""``meshtrain plan --cluster FILE`` on what ``kubectl get nodes,resourceslices -o yaml`` prints.

Nodes without the GPU extended resource publish their GPUs in ResourceSlices on a real
kube-apiserver; kubectl writes them to a file as it writes them for a user, and the planner
places a DRA job on the devices its selectors match, in one NVLink domain (``cliqueId``).
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest
import yaml

from meshtrain.cli import main
from meshtrain.operator.policy import devices
from tests.builders import JobBuilder

pytestmark = pytest.mark.integration

DRIVER = "gpu.sim.meshtrain.io"
H200 = f'device.attributes["{DRIVER}"].productName == "NVIDIA H200"'


def _job() -> JobBuilder:
    """Two pods of 4 GPUs (tensor 2, pipeline 2, data 2)."""
    return JobBuilder().layout(2, 2, 2, gpus_per_node=4).parallelism(microBatches=4)


def _write(tmp_path: Path, job: JobBuilder) -> Path:
    """The job's TrainingJob manifest as ``tmp_path/job.yaml``."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job.manifest()))
    return path


def _slice(node: str, product: str, clique: str, label: dict[str, str]) -> dict[str, object]:
    gpus = [
        {
            "name": f"gpu-{i}",
            "attributes": {
                "productName": {"string": product},
                "cliqueId": {"string": clique},
                "resource.kubernetes.io/pcieRoot": {"string": f"pci0000:{i // 2}"},
            },
            "capacity": {"memory": {"value": "141Gi"}},
        }
        for i in range(4)
    ]
    return {
        "metadata": {"name": f"{node}-gpus", "labels": label},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": gpus,
        },
    }


@pytest.fixture
def published(kube_api: kubernetes.client.ApiClient) -> Iterator[tuple[str, list[str]]]:
    """Four nodes of 4 GPUs in slices: H200s in clique a (two nodes) and b, A100s in clique a."""
    core = kubernetes.client.CoreV1Api(kube_api)
    resource = kubernetes.client.ResourceV1Api(kube_api)
    suffix = f"s{uuid.uuid4().hex[:6]}"
    label = {"meshtrain.io/test": suffix}
    names = [f"dra-{suffix}-{i}" for i in range(4)]
    shapes = [
        ("NVIDIA H200", "a"),
        ("NVIDIA A100", "a"),
        ("NVIDIA H200", "b"),
        ("NVIDIA H200", "a"),
    ]
    for name, (product, clique) in zip(names, shapes, strict=True):
        core.create_node(
            {"metadata": {"name": name, "labels": {**label, "kubernetes.io/hostname": name}}}
        )
        resource.create_resource_slice(_slice(name, product, f"{suffix}.{clique}", label))
    yield suffix, names
    for name in names:
        resource.delete_resource_slice(f"{name}-gpus")
        core.delete_node(name)


def test_plan_places_a_dra_job_on_the_devices_kubectl_lists(
    published,
    control_plane,
    control_plane_binaries,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    suffix, names = published
    listed = subprocess.run(
        [
            str(control_plane_binaries.kubectl),
            "--kubeconfig",
            str(control_plane.kubeconfig_path),
            "get",
            "nodes,resourceslices",
            "-l",
            f"meshtrain.io/test={suffix}",
            "-o",
            "yaml",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    (tmp_path / "cluster.yaml").write_text(listed)
    job = _write(tmp_path, _job().dra(DRIVER, H200, match_attribute=devices.PCIE_ROOT))
    # 4 GPUs per pod on one PCIe root: no node has 4 on one root (2 per root)
    assert main.main(["plan", str(job), "--cluster", str(tmp_path / "cluster.yaml"), "--json"]) == 4
    capsys.readouterr()
    _write(tmp_path, _job().dra(DRIVER, H200))
    assert main.main(["plan", str(job), "--cluster", str(tmp_path / "cluster.yaml"), "--json"]) == 0
    placement = json.loads(capsys.readouterr().out)["placement"]
    # the H200 nodes of clique a: the A100 node matches no selector, the clique-b node is farther
    assert sorted(placement["nodes"]) == sorted([names[0], names[3]])


def test_plan_from_cluster_reads_the_slices_too(
    published, control_plane, tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    suffix, names = published
    monkeypatch.setenv("KUBECONFIG", str(control_plane.kubeconfig_path))
    job = _write(
        tmp_path, _job().resources(nodeSelector={"meshtrain.io/test": suffix}).dra(DRIVER, H200)
    )
    assert main.main(["plan", str(job), "--from-cluster", "--json"]) == 0
    placement = json.loads(capsys.readouterr().out)["placement"]
    assert sorted(placement["nodes"]) == sorted([names[0], names[3]])
