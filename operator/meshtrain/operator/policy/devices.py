"""Devices published through Dynamic Resource Allocation, as kube-scheduler's allocator counts them.

ResourceSlices (``resource.k8s.io/v1``) publish each node's devices; allocated ResourceClaims
hold some; DeviceClasses select them by CEL (:mod:`device_cel`).  A node's free devices for a
request are the published devices of complete pools (the newest generation of each pool, all of
its slices present) that the class's and the request's selectors match, minus allocated ones
and the operator's own gated pods' (``HELD``, and ``UNBOUND`` extended resources a KEP-5004
class serves).  A request of ``count`` devices whose
``matchAttribute`` is set takes them from devices that share that attribute's value.  A device's
NVLink domain is its ``cliqueId`` attribute (of its driver's domain), its PCIe locality
``resource.kubernetes.io/pcieRoot``.  Pure.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from meshtrain.api import limits
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import device_cel

GROUP = "resource.k8s.io"
"""The API group of ResourceSlices, ResourceClaims and DeviceClasses (served as ``v1``)."""
CLIQUE = "cliqueId"
"""A device's NVLink domain: this attribute of its driver's domain (NVIDIA's DRA driver's name)."""
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
"""The standard attribute naming a device's PCIe root complex."""
HELD = "\0devices"
"""Usage key: devices the operator's own gated pods hold on a node before their claims are allocated."""
UNBOUND = "\0unbound:"
"""Usage key prefix: an extended resource (``UNBOUND + name``) that pods not yet bound request on
their node (the operator's gated pods), which a KEP-5004 class may serve from the node's devices:
no claim holds those devices until kube-scheduler binds the pod and allocates its claim."""
CANNOT_ALLOCATE = "cannot allocate all claims"
"""Reason worded as kube-scheduler's DynamicResources filter words it."""

TAINT_EFFECTS = ("NoSchedule", "NoExecute")
"""Device taint effects that keep a device from claims that do not tolerate them."""

Key = tuple[str, str, str]
"""(driver, pool, device): a device's identity in allocation results."""


@dataclasses.dataclass(frozen=True)
class Device:
    """One published device."""

    driver: str
    """The DRA driver that publishes it (its attributes' default domain)."""
    pool: str
    """The pool of its ResourceSlice."""
    name: str
    """Its name, unique in the pool."""
    attributes: Mapping[str, Mapping[str, Mapping[str, Any]]]
    """Domain -> attribute name -> the slice's typed value (``{"string": ...}``, ``int``, ...)."""
    capacity: Mapping[str, Mapping[str, str]]
    """Domain -> capacity name -> quantity."""
    tainted: bool = False
    """A NoSchedule or NoExecute device taint (DRADeviceTaints): no claim of the operator's, which
    tolerates none, gets the device."""
    shared: bool = False
    """It consumes a pool's shared counters (partitionable devices) or allows several allocations
    (consumable capacity): accounting the operator does not model, so kube-scheduler judges it."""

    @property
    def key(self) -> Key:
        """Its identity in allocation results."""
        return self.driver, self.pool, self.name

    def attribute(self, qualified: str) -> Any:
        """The plain value of a fully qualified (``domain/name``) or driver-domain attribute; None if absent."""
        domain, _, name = qualified.rpartition("/")
        value = self.attributes.get(domain or self.driver, {}).get(name)
        if not isinstance(value, Mapping):
            return None
        for kind in ("string", "int", "bool", "version"):
            if kind in value:
                return value[kind]
        return None


@dataclasses.dataclass(frozen=True)
class DeviceClass:
    """A DeviceClass as allocation reads it."""

    name: str
    """metadata.name."""
    selectors: tuple[str, ...]
    """Its CEL selectors (ANDed, before the request's)."""
    extended_resource_name: str | None = None
    """spec.extendedResourceName (KEP-5004): an extended resource this class serves."""
    created: str = ""
    """metadata.creationTimestamp (RFC 3339): of two classes serving one resource the newer wins."""


@dataclasses.dataclass(frozen=True)
class Request:
    """What one pod's claim asks: ``count`` devices of a class (allocationMode ExactCount)."""

    device_class: str
    """deviceClassName."""
    selectors: tuple[str, ...]
    """The request's CEL selectors (ANDed)."""
    count: int
    """Devices per pod."""
    match_attribute: str | None = None
    """Fully qualified attribute all of the pod's devices share (a constraint's matchAttribute)."""


@dataclasses.dataclass(frozen=True)
class Inventory:
    """The cluster's devices: what is published where and what is taken."""

    devices: Mapping[str, tuple[Device, ...]]
    """Node name -> the devices of complete pools its node-local slices publish."""
    allocated: frozenset[Key]
    """Devices some ResourceClaim's allocation holds."""
    classes: Mapping[str, DeviceClass]
    """DeviceClasses by name."""


EMPTY = Inventory(devices={}, allocated=frozenset(), classes={})
"""A cluster without DRA (or where resource.k8s.io/v1 is not served)."""


@dataclasses.dataclass(frozen=True)
class Fit:
    """How many pods of a request a node's free devices take."""

    slots: int
    """Pods whose claims the node's free devices satisfy together."""
    free: int
    """Free devices that match the request (whatever ``matchAttribute`` says)."""
    unknown: str | None = None
    """Why the verdict cannot be known (a selector this library cannot evaluate); None: known."""
    domains: tuple[str, ...] = ()
    """The NVLink domains (``cliqueId``) of the matching devices, sorted."""
    missing_class: str | None = None
    """The request's DeviceClass when no such class exists."""
    deferred: bool = False
    """A selector this library cannot compile: the API server judges it when the claim template
    is created (refusing it by its spec field if it is invalid), kube-scheduler the devices."""

    @property
    def reason(self) -> str | None:
        """Why no pod fits (None: one does); unknown verdicts name their selector."""
        if self.unknown is not None:
            return f"device verdict unknown: {self.unknown}"
        if self.missing_class is not None:
            return f"device class {self.missing_class} not found"
        return CANNOT_ALLOCATE if self.slots == 0 else None


def _typed_map(source: Any, limit: int) -> dict[str, Any]:
    return dict(list(source.items())[:limit]) if isinstance(source, Mapping) else {}


def device_of(driver: str, pool: str, raw: Mapping[str, Any]) -> Device:
    """A slice's device entry (bounded to ``limits.MAX_DEVICE_FIELDS`` attributes and capacities)."""
    attributes: dict[str, dict[str, Mapping[str, Any]]] = defaultdict(dict)
    for qualified, value in _typed_map(raw.get("attributes"), limits.MAX_DEVICE_FIELDS).items():
        domain, _, name = str(qualified).rpartition("/")
        if isinstance(value, Mapping):
            attributes[domain or driver][name] = value
    capacity: dict[str, dict[str, str]] = defaultdict(dict)
    for qualified, value in _typed_map(raw.get("capacity"), limits.MAX_DEVICE_FIELDS).items():
        domain, _, name = str(qualified).rpartition("/")
        if isinstance(value, Mapping) and "value" in value:
            capacity[domain or driver][name] = str(value["value"])
    found = raw.get("taints")
    taints: list[Any] = found if isinstance(found, list) else []
    shared = bool(raw.get("consumesCounters")) or raw.get("allowMultipleAllocations") is True
    return Device(
        driver=driver,
        pool=pool,
        name=str(raw.get("name") or ""),
        attributes=dict(attributes),
        capacity=dict(capacity),
        tainted=any(
            isinstance(t, Mapping) and t.get("effect") in TAINT_EFFECTS
            for t in taints[: limits.MAX_DEVICE_FIELDS]
        ),
        shared=shared,
    )


def _complete_pools(slices: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The slices of each (driver, pool)'s newest generation, when all of them are present."""
    newest: dict[tuple[str, str], int] = {}
    parts: dict[tuple[str, str, int], list[Mapping[str, Any]]] = defaultdict(list)
    for found in slices:
        spec = found.get("spec") or {}
        pool = spec.get("pool") or {}
        key = (str(spec.get("driver") or ""), str(pool.get("name") or ""))
        generation = int(pool.get("generation") or 0)
        newest[key] = max(newest.get(key, generation), generation)
        parts[(*key, generation)].append(found)
    kept = []
    for (driver, pool), generation in newest.items():
        group = parts[(driver, pool, generation)]
        wanted = int(
            ((group[0].get("spec") or {}).get("pool") or {}).get("resourceSliceCount") or 1
        )
        if len(group) >= wanted:
            kept.extend(group)
    return kept


def inventory(
    slices: Iterable[Mapping[str, Any]],
    claims: Iterable[Mapping[str, Any]],
    classes: Iterable[Mapping[str, Any]],
) -> Inventory:
    """The inventory from ResourceSlices, ResourceClaims and DeviceClasses (API objects)."""
    devices: dict[str, list[Device]] = defaultdict(list)
    for found in _complete_pools(slices):
        spec = found.get("spec") or {}
        node = spec.get("nodeName")
        if not node:
            continue  # network-attached devices (nodeSelector, allNodes): no GPU of a node
        driver, pool = str(spec.get("driver") or ""), str((spec.get("pool") or {}).get("name"))
        for raw in (spec.get("devices") or [])[: limits.MAX_DEVICES_PER_SLICE]:
            if isinstance(raw, Mapping):
                devices[str(node)].append(device_of(driver, pool, raw))
    return Inventory(
        devices={node: tuple(found) for node, found in devices.items()},
        allocated=frozenset(key for claim in claims for key in allocated_devices(claim)),
        classes={c.name: c for c in map(device_class, classes)},
    )


def allocated_devices(claim: Mapping[str, Any]) -> list[Key]:
    """The devices a ResourceClaim's ``status.allocation`` holds.

    A result with ``adminAccess: true`` (a monitoring claim on devices others use) holds nothing:
    kube-scheduler's allocator skips such results when it gathers the allocated devices.
    """
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return [
        (str(r.get("driver")), str(r.get("pool")), str(r.get("device")))
        for r in results[: limits.MAX_CLAIM_RESULTS]
        if isinstance(r, Mapping) and r.get("adminAccess") is not True
    ]


def device_class(obj: Mapping[str, Any]) -> DeviceClass:
    """A DeviceClass object as allocation reads it (CEL selectors only)."""
    spec = obj.get("spec") or {}
    selectors = tuple(
        str((s.get("cel") or {}).get("expression") or "")
        for s in (spec.get("selectors") or [])[: limits.MAX_CLASS_SELECTORS]
        if isinstance(s, Mapping)
    )
    extended = spec.get("extendedResourceName")
    metadata = obj.get("metadata") or {}
    return DeviceClass(
        name=str(metadata.get("name") or ""),
        selectors=selectors,
        extended_resource_name=str(extended) if extended else None,
        created=str(metadata.get("creationTimestamp") or ""),
    )


WHOLE_MAP_READS = ("exists", "all(", "map(", "filter(", "size(", "string(")
"""CEL that may read an attribute without naming it (macros iterate a map's keys, ``size`` counts
them): selectors holding one are evaluated on every device."""
MAX_VERDICTS = 65_536
"""Verdicts :func:`matches` remembers (a bound: the table is emptied when full)."""
_verdicts: dict[tuple[Any, ...], device_cel.Verdict] = {}


def _read_by(device: Device, selectors: tuple[str, ...]) -> tuple[Any, ...] | None:
    """What of ``device`` the selectors can read: its driver and the attributes and capacities
    whose names occur in their text; None when they may read a whole map (``WHOLE_MAP_READS``)."""
    text = "\n".join(selectors)
    if any(whole in text for whole in WHOLE_MAP_READS):
        return None
    attributes = tuple(
        (domain, name, repr(value))
        for domain, names in sorted(device.attributes.items())
        for name, value in sorted(names.items())
        if name in text
    )
    capacity = tuple(
        (domain, name, value)
        for domain, names in sorted(device.capacity.items())
        for name, value in sorted(names.items())
        if name in text
    )
    return selectors, device.driver, attributes, capacity


def remembered(device: Device, selectors: Sequence[str]) -> bool:
    """Whether :func:`matches` answers for ``device`` without evaluating (a device alike had it)."""
    key = _read_by(device, tuple(selectors))
    return not selectors or (key is not None and key in _verdicts)


def matches(device: Device, selectors: Sequence[str]) -> device_cel.Verdict:
    """The selectors in order, as the allocator evaluates them: the first that is not true decides.

    Devices alike in everything the selectors read get one evaluation (a cluster's GPUs differ
    in uuid, index and PCIe root, which product and memory selectors never read).
    """
    if not selectors:
        return True
    key = _read_by(device, tuple(selectors))
    found = _verdicts.get(key) if key is not None else None
    if found is not None:
        return found
    variables = device_cel.activation(device.driver, device.attributes, device.capacity)
    verdict: device_cel.Verdict = True
    for expression in selectors:
        verdict = device_cel.evaluate(expression, variables)
        if verdict is not True:
            break
    if key is not None:
        if len(_verdicts) >= MAX_VERDICTS:
            _verdicts.clear()
        _verdicts[key] = verdict
    return verdict


def fit(
    request: Request,
    found: Inventory,
    node: str,
    held: int = 0,
    budget: device_cel.Budget | None = None,
) -> Fit:
    """How many pods of ``request`` ``node``'s free devices serve, less ``held`` devices; the
    evaluations charged to the pass's ``budget`` (None: unbounded), left to kube-scheduler once it
    is spent."""
    known = found.classes.get(request.device_class)
    if known is None:
        return Fit(slots=0, free=0, missing_class=request.device_class)
    selectors = (*known.selectors, *request.selectors)
    for expression in selectors:
        compiled = device_cel.compile_selector(expression)
        if isinstance(compiled, device_cel.Unknown):
            return Fit(slots=0, free=0, unknown=compiled.describe(), deferred=True)
    cost = sum(len(expression) for expression in selectors)
    if cost > limits.MAX_EVALUATED_SELECTORS_CHARS:
        return _left_to_scheduler(f"selectors of {cost} characters of CEL")
    chars = limits.MAX_CEL_CHARS_PER_NODE
    free: list[Device] = []
    for device in found.devices.get(node, ()):
        if device.key in found.allocated or device.tainted:
            continue
        if device.shared:
            return _left_to_scheduler(
                f"device {device.name} shares counters or capacity, which are not modelled"
            )
        if not remembered(device, selectors):
            chars -= cost
            if chars < 0:
                return _left_to_scheduler(
                    f"more than {limits.MAX_CEL_CHARS_PER_NODE} characters of CEL on one node"
                )
            if budget is not None and budget.spent:
                return _left_to_scheduler(
                    f"the pass spent its {budget.seconds:g} s of CEL evaluation before this node"
                )
        if budget is not None:
            verdict = budget.timed(functools.partial(matches, device, selectors))
        else:
            verdict = matches(device, selectors)
        if isinstance(verdict, device_cel.Unknown):
            return Fit(slots=0, free=0, unknown=verdict.describe())
        if verdict:
            free.append(device)
    domains = tuple(sorted({str(d.attribute(CLIQUE)) for d in free if d.attribute(CLIQUE)}))
    return Fit(slots=_slots(free, request, held), free=max(len(free) - held, 0), domains=domains)


def _left_to_scheduler(what: str) -> Fit:
    """A verdict the operator does not reach (CEL costing more than it spends on one node's
    devices, ``limits``; device sharing it does not model): kube-scheduler judges the devices."""
    return Fit(slots=0, free=0, unknown=f"{what}: {device_cel.LEFT_TO_SCHEDULER}", deferred=True)


def _slots(free: Sequence[Device], request: Request, held: int) -> int:
    """Pods of ``request`` these devices serve; ``held`` of them are taken where they cost most."""
    if request.count <= 0:
        return 0
    if request.match_attribute is None:
        return max(len(free) - held, 0) // request.count
    groups = Counter(
        str(d.attribute(request.match_attribute))
        for d in free
        if d.attribute(request.match_attribute) is not None
    )
    sizes = sorted(groups.values())
    for _ in range(min(held, sum(sizes))):
        # the held device that leaves fewest slots: from a group that then loses one
        worst = max(range(len(sizes)), key=lambda i: (sizes[i] % request.count == 0, sizes[i]))
        sizes[worst] -= 1
    return sum(size // request.count for size in sizes)


def serving_class(found: Inventory, resource: str) -> DeviceClass | None:
    """The DeviceClass whose devices serve requests of the extended ``resource`` (KEP-5004): of
    several, the newest, then the first by name (kube-scheduler's choice); None: none does."""
    serving = [c for c in found.classes.values() if c.extended_resource_name == resource]
    if not serving:
        return None
    newest = max(c.created for c in serving)
    return min((c for c in serving if c.created == newest), key=lambda c: c.name)


def nvlink_domain(fitted: Fit) -> str | None:
    """The one NVLink domain all of a node's matching devices report, or None (none or several)."""
    return fitted.domains[0] if len(fitted.domains) == 1 else None


NPROC_ENV = "PET_NPROC_PER_NODE"
"""The env var of the operator's trainer container that says how many GPUs (devices) the pod uses."""


def held_by(pod: Mapping[str, Any]) -> int:
    """Devices an unbound pod with resource claims holds before its claims are allocated.

    kube-scheduler allocates a pod's claims when it binds it; until then the operator's gated pod
    holds its planned node's devices only in the operator's eyes (``capacity.counted_node``).
    The count is its trainer's ``PET_NPROC_PER_NODE``; 0 for a bound pod or one without claims.
    """
    spec = pod.get("spec") or {}
    if spec.get("nodeName") or not spec.get("resourceClaims"):
        return 0
    return _devices_used(spec)


@dataclasses.dataclass(frozen=True)
class Awaiting:
    """A bound pod whose devices count as held until the cache shows its claims allocated."""

    node: str
    """The node it is bound to."""
    count: int
    """Its devices (its trainer's ``PET_NPROC_PER_NODE``)."""
    claims: tuple[str, ...]
    """The names of the ResourceClaims its claims resolve to, in its namespace; ``""`` for a
    claim the resourceclaim controller has not named yet (never allocated in the cache)."""


def awaiting(pod: Mapping[str, Any]) -> Awaiting | None:
    """A bound, unfinished pod with resource claims (or whose plain GPU request a KEP-5004 class
    served: ``status.extendedResourceClaimStatus`` names the claim kube-scheduler made for it), as
    :class:`Awaiting`; None for any other.

    kube-scheduler writes a claim's allocation before it binds the pod, but the operator follows
    pods and claims on two watches: the pod's binding may arrive first.  Until every claim of the
    pod shows allocated in the cache, its devices are held (``HELD``) on its node.
    """
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    node = spec.get("nodeName")
    claims = spec.get("resourceClaims")
    extended = (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
    if not node or status.get("phase") in ("Succeeded", "Failed"):
        return None
    count = _devices_used(spec)
    if count <= 0:
        return None
    if (
        extended and not claims
    ):  # a plain GPU request a KEP-5004 class served: the scheduler's claim
        return Awaiting(node=str(node), count=count, claims=(str(extended),))
    if not isinstance(claims, list) or not claims:
        return None
    statuses = status.get("resourceClaimStatuses") or []
    generated = {
        str(s.get("name")): s.get("resourceClaimName")
        for s in statuses[: limits.MAX_CLAIM_RESULTS]
        if isinstance(s, Mapping)
    }
    names: list[str] = []
    for claim in claims[: limits.MAX_CLAIM_RESULTS]:
        if not isinstance(claim, Mapping):
            continue
        if claim.get("resourceClaimName"):
            names.append(str(claim["resourceClaimName"]))
        elif str(claim.get("name")) in generated:
            if generated[str(claim.get("name"))]:  # null: the template made no claim
                names.append(str(generated[str(claim.get("name"))]))
        else:
            names.append("")
    return Awaiting(node=str(node), count=count, claims=tuple(names))


def _devices_used(spec: Mapping[str, Any]) -> int:
    """The devices a pod of the operator's uses: its trainer's ``PET_NPROC_PER_NODE`` (0: none)."""
    for container in spec.get("containers") or []:
        for env in container.get("env") or []:
            if isinstance(env, Mapping) and env.get("name") == NPROC_ENV:
                try:
                    return min(max(int(str(env.get("value"))), 0), limits.MAX_GPUS_PER_NODE)
                except ValueError:
                    return 0
    return 0


def unbound_extended(pod: Mapping[str, Any], requests: Mapping[str, int]) -> dict[str, int]:
    """The extended resources (``domain/name``) an unbound pod without resource claims requests,
    as ``UNBOUND`` usage keys; nothing for a bound pod (its claim's allocation counts) or one with
    claims (``held_by`` counts those)."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName") or spec.get("resourceClaims"):
        return {}
    return {UNBOUND + name: amount for name, amount in requests.items() if "/" in name and amount}


@dataclasses.dataclass(frozen=True)
class Ask:
    """A job's GPUs as placement judges them against the cluster's devices."""

    inventory: Inventory
    """The cluster's devices."""
    gpu_resource: str
    """The job's ``gpuResourceName``: what an extended-resource job requests, and what a device
    plugin on a DRA node advertises for the same GPUs."""
    gpus_per_pod: int
    """Devices (or units of ``gpu_resource``) one pod takes."""
    request: Request | None = None
    """A DRA job's per-pod claim; None: the job requests ``gpu_resource``."""
    budget: device_cel.Budget = dataclasses.field(default_factory=device_cel.Budget, compare=False)
    """The CEL time the pass that judges this ask may still spend (one ask per pass)."""


@dataclasses.dataclass(frozen=True)
class NodeDevices:
    """What a node's devices allow one job."""

    slots: int | None
    """Pods the node's devices serve (None: devices do not limit this job there)."""
    reason: str | None = None
    """Why no more pods than ``slots`` (None: no limit)."""
    domain: str | None = None
    """The NVLink domain the node's matching devices report (``cliqueId``), if one."""
    serves_extended: bool = False
    """True when slices serve the job's extended resource on this node (KEP-5004): its
    allocatable, which lacks the resource, is not what limits the job."""


def ask_of(spec: api_spec.TrainingJobSpec, found: Inventory) -> Ask:
    """What a job's pods ask of the cluster's devices: its ``resources.dra`` claim, or its
    extended resource (which a KEP-5004 DeviceClass may serve from slices)."""
    resources = spec.resources
    dra = resources.dra
    request = None
    if dra is not None:
        request = Request(
            device_class=dra.device_class_name,
            selectors=tuple(dra.selectors),
            count=resources.gpus_per_node,
            match_attribute=dra.match_attribute,
        )
    return Ask(found, resources.gpu_resource_name, resources.gpus_per_node, request)


def judge(
    ask: Ask, node: str, allocatable: Mapping[str, int], used: Mapping[str, int]
) -> NodeDevices:
    """A node's devices for ``ask`` given its parsed allocatable and what pods there use.

    The GPUs of a node are counted once: a DRA job's free devices lose one for every unit of
    ``gpu_resource`` pods take through a device plugin on that node; an extended-resource job's
    allocatable loses the devices of the class serving it that claims hold there.
    """
    published = bool(ask.inventory.devices.get(node))
    plugin = allocatable.get(ask.gpu_resource, 0)
    held = used.get(HELD, 0)
    serving = serving_class(ask.inventory, ask.gpu_resource)
    # gated pods asking the extended resource where slices serve it take devices no claim holds yet
    pending = used.get(UNBOUND + ask.gpu_resource, 0) if serving is not None and plugin <= 0 else 0
    if ask.request is not None:
        doubled = used.get(ask.gpu_resource, 0) if plugin > 0 and published else pending
        fitted = fit(ask.request, ask.inventory, node, held + doubled, ask.budget)
        if fitted.deferred:
            return NodeDevices(None)
        reason = fitted.reason or CANNOT_ALLOCATE
        return NodeDevices(fitted.slots, reason, nvlink_domain(fitted))
    if serving is None or not published or ask.gpus_per_pod <= 0:
        return NodeDevices(None)
    request = Request(device_class=serving.name, selectors=(), count=ask.gpus_per_pod)
    if plugin <= 0:  # kube-scheduler serves the request from the class's devices
        fitted = fit(request, ask.inventory, node, held + pending, ask.budget)
        reason = fitted.reason or CANNOT_ALLOCATE
        return NodeDevices(fitted.slots, reason, nvlink_domain(fitted), True)
    claimed = sum(
        1
        for d in ask.inventory.devices[node]
        if d.key in ask.inventory.allocated and matches(d, serving.selectors) is True
    )
    left = plugin - used.get(ask.gpu_resource, 0) - claimed
    slots = max(left, 0) // ask.gpus_per_pod
    return NodeDevices(slots, f"Insufficient {ask.gpu_resource}")
