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
    """A ResourceClaim as the cache keeps it: the devices its allocation holds (results with
    ``adminAccess`` hold none and are dropped, :func:`devices.allocated_devices`)."""
    results = [
        {"driver": driver, "pool": pool, "device": device}
        for driver, pool, device in devices.allocated_devices(obj)
    ]
    status = {"allocation": {"devices": {"results": results}}} if results else {}
    return {"metadata": _names(obj.get("metadata") or {}), "status": status}


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
