"""``spec.podTemplateOverride`` merged into a pod the builders made (pure).

The override's metadata adds labels and annotations; its partial PodSpec adds to the pod: lists
are appended (volumes, init containers, tolerations, ...), mappings merged (securityContext),
and the container named like the trainer merges into it (env, envFrom, volumeMounts, ports
appended; resources and securityContext merged, capabilities deep, resource claims appended) while other containers are
added, each over the restricted container defaults (no privilege escalation, every capability
dropped) that its own securityContext may add to.  A required
node affinity is ANDed with the operator's pin to the planned node (:mod:`node_affinity`).  What
the operator owns was refused before (``meshtrain.api.spec.pod_template``), so nothing here
replaces it; the API server validates the merged pod.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from meshtrain.api.spec import pod_template
from meshtrain.operator.policy import node_affinity

APPENDED_CONTAINER_LISTS = (
    "env",
    "envFrom",
    "volumeMounts",
    "volumeDevices",
    "ports",
    "resizePolicy",
)
"""Lists of the trainer container the override's entries are appended to."""
MERGED_MAPPINGS = ("securityContext",)
"""Mappings whose keys the override sets, keeping the others (pod and trainer container)."""
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
RESTRICTED_CONTAINER: Mapping[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
"""The restricted Pod Security Standard's container settings, under every added container's own
(the pod's securityContext already sets seccomp RuntimeDefault and a non-root user)."""


def merge(
    pod: dict[str, Any], override: pod_template.PodTemplateOverride, node: str
) -> dict[str, Any]:
    """``pod`` with ``override`` merged in (changed in place, and returned)."""
    metadata = pod["metadata"]
    metadata["labels"] = {**metadata.get("labels", {}), **override.metadata.labels}
    metadata["annotations"] = {**metadata.get("annotations", {}), **override.metadata.annotations}
    spec = pod["spec"]
    for key, value in copy.deepcopy(override.spec).items():
        if key in ("containers", "initContainers"):
            for container in value:
                if container["name"] != pod_template.TRAINER_CONTAINER:  # none is in init
                    security = container.get("securityContext") or {}
                    container["securityContext"] = _security(RESTRICTED_CONTAINER, security)
            if key == "containers":
                _containers(spec, value)
            else:
                _set(spec, key, value)
        elif key == "affinity":
            spec["affinity"] = _affinity(value, node)
        else:
            _set(spec, key, value)
    return pod


def _set(into: dict[str, Any], key: str, value: Any) -> None:
    """A list appended to, a merged mapping merged, anything else the operator left unset set.

    Raises TypeError where ``value`` would replace a list or mapping of the operator's (the
    validation refuses such an override first).
    """
    existing = into.get(key)
    if isinstance(existing, list):
        if not isinstance(value, list):
            raise TypeError(f"{key}: a list of the operator's cannot be replaced")
        into[key] = [*existing, *value]
    elif isinstance(existing, Mapping) and key in MERGED_MAPPINGS:
        if not isinstance(value, Mapping):
            raise TypeError(f"{key}: a mapping of the operator's cannot be replaced")
        into[key] = (
            _security(existing, value) if key == "securityContext" else {**existing, **value}
        )
    else:
        into[key] = value


def _security(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, Any]:
    """A securityContext merged key by key, its capabilities deep: the adds united, the drops
    (the operator's ``drop: [ALL]``) kept."""
    merged = {**ours, **theirs}
    if "capabilities" in ours or "capabilities" in theirs:
        mine, yours = ours.get("capabilities") or {}, theirs.get("capabilities") or {}
        capabilities = {**mine, **yours}
        for kind in ("add", "drop"):
            names = [*(mine.get(kind) or []), *(yours.get(kind) or [])]
            if names:
                capabilities[kind] = list(dict.fromkeys(names))
        merged["capabilities"] = capabilities
    return merged


def _containers(spec: dict[str, Any], containers: list[dict[str, Any]]) -> None:
    own = {c["name"]: c for c in spec["containers"]}
    for container in containers:
        target = own.get(container["name"])
        if target is None:
            spec["containers"].append(container)
            continue
        for key, value in container.items():
            if key == "resources":
                target["resources"] = _resources(target.get("resources") or {}, value)
            elif key in APPENDED_CONTAINER_LISTS or key in MERGED_MAPPINGS:
                _set(target, key, value)
            else:
                target[key] = value


def _resources(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, Any]:
    """Requests and limits merged amount by amount; ``claims`` appended to the operator's (a DRA
    job's ``gpus`` claim stays); other keys as the override says."""
    merged = {**ours, **theirs}
    for kind in ("requests", "limits"):
        if isinstance(theirs.get(kind), Mapping):
            merged[kind] = {**(ours.get(kind) or {}), **theirs[kind]}
    if isinstance(theirs.get("claims"), list) and ours.get("claims"):
        merged["claims"] = [*ours["claims"], *theirs["claims"]]
    return merged


def _affinity(value: Mapping[str, Any], node: str) -> dict[str, Any]:
    """The override's affinity with its required node terms ANDed with the pin to ``node``."""
    affinity = dict(value)
    nodes = dict(affinity.get("nodeAffinity") or {})
    terms = (nodes.get(REQUIRED) or {}).get("nodeSelectorTerms") or []
    nodes[REQUIRED] = {"nodeSelectorTerms": node_affinity.pinned(terms, node)}
    affinity["nodeAffinity"] = nodes
    return affinity
