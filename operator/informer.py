"""Informer-style caches of pods and nodes: list once, then follow a watch; reads never hit the API.

A reconcile reads its job's pods from the job index and a placement reads
every node and live pod from here, so neither sends a LIST (the issue this
closes: every pass listed pods, every placement listed the cluster).  The
caches also wake job daemons (``Waker``): a pod change wakes its job; a pod
that finished or went away, and any node change, wake the jobs waiting for
capacity.

Memory is bounded by trimming: pods of TrainingJobs (label
``meshtrain.io/job``) are kept whole, because failure classification reads
their statuses; any other pod keeps only what capacity and feasibility read
(node, planned-node annotation, node affinity, container requests, overhead,
phase).  Nodes keep labels, taints, ``unschedulable``, allocatable and
conditions.

Consistency: lists paginate; a watch resumes from the last resourceVersion
(bookmarks keep it fresh) and a 410 Gone relists and replaces the store.  The
operator's own writes are applied from their answers (:meth:`Cache.learn`)
when they are newer than what is stored, so the pass after a create, patch or
delete sees it; a deleted object leaves a tombstone (its last version), so a
write answer that arrives after the DELETED event cannot revive it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from meshtrain.operator import feasibility, identity, kube, naming

logger = logging.getLogger("meshtrain.operator")

RETRY_SECONDS = 1.0
"""Pause before re-opening a watch that failed."""
TOMBSTONE_SECONDS = 120.0
"""How long a deleted object's last version is remembered (a write answer may arrive after its DELETED event)."""
FINISHED = ("Succeeded", "Failed")

Key = tuple[str, str]
"""(namespace, name); namespace is empty for nodes."""


class Waker(Protocol):
    def poke(self, key: tuple[str, str]) -> None: ...
    def poke_waiting(self) -> None: ...


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


def trim_pod(pod: kube.Body) -> kube.Body:
    """A pod as the cache keeps it: whole for children of TrainingJobs, else only what capacity reads."""
    if job_of(pod):
        return pod
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    annotations = _pick(metadata.get("annotations"), (naming.ANNOTATION_NODE,))
    slim_spec = _pick(spec, ("nodeName", "overhead", "resources"))
    affinity = (spec.get("affinity") or {}).get("nodeAffinity")
    if affinity:
        slim_spec["affinity"] = {"nodeAffinity": affinity}
    slim_spec["containers"] = [_pick(c, ("resources",)) for c in spec.get("containers") or []]
    if spec.get("initContainers"):
        slim_spec["initContainers"] = [
            _pick(c, ("resources", "restartPolicy")) for c in spec["initContainers"]
        ]
    slim_metadata = _pick(metadata, ("name", "namespace", "uid", "resourceVersion"))
    slim_metadata.update(_pick(metadata, ("deletionTimestamp",)))
    if annotations:
        slim_metadata["annotations"] = annotations
    return {
        "metadata": slim_metadata,
        "spec": slim_spec,
        "status": _pick(pod.get("status"), ("phase",)),
    }


def trim_node(node: kube.Body) -> kube.Body:
    """A node as the cache keeps it: what placement and feasibility read."""
    status = node.get("status") or {}
    return {
        "metadata": _pick(node.get("metadata"), ("name", "uid", "resourceVersion", "labels")),
        "spec": _pick(node.get("spec"), ("unschedulable", "taints")),
        "status": {
            **_pick(status, ("allocatable", "capacity")),
            "conditions": [_pick(c, ("type", "status")) for c in status.get("conditions") or []],
        },
    }


class _Asleep:
    def poke(self, key: tuple[str, str]) -> None:
        pass

    def poke_waiting(self) -> None:
        pass


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

    def replace(self, objects: Iterable[kube.Body], version: str | None = None) -> None:
        """The full state after a list taken at ``version``.

        What the store learned after the list was taken (the operator's own writes
        answered while a long list paginated: a newer object, a tombstone) is kept;
        the watch from ``version`` replays those changes anyway.
        """
        try:
            taken = int(version) if version is not None else None
        except ValueError:
            taken = None
        newer = {
            key: obj
            for key, obj in self._objects.items()
            if taken is not None and _version(obj) > taken
        }
        tombstones = {
            key: mark
            for key, mark in self._tombstones.items()
            if taken is not None and mark[0] > taken
        }
        for key, old in list(self._objects.items()):
            if key not in newer:
                self._index(key, old, add=False)
                del self._objects[key]
                self._changed(old, None)
        self._tombstones = tombstones
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
    """The pod and node informers of one operator process."""

    def __init__(self) -> None:
        self.pods = Store(trim_pod, by_job=True, on_change=self._count)
        self.nodes = Store(trim_node)
        self._requested: dict[str, Counter[str]] = {}
        """Node -> summed requests of the pods holding resources there (kept up to date per event)."""
        self._pods_on: Counter[str] = Counter()
        """Node -> how many such pods."""
        self._usage: tuple[int, dict[str, feasibility.Usage]] = (-1, {})
        """(pods.changes, usage per node) of the last :meth:`usage` without exclusions."""
        self.synced = asyncio.Event()
        """Set once both stores hold a full list."""
        self._synced: set[str] = set()

    def job_pods(self, namespace: str, job: str) -> list[kube.Body]:
        """Pods labelled with ``job`` in ``namespace``, by name."""
        found = (
            self.pods.get((namespace, name)) for name in self.pods.names_of_job(namespace, job)
        )
        return [p for p in found if p is not None]

    def live_pods(self) -> list[kube.Body]:
        """Every pod that may still hold resources (not Succeeded or Failed)."""
        return [
            p for p in self.pods.values() if (p.get("status") or {}).get("phase") not in FINISHED
        ]

    def _count(self, old: kube.Body | None, new: kube.Body | None) -> None:
        for pod, sign in ((old, -1), (new, 1)):
            if pod is None or not feasibility.holds_resources(pod):
                continue
            node = identity.planned_node(pod)
            if not node:
                continue
            requested = self._requested.setdefault(node, Counter())
            for resource, amount in feasibility.pod_requests(pod).items():
                requested[resource] += sign * amount
            self._pods_on[node] += sign

    def usage(self, *, without: Iterable[kube.Body] = ()) -> dict[str, feasibility.Usage]:
        """What the pods on each node take (``feasibility.usage`` of them), leaving ``without`` out.

        Kept per event, so a placement on 10,000 nodes and 100,000 pods adds nothing up.
        """
        if self._usage[0] != self.pods.changes:
            self._usage = (
                self.pods.changes,
                {node: self._node_usage(self._requested[node], node) for node in self._requested},
            )
        found = self._usage[1]
        left_out: dict[str, Counter[str]] = {}
        for pod in without:
            node = identity.planned_node(pod)
            if node and feasibility.holds_resources(pod) and node in self._requested:
                left_out.setdefault(node, Counter())
                left_out[node].update(feasibility.pod_requests(pod))
                left_out[node]["\0pods"] += 1
        if not left_out:
            return found
        found = dict(found)
        for node, amounts in left_out.items():
            requested = Counter(self._requested[node])
            requested.subtract({r: a for r, a in amounts.items() if r != "\0pods"})
            found[node] = self._node_usage(requested, node, amounts["\0pods"])
        return found

    def _node_usage(self, requested: Counter[str], node: str, fewer: int = 0) -> feasibility.Usage:
        kept = {r: a for r, a in requested.items() if a}
        return feasibility.Usage(requested=kept, pods=self._pods_on[node] - fewer)

    def learn(self, verb: str, obj: kube.Body) -> None:
        """Apply the answer of one of the operator's own writes (``kube.Client.on_write``)."""
        store = {"Pod": self.pods, "Node": self.nodes}.get(str(obj.get("kind")))
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

    async def run(self, client: kube.Client, waker: Waker | None = None) -> None:
        """Follow pods (all namespaces: foreign pods hold GPUs too) and nodes until cancelled.

        Also makes ``client`` report its writes to the cache; ``waker`` (None: none) is poked.
        """
        client.on_write = self.learn
        waker = waker or _Asleep()
        await asyncio.gather(
            self._follow("pods", client.list_pods, client.watch_pods, self.pods, waker),
            self._follow("nodes", client.list_nodes, client.watch_nodes, self.nodes, waker),
        )

    async def _follow(
        self,
        what: str,
        list_: Callable[..., Any],
        watch: Callable[..., Any],
        store: Store,
        waker: Waker,
    ) -> None:
        version: str | None = None
        scope: dict[str, Any] = {"namespace": None} if what == "pods" else {}
        while True:
            try:
                if version is None:
                    items, version = await list_(**scope, keep=store.trim)
                    store.replace(items, version)
                    self._synced.add(what)
                    if self._synced == {"pods", "nodes"}:
                        self.synced.set()
                    waker.poke_waiting()
                    logger.info("cache of %s filled: %d object(s)", what, len(store))
                async for type_, obj in watch(**scope, resource_version=version):
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    if type_ == "BOOKMARK":
                        continue
                    if type_ == "DELETED":
                        store.remove(obj)
                    elif not store.upsert(obj):
                        continue  # nothing the operator reads changed (a heartbeat)
                    _wake(waker, what, type_, obj)
            except kube.ApiError as err:
                if err.status == 410:
                    version = None  # too old: list again and replace the store
                    continue
                logger.warning("watch of %s failed: %s", what, err)
                await asyncio.sleep(RETRY_SECONDS)
            except (TimeoutError, OSError, ValueError) as err:
                logger.warning("watch of %s interrupted: %s", what, err)
                await asyncio.sleep(RETRY_SECONDS)


def _wake(waker: Waker, what: str, type_: str, obj: kube.Body) -> None:
    if what == "nodes":
        waker.poke_waiting()
        return
    job = job_of(obj)
    if job:
        waker.poke((_key(obj)[0], job))
    if type_ == "DELETED" or (obj.get("status") or {}).get("phase") in FINISHED:
        waker.poke_waiting()
