"""The jobs of one operator process waiting for capacity: :class:`Queue`.

The placer enters a job whose plan placed nothing and removes it once placed; the wake-ups ask
which waiting jobs a capacity change could admit, and the placer whether the reservation holds a
job back (the rules are ``policy.capacity_queue``'s).  Free pod slots are counted on the informer's
nodes and usage, once per pod shape per question.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable

from meshtrain.api import spec as api_spec
from meshtrain.operator.cluster import informer
from meshtrain.operator.policy import capacity_queue, feasibility, identity, resizing

Key = tuple[str, str]
"""(namespace, name) of a job."""


def shape_of(demand: feasibility.Demand) -> Hashable:
    """A key equal for pods that fit the same nodes alike (requests, tolerations, selectors)."""
    return (
        tuple(sorted(demand.requests.items())),
        repr(demand.tolerations),
        tuple(sorted(demand.node_selector.items())),
        repr(demand.node_affinity),
    )


def need_of(spec: api_spec.TrainingJobSpec, demand: feasibility.Demand) -> capacity_queue.Need:
    """What a job waits for: its smallest allowed gang of pods of ``demand``."""
    pods = min((candidate.pods for _, candidate in resizing.candidates(spec)), default=spec.pods)
    gpus = demand.requests.get(spec.resources.gpu_resource_name, 0)
    return capacity_queue.Need(shape=shape_of(demand), gpus_per_pod=gpus, pods=pods)


class Queue:
    """Waiting jobs by UID, the pod demand of each shape, and free slots counted on the cache."""

    def __init__(self, cache: informer.Cache) -> None:
        self.cache = cache
        self.entries: dict[str, capacity_queue.Waiting] = {}
        """Waiting jobs by UID."""
        self._uids: dict[Key, str] = {}
        """(namespace, name) -> UID of the waiting job of that name."""
        self._demands: dict[Hashable, feasibility.Demand] = {}
        """Shape -> a pod demand of that shape (what free slots are counted for)."""
        self.kueue: set[str] = set()
        """UIDs of jobs Kueue admitted: Kueue's queue orders them, so they neither hold the
        reservation nor are held back by it (the wake-up rule applies to them all the same)."""

    def enter(
        self, ref: identity.JobRef, spec: api_spec.TrainingJobSpec, demand: feasibility.Demand
    ) -> capacity_queue.Waiting:
        """The job waits (since the first time: a job entered again keeps its place)."""
        need = need_of(spec, demand)
        self._demands.setdefault(need.shape, demand)
        found = self.entries.get(ref.uid)
        if found is None or found.need != need:
            since = found.since if found is not None else time.monotonic()
            found = self.entries[ref.uid] = capacity_queue.Waiting(ref.uid, need, since)
        self._uids[(ref.namespace, ref.name)] = ref.uid
        return found

    def leave(self, ref: identity.JobRef) -> None:
        """The job waits no more (placed, deleted, finished or suspended)."""
        self.entries.pop(ref.uid, None)
        self.kueue.discard(ref.uid)
        if self._uids.get((ref.namespace, ref.name)) == ref.uid:
            del self._uids[(ref.namespace, ref.name)]

    def free_slots(self, shape: Hashable) -> int:
        """Pods of ``shape`` the nodes could take now, each node counted on its own."""
        demand = self._demands[shape]
        total = 0
        for node in self.cache.nodes.values():
            name = (node.get("metadata") or {}).get("name") or ""
            used = self.cache.node_usage(name) or feasibility.Usage()
            total += feasibility.slots(demand, node, used, 1 << 30)
        return total

    def holder(self) -> capacity_queue.Waiting | None:
        """The job holding the reservation, if any (``capacity_queue.holder``)."""
        ours = (w for uid, w in self.entries.items() if uid not in self.kueue)
        return capacity_queue.holder(ours, time.monotonic())

    def held_back(
        self, ref: identity.JobRef, spec: api_spec.TrainingJobSpec, demand: feasibility.Demand
    ) -> capacity_queue.Waiting | None:
        """The reservation's holder when it holds this job back, else None."""
        reserved = self.holder()
        if reserved is None or reserved.uid == ref.uid or ref.uid in self.kueue:
            return None
        free = self.free_slots(reserved.need.shape)
        need = need_of(spec, demand)
        return reserved if capacity_queue.held_back(ref.uid, need, reserved, free) else None

    def wake(self, keys: Iterable[Key]) -> list[Key]:
        """Of the waiting jobs ``keys``, those a capacity change could admit (unknown ones too):
        their pods fit in the free slots, and the reservation does not hold them back."""
        needs = {}
        for key in keys:
            entry = self.entries.get(self._uids.get(key, ""))
            needs[key] = entry.need if entry is not None else None
        counted: dict[Hashable, int] = {}

        def free(shape: Hashable) -> int:
            if shape not in counted:
                counted[shape] = self.free_slots(shape)
            return counted[shape]

        found = capacity_queue.admissible(needs, free)
        reserved = self.holder()
        if reserved is None:
            return found
        kept = []
        for key in found:
            need, uid = needs[key], self._uids.get(key, "")
            if (
                need is None
                or uid in self.kueue
                or not capacity_queue.held_back(uid, need, reserved, free(reserved.need.shape))
            ):
                kept.append(key)
        return kept
