"""The informer's caches of ResourceSlices, ResourceClaims and DeviceClasses (``resource.k8s.io/v1``).

Each object is trimmed to what allocation reads (``devices``), bounded like every other read
(``limits``); the inventory is rebuilt only after a change.  A cluster that does not serve the
API (404) has no devices: its stores count as synced and stay empty.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshtrain.api import limits
from meshtrain.operator.cluster import kube
from meshtrain.operator.policy import devices

RESOURCES = ("resourceslices", "resourceclaims", "deviceclasses")
"""What the cache follows, as the client's ``list_devices`` names them."""


def _names(metadata: dict[str, Any]) -> dict[str, Any]:
    kept = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
    return {k: metadata[k] for k in kept if k in metadata}


def trim_slice(obj: kube.Body) -> kube.Body:
    """A ResourceSlice as the cache keeps it: node, driver, pool, and bounded devices."""
    spec = obj.get("spec") or {}
    kept_devices = []
    for raw in (spec.get("devices") or [])[: limits.MAX_DEVICES_PER_SLICE]:
        if not isinstance(raw, dict):
            continue
        device: dict[str, Any] = {"name": raw.get("name")}
        for part in ("attributes", "capacity"):
            if isinstance(raw.get(part), dict):
                device[part] = dict(list(raw[part].items())[: limits.MAX_DEVICE_FIELDS])
        if raw.get("consumesCounters"):  # partitionable: only whether it shares counters
            device["consumesCounters"] = [{}]
        if raw.get("allowMultipleAllocations") is True:
            device["allowMultipleAllocations"] = True
        if isinstance(raw.get("taints"), list):
            device["taints"] = [
                {"effect": t.get("effect")}
                for t in raw["taints"][: limits.MAX_DEVICE_FIELDS]
                if isinstance(t, dict)
            ]
        kept_devices.append(device)
    kept_spec = {k: spec[k] for k in ("driver", "pool", "nodeName") if k in spec}
    return {
        "metadata": _names(obj.get("metadata") or {}),
        "spec": {**kept_spec, "devices": kept_devices},
    }


def trim_claim(obj: kube.Body) -> kube.Body:
    """A ResourceClaim as the cache keeps it: whether it is allocated, on which node (``nodeName``,
    from the allocation's node selector, when it names one node), and the devices the allocation
    holds (results with ``adminAccess`` hold none and are dropped, :func:`devices.allocated_devices`)."""
    allocation = (obj.get("status") or {}).get("allocation")
    if not isinstance(allocation, dict):
        return {"metadata": _names(obj.get("metadata") or {}), "status": {}}
    results = [
        {"driver": driver, "pool": pool, "device": device}
        for driver, pool, device in devices.allocated_devices(obj)
    ]
    kept: dict[str, Any] = {"devices": {"results": results}}
    node = allocated_node(allocation)
    if node is not None:
        kept["nodeName"] = node
    return {"metadata": _names(obj.get("metadata") or {}), "status": {"allocation": kept}}


def allocated_node(allocation: dict[str, Any]) -> str | None:
    """The one node an allocation's ``nodeSelector`` names (``metadata.name In [node]``, as
    kube-scheduler writes it for node-local devices); None: none, or not one node."""
    terms = (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []
    if len(terms) != 1 or not isinstance(terms[0], dict):
        return None
    fields = terms[0].get("matchFields") or []
    for field in fields[: limits.MAX_DEVICE_FIELDS]:
        if not isinstance(field, dict):
            continue
        values = field.get("values")
        one = isinstance(values, list) and len(values) == 1
        if field.get("key") == "metadata.name" and field.get("operator") == "In" and one:
            return str(values[0])  # type: ignore[index]
    return None


def is_allocated(claim: kube.Body | None) -> bool:
    """Whether a cached claim (:func:`trim_claim`) is allocated."""
    return claim is not None and "allocation" in (claim.get("status") or {})


def changed_nodes(what: str, old: kube.Body | None, new: kube.Body | None) -> frozenset[str] | None:
    """The nodes where a change of a followed object (None: gone) may have freed or added devices:
    a slice's node (any change), a claim's allocated node when its devices were freed (a claim
    being allocated frees nothing: empty).  None: any node (a DeviceClass changed, or a freed
    claim's node is not known)."""
    if what == "deviceclasses":
        return None
    if what == "resourceslices":
        nodes = {((o or {}).get("spec") or {}).get("nodeName") for o in (old, new)}
        return frozenset(str(n) for n in nodes if n)
    held = set(devices.allocated_devices(old or {}))
    if not held or held <= set(devices.allocated_devices(new or {})):
        return frozenset()
    node = (((old or {}).get("status") or {}).get("allocation") or {}).get("nodeName")
    return frozenset([str(node)]) if node else None


def trim_class(obj: kube.Body) -> kube.Body:
    """A DeviceClass as the cache keeps it: its CEL selectors and extended resource."""
    found = devices.device_class(obj)
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": s}} for s in found.selectors]}
    if found.extended_resource_name:
        spec["extendedResourceName"] = found.extended_resource_name
    return {"metadata": _names(obj.get("metadata") or {}), "spec": spec}


TRIMS: dict[str, Callable[[kube.Body], kube.Body]] = {
    "resourceslices": trim_slice,
    "resourceclaims": trim_claim,
    "deviceclasses": trim_class,
}
"""The trim of each followed resource."""
