"""Informer-style caches of pods, nodes and TrainingJobs: list once, then follow a watch.

A reconcile reads its job's pods from the job index and a placement reads every node and the
per-node usage kept here, so neither sends a LIST.  The TrainingJobs' status says which unbound
pods are the operator's own and where they hold resources (``capacity.counted_node``).  Trimming bounds the memory on big clusters;
the operator's own writes are applied from their answers (:meth:`Cache.learn`), so the pass
after a write sees it.  Watch events wake the job daemons (:class:`Waker`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from meshtrain.api import limits
from meshtrain.operator.cluster import api_errors, assumed, device_cache, kube
from meshtrain.operator.policy import (
    capacity,
    conditions,
    devices,
    feasibility,
    identity,
    kueue_workload,
    naming,
    reservation,
    store_pod,
)

logger = logging.getLogger("meshtrain.operator")

RETRY_SECONDS = 1.0
"""Pause before re-opening a watch that failed once; doubled (with jitter) for each failure in a row."""
RETRY_CAP_SECONDS = 30.0
"""Longest pause between two tries of a failing list or watch."""
TOMBSTONE_SECONDS = 120.0
"""How long a deleted object's last version is remembered (a write answer may arrive after its DELETED event)."""
DEPARTED_SECONDS = 600.0
"""How long the last version of a gone store pod is kept for its job's next pass (``departed``)."""
DEPARTED_LIMIT = 1024
"""Most gone store pods kept at once (the oldest is dropped first)."""
FINISHED = ("Succeeded", "Failed")

_T = TypeVar("_T")
_H = TypeVar("_H", bound=Hashable)
Key = tuple[str, str]
"""(namespace, name); namespace is empty for nodes."""


class Waker(Protocol):
    """Wakes job daemons: a pod change its job; a pod that finished or went away, and any node
    change, the jobs waiting for capacity."""

    def poke(self, key: tuple[str, str]) -> None: ...
    def poke_waiting(self) -> None: ...
    def poke_devices(self, nodes: frozenset[str] | None) -> None: ...


def _version(obj: kube.Body) -> int:
    """resourceVersion as a number (etcd revisions); -1 when absent or opaque."""
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or -1)
    except ValueError:
        return -1


def _key(obj: kube.Body) -> Key:
    metadata = obj.get("metadata") or {}
    return metadata.get("namespace") or "", metadata.get("name") or ""


def _unversioned(obj: kube.Body) -> kube.Body:
    metadata = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "resourceVersion"}
    return {**obj, "metadata": metadata}


def job_of(pod: kube.Body) -> str | None:
    """Name of the TrainingJob a pod belongs to (its ``meshtrain.io/job`` label)."""
    return ((pod.get("metadata") or {}).get("labels") or {}).get(naming.LABEL_JOB)


def _pick(source: dict[str, Any] | None, keys: Iterable[str]) -> dict[str, Any]:
    return {k: source[k] for k in keys if source and k in source}


SHARED_PARTS = 20_000
"""Most distinct parts :class:`Shared` keeps one copy of (a bound: the table never shrinks)."""


class Shared:
    """One copy of equal parts of cached objects, which the cache never modifies.

    100,000 foreign pods mostly repeat a few container request sets and phases,
    and 10,000 nodes the same allocatable and conditions; each part decoded from
    JSON is otherwise a separate tree of dicts and strings.  Parts are matched by
    ``repr`` (for JSON values, equal text is equal value).
    """

    def __init__(self, limit: int = SHARED_PARTS) -> None:
        self._parts: dict[str, Any] = {}
        self._limit = limit

    def __call__(self, part: _T) -> _T:
        if not part:
            return part
        key = repr(part)
        found = self._parts.get(key)
        if found is not None:
            return found  # type: ignore[no-any-return]
        if len(self._parts) < self._limit:
            self._parts[key] = part
        return part


def _name(value: Any) -> Any:
    """Names that many objects repeat (namespaces, node names, labels) as one string each."""
    return sys.intern(value) if isinstance(value, str) else value


def _unshared(part: _T) -> _T:
    return part


def trim_pod(pod: kube.Body, shared: Callable[[Any], Any] = _unshared) -> kube.Body:
    """A pod as the cache keeps it: whole for children of TrainingJobs, else only what capacity reads.

    A child is a pod whose controller owner reference is a TrainingJob (``capacity.controller_uid``);
    it stays whole, since failure classification reads its status, but for its ``managedFields``
    (the largest part of a pod, read by no one here).  Every other pod is foreign, whatever labels
    it carries: a label is anyone's to write, and a whole pod with large annotations or env per
    label would let any tenant grow the operator's memory.  ``shared`` (a :class:`Shared`) lets
    equal parts of foreign pods be one object.  A foreign pod's annotations and affinity reserve
    nothing (``capacity.counted_node``) and are not kept.
    """
    metadata = pod.get("metadata") or {}
    if capacity.controller_uid(pod) is not None:
        if "managedFields" not in metadata:
            return pod
        kept = {k: v for k, v in metadata.items() if k != "managedFields"}
        return {**pod, "metadata": kept}
    spec = pod.get("spec") or {}
    slim_spec = {k: shared(v) for k, v in _pick(spec, ("overhead", "resources")).items()}
    for name in ("nodeName", "schedulerName"):
        if name in spec:
            slim_spec[name] = _name(spec[name])
    slim_spec["containers"] = shared(
        [_pick(c, ("resources",)) for c in spec.get("containers") or []]
    )
    if spec.get("initContainers"):
        slim_spec["initContainers"] = shared(
            [_pick(c, ("resources", "restartPolicy")) for c in spec["initContainers"]]
        )
    slim_metadata = _pick(metadata, ("name", "uid", "resourceVersion"))
    if "namespace" in metadata:
        slim_metadata["namespace"] = _name(metadata["namespace"])
    slim_metadata.update(_pick(metadata, ("deletionTimestamp",)))
    return {
        "metadata": slim_metadata,
        "spec": slim_spec,
        "status": shared(_pick(pod.get("status"), ("phase", "nominatedNodeName"))),
    }


def trim_node(node: kube.Body, shared: Callable[[Any], Any] = _unshared) -> kube.Body:
    """A node as the cache keeps it: what placement and feasibility read."""
    status = node.get("status") or {}
    source = node.get("metadata") or {}
    metadata = _pick(source, ("uid", "resourceVersion"))
    if "name" in source:
        metadata["name"] = _name(source["name"])
    if source.get("labels") is not None:
        metadata["labels"] = {_name(k): _name(v) for k, v in source["labels"].items()}
    features = status.get("declaredFeatures")  # kubelet_tier.declares reads them
    declared = features[: limits.MAX_DECLARED_FEATURES] if isinstance(features, list) else []
    return {
        "metadata": metadata,
        "spec": shared(_pick(node.get("spec"), ("unschedulable", "taints"))),
        "status": {
            **{k: shared(v) for k, v in _pick(status, ("allocatable", "capacity")).items()},
            "conditions": shared(
                [_pick(c, ("type", "status")) for c in status.get("conditions") or []]
            ),
            "declaredFeatures": shared([_name(f) for f in declared if isinstance(f, str)]),
        },
    }


LIMIT_FIELDS = ("activeDeadlineSeconds", "terminationGracePeriodSeconds")
"""``spec.runPolicy`` fields :func:`trim_job` keeps."""


def trim_job(job: kube.Body) -> kube.Body:
    """A TrainingJob as the cache keeps it: whether it is live, its UID, and which gated pods hold
    which nodes (``status.restarts`` and ``status.placement``, ``capacity.live_owner``); its Kueue
    queue label, ``Placed`` condition and ``queuedSince`` (whether it may hold the reservation
    after a restart, ``reservation.may_hold``); its declared limit, grace and start time (when its pods are gone,
    ``reservation.limits_of``)."""
    metadata = job.get("metadata") or {}
    status = job.get("status") or {}
    policy = _pick((job.get("spec") or {}).get("runPolicy"), LIMIT_FIELDS)
    labels = _pick(metadata.get("labels"), (kueue_workload.QUEUE_LABEL,))
    found = conditions.find(status.get("conditions") or [], conditions.PLACED)
    placed = _pick(found, ("type", "status", "reason", "lastTransitionTime"))  # not the message
    if status.get("phase") in FINISHED:
        placed = {}  # it holds nothing: a change there is no news (``_wake`` wakes at finished jobs)
    return {
        "metadata": {
            **_pick(
                metadata,
                ("name", "namespace", "uid", "generation", "resourceVersion", "deletionTimestamp"),
            ),
            **({"labels": labels} if labels else {}),
        },
        **({"spec": {"runPolicy": policy}} if policy else {}),
        "status": {
            **_pick(
                status,
                (
                    *("phase", "restarts", "placement", "startTime", "backfill"),
                    *("queuedSince", "queuedGeneration"),
                ),
            ),
            **({"conditions": [placed]} if placed else {}),
        },
    }


class _Asleep:
    def poke(self, key: tuple[str, str]) -> None:
        pass

    def poke_waiting(self) -> None:
        pass

    def poke_devices(self, nodes: frozenset[str] | None) -> None:
        pass


class _Counted:
    """A waker that counts the capacity changes it is told of on the cache, then passes them on."""

    def __init__(self, cache: Cache, waker: Waker) -> None:
        self._cache = cache
        self._waker = waker

    def poke(self, key: tuple[str, str]) -> None:
        self._waker.poke(key)

    def poke_waiting(self) -> None:
        self._cache.capacity_changes += 1
        self._waker.poke_waiting()

    def poke_devices(self, nodes: frozenset[str] | None) -> None:
        if nodes is None or nodes:
            self._cache.capacity_changes += 1
        self._waker.poke_devices(nodes)


class Store:
    """Objects by key, newest resourceVersion wins; optional index of pods by (namespace, job)."""

    def __init__(
        self,
        trim: Callable[[kube.Body], kube.Body],
        *,
        by_job: bool = False,
        on_change: Callable[[kube.Body | None, kube.Body | None], None] | None = None,
    ) -> None:
        self._trim = trim
        self._on_change = on_change
        """Called with (old, new) whenever an object is stored, replaced or forgotten."""
        self.changes = 0
        """Counts every change: what was derived from the store at one count still holds."""
        self._objects: dict[Key, kube.Body] = {}
        self._tombstones: dict[Key, tuple[int, float]] = {}
        """Deleted key -> (last version, when): older versions of it are not stored again."""
        self._by_job: dict[Key, set[str]] | None = {} if by_job else None

    def __len__(self) -> int:
        return len(self._objects)

    def trim(self, obj: kube.Body) -> kube.Body:
        """What the store keeps of ``obj`` (lists apply it page by page)."""
        return self._trim(obj)

    def values(self) -> Iterator[kube.Body]:
        return iter(list(self._objects.values()))

    def get(self, key: Key) -> kube.Body | None:
        return self._objects.get(key)

    def names_of_job(self, namespace: str, job: str) -> list[str]:
        assert self._by_job is not None
        return sorted(self._by_job.get((namespace, job), ()))

    def _index(self, key: Key, obj: kube.Body | None, add: bool) -> None:
        if self._by_job is None or obj is None:
            return
        job = job_of(obj)
        if not job:
            return
        names = self._by_job.setdefault((key[0], job), set())
        if add:
            names.add(key[1])
            return
        names.discard(key[1])
        if not names:
            del self._by_job[(key[0], job)]

    def replace(
        self, objects: Iterable[kube.Body], version: str | None = None, namespace: str | None = None
    ) -> None:
        """The full state after a list taken at ``version`` (of ``namespace`` only, if given).

        What the store learned after the list was taken (the operator's own writes
        answered while a long list paginated: a newer object, a tombstone) is kept;
        the watch from ``version`` replays those changes anyway.
        """
        try:
            taken = int(version) if version is not None else None
        except ValueError:
            taken = None

        def kept(key: Key, found_version: int) -> bool:
            outside = namespace is not None and key[0] != namespace
            return outside or (taken is not None and found_version > taken)

        newer = {key for key, obj in self._objects.items() if kept(key, _version(obj))}
        for key, old in list(self._objects.items()):
            if key not in newer:
                self._index(key, old, add=False)
                del self._objects[key]
                self._changed(old, None)
        self._tombstones = {
            key: mark for key, mark in self._tombstones.items() if kept(key, mark[0])
        }
        for obj in objects:
            self.upsert(obj)

    def upsert(self, obj: kube.Body) -> bool:
        """Store ``obj`` unless a newer (or the same) version is stored or it was deleted after it.

        True when what the store keeps changed; a new version that differs only in what
        trimming drops (a node's heartbeat, a foreign pod's conditions) is stored silently.
        """
        key = _key(obj)
        version = _version(obj)
        if key in self._tombstones and version <= self._tombstones[key][0]:
            return False
        old = self._objects.get(key)
        if old is not None and version != -1 and version <= _version(old):
            return False
        trimmed = self._trim(obj)
        if old is not None and _unversioned(old) == _unversioned(trimmed):
            self._objects[key] = trimmed
            return False
        self._index(key, old, add=False)
        self._objects[key] = trimmed
        self._index(key, trimmed, add=True)
        self._changed(old, trimmed)
        return True

    def _changed(self, old: kube.Body | None, new: kube.Body | None) -> None:
        self.changes += 1
        if self._on_change is not None:
            self._on_change(old, new)

    def remove(self, obj: kube.Body) -> None:
        """Forget ``obj``, leaving a tombstone so that no older version of it comes back."""
        key = _key(obj)
        old = self._objects.get(key)
        version = _version(obj)
        if old is not None and (version == -1 or _version(old) <= version):
            self._index(key, self._objects.pop(key), add=False)
            self._changed(old, None)
        now = time.monotonic()
        self._tombstones[key] = (max(version, self._tombstones.get(key, (-1, 0.0))[0]), now)
        if len(self._tombstones) > 1000:
            for stale in [
                k for k, (_, t) in self._tombstones.items() if now - t > TOMBSTONE_SECONDS
            ]:
                del self._tombstones[stale]


class Cache:
    """The pod, node and TrainingJob informers of one operator process."""

    def __init__(self, *, follow_devices: bool = False) -> None:
        """``follow_devices``: follow ResourceSlices, ResourceClaims and DeviceClasses too (DRA)."""
        shared = Shared()
        self.pods = Store(
            functools.partial(trim_pod, shared=shared), by_job=True, on_change=self._count
        )
        self.nodes = Store(functools.partial(trim_node, shared=shared))
        self.jobs = Store(trim_job, on_change=self._job_changed)
        self._devices = device_cache.RESOURCES if follow_devices else ()
        self.dra = {name: Store(trim) for name, trim in device_cache.TRIMS.items()}
        """ResourceSlices, ResourceClaims and DeviceClasses (``device_cache.RESOURCES``)."""
        self.dra["resourceclaims"] = Store(device_cache.trim_claim, on_change=self._claim_changed)
        self._inventory: tuple[tuple[int, ...], devices.Inventory] = ((), devices.EMPTY)
        self._allocated: Counter[devices.Key] = Counter()
        """Device -> claims whose allocation holds it (kept per claim event, not rebuilt)."""
        self._awaiting: dict[Key, devices.Awaiting] = {}
        """Bound pods whose claims the cache may not show allocated yet (``devices.awaiting``)."""
        self._awaiting_on: dict[str, set[Key]] = {}
        """Node -> the :attr:`_awaiting` pods bound to it."""
        self._awaiting_for: dict[Key, set[Key]] = {}
        """Claim (namespace, name) -> the :attr:`_awaiting` pods that wait for it."""
        self._live: dict[Key, capacity.Owner] = {}
        """(namespace, job) -> the live TrainingJob of that name (``capacity.live_owner``)."""
        self._requested: dict[str, Counter[str]] = {}
        """Node -> summed requests of the pods holding resources there (kept up to date per event)."""
        self._pods_on: Counter[str] = Counter()
        """Node -> how many such pods."""
        self._ours: dict[str, Counter[str]] = {}
        """Node -> the part of :attr:`_requested` that meshtrain's own pods (assumed ones
        included) take, pod count under the key ``\\0pods``: what the reservation's plan counts
        free without reading every pod."""
        self._usage_of: dict[str, feasibility.Usage] = {}
        """Node -> its usage as last asked for; dropped when a pod on the node changes."""
        self._our_pods: dict[str, Counter[Key]] = {}
        """Node -> the meshtrain pods charged to it (:meth:`holding`)."""
        self.assumed = assumed.Assumed(functools.partial(self._charge_amounts, ours=True))
        """Pods of planned gangs charged to their nodes before they exist (:meth:`assume`)."""
        self.waker: Waker = _Counted(self, _Asleep())
        self.capacity_changes = 0
        """Capacity changes this cache woke waiting jobs for (``waiting.Queue.seq`` reads it)."""
        """What :meth:`run` pokes (a released assumption frees capacity too)."""
        self._departed: dict[Key, tuple[kube.Body, float]] = {}
        """Gone store pods -> (their last version, when they went): see :meth:`departed`."""
        self.synced = asyncio.Event()
        """Set once every store holds a full list."""
        self._synced: set[str] = set()
        self._expected: set[str] = {"pods", "nodes", *self._devices}
        """What :meth:`run` follows: the lists ``synced`` waits for."""

    def job_pods(self, namespace: str, job: str) -> list[kube.Body]:
        """Pods labelled with ``job`` in ``namespace``, by name."""
        found = (
            self.pods.get((namespace, name)) for name in self.pods.names_of_job(namespace, job)
        )
        return [p for p in found if p is not None]

    def holding(
        self, nodes: Iterable[str]
    ) -> dict[str, list[tuple[kube.Body | None, kube.Body | None]]]:
        """Per node of ``nodes`` that holds any: (its TrainingJob as cached, pod) of each meshtrain
        pod that takes resources there, and (job, None) of each pod assumed there; the job None
        when the cache holds none of that UID (the reservation's backfill bound,
        ``reservation.pod_end``)."""
        nodes = frozenset(nodes)
        found: dict[str, list[tuple[kube.Body | None, kube.Body | None]]] = {}
        for node in nodes:
            for key in list(self._our_pods.get(node, ())):
                pod = self.pods.get(key)
                if pod is None:
                    continue
                job = self.jobs.get((key[0], job_of(pod) or ""))
                uid = ((job or {}).get("metadata") or {}).get("uid")
                mine = job if uid and uid == capacity.controller_uid(pod) else None
                found.setdefault(node, []).append((mine, pod))
        # pods being created: only the gangs placed in the last moments (``assumed``)
        assumed_on = [(a.job, a.node) for a in list(self.assumed.pods.values()) if a.node in nodes]
        if assumed_on:
            wanted, jobs = {uid for uid, _ in assumed_on}, {}
            for job in self.jobs.values():  # assumptions name their job by UID: rare, brief
                uid = (job.get("metadata") or {}).get("uid")
                if uid in wanted:
                    jobs[uid] = job
            for uid, node in assumed_on:
                found.setdefault(node, []).append((jobs.get(uid), None))
        return found

    def _node_of(self, pod: kube.Body) -> str | None:
        """The node ``pod`` takes resources on, as :func:`capacity.counted_node` says."""
        job = job_of(pod)
        owner = self._live.get((_key(pod)[0], job)) if job else None
        return capacity.counted_node(pod, owner)

    def inventory(self) -> devices.Inventory:
        """The devices of the cluster (``devices.inventory``): the slices and classes parsed again
        only after one of them changed; a claim's change updates only the allocated set."""
        slices, claims, classes = (self.dra[n] for n in device_cache.RESOURCES)
        key = (slices.changes, classes.changes, claims.changes)
        built = self._inventory
        if built[0][:2] != key[:2]:
            found = devices.inventory(slices.values(), (), classes.values())
            built = (key, dataclasses.replace(found, allocated=frozenset(self._allocated)))
        elif built[0] != key:
            built = (key, dataclasses.replace(built[1], allocated=frozenset(self._allocated)))
        self._inventory = built
        return built[1]

    def _claim_changed(self, old: kube.Body | None, new: kube.Body | None) -> None:
        """A claim changed: the allocated set follows, and the nodes of pods waiting for it
        count their devices again."""
        for claim, sign in ((old, -1), (new, 1)):
            for device in devices.allocated_devices(claim or {}):
                self._allocated[device] += sign
                if self._allocated[device] <= 0:
                    del self._allocated[device]
        for pod in self._awaiting_for.get(_key(new or old or {}), ()):
            self._usage_of.pop(self._awaiting[pod].node, None)

    def departed(self, key: Key) -> kube.Body | None:
        """What was last seen of store pod ``key`` (namespace, name) if it went in the last
        ``DEPARTED_SECONDS``: its labels, placement stamp, owner, node and ``DisruptionTarget``
        condition (``store_pod.loss`` tells a removal with its node from a deletion by it)."""
        found = self._departed.get(key)
        if found is None or time.monotonic() - found[1] > DEPARTED_SECONDS:
            return None
        return found[0]

    def _depart(self, pod: kube.Body) -> None:
        """Keep a gone store pod's last version: only the current attempt's store pod of a live
        TrainingJob that controls it (anyone may label or own a pod), and only what
        ``store_pod.loss`` reads, so a tenant's churn of pods costs at most one small record per
        live job."""
        key, job = _key(pod), job_of(pod)
        owner = self._live.get((key[0], job)) if job else None
        if owner is None or capacity.controller_uid(pod) != owner.uid:
            return
        if job is None or key[1] != naming.store_pod_name(job, owner.attempt):
            return
        self._departed.pop(key, None)
        self._departed[key] = (store_pod.last_seen(pod), time.monotonic())
        while len(self._departed) > DEPARTED_LIMIT:  # insertion order: the oldest first
            del self._departed[next(iter(self._departed))]

    def _count(self, old: kube.Body | None, new: kube.Body | None) -> None:
        if new is not None:
            self.assumed.seen(_key(new))
            self._departed.pop(_key(new), None)  # back (a relist forgets, then stores it again)
        elif old is not None and store_pod.is_store(old):
            self._depart(old)
        for pod, sign in ((old, -1), (new, 1)):
            if pod is not None:
                self._charge(pod, self._node_of(pod), sign)
        if self._devices:
            self._await(_key(new or old or {}), None if new is None else devices.awaiting(new))

    def _await(self, pod: Key, found: devices.Awaiting | None) -> None:
        """Index (or forget) the bound pod ``pod`` whose claims the cache may not show allocated."""
        gone = self._awaiting.pop(pod, None)
        for entry, add in ((gone, False), (found, True)):
            if entry is None:
                continue
            self._usage_of.pop(entry.node, None)
            _member(self._awaiting_on, entry.node, pod, add)
            for claim in entry.claims:
                _member(self._awaiting_for, (pod[0], claim), pod, add)
        if found is not None:
            self._awaiting[pod] = found

    def _awaiting_held(self, node: str) -> int:
        """Devices of pods bound to ``node`` whose claims the cache does not show allocated."""
        claims = self.dra["resourceclaims"]
        held = 0
        for pod in self._awaiting_on.get(node, ()):
            entry = self._awaiting[pod]
            if not all(device_cache.is_allocated(claims.get((pod[0], c))) for c in entry.claims):
                held += entry.count
        return held

    def _charge(self, pod: kube.Body, node: str | None, sign: int) -> None:
        if node:
            amounts = _charged(pod, bool(self._devices))
            ours = reservation.is_ours(pod)
            self._charge_amounts(node, amounts, sign, ours=ours)
            if ours:
                keys = self._our_pods.setdefault(node, Counter())
                keys[_key(pod)] += sign
                if keys[_key(pod)] <= 0:
                    del keys[_key(pod)]
                    if not keys:
                        del self._our_pods[node]

    def _charge_amounts(
        self, node: str, amounts: Mapping[str, int], sign: int, *, ours: bool = False
    ) -> None:
        requested = self._requested.get(node)
        if requested is None:
            requested = self._requested[node] = Counter()
        for resource, amount in amounts.items():
            requested[resource] += sign * amount
        self._pods_on[node] += sign
        self._usage_of.pop(node, None)
        if ours:
            counted = self._ours.setdefault(node, Counter())
            counted.update({resource: sign * amount for resource, amount in amounts.items()})
            counted["\0pods"] += sign
            if not any(counted.values()):
                del self._ours[node]

    def assume(self, job: str, pods: Iterable[kube.Body]) -> int:
        """Charge ``pods`` of job ``job``, about to be created, to their planned nodes until each
        appears here (``assumed``); a pod of a name the cache holds is not assumed."""
        keyed = ((_key(p), identity.planned_node(p), p) for p in pods)
        return self.assumed.assume(
            job,
            [
                (key, node, _charged(p, bool(self._devices)))
                for key, node, p in keyed
                if node and self.pods.get(key) is None
            ],
            time.monotonic(),
        )

    def _job_changed(self, old: kube.Body | None, new: kube.Body | None) -> None:
        """A job that became live or stopped being live (or a namesake with another UID), or whose
        placement or attempt changed: its pods are counted again under the new answer."""
        key = _key(new or old or {})
        live = capacity.live_owner(new) if new is not None else None
        if self._live.get(key) == live:
            return
        pods = self.job_pods(*key)
        for pod in pods:
            self._charge(pod, self._node_of(pod), -1)
        if live is None:
            self._live.pop(key, None)
        else:
            self._live[key] = live
        for pod in pods:
            self._charge(pod, self._node_of(pod), 1)

    def usage(
        self, *, without: Iterable[kube.Body] = (), ours_free: bool = False
    ) -> Mapping[str, feasibility.Usage]:
        """What the pods on each node take (``feasibility.usage`` of them), leaving ``without`` out,
        or with ``ours_free`` every pod meshtrain placed or assumed (the reservation's view).

        Sums are kept per event and a node's usage is built when first read after a
        change of its pods, so a placement on 10,000 nodes and 100,000 pods adds nothing
        up, and the check of a gang's planned nodes reads only those.
        """
        self.assumed.expire(time.monotonic())
        if ours_free:
            return _UsageView(self, self._ours)
        left_out: dict[str, Counter[str]] = {}
        for pod in without:
            node = self._node_of(pod)
            if node and node in self._requested:
                left_out.setdefault(node, Counter())
                left_out[node].update(_charged(pod, bool(self._devices)))
                left_out[node]["\0pods"] += 1
        return _UsageView(self, left_out)

    def node_usage(self, node: str) -> feasibility.Usage | None:
        """What the pods on ``node`` take; None when no pod there holds anything."""
        self.assumed.expire(time.monotonic())
        found = self._usage_of.get(node)
        if found is None:
            requested = self._requested.get(node)
            if requested is None:
                return None
            found = self._usage_of[node] = self._node_usage(requested, node)
        return found

    def node_usage_without(self, node: str, amounts: Counter[str]) -> feasibility.Usage:
        """What the pods on ``node`` take, less ``amounts`` (pod count under the key ``\\0pods``)."""
        requested = Counter(self._requested[node])
        requested.subtract({r: a for r, a in amounts.items() if r != "\0pods"})
        return self._node_usage(requested, node, amounts["\0pods"])

    def _node_usage(self, requested: Counter[str], node: str, fewer: int = 0) -> feasibility.Usage:
        kept = {r: a for r, a in requested.items() if a}
        awaiting = self._awaiting_held(node) if node in self._awaiting_on else 0
        if awaiting:
            kept[devices.HELD] = kept.get(devices.HELD, 0) + awaiting
        return feasibility.Usage(requested=kept, pods=self._pods_on[node] - fewer)

    def learn(self, verb: str, obj: kube.Body) -> None:
        """Apply the answer of one of the operator's own writes (``kube.Client.on_write``)."""
        store = {"Pod": self.pods, "Node": self.nodes, "TrainingJob": self.jobs}.get(
            str(obj.get("kind"))
        )
        if store is None:
            return
        metadata = obj.get("metadata") or {}
        if (
            verb == "delete"
            and not metadata.get("finalizers")  # a finalizer keeps it until its owner is done
            and (
                not metadata.get("deletionTimestamp")
                or metadata.get("deletionGracePeriodSeconds") == 0
            )
        ):
            store.remove(obj)  # deleted at once (never bound, or no grace period): gone now
            return
        store.upsert(obj)

    async def run(
        self, client: kube.Client, waker: Waker | None = None, namespaces: Sequence[str] = ()
    ) -> None:
        """Follow pods (all namespaces: foreign pods hold GPUs too), nodes, and the TrainingJobs of
        ``namespaces`` (the operator's watch; none: all) until cancelled.

        Also makes ``client`` report its writes to the cache; ``waker`` (None: none) is poked.
        """
        client.on_write = self.learn
        waker = self.waker = _Counted(self, waker or _Asleep())
        watched: list[str | None] = [*namespaces] or [None]
        scopes = {f"trainingjobs in {n or 'all namespaces'}": n for n in watched}
        self._expected = {"pods", "nodes", *scopes, *self._devices}
        jobs = [
            self._follow(
                what, client.list_jobs, client.watch_jobs, self.jobs, waker, {"namespace": n}
            )
            for what, n in scopes.items()
        ]
        await asyncio.gather(
            self._follow(
                "pods", client.list_pods, client.watch_pods, self.pods, waker, {"namespace": None}
            ),
            self._follow("nodes", client.list_nodes, client.watch_nodes, self.nodes, waker, {}),
            *jobs,
            *(
                self._follow(
                    name,
                    client.list_devices,
                    client.watch_devices,
                    self.dra[name],
                    waker,
                    {"resource": name},
                )
                for name in self._devices
            ),
        )

    async def _follow(
        self,
        what: str,
        list_: Callable[..., Any],
        watch: Callable[..., Any],
        store: Store,
        waker: Waker,
        scope: dict[str, Any],
    ) -> None:
        """List (paginated), then watch from the list's resourceVersion (bookmarks keep it fresh).

        ``scope`` are the list and watch calls' arguments; a 410 Gone lists again and replaces
        the store.
        """
        version: str | None = None
        failures = 0  # tries in a row that failed
        while True:
            try:
                if version is None:
                    items, version = await list_(**scope, keep=store.trim)
                    store.replace(items, version, scope.get("namespace"))
                    # The cache is most of the heap and its JSON trees hold no cycles: kept out of
                    # the collector, a full collection no longer walks 100,000 pods (0.3 s a pass).
                    gc.freeze()
                    self._synced.add(what)
                    if self._synced >= self._expected:
                        self.synced.set()
                    waker.poke_waiting()
                    logger.info("cache of %s filled: %d object(s)", what, len(store))
                async for type_, obj in watch(**scope, resource_version=version):
                    failures = 0
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    if type_ == "BOOKMARK":
                        continue
                    old = store.get(_key(obj)) if what in device_cache.RESOURCES else None
                    if type_ == "DELETED":
                        store.remove(obj)
                    elif not store.upsert(obj):
                        continue  # nothing the operator reads changed (a heartbeat)
                    if what in device_cache.RESOURCES:
                        new = None if type_ == "DELETED" else store.get(_key(obj))
                        waker.poke_devices(device_cache.changed_nodes(what, old, new))
                        continue
                    _wake(waker, what, type_, obj)
            except kube.ApiError as err:
                if err.status == 410:
                    version = None  # too old: list again and replace the store
                    continue
                if err.status == 404 and version is None and what in device_cache.RESOURCES:
                    self._synced.add(what)  # not served (no DRA): no devices; asked again later
                    if self._synced >= self._expected:
                        self.synced.set()
                    await asyncio.sleep(RETRY_CAP_SECONDS)
                    continue
                failures += 1
                logger.warning("watch of %s failed: %s", what, err)
                await asyncio.sleep(_retry_delay(err, failures))
            except (TimeoutError, OSError, ValueError) as err:
                failures += 1
                logger.warning("watch of %s interrupted: %s", what, err)
                await asyncio.sleep(_retry_delay(err, failures))


def _member(index: dict[_H, set[Key]], where: _H, pod: Key, add: bool) -> None:
    """Add ``pod`` to (or drop it from) ``index[where]``; an emptied set goes."""
    members = index.setdefault(where, set())
    if add:
        members.add(pod)
        return
    members.discard(pod)
    if not members:
        del index[where]


def _retry_delay(err: BaseException, failures: int) -> float:
    return api_errors.retry_delay(
        err, failures, random.random(), base=RETRY_SECONDS, cap=RETRY_CAP_SECONDS
    )


class _UsageView(Mapping[str, feasibility.Usage]):
    """Usage per node as :meth:`Cache.usage` reports it, built node by node as it is read."""

    def __init__(self, cache: Cache, left_out: dict[str, Counter[str]]) -> None:
        self._cache = cache
        self._left_out = left_out

    def __getitem__(self, node: str) -> feasibility.Usage:
        amounts = self._left_out.get(node)
        if amounts is not None:
            return self._cache.node_usage_without(node, amounts)
        found = self._cache.node_usage(node)
        if found is None:
            raise KeyError(node)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._cache._requested))

    def __len__(self) -> int:
        return len(self._cache._requested)


def _charged(pod: kube.Body, with_devices: bool) -> dict[str, int]:
    """What a pod holds on its node: its requests, the devices it holds before its claims are
    allocated (``devices.HELD``), and, unbound and ``with_devices`` (the cache follows DRA), its
    extended resources (``devices.UNBOUND``)."""
    held = devices.held_by(pod)
    requests = feasibility.pod_requests(pod)
    return {
        **requests,
        **({devices.HELD: held} if held else {}),
        **(devices.unbound_extended(pod, requests) if with_devices else {}),
    }


def _wake(waker: Waker, what: str, type_: str, obj: kube.Body) -> None:
    if what == "nodes":
        waker.poke_waiting()
        return
    job = job_of(obj)
    if job:
        waker.poke((_key(obj)[0], job))
    if type_ == "DELETED" or (obj.get("status") or {}).get("phase") in FINISHED:
        waker.poke_waiting()
