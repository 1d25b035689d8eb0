"""The sandbox's simulated GPU nodes: topology and Node/Lease objects.

Pure builders.  :func:`topology` lays out a small fabric
(blocks > leaves > nodes, each node with a number of GPUs) and the ``build_*``
functions return the Node, its status and its heartbeat Lease as the kubelet
would write them, with the labels real GPU clusters carry:
``network.topology.nvidia.com/block`` and ``.../leaf`` (NVIDIA's topology
labels), ``nvidia.com/gpu.count`` and the ``nvidia.com/gpu`` capacity.

Not a kubelet.  No I/O: the node agent sends these objects.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

BLOCK_LABEL = "network.topology.nvidia.com/block"
"""Node label naming the fabric block (spine group) of a node."""
LEAF_LABEL = "network.topology.nvidia.com/leaf"
"""Node label naming the leaf switch of a node."""
GPU_RESOURCE = "nvidia.com/gpu"
"""Extended resource name of a GPU."""
SANDBOX_LABEL = "meshtrain.io/sandbox-node"
"""Marks nodes the sandbox's agent owns (value "true")."""
LEASE_NAMESPACE = "kube-node-lease"
"""Namespace of node heartbeat Leases."""
LEASE_SECONDS = 40
"""Lease duration the agent announces; it renews every 10 s."""


@dataclasses.dataclass(frozen=True)
class SimNode:
    """One simulated GPU node and its place in the fabric."""

    name: str
    """Node name, e.g. gpu-b0-l1-n0."""
    block: str
    """Value of the block label."""
    leaf: str
    """Value of the leaf label."""
    gpus: int
    """GPUs (capacity and allocatable of nvidia.com/gpu)."""


def topology(
    *, blocks: int = 2, leaves: int = 2, nodes_per_leaf: int = 2, gpus: int = 4
) -> list[SimNode]:
    """The sandbox fabric: ``blocks x leaves x nodes_per_leaf`` nodes of ``gpus`` GPUs.

    The default is 2 blocks x 2 leaves x 2 nodes x 4 GPUs = 8 nodes, 32 GPUs:
    enough for a job to span leaves and blocks, small enough for one machine.
    """
    return [
        SimNode(name=f"gpu-b{b}-l{lf}-n{n}", block=f"block-{b}", leaf=f"leaf-{b}-{lf}", gpus=gpus)
        for b in range(blocks)
        for lf in range(leaves)
        for n in range(nodes_per_leaf)
    ]


def now() -> str:
    """RFC 3339 UTC time with seconds, as Kubernetes writes it."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """RFC 3339 UTC time with microseconds (Lease renewTime is a MicroTime)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def build_node(node: SimNode) -> dict[str, Any]:
    """The Node object to create (metadata and spec; status is a separate write)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            "labels": {
                "kubernetes.io/hostname": node.name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": f"sandbox-{node.gpus}gpu",
                BLOCK_LABEL: node.block,
                LEAF_LABEL: node.leaf,
                "nvidia.com/gpu.count": str(node.gpus),
                "nvidia.com/gpu.product": "Sandbox-Simulated-GPU",
                SANDBOX_LABEL: "true",
            },
        },
        "spec": {},
    }


def build_node_status(node: SimNode, *, heartbeat: str, ready_since: str) -> dict[str, Any]:
    """The node's status: capacity with GPUs, Ready and the pressure conditions, addresses."""
    resources = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        GPU_RESOURCE: str(node.gpus),
    }

    def condition(kind: str, status: str, reason: str, message: str) -> dict[str, Any]:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": heartbeat,
            "lastTransitionTime": ready_since,
        }

    return {
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                condition(
                    "MemoryPressure", "False", "KubeletHasSufficientMemory", "simulated node"
                ),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "simulated node"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "simulated node"),
                condition(
                    "Ready",
                    "True",
                    "KubeletReady",
                    "meshtrain sandbox node agent: pods run as local processes",
                ),
            ],
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": node.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "machineID": node.name,
                "systemUUID": node.name,
                "bootID": "sandbox",
                "kernelVersion": "sandbox",
                "osImage": "meshtrain sandbox (local processes)",
                "containerRuntimeVersion": "sandbox://0",
                "kubeletVersion": "v0.0.0-sandbox",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }
    }


def build_lease(node_name: str, *, uid: str, renew_time: str) -> dict[str, Any]:
    """The node's heartbeat Lease in kube-node-lease, owned by the Node."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": node_name,
            "namespace": LEASE_NAMESPACE,
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": uid}
            ],
        },
        "spec": {
            "holderIdentity": node_name,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": renew_time,
        },
    }
