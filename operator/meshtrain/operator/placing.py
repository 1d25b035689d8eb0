"""The placement step of a pass: plan the gang under one process-wide lock, then create it.

:class:`Placer` asks ``gang_fit`` where the gang fits and writes what ``placement_outcome`` says
the plan comes to, and assumes the gang's pods in the cache, before the next job may plan, so
two jobs never plan onto the same free GPUs; the pods are created after the lock is released
(``creating``).  Under the same lock it checks the planned nodes again before the gates are
lifted, grows an elastic gang, and drops a placement whose nodes can no longer take it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from meshtrain.api import spec as api_spec
from meshtrain.operator import (
    creating,
    gang_fit,
    placement_lock,
    planning,
    replan_counts,
    reserving,
    waiting,
)
from meshtrain.operator.cluster import (
    children,
    claims,
    clock,
    informer,
    kube,
    metrics,
    owned,
    priorities,
    status_writes,
    workloads,
)
from meshtrain.operator.cluster.status_writes import Step
from meshtrain.operator.policy import (
    builders,
    capacity,
    conditions,
    device_errors,
    devices,
    failure,
    feasibility,
    gang_backend,
    identity,
    job_actions,
    job_state,
    kubelet_tier,
    kueue_reassigned,
    kueue_topology,
    kueue_workload,
    naming,
    placement_outcome,
    placement_status,
    pod_state,
    queue_order,
    replacement,
    rescheduling,
    reservation,
    resizing,
    retries,
    store_pod,
    topology_hold,
    torchrun_tier,
    volumes,
)

logger = logging.getLogger("meshtrain.operator")

SLOW_PLAN_SECONDS = 0.5
"""A plan that takes this long in the worker is slow (logged with its spacing): real jobs plan in
milliseconds."""
PLAN_SPACING = 20.0
"""A job whose plan placed nothing is not planned again for this many times what that plan took,
so a job whose plans are slow (yet within the deadline) holds the placement lock, which every
other job plans under, a twentieth of the time at most.  A pass that comes meanwhile (a wake when
capacity frees) is not lost: the job is planned again as the spacing ends."""
FAILED_PLAN_RETRY_SECONDS = 30.0
"""A job whose plan got no verdict (the worker died twice, or the node starved it of CPU) is not
planned again for this long: each plan may cost a fresh worker's start."""

WAITS = "waits for capacity"
"""Logged once when a job's plan first finds no place and it joins the waiting jobs."""
PLANNED_AGAIN = "planned again while waiting"
"""Logged at every plan of a waiting job: a platform engineer sees what woke it, and the churn
benchmark checks each against the capacity changes it saw itself (``benchmarks/fleet/replans``)."""


def _describe(problems: Mapping[str, str]) -> str:
    return ", ".join(f"{node}: {why}" for node, why in sorted(problems.items()))


class Placer:
    """Places, grows and re-places the gangs of every job of the process, one at a time."""

    def __init__(
        self,
        *,
        client: kube.Client,
        cache: informer.Cache,
        writer: status_writes.JobWriter,
        fit: gang_fit.GangFit,
        trainer_image: str,
        isolated_namespaces: frozenset[str] = frozenset(),
        gang_peers: builders.GangPeers = builders.NO_PEERS,
        restart_rules: bool = True,
        restart_all: kubelet_tier.RestartAll = "off",
        gang: gang_backend.GangBackend = gang_backend.AUTO,
    ) -> None:
        self.client = client
        self.cache = cache
        self.writer = writer
        self.fit = fit
        self.trainer_image = trainer_image
        self.isolated_namespaces = isolated_namespaces
        """Namespaces where each gang gets its own NetworkPolicy (``--gang-network-policy-namespace``)."""
        self.gang_peers = gang_peers
        """The operator and Prometheus, admitted by each gang's NetworkPolicy on their ports."""
        self.restart_rules = restart_rules
        """The API server accepts container restart rules (``kubelet_tier``): pods carry them."""
        self.restart_all = restart_all
        """Whether custom trainers' pods carry the ``RestartAllContainers`` rule (KEP-5532):
        ``auto`` where every node of the gang declares it (:meth:`restart_all_on`)."""
        self.lock = placement_lock.PlacementLock()
        self.waiting = waiting.Queue(cache)
        """Jobs waiting for capacity: whom a capacity change wakes, who holds the reservation."""
        self.replans = replan_counts.Counts()
        """Per waiting job, its plans and the capacity changes that could admit it."""
        self.priorities = priorities.Priorities(client)
        """PriorityClass values of jobs' pods: the reservation's order."""
        self._grow_backoff: dict[tuple[str, str], tuple[float, float]] = {}
        """Jobs whose last grow check found no room: (monotonic time of the next check, interval)."""
        self._next_plan: dict[str, float] = {}
        """Jobs (by UID) whose last plan placed nothing, or got no verdict: when they may
        plan again (:data:`PLAN_SPACING`, :data:`FAILED_PLAN_RETRY_SECONDS`)."""
        self._deferred: set[str] = set()
        """Jobs (by UID) a pass found spaced out: planned again as their spacing ends."""
        self._held_back: dict[str, float] = {}
        """Jobs (by UID) held back after a restart (``waiting.Queue.hold_back``) -> the
        :attr:`_next_plan` they had before, restored once the hold-back ends."""
        self.gang = gang
        """Who binds each gang whole (``--gang-backend``)."""
        self._gang: gang_backend.Resolved | None = None
        """What ``gang`` comes to on this cluster (None: not decided yet; ``auto`` asks whether
        the native PodGroups are served, once)."""
        self.create_failures = retries.Backoff(children.retry_delay)
        """Jobs (by UID: a namesake re-created is a new job) whose children were refused: when they may try again."""
        self._policy_checked: set[str] = set()
        """Jobs (by UID) whose gang NetworkPolicy this process has ensured or removed once."""

    def forget(self, ref: identity.JobRef) -> None:
        """Drop what is remembered of a deleted job."""
        self.fit.forget(ref.namespace, ref.name, ref.uid)
        self.cache.assumed.release(ref.uid)
        self.waiting.leave(ref)
        self.create_failures.forget(ref.uid)
        self._grow_backoff.pop((ref.namespace, ref.name), None)
        self._next_plan.pop(ref.uid, None)
        self._policy_checked.discard(ref.uid)
        self._deferred.discard(ref.uid)
        self._held_back.pop(ref.uid, None)

    def restart_all_on(self, nodes: Iterable[str]) -> bool:
        """Whether pods placed on ``nodes`` carry the ``RestartAllContainers`` rule (cached Nodes)."""
        cached = (self.cache.nodes.get(("", node)) for node in nodes)
        return kubelet_tier.declares_all(self.restart_all, cached)

    async def check_gang_policy(self, job: job_state.JobState) -> None:
        """Once per job and process, for a gang that has pods: ensure its NetworkPolicy where
        its namespace is isolated (isolation turned on while it ran), delete the one it owns
        where it is not (turned off); a same-named policy it does not own is left alone.

        One read (and a create, patch or delete) per job per operator start, no LIST.
        """
        ref = job.ref
        if ref.uid in self._policy_checked or job.spec is None:
            return
        if ref.namespace in self.isolated_namespaces:
            policy = builders.build_network_policy(ref, job.spec, self.gang_peers)
            refused = await children.ensure(self.client, ref.uid, [policy], [])
            if refused is not None:
                logger.warning(
                    "%s/%s: no gang NetworkPolicy: %s", ref.namespace, ref.name, refused.message
                )
        elif self.isolated_namespaces:  # none isolated: no RBAC on NetworkPolicies to ask with
            name = naming.network_policy_name(ref.name)
            try:
                await children.delete_owned(
                    self.client, ref.uid, "NetworkPolicy", ref.namespace, name
                )
            except kube.ApiError as err:
                if err.status != 403:  # forbidden: a namespace the RBAC does not cover
                    raise
                logger.info(
                    "%s/%s: gang NetworkPolicy not checked: HTTP %s",
                    ref.namespace,
                    ref.name,
                    err.status,
                )
        self._policy_checked.add(ref.uid)

    def spaced_for(self, uid: str) -> float | None:
        """Seconds until a job a pass found spaced out may plan again (None: no pass is owed).

        Owed once: past the spacing, the pass that came then owes nothing more.
        """
        left = self._next_plan.get(uid, 0.0) - time.monotonic()
        if uid not in self._deferred or left <= 0:
            self._deferred.discard(uid)
            return None
        return left

    async def lift_gates(
        self, action: job_actions.LiftGates, body: dict[str, Any], job: job_state.JobState
    ) -> Step:
        """Lift the gang's gates, unless a planned node can no longer take its pods: then place it again."""
        ref = job.ref
        async with self.lock.urgent():  # the gang holds its GPUs already: before any new plan
            moved = await self._planned_nodes_changed(job)
            if moved:
                message = (
                    f"planned node(s) can no longer take the gang before its gates were lifted "
                    f"({_describe(moved)}); placing it again"
                )
                return await self._replace(body, job, conditions.NODES_CHANGED, message)
            uids = {
                p["metadata"]["name"]: p["metadata"]["uid"]
                for p in owned.owned_pods(self.cache, ref)
            }
            lifted = await self.client.lift_gates(
                namespace=ref.namespace,
                uids={n: uids[n] for n in action.names if n in uids},
            )
        logger.info(
            "gang of %s/%s complete: lifted %d gate(s)",
            ref.namespace,
            ref.name,
            len(lifted),
        )
        return body, job, True

    async def replace_refused(
        self, action: rescheduling.ReplaceRefused, body: dict[str, Any], job: job_state.JobState
    ) -> Step:
        """Place the gang again away from the nodes kube-scheduler refused, spaced per ``rescheduling``."""
        now = time.monotonic()
        record = self.fit.refusals.get(job.ref.uid)
        if rescheduling.wait(record, now) is not None:
            return body, job, False
        self.fit.refusals[job.ref.uid] = rescheduling.replaced(record, action.nodes, now)
        message = rescheduling.message(action.nodes)
        return await self._replace(body, job, conditions.SCHEDULER_REFUSED, message)

    async def _planned_nodes_changed(self, job: job_state.JobState) -> dict[str, str]:
        """Planned nodes that can no longer take their pods of the gang (name -> why).

        The nodes are read from the API server (not the cache, which may lag a watch event
        behind); the pods on them, bound or nominated there, from the cache.
        """
        assert job.spec is not None
        ref = job.ref
        gang = [
            p
            for p in self.cache.job_pods(ref.namespace, ref.name)
            if capacity.owned_by(p, ref.uid)
            and capacity.holds_gpus(p)
            and not store_pod.is_store(p)
        ]
        planned = collections.Counter(identity.planned_node(p) or "" for p in gang)
        if not gang:
            return {}
        demand = feasibility.demand_of(gang[0])
        nodes = await asyncio.gather(*(self.client.get_node(name=name) for name in planned))
        for node in nodes:
            if node is not None:
                self.cache.nodes.upsert(node)
        return capacity.infeasible_nodes(
            demand,
            planned,
            [n for n in nodes if n is not None],
            self.cache.usage(without=self.fit.freed_by_replacing(job)),
            devices.ask_of(job.spec, self.cache.inventory()) if job.spec is not None else None,
        )

    async def _replace(
        self, body: dict[str, Any], job: job_state.JobState, reason: str, message: str
    ) -> Step:
        """A planned node cannot take its pods (before or after the gates were lifted): delete
        the gang's pods and place it again.

        A re-placement, not a restart: no rank started training, ``restarts`` is unchanged.
        """
        ref = job.ref
        logger.info("%s/%s: %s", ref.namespace, ref.name, message)
        body, job, _ = await self.writer.set_status(
            body, job, placement_status.dropped(job, clock.now(), message, reason)
        )
        await self._delete_gang(ref)
        await self.writer.emit(body, "Warning", reason, message)
        return body, job, True

    async def _delete_gang(self, ref: identity.JobRef) -> None:
        """Delete the pods of a dropped placement (written first: a new leader finishes this).

        Never grace 0: the cache may lag a binding (a kubelet would keep GPUs it shows free);
        the API server deletes an unbound pod at once anyway.
        """
        names = [p["metadata"]["name"] for p in owned.owned_pods(self.cache, ref)]
        await owned.delete_pods(
            self.client, self.cache, ref, names, failure.BROKEN_GANG_GRACE_SECONDS
        )

    async def grow(
        self, action: resizing.Grow, body: dict[str, Any], job: job_state.JobState
    ) -> Step:
        """Rebuild a gang running below its largest size when a larger one fits beside everyone else."""
        assert job.declared is not None
        ref = job.ref
        key = (ref.namespace, ref.name)
        backoff = self._grow_backoff.get(key)
        if backoff is not None and time.monotonic() < backoff[0] or self.waiting.unsettled(ref.uid):
            return body, job, False
        async with self.lock:
            gpu = job.declared.resources.gpu_resource_name
            raw_nodes, nodes, _ = self.fit.candidates(job, gpu, clock.now())
            raw_nodes, nodes = reserving.outside(self.waiting, job, raw_nodes, nodes)
            demand = feasibility.demand_of(builders.build_pod(ref, job.declared, 0, 0, ""))
            # Only the size a placement would pick (rules and memory admission included): growing to
            # one it would not pick rebuilds the gang at the running size, again and again.
            try:
                sized = await self.fit.plan_sizes(job, raw_nodes, nodes, demand)
            except (planning.DeadlineExceeded, planning.WorkerFailed) as err:
                logger.info("%s/%s: no grow check: %s", ref.namespace, ref.name, err)
                sized = None
            size = placement_outcome.larger_size(sized, action.running) if sized else None
            if size is None:
                interval = resizing.next_grow_check(backoff[1] if backoff else None)
                self._grow_backoff[key] = (time.monotonic() + interval, interval)
                return await self.writer.set_status(body, job, resizing.no_room(job.status))
        self._grow_backoff.pop(key, None)  # room: check again at every pass until it is stable
        checked = resizing.room_found(
            job.declared, job.status, action.running, size.data, clock.now()
        )
        if not checked.grow:
            body, job, changed = await self.writer.set_status(body, job, checked.fields)
            if checked.message is not None:
                logger.info("%s/%s: %s", ref.namespace, ref.name, checked.message)
                await self.writer.emit(
                    body, "Normal", conditions.ELASTIC_GROW_PENDING, checked.message
                )
            return body, job, changed
        fields, message = resizing.growing(job.status, action.running, size, clock.now())
        logger.info("%s/%s: %s", ref.namespace, ref.name, message)
        # roomSince written with it: the placement that follows may then pick the larger size
        body, job, _ = await self.writer.set_status(
            body, job, {**checked.fields, **fields, "observedGeneration": job.generation}
        )
        await self.writer.emit(body, "Normal", conditions.ELASTIC_GROWING, message)
        await owned.delete_pods(
            self.client,
            self.cache,
            ref,
            [p["metadata"]["name"] for p in owned.owned_pods(self.cache, ref)],
        )
        return body, job, True

    async def _wait_for_leaving(self, body: dict[str, Any], job: job_state.JobState) -> Step | None:
        """Hold a new gang back while the earlier one's pods still terminate (None: none left).

        The state machine deleted them this pass (stale pods); what the wait says is the same
        policy's as for the attempt's own (``placement_outcome.old_gang_leaving``).  Their
        deletion wakes the job.  An earlier attempt's store pod is no reason to wait (the new
        store has another name); this attempt's, still terminating, is.
        """
        owned_pods = owned.owned_pods(self.cache, job.ref)
        attempt = int(job.status.get("restarts") or 0)
        gang = [p for p in owned_pods if not store_pod.is_store(p)]
        leaving = capacity.still_leaving(gang, attempt)
        stores = store_pod.terminating(owned_pods, attempt)  # the new store takes its name
        if not leaving and not stores:
            return None
        pods = [s for s in (pod_state.read(p) for p in leaving) if s is not None]
        waiting = placement_outcome.old_gang_leaving(job, pods, clock.now(), stores)
        return await self.writer.set_status(body, job, waiting.status)

    async def resolved_gang(self) -> gang_backend.Resolved:
        """The gang backend on this cluster, decided once (``auto``: one discovery request)."""
        if self._gang is None:
            served = self.gang.kind == "auto" and await self.client.serves_pod_groups()
            self._gang = gang_backend.resolve(self.gang.kind, served)
            logger.info(
                "gang backend %s: %s", self.gang.kind, gang_backend.described(self._gang, self.gang)
            )
        return self._gang

    async def _pod_group(
        self,
        ref: identity.JobRef,
        spec: api_spec.TrainingJobSpec,
        attempt: int,
        stamped: str | None = None,
    ) -> dict[str, Any] | None:
        """The gang's PodGroup under the cluster's gang backend, else None."""
        resolved = await self.resolved_gang()
        return gang_backend.build_pod_group(resolved, self.gang, ref, spec, attempt, stamped)

    async def gang_pod(
        self, pod: dict[str, Any], group: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """``pod`` as the gang backend schedules it: a member of ``group`` (a gang pod), or of no
        group (a spare, a replacement: their gang is bound)."""
        resolved = await self.resolved_gang()
        name = None if group is None else str(group["metadata"]["name"])
        return gang_backend.join(pod, resolved, self.gang, name)

    async def _refused(
        self, body: dict[str, Any], job: job_state.JobState, refused: children.Refused
    ) -> Step:
        """Children refused: remove what was created, drop the placement, say why, wait longer each time."""
        ref, now = job.ref, time.monotonic()
        tries = self.create_failures.refused(ref.uid, job.generation, now)
        message = (
            f"{refused.message} (try {tries.failures}; next in {tries.not_before - now:.0f} s)"
        )
        logger.warning("%s/%s: %s", ref.namespace, ref.name, message)
        reason, changes = refused.reason, placement_status.children_refused
        if refused.invalid and tries.failures >= children.INVALID_TRIES:  # refused for ever
            reason, changes = conditions.INVALID_SPEC, placement_status.refused
        body, job, _ = await self.writer.set_status(
            body, job, changes(job, reason, message, clock.now())
        )
        await self._delete_gang(ref)
        await self.writer.emit(body, "Warning", reason, refused.message)
        return body, job, True

    def _hold_back_while_unsettled(self, ref: identity.JobRef) -> None:
        """Just restarted: the node sets of the jobs that may hold come first.  A job held back
        is spaced out until the settle window ends and woken as the last of them settles."""
        if self.waiting.unsettled(ref.uid):
            until = time.monotonic() + self.waiting.hold_back(ref)
            before = self._held_back.setdefault(ref.uid, self._next_plan.get(ref.uid, 0.0))
            self._next_plan[ref.uid] = max(before, until)
        elif ref.uid in self._held_back:  # settled: its own spacing, if any, again
            self._next_plan[ref.uid] = self._held_back.pop(ref.uid)

    async def place(
        self, action: job_actions.Place, body: dict[str, Any], job: job_state.JobState
    ) -> Step:
        """Plan the gang and create it (or re-create its missing pods), under the process-wide lock."""
        assert job.spec is not None
        ref, spec = job.ref, job.spec
        if action.missing is None:
            if self.create_failures.wait(ref.uid, job.generation, time.monotonic()) is not None:
                return body, job, False  # refused recently: wait (outside the lock) for the backoff
            self._hold_back_while_unsettled(ref)
            if time.monotonic() < self._next_plan.get(ref.uid, 0.0):
                self._deferred.add(ref.uid)  # planned as the spacing ends (``spaced_for``)
                return body, job, False  # its last plan placed nothing: spaced by what it took
            self._deferred.discard(ref.uid)
            if waiting := await self._wait_for_leaving(body, job):
                return waiting
        if action.flavors or action.topology is not None:  # Kueue's queue orders it
            self.waiting.kueue.add(ref.uid)
        where = await workloads.flavors(self.client, action.flavors)
        if isinstance(where, kueue_workload.Unassignable):
            return await self._unassignable(body, job, where)
        try:
            template = kueue_workload.assign(
                builders.build_pod(ref, spec, action.attempt, 0, ""), where
            )
        except kueue_workload.AssignmentConflict as conflict:
            unassignable = kueue_workload.Unassignable(
                kueue_workload.FLAVOR_CONFLICT, str(conflict)
            )
            return await self._unassignable(body, job, unassignable)
        claim = self.fit.claims[ref.uid] = await claims.topology(self.client, ref.namespace, spec)
        priority = await self.priorities.of(spec)
        async with self.lock:
            if action.missing is not None:
                return await self._recreate_missing(
                    action.attempt, action.missing, body, job, template, where, action.topology
                )
            demand = feasibility.demand_of(template)
            if self.waiting.unchanged(ref, job.generation):  # a resync: nothing new to plan on
                step, placed = (body, job, False), None  # its node set may still be due
            else:
                if self.waiting.owed_to_time(ref.uid):  # no capacity change, but one all the same
                    self.replans.owed_to_time((ref.namespace, ref.name))
                self.waiting.planning(ref, job.generation)
                step, placed = await self._place_gang(
                    action.attempt, body, job, template, where, claim, action.topology, priority
                )
            reserved = None  # it waits: the node set it holds, when one is due
            if placed is None:
                reserved = await reserving.refresh(self.waiting, self.fit, step[1], demand)
            backfilled = reserving.backfilled(self.waiting, step[1], placed)
        if reserved is not None:
            said = reservation.described(reserved)
            await self.writer.emit(step[0], "Normal", conditions.NODES_RESERVED, said)
        if backfilled is not None:
            said, record = backfilled
            metrics.BACKFILLS.labels(namespace=ref.namespace).inc()
            logger.info("%s/%s backfilled: %s", ref.namespace, ref.name, said)
            if record:  # before the pods: the deadline it backfilled with holds from now on
                step = await self.writer.set_status(step[0], step[1], {"backfill": record})
            await self.writer.emit(step[0], "Normal", conditions.BACKFILLED, said)
        if placed is None:
            return step
        return await self._create(step, *placed)

    async def _create(
        self, step: Step, outcome: placement_outcome.Placed, gang: creating.Gang
    ) -> Step:
        """Create the placed gang, outside the lock (its pods are assumed in the cache meanwhile)."""
        body, job, _ = step
        ref = job.ref
        refused = await creating.create(self.client, self.cache, gang)
        if refused is not None:
            return await self._refused(body, job, refused)
        self.create_failures.forget(ref.uid)
        self._next_plan.pop(ref.uid, None)
        self.waiting.leave(ref)
        logger.info(
            "placed %s/%s %s on %d node(s)",
            ref.namespace,
            ref.name,
            outcome.spec.parallelism.layout_string,
            len(set(outcome.nodes)),
        )
        await self.writer.emit(body, "Normal", conditions.GANG_PLACED, outcome.message)
        return body, job, True

    def _beside_own(self, job: job_state.JobState) -> bool:
        """Whether the job still has pods holding resources: its plan may use what they free,
        which the free slots do not count (its shape is then unknown: always woken)."""
        return any(
            feasibility.holds_resources(p) and not store_pod.is_store(p)
            for p in owned.owned_pods(self.cache, job.ref)
        )

    def _node(self, name: str) -> dict[str, Any] | None:
        return self.cache.nodes.get(("", name))

    async def _recreate_missing(
        self,
        attempt: int,
        missing: tuple[int, ...],
        body: dict[str, Any],
        job: job_state.JobState,
        template: dict[str, Any],
        where: kueue_workload.Assignment,
        topology: kueue_topology.Assignment | None = None,
    ) -> Step:
        """Crash recovery of a gated gang: its missing pods on their recorded nodes, or a new plan."""
        assert job.spec is not None
        ref, spec = job.ref, job.spec
        now = clock.now()
        raw_nodes, _, _ = self.fit.candidates(job, spec.resources.gpu_resource_name, now)
        demand = feasibility.demand_of(template)
        wanted = placement_status.missing_per_node(job, missing)
        ask = devices.ask_of(spec, self.cache.inventory())
        blocked = capacity.infeasible_nodes(demand, wanted, raw_nodes, self.cache.usage(), ask)
        if topology is not None:  # Kueue may have moved the gang's domains meanwhile
            moved = kueue_reassigned.recorded_outside(job, missing, self._node, topology)
            blocked = {**blocked, **moved}
        recovery = placement_status.recover_missing(job, missing, blocked, now)
        if isinstance(recovery, placement_status.Replan):
            live = [p for p in owned.owned_pods(self.cache, ref) if feasibility.holds_resources(p)]
            await owned.delete_pods(
                self.client, self.cache, ref, [p["metadata"]["name"] for p in live]
            )
            return await self.writer.set_status(body, job, recovery.status)
        group = await self._pod_group(ref, spec, attempt, job.status.get("specHash"))
        every = self.restart_all_on(node for _, node in recovery.nodes)
        pods = [
            kueue_workload.gang_pod(
                await self.gang_pod(
                    builders.build_pod(
                        ref,
                        spec,
                        attempt,
                        i,
                        node,
                        default_image=self.trainer_image,
                        restart_rules=self.restart_rules,
                        restart_all=every,
                        pod_group=gang_backend.native_group(group),
                        device_errors=device_errors.newest_by_node(job.status, now),
                    ),
                    group,
                ),
                where,
                job=ref.name,
                topology=topology,
            )
            for i, node in recovery.nodes
        ]
        refused = await children.ensure(
            self.client,
            ref.uid,
            self._shared_children(ref, spec, group, attempt, job.status),
            pods,
        )
        if refused is not None:
            return await self._refused(body, job, refused)
        logger.info("re-created %d missing pod(s) of %s/%s", len(pods), ref.namespace, ref.name)
        return body, job, True

    async def _place_gang(
        self,
        attempt: int,
        body: dict[str, Any],
        job: job_state.JobState,
        template: dict[str, Any],
        where: kueue_workload.Assignment,
        claim: volumes.Topology | None,
        topology: kueue_topology.Assignment | None = None,
        priority: int = 0,
    ) -> tuple[Step, tuple[placement_outcome.Placed, creating.Gang] | None]:
        """Plan the whole gang (off the nodes reserved for another job) and write what the plan
        comes to; placed, the gang's children to create, its pods assumed in the cache."""
        assert job.spec is not None
        ref = job.ref
        started = time.perf_counter()
        now, began = clock.now(), time.monotonic()
        gpu = job.spec.resources.gpu_resource_name
        raw_nodes, nodes, avoid = self.fit.candidates(job, gpu, now, at=began)
        avoided_until = self.fit.avoided_until(job, gpu, now, began) if avoid else None
        demand = feasibility.demand_of(template)
        hold = self._hold(job, raw_nodes, demand, now)
        held = frozenset() if hold is None else hold.labels
        raw_nodes, nodes = reserving.outside(self.waiting, job, raw_nodes, nodes)
        cap = resizing.largest_allowed(job.declared or job.spec, job.status, now)
        was_waiting = ref.uid in self.waiting.entries
        if was_waiting:  # it waited: a wake-up (or its resync) plans it again
            metrics.REPLANS.labels(namespace=ref.namespace).inc()
            self.replans.planned((ref.namespace, ref.name))
            logger.info("%s/%s: %s", ref.namespace, ref.name, PLANNED_AGAIN)
        try:
            sized = await self.fit.plan_sizes(
                job, raw_nodes, nodes, demand, cap, topology, held=held
            )
        except planning.DeadlineExceeded as exceeded:
            return await self._planning_refused(body, job, exceeded), None
        except planning.WorkerFailed as failed:
            self._next_plan[ref.uid] = time.monotonic() + FAILED_PLAN_RETRY_SECONDS
            unplaced = placement_outcome.unplaced(job, conditions.PLANNING_FAILED, str(failed), now)
            said = f"{ref.namespace}/{ref.name} not planned: {failed}"
            return await self._write_unplaced(body, job, unplaced, said), None
        outcome = placement_outcome.judge(
            job,
            sized,
            avoid=avoid,
            claim=claim,
            nodes_seen=len(raw_nodes),
            now=now,
            hold_note="" if hold is None else hold.note,
        )
        job = dataclasses.replace(job, spec=sized.spec)
        if isinstance(outcome, placement_outcome.WontFit):
            return await self._write_refused(body, job, outcome), None
        if topology is not None:  # Kueue TAS assigned the domains: the plan keeps them or waits
            outcome = placement_outcome.within_assignment(outcome, job, topology, nodes, now)
        metrics.PLACEMENT_SECONDS.labels(namespace=ref.namespace).observe(
            time.perf_counter() - started
        )
        if isinstance(outcome, placement_outcome.Unplaced):
            outcome = reserving.unplaced(self.waiting, job, demand, outcome)
            if not was_waiting:
                logger.info("%s/%s: %s", ref.namespace, ref.name, WAITS)
            since = queue_order.since_of(job.status, now, job.generation)
            declared, beside = job.declared or sized.spec, self._beside_own(job)
            # the hold's end on the monotonic clock, from when ``now`` was read (not the plan's end)
            held_until = None if hold is None else began + (hold.until - now).total_seconds()
            self.waiting.enter(
                *(ref, declared, demand, beside, since, priority, avoided_until, held_until, held),
                started=job.status.get("startTime"),
            )
            took = self.fit.worker.last_seconds
            self._next_plan[ref.uid] = time.monotonic() + PLAN_SPACING * took
            if took >= SLOW_PLAN_SECONDS:
                logger.info(
                    "%s/%s: planned in %.1f s without a place; next plan in %.0f s at the earliest",
                    *(ref.namespace, ref.name, took, PLAN_SPACING * took),
                )
            metrics.PLACEMENT_FAILURES.labels(namespace=ref.namespace, reason=outcome.reason).inc()
            said = f"{ref.namespace}/{ref.name} unschedulable: {outcome.reason}: {outcome.message}"
            return await self._write_unplaced(body, job, outcome, said), None
        spec = outcome.spec
        nodes_used = len(set(outcome.nodes))
        if shared := await claims.access_refusal(self.client, ref.namespace, spec, nodes_used):
            unshared = kueue_workload.Unassignable(conditions.CLAIM_NOT_SHARED, shared)
            return await self._unassignable(body, job, unshared), None
        body, job, _ = await self.writer.set_status(body, job, outcome.status)
        if (resized := outcome.resized) is not None:
            metrics.resized(ref.namespace, ref.name, resized.direction)
            logger.info(
                "%s/%s elastic %s: %s", ref.namespace, ref.name, resized.direction, resized.detail
            )
            await self.writer.emit(body, resized.type, resized.reason, resized.message)
        if (ignored := torchrun_tier.ignored(spec)) is not None:
            await self.writer.emit(body, "Warning", torchrun_tier.IGNORED, ignored)
        group = await self._pod_group(ref, spec, attempt)
        pods = [
            kueue_workload.gang_pod(
                await self.gang_pod(pod, group), where, job=ref.name, topology=topology
            )
            for pod in builders.build_pods(
                ref,
                spec,
                attempt,
                outcome.nodes,
                default_image=self.trainer_image,
                restart_rules=self.restart_rules,
                restart_all=self.restart_all_on(outcome.nodes),
                pod_group=gang_backend.native_group(group),
                device_errors=device_errors.newest_by_node(job.status, now),
            )
        ]
        gang = creating.Gang(
            ref, self._shared_children(ref, spec, group, attempt, job.status), pods
        )
        creating.assume(self.cache, gang)
        return (body, job, True), (outcome, gang)

    def _hold(
        self,
        job: job_state.JobState,
        raw_nodes: list[dict[str, Any]],
        demand: feasibility.Demand,
        now: datetime.datetime,
    ) -> topology_hold.Hold | None:
        """The preferred levels holding the gang's first placement for one domain, judged on
        its candidate nodes with nothing running there (``topology_hold``)."""
        if not topology_hold.may_hold(job, kueue=job.ref.uid in self.waiting.kueue):
            return None
        assert job.spec is not None
        pods, empty = job.spec.pods, feasibility.Usage()
        slots = (
            (
                (n.get("metadata") or {}).get("name") or "",
                (n.get("metadata") or {}).get("labels") or {},
                feasibility.slots(demand, n, empty, pods),
            )
            for n in raw_nodes
        )
        return topology_hold.of_job(job, slots, now)

    async def _planning_refused(
        self, body: dict[str, Any], job: job_state.JobState, exceeded: planning.DeadlineExceeded
    ) -> Step:
        """Planning outlasted the deadline (the worker was killed): the job fails, naming the deadline."""
        refused = placement_outcome.planning_refused(job, exceeded.seconds, clock.now())
        return await self._write_refused(body, job, refused)

    async def _write_refused(
        self, body: dict[str, Any], job: job_state.JobState, refused: placement_outcome.WontFit
    ) -> Step:
        """Write a refusal before placement (the job fails), log it and emit a Warning."""
        logger.info("%s/%s refused: %s", job.ref.namespace, job.ref.name, refused.message)
        metrics.PLACEMENT_FAILURES.labels(namespace=job.ref.namespace, reason=refused.reason).inc()
        body, job, changed = await self.writer.set_status(body, job, refused.status)
        await self.writer.emit(body, "Warning", refused.reason, refused.message)
        return body, job, changed

    async def _unassignable(
        self, body: dict[str, Any], job: job_state.JobState, why: kueue_workload.Unassignable
    ) -> Step:
        """The admitted flavors give the gang nowhere to go: no pods; say why (once) and look again."""
        unplaced = placement_outcome.unplaced(job, why.reason, why.message, clock.now())
        said = f"{job.ref.namespace}/{job.ref.name}: {why.message}"
        return await self._write_unplaced(body, job, unplaced, said)

    async def _write_unplaced(
        self,
        body: dict[str, Any],
        job: job_state.JobState,
        unplaced: placement_outcome.Unplaced,
        said: str,
    ) -> Step:
        """Write why the gang has no pods; when that is news, log ``said`` and emit a Warning."""
        body, job, changed = await self.writer.set_status(body, job, unplaced.status)
        if unplaced.news:
            logger.info("%s", said)
            await self.writer.emit(body, "Warning", unplaced.reason, unplaced.message)
        return body, job, changed

    def _shared_children(
        self,
        ref: identity.JobRef,
        spec: api_spec.TrainingJobSpec,
        group: dict[str, Any] | None,
        attempt: int,
        status: Mapping[str, Any],
    ) -> list[dict[str, Any]]:
        """The gang's objects besides its pods: spec ConfigMap, headless Service, PodGroup of the
        gang backend (``gang_backend``), NetworkPolicy in an isolated namespace, DRA claim objects
        with resources.dra, and the store pod of gang ``attempt`` with ``rendezvousStore:
        dedicated`` (made before the trainer pods, never again once they run: a new store would
        be empty), stamped with the placement's ``startTime`` and kept off its nodes where it can
        be (``status``, written before the gang's objects are made).

        Crash recovery ensures them again with the missing pods (they exist: each is read, and
        brought up to date when it is the job's), so a recovered gang never rests on how far the
        killed pass got.
        """
        isolated = ref.namespace in self.isolated_namespaces
        return [
            builders.build_configmap(ref, spec),
            builders.build_service(ref, spec),
            *([builders.build_network_policy(ref, spec, self.gang_peers)] if isolated else []),
            *([group] if group else []),
            *builders.build_device_claims(ref, spec),
            *(
                [
                    builders.build_store_pod(
                        ref,
                        spec,
                        attempt,
                        placed=str(status.get("startTime") or ""),
                        avoid=[
                            str(e.get("node") or "") for e in replacement.entries(status).values()
                        ],
                        default_image=self.trainer_image,
                    )
                ]
                if kubelet_tier.store_pod(spec)
                else []
            ),
        ]
