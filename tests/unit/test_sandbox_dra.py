"""The sandbox's DRA driver plumbing: the binary's source hash, the node configs, the DeviceClass, CDI in containerd."""

from __future__ import annotations

import pathlib
import re
import subprocess
import tomllib

from meshtrain.sandbox import dra, nodeconfig

BOOTSTRAP = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bootstrap.sh"


def test_source_hash_is_the_bootstraps() -> None:
    """The sandbox refuses a binary whose recorded hash differs: both sides must hash alike."""
    text = BOOTSTRAP.read_text()
    function = re.search(r"^dra_driver_source_hash\(\) \{.*?^\}", text, re.S | re.M)
    assert function, "scripts/bootstrap.sh lost dra_driver_source_hash"
    script = f"{function.group(0)}\ndra_driver_source_hash {dra.SOURCE}"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == dra.source_hash()


def test_node_config_has_eight_gpus_on_four_pcie_roots_and_two_numa_nodes() -> None:
    config = dra.node_config(1)
    gpus = config["gpus"]
    assert len(gpus) == dra.GPUS_PER_NODE == 8
    assert [g["pcieRoot"] for g in gpus].count(gpus[0]["pcieRoot"]) == 2
    assert len({g["pcieRoot"] for g in gpus}) == 4
    assert [g["numaNode"] for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert config["cliqueId"] != dra.node_config(0)["cliqueId"]
    # The nvidia.com/gpu.clique label's form: a label value.
    assert re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", config["cliqueId"])


def test_device_class_selects_the_drivers_devices() -> None:
    device_class = dra.device_class()
    assert device_class["metadata"]["name"] == dra.DRIVER == "gpu.sim.meshtrain.io"
    assert device_class["spec"]["selectors"] == [
        {"cel": {"expression": 'device.driver == "gpu.sim.meshtrain.io"'}}
    ]


def test_containerd_reads_cdi_specs_from_the_nodes_own_directory(tmp_path: pathlib.Path) -> None:
    directories = {
        name: tmp_path / name for name in ("root", "state", "cni_conf_dir", "cdi_spec_dir")
    }
    text = nodeconfig.containerd_config(
        **directories, socket=tmp_path / "c.sock", pause_image="localhost/pause:1"
    )
    runtime = tomllib.loads(text)["plugins"]["io.containerd.cri.v1.runtime"]
    assert runtime["cdi_spec_dirs"] == [str(directories["cdi_spec_dir"])]


def test_slice_summary_lists_the_drivers_devices_per_node() -> None:
    device = {
        "name": "gpu-3",
        "attributes": {
            "numaNode": {"int": 0},
            "cliqueId": {"string": "c.0"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:40"},
        },
    }
    slices = [
        {"spec": {"driver": dra.DRIVER, "nodeName": "n0", "devices": [device]}},
        {"spec": {"driver": "other.example.com", "nodeName": "n0", "devices": [device]}},
    ]
    assert dra.slice_summary(slices) == {"n0": ["gpu-3 pci0000:40 numa0 clique c.0"]}


def test_socket_paths_fit_a_pytest_state_dir_and_a_deeper_one_is_named() -> None:
    """A unix socket's path holds 107 bytes: the e2e tests' state dirs fit, a deeper one is refused."""
    pytest_root = pathlib.Path(
        "/tmp/pytest-of-root/pytest-10000/sandbox0/nodes/gpu-b0-l0-n0/kubelet"
    )
    assert dra.long_socket_paths(pytest_root) == []
    deeper = pytest_root.parent / ("x" * 40) / "kubelet"
    assert dra.long_socket_paths(deeper) == [str(deeper / name) for name in dra.SOCKETS]
