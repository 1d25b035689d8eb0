"""``meshtrain plan --cluster FILE`` when FILE holds Kubernetes objects (``kubectl get -o yaml``).

A List (or one object) of Nodes, ResourceSlices and DeviceClasses, e.g. ``kubectl get
nodes,resourceslices,deviceclasses -o yaml``.  Nodes give labels and allocatable GPUs (the
converter the operator uses, :func:`meshtrain.placement.node_from_manifest`); ResourceSlices give
a node's devices, counted as the operator counts them (:mod:`meshtrain.operator.policy.devices`:
the job's DeviceClass and CEL selectors, ``matchAttribute``, the NVLink domain from ``cliqueId``).
A DeviceClass absent from the file is taken to select its namesake driver's devices
(``gpu.nvidia.com``, ``gpu.sim.meshtrain.io``).  Like ``--from-cluster``, nothing running is
subtracted.  Any other file is the planner's own format (:mod:`meshtrain.planner.cluster`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from meshtrain import placement
from meshtrain.api import limits
from meshtrain.api import spec as api_spec
from meshtrain.cli import extras
from meshtrain.placement import values
from meshtrain.planner import cluster

KINDS = ("Node", "ResourceSlice", "DeviceClass")
"""Kinds read; others (a ResourceClaim, a Pod) are ignored: the plan is for an empty cluster."""
MAX_FILE_BYTES = limits.MAX_CLUSTER_FILE_BYTES
"""Largest cluster file read."""


def _objects(data: Any, source: str) -> list[dict[str, Any]] | None:
    """The file's Kubernetes objects, or None when it is not a Kubernetes document."""
    if not isinstance(data, dict) or "apiVersion" not in data or "kind" not in data:
        return None
    items = data.get("items") if str(data.get("kind")).endswith("List") else [data]
    if not isinstance(items, list) or not items:
        raise cluster.ClusterError(f"{source}: a Kubernetes List without items")
    if len(items) > limits.MAX_CLUSTER_OBJECTS:
        raise cluster.ClusterError(
            f"{source}: {len(items)} objects; at most {limits.MAX_CLUSTER_OBJECTS} are read"
        )
    for index, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("metadata"), dict):
            raise cluster.ClusterError(f"{source}: items[{index}] is not a Kubernetes object")
    return [item for item in items if item.get("kind") in KINDS]


def load(path: str | Path, job: api_spec.TrainingJobSpec) -> list[placement.Node]:
    """The nodes of a cluster file for ``job`` (either format); :class:`cluster.ClusterError`
    names the file and what is wrong."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise cluster.ClusterError(f"{path}: {size} bytes; at most {MAX_FILE_BYTES} are read")
        text = path.read_text()
    except OSError as err:
        raise cluster.ClusterError(
            f"{path}: cannot read cluster file: {err.strerror or err}"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise cluster.ClusterError(f"{path}: not valid YAML: {err}") from None
    objects = _objects(data, str(path))
    if objects is None:
        return cluster.parse_text(text, str(path))
    return nodes_of(objects, job, str(path))


def nodes_of(
    objects: list[dict[str, Any]], job: api_spec.TrainingJobSpec, source: str
) -> list[placement.Node]:
    """Nodes as the planner sees them: a Node's allocatable GPUs, or its devices where slices
    publish some (the GPUs are counted once, as the operator counts them)."""
    gpu = job.resources.gpu_resource_name
    by_kind: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for obj in objects:
        by_kind[str(obj["kind"])].append(obj)
    nodes = {n.name: n for n in (placement.node_from_manifest(m, gpu) for m in by_kind["Node"])}
    if not by_kind["ResourceSlice"]:
        if not nodes:
            raise cluster.ClusterError(f"{source}: no Node and no ResourceSlice in the file")
        return list(nodes.values())
    extras.require("operator", "meshtrain plan --cluster with ResourceSlices")  # CEL, quantities
    from meshtrain.operator.policy import devices  # noqa: PLC0415 - the operator extra's CEL

    found = devices.inventory(by_kind["ResourceSlice"], [], by_kind["DeviceClass"])
    request = _request(devices, job, found)
    classes = {**found.classes, ANY_DEVICE: devices.DeviceClass(ANY_DEVICE, ())}
    if request.device_class not in classes:  # NVIDIA's and the simulated driver's own class
        selector = f'device.driver == "{request.device_class}"'
        classes[request.device_class] = devices.DeviceClass(request.device_class, (selector,))
    found = devices.Inventory(found.devices, found.allocated, classes)
    for name in sorted(found.devices):
        fitted = devices.fit(request, found, name)
        if fitted.unknown is not None:
            raise cluster.ClusterError(f"{source}: node {name}: {fitted.reason}")
        base = nodes.get(name) or placement.Node(name, 0, {values.HOSTNAME_LABEL: name})
        domain = devices.nvlink_domain(fitted)
        labels = {**base.labels, **({values.DEVICE_CLIQUE_LABEL: domain} if domain else {})}
        nodes[name] = placement.Node(name, fitted.slots * request.count, labels, base.unschedulable)
    if job.resources.dra is not None:  # a node without slices has no device for a DRA job
        for name, node in nodes.items():
            if name not in found.devices:
                nodes[name] = placement.Node(name, 0, node.labels, node.unschedulable)
    return list(nodes.values())


ANY_DEVICE = "\0any"
"""The class a job asking the extended resource counts a node's devices by, when no DeviceClass
in the file serves that resource (KEP-5004): every device the node's slices publish."""


def _request(devices: Any, job: api_spec.TrainingJobSpec, found: Any) -> Any:
    """The devices one pod of ``job`` takes (a ``devices.Request``)."""
    ask = devices.ask_of(job, found)
    if ask.request is not None:
        return ask.request
    served = devices.serving_class(found, job.resources.gpu_resource_name)
    name = served.name if served is not None else ANY_DEVICE
    return devices.Request(name, (), job.resources.gpus_per_node)
