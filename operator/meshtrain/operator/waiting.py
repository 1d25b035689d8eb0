"""The jobs of one operator process waiting for capacity: :class:`Queue`.

The placer enters a job whose plan placed nothing and removes it once placed; the wake-ups ask
which waiting jobs a capacity change could admit, and the placer which nodes the reservation
keeps from a job (the rules are ``policy.capacity_queue``'s and ``policy.reservation``'s; the
node set is planned by ``reserving``).  Free pod slots are counted on the informer's
nodes and usage, once per pod shape per question (at most :data:`MAX_SHAPES` shapes: beyond
them, and for DRA jobs, a job's shape is unknown and it is always woken); a job a preferred level
holds to one domain (``topology_hold``) is woken only where one domain of each held level has
its slots, counted for that job.

A capacity-change sequence number (:meth:`Queue.capacity_changed`) is recorded when a job's plan
starts (:meth:`Queue.planning`): a pass plans a waiting job again only if something it may use
changed since (capacity, the reservation's holder or released nodes, or with time alone: a hold
for one domain ended, a node it avoided came back, :meth:`Queue.time_changed`) and the wake-up
rule admits it on what there is now (:meth:`Queue.unchanged`); a job whose plan raced a change is
woken once it is marked waiting (:meth:`Queue.missed`).  The reservation's holder has its node
set planned when due (``reserving.refresh``) without a plan of its gang.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Hashable, Iterable

from meshtrain.api import spec as api_spec
from meshtrain.operator.cluster import clock, informer, kube
from meshtrain.operator.policy import (
    capacity_queue,
    feasibility,
    identity,
    job_state,
    reservation,
    resizing,
    topology_hold,
)

Key = tuple[str, str]
"""(namespace, name) of a job."""
TIME_CHANGE_RETRY_SECONDS = 1.0
"""The soonest requeue for a change of time that came before a pass judged it."""
MAX_SHAPES = 64
"""Distinct pod shapes whose free slots are counted; a job of any further shape is unknown (woken)."""


def shape_of(demand: feasibility.Demand) -> Hashable:
    """A key equal for pods that fit the same nodes alike (requests, tolerations, selectors)."""
    return (
        tuple(sorted(demand.requests.items())),
        repr(demand.tolerations),
        tuple(sorted(demand.node_selector.items())),
        repr(demand.node_affinity),
    )


def need_of(
    spec: api_spec.TrainingJobSpec, demand: feasibility.Demand, unknown: bool = False
) -> capacity_queue.Need:
    """What a job waits for: its smallest allowed gang of pods of ``demand`` (shape None when
    ``unknown`` or the job asks its GPUs through DRA: node allocatable does not count them)."""
    pods = min((candidate.pods for _, candidate in resizing.candidates(spec)), default=spec.pods)
    gpus = demand.requests.get(spec.resources.gpu_resource_name, 0)
    unknown = unknown or spec.resources.dra is not None
    return capacity_queue.Need(
        shape=None if unknown else shape_of(demand), gpus_per_pod=gpus, pods=pods
    )


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
        self.specs: dict[str, api_spec.TrainingJobSpec] = {}
        """UID -> the waiting job's spec (what a device change is judged against, ``device_wake``;
        its declared limit, whether it may backfill)."""
        self._started: dict[str, dict[str, str]] = {}
        """UID -> the waiting job's ``startTime`` as its status has it (``{}``: never started)."""
        self.kueue: set[str] = set()
        """UIDs of jobs Kueue admitted: Kueue's queue orders them, so they neither hold the
        reservation nor are held back by it (the wake-up rule applies to them all the same)."""
        self._changes = 0
        """Capacity changes told to this queue (:meth:`capacity_changed`)."""
        self._planned: dict[str, tuple[int, int, str | None, int, bool]] = {}
        """UID -> (:attr:`seq`, generation, holder UID, releases seen, whether it may backfill)
        when its last plan started (:meth:`_reserved_for`)."""
        self._avoided: dict[str, tuple[float, frozenset[str]]] = {}
        """UID -> (monotonic time the first nodes its last plan left out for a while, replaced
        stragglers or scheduler refusals, may take its pods again; those nodes): the pass then
        judges it with no capacity change."""
        self._released = 0
        """Node sets of the reservation planned again that let nodes go (:meth:`released`)."""
        self._holds: dict[str, tuple[float, frozenset[str]]] = {}
        """UID -> (monotonic time its last plan's hold for one domain ends, the held levels'
        labels) (``topology_hold``): until then a change wakes it only where one domain of each
        held level has its slots; then a pass judges it with no change (:meth:`unchanged`) and,
        admitted, plans it across domains if need be."""
        self._owed: set[str] = set()
        """UIDs whose next plan answers a change of time alone (:meth:`owed_to_time`)."""
        self._verdicts: dict[str, tuple[tuple[int, int, str | None, int, bool], bool]] = {}
        """UID -> ((:attr:`seq`, generation, holder UID, releases, backfill), whether the wake-up rule
        admits it): the free slots are counted once per change, not at every resync."""
        self.reserve_after = capacity_queue.RESERVE_AFTER_SECONDS
        """Seconds a job waits before it may hold the reservation (``--reserve-after-seconds``)."""
        self.reservation: reservation.Reservation | None = None
        """The node set kept for the holder, as last planned (``reserving``)."""
        self._may_hold: set[str] | None = None
        """UIDs of the jobs that may hold by their objects when this process first asked
        (:meth:`unsettled`), until each had its node set asked for here."""
        self._settle_until = 0.0
        """Monotonic time past which :meth:`unsettled` answers False whatever is left."""
        self._held_back: dict[str, Key] = {}
        """UID -> (namespace, name) of the jobs :meth:`hold_back` held back: woken when the last
        job that may hold settles (no pass every second while they wait)."""
        self._clear_memo: tuple[tuple[object, ...], tuple[bool, float | None]] | None = None
        """(what it was counted on, :meth:`_counted`'s answer)."""
        self._unfit: dict[str, int] = {}
        """UID -> node changes when its reservation's plan found no place: it may not hold until
        the nodes change."""

    @property
    def seq(self) -> int:
        """Capacity changes seen so far: those the cache saw itself (every wake-up it gave, with
        or without a waker wired to this queue) and those told here; only compared for equality."""
        return self.cache.capacity_changes + self._changes

    def capacity_changed(self) -> None:
        """Nodes changed or GPUs were freed (the informer's wake-up)."""
        self._changes += 1

    def planning(self, ref: identity.JobRef, generation: int) -> None:
        """A plan of the job starts now: what it sees is the capacity as of :attr:`seq` (and the
        reservation's holder and node set then)."""
        self._planned[ref.uid] = (self.seq, generation, *self._reserved_for(ref.uid))

    def _reserved_for(self, uid: str) -> tuple[str | None, int, bool]:
        """What of the reservation job ``uid``'s plan depends on: the holder, for any other job
        how often a node set let nodes go (the holder's own plan may use its nodes, as may a job
        that backfills), and whether it may backfill."""
        held = self.holder()
        holder = None if held is None else held.uid
        backfills = holder != uid and reservation.may_backfill(
            self._backfill_clear(held), self._ends(uid)
        )
        return holder, 0 if holder == uid or backfills else self._released, backfills

    def _ends(self, uid: str) -> float | None:
        """When waiting job ``uid``'s pods would be gone if placed now (``reservation.job_end``)."""
        spec = self.specs.get(uid)
        if spec is None:
            return None
        return reservation.job_end(spec, self._started.get(uid, {}), time.time())

    def _backfill_clear(self, held: capacity_queue.Waiting | None) -> float | None:
        """When the reserved nodes are clear for their holder ``held`` by the declared limits of
        the jobs on them, while backfill is open: a node set is planned for it and it cannot
        start there now (it goes first once it can).  None: closed, or a job there declares no
        limit."""
        counted = self._counted(held)
        return None if counted is None or not counted[0] else counted[1]

    def reserved_clear(self) -> float | None:
        """When the reserved nodes are clear of the jobs on them by their declared limits,
        whether or not the holder could start now (None: none reserved, or a job there declares
        no limit)."""
        counted = self._counted(self.holder())
        return None if counted is None else counted[1]

    def _counted(self, held: capacity_queue.Waiting | None) -> tuple[bool, float | None] | None:
        """(whether ``held`` cannot start on its node set now, when that set is clear by the
        declared limits: ``reservation.clear_by``); None when no node set is planned for it.
        Counted on the cache as it is, again only after a pod, job, assumption, node or the
        holder's need changed (a clear time passed since is read as now)."""
        kept = self.reservation
        if held is None or kept is None or kept.holder != held.uid or not kept.nodes:
            return None
        cache = self.cache
        cache.assumed.expire(time.monotonic())  # an assumption ran out: it counts no more
        key = (
            *(kept.holder, kept.at, held.need, cache.pods.changes, cache.jobs.changes),
            *(cache.assumed.changes, cache.nodes.changes),
        )
        if self._clear_memo is None or self._clear_memo[0] != key:
            self._clear_memo = (key, (self._short(held) is True, self._clear_by(kept)))
        blocked, clear = self._clear_memo[1]
        return blocked, None if clear is None else max(clear, time.time())  # never in the past

    def node_ends(self, names: list[str]) -> dict[str, float]:
        """Per node, when it is clear of meshtrain's pods by their jobs' declared limits
        (``reservation.pod_end``; ``math.inf``: some job there declares none); a node without
        such pods is clear now.  The holder's own pods are not counted."""
        now, held = time.time(), self.holder()
        holding = self.cache.holding(names)
        found = {}
        for name in names:
            ends = [
                reservation.pod_end(pod, job, now)
                for job, pod in holding.get(name, ())
                if held is None or ((job or {}).get("metadata") or {}).get("uid") != held.uid
            ]
            latest = reservation.clear_by(ends, now)
            found[name] = math.inf if latest is None else latest
        return found

    def _clear_by(self, kept: reservation.Reservation) -> float | None:
        now = time.time()
        ends = (
            reservation.pod_end(pod, job, now)
            for held in self.cache.holding(kept.nodes).values()
            for job, pod in held
            if ((job or {}).get("metadata") or {}).get("uid") != kept.holder
        )
        return reservation.clear_by(ends, now)

    def released(self) -> None:
        """The holder's node set was planned again and let nodes go: the other waiting jobs are
        judged again at their next pass (as after a capacity change)."""
        self._released += 1

    def key_of(self, uid: str) -> Key | None:
        """(namespace, name) of the waiting job ``uid`` (None: not waiting)."""
        return next((key for key, found in self._uids.items() if found == uid), None)

    def uid_of(self, key: Key) -> str | None:
        """The UID of the waiting job ``key`` (None: not waiting)."""
        return self._uids.get(key)

    def missed(self, key: Key) -> bool:
        """Whether capacity changed since the waiting job ``key``'s last plan started."""
        planned = self._planned.get(self._uids.get(key, ""))
        return planned is not None and planned[0] != self.seq

    def unchanged(self, ref: identity.JobRef, generation: int) -> bool:
        """Whether this waiting job needs no plan: the same generation as its last plan, and
        either nothing changed since (capacity, the reservation's holder, and with time alone:
        a hold's end, an avoided node's return) or the wake-up rule does not admit it on the
        capacity there is now: only a change that could admit it plans (issue #36's one plan per
        admitting change).  A reservation's holder whose node set is due has it planned by
        ``reserving.refresh`` all the same."""
        if ref.uid not in self.entries or ref.uid in self.kueue:
            return False  # Kueue's admissions and reassignments wake its jobs: they plan
        planned = self._planned.get(ref.uid)
        if planned is None or planned[1] != generation:
            return False
        hold_ended, returned = self._times_came(ref.uid)
        timed = hold_ended or returned is not None
        mark = (self.seq, generation, *self._reserved_for(ref.uid))
        changed = (planned[0], *planned[2:]) != (mark[0], *mark[2:])
        if not timed and not changed:
            return True  # its last plan saw this very capacity: it would place nothing again
        narrowed = planned[4] and not mark[4] and (planned[0], planned[2]) == (mark[0], mark[2])
        if not timed and narrowed:
            return True  # only its backfill ended: it may use fewer nodes than its last plan saw
        known = self._verdicts.get(ref.uid)
        if timed or known is None or known[0] != mark:  # the verdict changes with what it may use
            known = self._verdicts[ref.uid] = (mark, bool(self.wake([(ref.namespace, ref.name)])))
        admits = known[1]
        shape = self.entries[ref.uid].need.shape
        if admits and not changed and not hold_ended and returned and shape is not None:
            admits = self.free_slots(shape, only=returned) > 0  # only those nodes came back
        if timed and admits:
            self._owed.add(ref.uid)
        return not admits

    def _times_came(self, uid: str) -> tuple[bool, frozenset[str] | None]:
        """Whether job ``uid``'s hold ended, and the avoided nodes that came back (None: none),
        since a pass last judged them; each is judged once (dropped here)."""
        now = time.monotonic()
        hold_ended = self._holds.get(uid, (math.inf,))[0] <= now
        if hold_ended:
            self._holds.pop(uid, None)
        avoided = self._avoided.get(uid)
        returned = None
        if avoided is not None and avoided[0] <= now:
            returned = self._avoided.pop(uid)[1]
        return hold_ended, returned

    def owed_to_time(self, uid: str) -> bool:
        """Whether the plan of job ``uid`` about to start answers a change of time alone that the
        wake-up rule admits (:meth:`unchanged`); asked once per such change."""
        if uid in self._owed:
            self._owed.discard(uid)
            return True
        return False

    def enter(
        self,
        ref: identity.JobRef,
        spec: api_spec.TrainingJobSpec,
        demand: feasibility.Demand,
        unknown: bool = False,
        since: float | None = None,
        priority: int = 0,
        avoided_until: tuple[float, frozenset[str]] | None = None,
        held_until: float | None = None,
        held_in: frozenset[str] = frozenset(),
        started: str | None = None,
    ) -> capacity_queue.Waiting:
        """The job waits (since the first time: a job entered again keeps its place).

        ``unknown``: slot counts do not bound its plan (it re-places beside its own pods);
        ``since``: when it began to wait (``queue_order.since_of``; None: now), ``priority``: its
        PriorityClass value; ``avoided_until``: monotonic time the first nodes its plan left out
        for a while (stragglers, scheduler refusals) may take its pods again, and those nodes
        (``GangFit.avoided_until``): an exclusion that ends with time, not with a capacity change;
        ``held_until``: monotonic time a preferred level stops holding it for one domain, one
        of each of the ``held_in`` labels; ``started``: its ``status.startTime`` (its declared
        limit runs from then, :meth:`_reserved_for`).
        """
        unknown = unknown or bool(self.cache.inventory().devices)  # slices may serve it
        need = need_of(spec, demand, unknown)
        if need.shape is not None and need.shape not in self._demands:
            if len(self._demands) >= MAX_SHAPES:
                need = dataclasses.replace(need, shape=None)
            else:
                self._demands[need.shape] = demand
        found = self.entries.get(ref.uid)
        misses = 0 if found is None else found.misses
        if (
            found is not None
            and held_until is None  # a plan held to one domain says nothing of the reserved nodes
            and self.holder() == found
            and self._short(found) is False
        ):
            misses += 1  # it held, its count was free, and its plan placed nothing
        began = [t for t in (since, None if found is None else found.since) if t is not None]
        fits = need.shape is None or self._fits_drained(need.shape, need.pods)
        if self._unfit.get(ref.uid) == self.cache.nodes.changes:
            fits = False  # its reservation's plan found no place even with our pods gone
        entry = self.entries[ref.uid] = capacity_queue.Waiting(
            ref.uid, need, min(began, default=time.time()), fits, misses, priority
        )
        self._uids[(ref.namespace, ref.name)] = ref.uid
        self.specs[ref.uid] = spec
        self._started[ref.uid] = {"startTime": started} if started else {}
        if held_until is None:
            self._holds.pop(ref.uid, None)
        else:
            self._holds[ref.uid] = (held_until, held_in)
        self._verdicts.pop(ref.uid, None)  # judged under the hold it had, if any
        if avoided_until is None:
            self._avoided.pop(ref.uid, None)
        else:
            self._avoided[ref.uid] = avoided_until
        if found is not None:
            self._prune(found.need.shape)
        return entry

    def leave(self, ref: identity.JobRef) -> None:
        """The job waits no more (placed, deleted, finished or suspended)."""
        left = self.entries.pop(ref.uid, None)
        self.specs.pop(ref.uid, None)
        self._started.pop(ref.uid, None)
        self.kueue.discard(ref.uid)
        self._planned.pop(ref.uid, None)
        self._verdicts.pop(ref.uid, None)
        self._avoided.pop(ref.uid, None)
        self._owed.discard(ref.uid)
        self._holds.pop(ref.uid, None)
        if self._uids.get((ref.namespace, ref.name)) == ref.uid:
            del self._uids[(ref.namespace, ref.name)]
        if self.reservation is not None and self.reservation.holder == ref.uid:
            self.reservation = None
        self._unfit.pop(ref.uid, None)
        self._held_back.pop(ref.uid, None)
        self.settled(ref.uid)  # placed or gone: nobody waits for its node set
        if left is not None:
            self._prune(left.need.shape)

    def unfit(self, uid: str) -> None:
        """Job ``uid`` found no place even with meshtrain's pods gone: it holds no more (until
        the nodes change)."""
        if (entry := self.entries.get(uid)) is not None:
            self.entries[uid] = dataclasses.replace(entry, fits_drained=False)
            self._unfit[uid] = self.cache.nodes.changes

    def _prune(self, shape: Hashable | None) -> None:
        """Forget ``shape``'s demand once no waiting job has it."""
        if all(w.need.shape != shape for w in self.entries.values()):
            self._demands.pop(shape, None)

    def _short(self, entry: capacity_queue.Waiting) -> bool | None:
        """Whether the free slots are fewer than the entry's pods (None: unknown shape), counted
        on its reserved nodes once they are planned."""
        if entry.need.shape is None:
            return None
        kept = self.reservation
        only = kept.nodes if kept is not None and kept.holder == entry.uid else None
        return self.free_slots(entry.need.shape, only=only) < entry.need.pods

    def _fits_drained(self, shape: Hashable, pods: int) -> bool:
        """Whether ``pods`` of ``shape`` fit the nodes with nothing running on them."""
        demand, total = self._demands[shape], 0
        for node in self.cache.nodes.values():
            total += feasibility.slots(demand, node, feasibility.Usage(), pods)
            if total >= pods:
                return True
        return False

    def free_slots(
        self,
        shape: Hashable,
        excluding: frozenset[str] = frozenset(),
        only: frozenset[str] | None = None,
    ) -> int:
        """Pods of ``shape`` the nodes could take now, each node counted on its own (leaving the
        ``excluding`` nodes out; only the ``only`` nodes, when given)."""
        demand = self._demands[shape]
        total = 0
        if only is None:
            nodes: Iterable[kube.Body] = self.cache.nodes.values()
        else:  # those nodes alone (a reserved set): not a walk over the fleet
            nodes = (n for name in only if (n := self.cache.nodes.get(("", name))) is not None)
        for node in nodes:
            name = (node.get("metadata") or {}).get("name") or ""
            if name in excluding:
                continue
            used = self.cache.node_usage(name) or feasibility.Usage()
            total += feasibility.slots(demand, node, used, 1 << 30)
        return total

    def holder(self) -> capacity_queue.Waiting | None:
        """The job holding the reservation, if any (``capacity_queue.holder``)."""
        ours = (w for uid, w in self.entries.items() if uid not in self.kueue)
        return capacity_queue.holder(ours, time.time(), self.reserve_after)

    def basis(self) -> tuple[int, int]:
        """(node changes, capacity changes) so far: a reservation planned on them is current."""
        return self.cache.nodes.changes, self.seq

    def reservation_due(self, uid: str) -> bool:
        """Whether job ``uid`` holds the reservation and its node set is to be planned now."""
        held = self.holder()
        if held is None or held.uid != uid:
            return False
        return reservation.due(self.reservation, uid, self.basis(), time.monotonic())

    def unsettled(self, uid: str) -> bool:
        """Whether another job than ``uid`` may hold (its condition says it waited long enough)
        but this process has not asked for its node set yet: just after a restart or failover,
        for :data:`reservation.SETTLE_SECONDS` at most.  Other paths that take GPUs wait."""
        now = time.monotonic()
        if self._may_hold is None:
            self._settle_until = now + reservation.SETTLE_SECONDS
            stamp = clock.now()
            self._may_hold = {
                str(job["metadata"].get("uid"))
                for job in self.cache.jobs.values()
                if reservation.may_hold(job, stamp, self.reserve_after)
            } - self._planned.keys()  # planned here already: asked for its node set then
        if now >= self._settle_until:  # the held-back jobs' own passes are owed now
            self._may_hold.clear()
            self._held_back.clear()
        return uid not in self._may_hold and bool(self._may_hold)

    def settled(self, uid: str) -> None:
        """This process asked for job ``uid``'s node set (planned, not due, or it placed); the
        last of them wakes the jobs held back."""
        if self._may_hold is None:
            return
        self._may_hold.discard(uid)
        if not self._may_hold and self._held_back:
            held_back, self._held_back = self._held_back, {}
            for key in held_back.values():
                self.cache.waker.poke(key)

    def _time_change(self, uid: str) -> float | None:
        """Monotonic time the nodes waiting job ``uid`` may use change with no capacity change:
        a preferred level's hold ends, or a node its plan avoided comes back (None: never)."""
        ends = (self._holds.get(uid, (None,))[0], self._avoided.get(uid, (None,))[0])
        return min((t for t in ends if t is not None), default=None)

    def time_changed(self, uid: str) -> bool:
        """Whether that time (:meth:`_time_change`) has come and no pass judged it yet
        (:meth:`unchanged` judges it as a capacity change is judged, once)."""
        at = self._time_change(uid)
        return at is not None and at <= time.monotonic()

    def time_left(self, uid: str) -> float | None:
        """Seconds until a pass is owed for that time (None: no such time); a time that came
        while no pass judged it (it came during the plan) is owed after
        :data:`TIME_CHANGE_RETRY_SECONDS`, never at once (the reconciler waits longer while the
        job's plans are spaced out)."""
        at = self._time_change(uid)
        return None if at is None else max(at - time.monotonic(), TIME_CHANGE_RETRY_SECONDS)

    def hold_back(self, ref: identity.JobRef) -> float:
        """Hold job ``ref``'s plan back while :meth:`unsettled`: it is woken when the last job
        that may hold settles; the seconds until the settle window ends (a pass is owed then)."""
        self._held_back[ref.uid] = (ref.namespace, ref.name)
        return max(self._settle_until - time.monotonic(), 0.0)

    def reserved_nodes(self) -> frozenset[str]:
        """The nodes kept for the holder (none while its node set is not planned)."""
        held = self.holder()
        if held is None or self.reservation is None or self.reservation.holder != held.uid:
            return frozenset()
        return self.reservation.nodes

    def excluded(self, uid: str, ends: float | None = None) -> frozenset[str]:
        """The reserved nodes job ``uid``, whose pods are gone by ``ends`` (None: not bounded),
        may not take (``reservation.excluded``)."""
        held = self.holder()
        if held is None or self.reservation is None or self.reservation.holder != held.uid:
            return frozenset()
        backfills = reservation.may_backfill(self._backfill_clear(held), ends)
        return reservation.excluded(self.reservation, uid, backfills)

    def excluded_for(self, job: job_state.JobState) -> frozenset[str]:
        """:meth:`excluded` for ``job`` by its declared limit (``reservation.job_end``)."""
        spec = job.declared or job.spec
        ends = None if spec is None else reservation.job_end(spec, job.status, time.time())
        return self.excluded(job.ref.uid, ends)

    def wake(self, keys: Iterable[Key]) -> list[Key]:
        """Of the waiting jobs ``keys``, those a capacity change could admit (unknown ones too):
        their pods fit in the free slots, outside the reserved nodes unless they hold them or
        may backfill."""
        needs = {}
        for key in keys:
            entry = self.entries.get(self._uids.get(key, ""))
            needs[key] = entry.need if entry is not None else None
        held = self.holder()
        reserved = self.reserved_nodes()
        clear = self._backfill_clear(held) if reserved else None
        holds = {
            k
            for k in needs
            if held is not None
            and (
                self._uids.get(k) == held.uid
                or reservation.may_backfill(clear, self._ends(self._uids.get(k, "")))
            )
        }
        found = set(capacity_queue.admissible({k: needs[k] for k in holds}, self.free_slots))
        others = {k: n for k, n in needs.items() if k not in holds}
        found.update(
            capacity_queue.admissible(others, lambda s: self.free_slots(s, excluding=reserved))
        )
        largest: dict[tuple[Hashable, str, bool], int] = {}  # counted once per wake
        return [
            key
            for key in needs
            if key in found and self._domain_for(key, key in holds, reserved, largest)
        ]

    def _domain_for(
        self,
        key: Key,
        holds: bool,
        reserved: frozenset[str],
        largest: dict[tuple[Hashable, str, bool], int],
    ) -> bool:
        """Whether waiting job ``key``, if a preferred level still holds it, finds its pods'
        slots inside one domain of each held level (outside the reserved nodes unless it
        ``holds`` them); a job no level holds, or of unknown shape, passes.  ``largest`` keeps
        each (shape, label, holds) count for the other jobs of one wake-up."""
        uid = self._uids.get(key, "")
        entry, held = self.entries.get(uid), self._holds.get(uid)
        if entry is None or held is None or entry.need.shape is None:
            return True
        ends, labels = held
        if ends <= time.monotonic():
            return True
        shape = entry.need.shape
        for label in labels:
            if (shape, label, holds) not in largest:
                excluding = frozenset() if holds else reserved
                largest[(shape, label, holds)] = self._largest_domain(shape, label, excluding)
            if largest[(shape, label, holds)] < entry.need.pods:
                return False
        return True

    def _largest_domain(self, shape: Hashable, label: str, excluding: frozenset[str]) -> int:
        """Free pods of ``shape`` in the fullest domain of ``label`` (``topology_hold``'s count),
        leaving the ``excluding`` nodes out."""
        demand = self._demands[shape]
        free = []
        for node in self.cache.nodes.values():
            metadata = node.get("metadata") or {}
            name = metadata.get("name") or ""
            if name not in excluding:
                used = self.cache.node_usage(name) or feasibility.Usage()
                slots = feasibility.slots(demand, node, used, 1 << 30)
                free.append((name, metadata.get("labels") or {}, slots))
        return topology_hold.largest_domains(free, (label,))[label]
