"""The shape of ``spec.podTemplateOverride.spec`` wherever the operator reads or merges it.

The partial PodSpec is kept as written and the API server judges the merged pod, but the
operator itself merges the override into its own pod (lists appended, mappings merged), reads
its required node terms, tolerations and resources (placement, Kueue), and runs its pods under
its own ServiceAccount.  So here, before any of that: no ``null`` and no wrong type where the
operator appends or merges, node selector requirements as the API server validates them,
quantities it can parse, and no host namespace, privileged container or hostPath volume.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from meshtrain.api.spec import kube_names
from meshtrain.api.spec import resources as api_resources

POD_LISTS = (
    "containers",
    "initContainers",
    "volumes",
    "tolerations",
    "hostAliases",
    "readinessGates",
    "resourceClaims",
    "topologySpreadConstraints",
)
"""Pod lists of mappings (appended, or merged by name)."""
POD_MAPPINGS = ("securityContext", "affinity", "resources", "overhead", "dnsConfig")
"""Pod mappings (merged, or read by placement and Kueue)."""
CONTAINER_LISTS = ("env", "envFrom", "volumeMounts", "volumeDevices", "ports", "resizePolicy")
"""Container lists of mappings (appended to the trainer's)."""
CONTAINER_STRINGS = ("command", "args")
"""Container lists of strings."""
CONTAINER_MAPPINGS = ("securityContext", "resources")
"""Container mappings (merged into the trainer's)."""
HOST_FIELDS = ("hostNetwork", "hostPID", "hostIPC")
"""Pod fields that share the node's namespaces: refused (the operator's ServiceAccount creates
the pods, so a TrainingJob must not get more than its author could)."""
DNS_POLICIES = ("ClusterFirst", "ClusterFirstWithHostNet")
"""DNS policies that resolve the gang's headless Service names (rank 0's address)."""
OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
_INTEGER = re.compile(r"[+-]?[0-9]{1,19}")


def problem(spec: Mapping[str, Any], path: str) -> str | None:
    """The first shape problem of the partial PodSpec ``spec`` at ``path``, or None."""
    return next(_problems(spec, path), None)


def _problems(spec: Mapping[str, Any], path: str) -> Iterator[str]:
    yield from _no_nulls(spec, path)
    yield from _typed(spec, path, POD_LISTS, POD_MAPPINGS, ())
    for key in HOST_FIELDS:
        if key in spec:
            yield f"{path}.{key} shares the node's namespaces with the pod: remove it"
    policy = spec.get("dnsPolicy")
    if policy is not None and policy not in DNS_POLICIES:
        yield (
            f"{path}.dnsPolicy must be one of {', '.join(DNS_POLICIES)} (the gang finds rank 0 "
            "by its cluster DNS name); use dnsConfig to add resolvers"
        )
    for i, volume in enumerate(spec.get("volumes") or []):
        if "hostPath" in volume:
            yield f"{path}.volumes[{i}].hostPath mounts the node's files: use a PVC, CSI or image volume"
    for key in ("containers", "initContainers"):
        for i, container in enumerate(spec.get(key) or []):
            yield from _container(container, f"{path}.{key}[{i}]")
    yield from _quantities(spec.get("resources") or {}, f"{path}.resources")
    yield from _amounts(spec.get("overhead") or {}, f"{path}.overhead")
    for i, toleration in enumerate(spec.get("tolerations") or []):
        yield from _toleration(toleration, f"{path}.tolerations[{i}]")
    yield from _affinity(spec.get("affinity") or {}, f"{path}.affinity")


def _no_nulls(mapping: Mapping[str, Any], path: str) -> Iterator[str]:
    for key, value in mapping.items():
        if value is None:
            yield f"{path}.{key} is null: remove the key (null would drop what the operator set)"


def _typed(
    mapping: Mapping[str, Any],
    path: str,
    lists: tuple[str, ...],
    mappings: tuple[str, ...],
    strings: tuple[str, ...],
) -> Iterator[str]:
    for key in lists:
        items = mapping.get(key, [])
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            yield f"{path}.{key} must be a list of mappings"
    for key in strings:
        items = mapping.get(key, [])
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            yield f"{path}.{key} must be a list of strings"
    for key in mappings:
        if not isinstance(mapping.get(key, {}), dict):
            yield f"{path}.{key} must be a mapping"


def _container(container: Mapping[str, Any], path: str) -> Iterator[str]:
    yield from _no_nulls(container, path)
    yield from _typed(container, path, CONTAINER_LISTS, CONTAINER_MAPPINGS, CONTAINER_STRINGS)
    security = container.get("securityContext")
    if isinstance(security, dict):
        if security.get("privileged") is True:
            yield f"{path}.securityContext.privileged gives the container the node: remove it"
        if security.get("allowPrivilegeEscalation") is True:
            yield f"{path}.securityContext.allowPrivilegeEscalation must stay false: remove it"
        capabilities = security.get("capabilities", {})
        if not isinstance(capabilities, dict) or not all(
            isinstance(c, list) and all(isinstance(n, str) for n in c)
            for c in capabilities.values()
        ):
            yield f"{path}.securityContext.capabilities must map add/drop to lists of names"
    resources = container.get("resources")
    if isinstance(resources, dict):
        yield from _quantities(resources, f"{path}.resources")


def _quantities(resources: Mapping[str, Any], path: str) -> Iterator[str]:
    for kind in ("requests", "limits"):
        if kind in resources:
            yield from _amounts(resources[kind], f"{path}.{kind}")


def _amounts(amounts: Any, path: str) -> Iterator[str]:
    if not isinstance(amounts, dict):
        yield f"{path} must be a mapping of resource names to quantities"
        return
    for name, value in amounts.items():
        text = value if isinstance(value, str) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            text = str(value)
        if text is None or not api_resources.is_quantity(text):
            yield f"{path}[{name!r}] must be a quantity, e.g. 500m, 2 or 16Gi"


def _toleration(toleration: Mapping[str, Any], path: str) -> Iterator[str]:
    for key in ("key", "operator", "value", "effect"):
        if not isinstance(toleration.get(key, ""), str):
            yield f"{path}.{key} must be a string"
    seconds = toleration.get("tolerationSeconds", 0)
    if not isinstance(seconds, int) or isinstance(seconds, bool):
        yield f"{path}.tolerationSeconds must be an integer"


def _affinity(affinity: Mapping[str, Any], path: str) -> Iterator[str]:
    nodes = affinity.get("nodeAffinity", {})
    if not isinstance(nodes, dict):
        yield f"{path}.nodeAffinity must be a mapping"
        return
    where = f"{path}.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    if "requiredDuringSchedulingIgnoredDuringExecution" not in nodes:
        return
    required = nodes["requiredDuringSchedulingIgnoredDuringExecution"]
    terms = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
    if not isinstance(terms, list) or not terms:
        yield f"{where}.nodeSelectorTerms must be a non-empty list (remove the required part instead)"
        return
    for i, term in enumerate(terms):
        yield from _term(term, f"{where}.nodeSelectorTerms[{i}]")


def _term(term: Any, path: str) -> Iterator[str]:
    """A NodeSelectorTerm as ``ValidateNodeSelectorTerm`` judges it."""
    if not isinstance(term, dict):
        yield f"{path} must be a mapping"
        return
    for key in ("matchExpressions", "matchFields"):
        requirements = term.get(key, [])
        if not isinstance(requirements, list):
            yield f"{path}.{key} must be a list"
            continue
        for j, requirement in enumerate(requirements):
            yield from _requirement(requirement, f"{path}.{key}[{j}]", key == "matchFields")
    if not (term.get("matchExpressions") or term.get("matchFields")):
        yield (
            f"{path} has no matchExpressions nor matchFields: it matches no node; remove it "
            "or give it a requirement"
        )


def _requirement(requirement: Any, path: str, field: bool) -> Iterator[str]:
    """A NodeSelectorRequirement as ``ValidateNodeSelectorRequirement`` (and, for a field,
    ``ValidateNodeFieldSelectorRequirement``) judges it."""
    if not isinstance(requirement, dict):
        yield f"{path} must be a mapping with key, operator and values"
        return
    key, operator = requirement.get("key"), requirement.get("operator")
    values = requirement.get("values", [])
    if not isinstance(key, str) or not (field or kube_names.is_qualified_name(key)):
        yield f"{path}.key must be a label key (a qualified name, e.g. example.com/gpu)"
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        yield f"{path}.values must be a list of strings"
        return
    if field:
        if key != "metadata.name" or operator not in ("In", "NotIn") or len(values) != 1:
            yield f"{path}: matchFields takes key metadata.name, operator In or NotIn, one value"
    elif operator not in OPERATORS:
        yield f"{path}.operator must be one of {', '.join(OPERATORS)}"
    elif operator in ("In", "NotIn") and not values:
        yield f"{path}.values must be non-empty for operator {operator}"
    elif operator in ("Exists", "DoesNotExist") and values:
        yield f"{path}.values must be empty for operator {operator}"
    elif operator in ("Gt", "Lt") and (len(values) != 1 or not _INTEGER.fullmatch(values[0])):
        yield f"{path}.values must be one integer for operator {operator}"
