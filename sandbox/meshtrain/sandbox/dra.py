"""The sandbox's simulated GPU DRA driver: its binary, per-node config, command line and DeviceClass.

The driver (Go, sandbox/dra-driver, built by scripts/bootstrap.sh) runs as a kubelet plugin on
every node: it registers in the kubelet's ``<root-dir>/plugins_registry``, publishes the node's
:data:`GPUS_PER_NODE` simulated GPUs in a ResourceSlice and, when the kubelet prepares a claim,
writes a CDI spec into the node's own CDI directory (its containerd's ``cdi_spec_dirs``) that
puts the allocated devices' names and uuids into the container's environment (:data:`ENV_GPUS`,
:data:`ENV_UUIDS`).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from typing import Any

from meshtrain.sandbox import nodes as nodes_mod
from meshtrain.sandbox.controlplane import binaries

DRIVER = "gpu.sim.meshtrain.io"
"""The driver's name, its attributes' domain, and the name of its DeviceClass."""
GPUS_PER_NODE = 8
"""Devices ``gpu-0`` .. ``gpu-7`` on every node, as on an HGX board."""
PRODUCT = "NVIDIA H200"
"""The devices' ``productName``."""
MEMORY = "141Gi"
"""The devices' ``memory`` capacity."""
CLUSTER_UUID = "5a1dbc3e-0000-4000-8000-6d6573687472"
"""The NVLink fabric's cluster uuid; a node's clique is ``<uuid>.<n>``, the nvidia.com/gpu.clique form."""
PCIE_ROOTS = ("pci0000:00", "pci0000:40", "pci0000:80", "pci0000:c0")
"""The four PCIe root complexes of a node; GPUs 2k and 2k+1 share the k-th."""
ENV_GPUS = "MESHTRAIN_SIM_GPUS"
"""Env the CDI spec sets: the allocated device names, comma-separated (``gpu-0,gpu-3``)."""
ENV_UUIDS = "MESHTRAIN_SIM_GPU_UUIDS"
"""Env the CDI spec sets: their uuids, in the same order."""
ENV_NODE = "MESHTRAIN_SIM_GPU_NODE"
"""Env the CDI spec sets: the node (the pool) the devices belong to."""
SOURCE = pathlib.Path(__file__).resolve().parents[2] / "dra-driver"
"""The driver's Go module."""
SOCKETS = ("plugins_registry/gpu-sim.sock", "plugins/gpu-sim/dra.sock")
"""The driver's registration and DRA sockets under the kubelet's root dir (sandbox/dra-driver/main.go)."""
MAX_SOCKET_PATH = 107
"""Bytes a unix socket's path may have (sun_path holds 108 with the NUL)."""


def long_socket_paths(kubelet_root: pathlib.Path) -> list[str]:
    """The driver's socket paths under ``kubelet_root`` that no process could bind or dial."""
    paths = [str(kubelet_root / name) for name in SOCKETS]
    return [p for p in paths if len(p.encode()) > MAX_SOCKET_PATH]


def staging_version() -> str:
    """The k8s.io staging version of the Kubernetes release (v1.36.3 -> v0.36.3)."""
    return "v0." + binaries.k8s_version().removeprefix("v1.")


def source_hash(source: pathlib.Path = SOURCE) -> str:
    """sha256 of go.mod, go.sum and the ``*.go`` files (byte-sorted): the bootstrap's ``dra_driver_source_hash``."""
    digest = hashlib.sha256()
    names = ["go.mod", "go.sum", *sorted(p.name for p in source.glob("*.go"))]
    for name in names:
        digest.update((source / name).read_bytes())
    return digest.hexdigest()


def locate() -> pathlib.Path:
    """The driver's binary, or :class:`binaries.BinariesMissingError` when missing or built from other sources."""
    root = binaries.cache_root() / f"dra-driver-{staging_version()}"
    binary = root / "bin" / "dra-driver"
    built_from = root / "source.sha256"
    fix = "run `make bootstrap` (scripts/bootstrap.sh builds it from sandbox/dra-driver; `--no-node` skips it)"
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise binaries.BinariesMissingError(f"the DRA driver is not at {binary}: {fix}")
    if not built_from.exists() or built_from.read_text().strip() != source_hash():
        raise binaries.BinariesMissingError(
            f"the DRA driver at {binary} was built from other sources than sandbox/dra-driver: {fix}"
        )
    return binary


def node_config(ordinal: int) -> dict[str, Any]:
    """The driver's config file of the ``ordinal``-th node: one NVLink clique per node (HGX), 4 PCIe roots, 2 NUMA nodes."""
    return {
        "productName": PRODUCT,
        "memory": MEMORY,
        "cliqueId": f"{CLUSTER_UUID}.{ordinal}",
        "gpus": [
            {"pcieRoot": PCIE_ROOTS[index // 2], "numaNode": index // (GPUS_PER_NODE // 2)}
            for index in range(GPUS_PER_NODE)
        ],
    }


def command(
    binary: pathlib.Path,
    *,
    node: nodes_mod.NodeSpec,
    kubeconfig: pathlib.Path,
    config: pathlib.Path,
    kubelet_root: pathlib.Path,
    cdi_dir: pathlib.Path,
) -> list[str]:
    """The driver's command line for one node (it runs on the host: the kubelet reaches it by socket path)."""
    return [
        str(binary),
        f"--node-name={node.name}",
        f"--kubeconfig={kubeconfig}",
        f"--config={config}",
        f"--kubelet-root-dir={kubelet_root}",
        f"--cdi-dir={cdi_dir}",
    ]


def device_class() -> dict[str, Any]:
    """The DeviceClass of the driver's GPUs, named after the driver."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DRIVER},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }


def slice_summary(slices: list[dict[str, Any]]) -> dict[str, list[str]]:
    """``node -> ["gpu-0 pci0000:00 numa0 clique ...", ...]`` of the driver's ResourceSlices, for ``status``."""
    summary: dict[str, list[str]] = {}
    for item in slices:
        spec = item.get("spec") or {}
        if spec.get("driver") != DRIVER:
            continue
        for device in spec.get("devices") or []:
            attributes = device.get("attributes") or {}
            value = {k: next(iter(v.values()), None) for k, v in attributes.items()}
            summary.setdefault(str(spec.get("nodeName")), []).append(
                f"{device.get('name')} {value.get('resource.kubernetes.io/pcieRoot')} "
                f"numa{value.get('numaNode')} clique {value.get('cliqueId')}"
            )
    return summary
