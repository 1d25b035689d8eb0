"""One reconcile pass of a TrainingJob: observe -> decide -> act.

:class:`Reconciler`, which reads the job and its pods, asks
:func:`lifecycle.decide` what to do and performs the actions through
:mod:`kube`.  The only decision made here is the placement step, under one
process-wide lock: read nodes and live pods from the informer cache, judge
the job's memory plan on the GPU profile of its candidate nodes (``sizing``: a job that won't fit fails
with ``WontFit`` and gets no pods), derive reservations, ``plan``, record the
placement and the plan's numbers in the status and create the gated pods —
all before the next job may plan, so two jobs never plan onto the same free
GPUs.  (Peering makes sure only one operator process acts at a time.)
Status writes carry the resourceVersion they were decided on.  On 409 the job
is read again: if only its metadata changed (kopf's finalizer and
annotations) the write is retried on the new version, else ``kube.Conflict``
ends the pass and the next pass decides from the fresh read.

It owns no watch and no loop (see ``handlers``), and builds
no manifest itself (see ``builders``).
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

from meshtrain import placement
from meshtrain.api import elastic
from meshtrain.api import spec as api_spec
from meshtrain.operator import (
    admitting,
    builders,
    capacity,
    children,
    claims,
    conditions,
    failure,
    feasibility,
    identity,
    informer,
    kube,
    lifecycle,
    metrics,
    naming,
    noise_condition,
    progress_status,
    queueing,
    rescheduling,
    resizing,
    retries,
    sizing,
    stragglers,
    volumes,
    workloads,
)
from meshtrain.planner import placement_request, profiles

logger = logging.getLogger("meshtrain.operator")


CONFLICT_RETRIES = 3
"""Status writes retried after a 409 when the job changed only outside spec and status."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Timers of the operator (flags of ``meshtrain operator``)."""

    resync_seconds: float = 30.0
    """Longest wait between two reconciles of a job without events."""
    progress_seconds: float = 10.0
    """How often rank 0's /progress is read while a job runs."""
    progress_timeout_seconds: float = 2.0
    """Timeout of one /progress request."""
    gpu_profile: profiles.Profile | None = None
    """Profile a job is judged by when no candidate node names its GPU (``--gpu-profile``); None: not judged."""
    trainer_image: str = naming.DEFAULT_TRAINER_IMAGE
    """Image of jobs whose spec.image is empty (the chart's trainer.image)."""


@dataclasses.dataclass(frozen=True)
class _Sized:
    """The placement answer at one size of the gang (``size`` None without runPolicy.elastic)."""

    size: elastic.Size | None
    spec: api_spec.TrainingJobSpec
    verdict: sizing.Admitted | sizing.Refused | None
    answer: placement.Placement | placement.Unschedulable | None
    """None when the verdict refused the size."""
    refusals: list[str]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """Result of one pass: whether it changed anything, and when to look again."""

    changed: bool
    requeue_after: float | None
    waiting_for_capacity: bool = False
    gone: bool = False
    done: bool = False
    """The job is finished and nothing is left to do for it (no TTL pending)."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _describe(problems: Mapping[str, str]) -> str:
    return ", ".join(f"{node}: {why}" for node, why in sorted(problems.items()))


def _decided_on(read: dict[str, Any], fresh: dict[str, Any]) -> bool:
    """True when ``fresh`` has the spec generation and status that ``read`` had."""
    generation = (read.get("metadata") or {}).get("generation")
    return (fresh.get("metadata") or {}).get("generation") == generation and fresh.get(
        "status"
    ) == read.get("status")


def _same(status: dict[str, Any], changes: dict[str, Any]) -> bool:
    """True when merging ``changes`` would not change ``status``."""
    return all(status.get(key) == value for key, value in changes.items())


class Reconciler:
    """Reconciles TrainingJobs through one API client; shared by every job of the process."""

    def __init__(self, *, client: kube.Client, cache: informer.Cache, settings: Settings) -> None:
        self.client = client
        self.cache = cache
        self.settings = settings
        self.placement_lock = asyncio.Lock()
        self._planner_nodes: tuple[Any, list[dict[str, Any]], list[placement.Node]] = (None, [], [])
        self._last_progress: dict[tuple[str, str], float] = {}
        self._admissions = admitting.Admissions(settings.gpu_profile)
        self._grow_backoff: dict[tuple[str, str], tuple[float, float]] = {}
        """Jobs whose last grow check found no room: (monotonic time of the next check, interval)."""
        self._gang_api: bool | None = None
        """Whether PodGroups are served (None: not asked yet)."""
        self._create_failures = retries.Backoff(children.retry_delay)
        """Jobs (by UID: a namesake re-created is a new job) whose children were refused: when they may try again."""
        self._workload_rejections = retries.Backoff(children.retry_delay)
        """Jobs (by UID) whose Workload the API server refused: when they may try again, and why."""
        self._refusals: dict[str, rescheduling.Record] = {}
        """Jobs (by UID) re-placed after kube-scheduler refused their released pods."""
        self._claims: dict[str, volumes.Topology | None] = {}
        """Where each job's claim lets its pods go, as its last placement read it (by UID)."""

    async def reconcile(self, *, namespace: str, name: str) -> Outcome:
        """One pass over ``namespace/name``."""
        started = time.perf_counter()
        try:
            return await self._reconcile(namespace, name)
        finally:
            metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)

    async def _reconcile(self, namespace: str, name: str) -> Outcome:
        await self.cache.synced.wait()
        body = await self.client.get_job(namespace=namespace, name=name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            metrics.forget(namespace, name)
            return Outcome(changed=False, requeue_after=None, gone=True)
        job = lifecycle.job_state(body)
        pods = self._owned_pods(job.ref)
        states = [s for s in (failure.pod_state(p) for p in pods) if s is not None]
        queue = queueing.queue_of((body.get("metadata") or {}).get("labels"))
        gate, workload = await workloads.gate(self.client, body, queue, self._rejected(job))
        planned = {p.get("node") for p in job.status.get("placement") or [] if isinstance(p, dict)}
        gone = frozenset(
            n for n in planned if isinstance(n, str) and self.cache.nodes.get(("", n)) is None
        )
        decision = lifecycle.decide(job, states, _now(), gate, gone)
        changed = refused_now = False
        for action in decision.actions:
            if isinstance(action, workloads.ACTIONS):
                try:
                    did = await workloads.perform(
                        self.client, action, job, queue, workload, self.settings.trainer_image
                    )
                except workloads.Rejected as err:
                    did = refused_now = self._workload_refused(job, str(err))
                else:
                    if isinstance(action, queueing.CreateWorkload):
                        self._workload_rejections.forget(job.ref.uid)
            else:
                body, job, did = await self._act(action, body, job)
            changed = changed or did
        phase = (body.get("status") or {}).get("phase") or "Pending"
        if phase == lifecycle.Phase.RUNNING.value:  # it ran where it was placed: start afresh
            self._refusals.pop(job.ref.uid, None)
        placed = (
            conditions.find((body.get("status") or {}).get("conditions") or [], conditions.PLACED)
            or {}
        )
        waiting = placed.get("status") == conditions.FALSE and placed.get("reason") in (
            placement.INSUFFICIENT_GPUS,
            placement.TOPOLOGY_UNSATISFIABLE,
        )
        metrics.observe_job(body, unschedulable=waiting, placed_condition=placed)
        requeue = decision.requeue_after
        retry = self._create_failures.wait(job.ref.uid, job.generation, time.monotonic())
        rejected = self._workload_rejections.current(job.ref.uid, job.generation)
        if rejected is not None:
            # Just refused: a pass now writes why (Queued); then the backoff's remaining time.
            left = max(rejected.not_before - time.monotonic(), 0.0) if not refused_now else 0.0
            retry = left if retry is None else min(retry, left)
        if any(isinstance(a, rescheduling.ReplaceRefused) for a in decision.actions):
            spaced = rescheduling.wait(self._refusals.get(job.ref.uid), time.monotonic())
            retry = spaced if retry is None or spaced is None else min(retry, spaced)
        if retry is not None:
            requeue = retry if requeue is None else min(requeue, retry)
        if any(isinstance(a, lifecycle.PollProgress) for a in decision.actions):
            requeue = (
                self.settings.progress_seconds
                if requeue is None
                else min(requeue, self.settings.progress_seconds)
            )
        done = phase in lifecycle.FINAL and requeue is None and not changed
        return Outcome(
            changed=changed, requeue_after=requeue, waiting_for_capacity=waiting, done=done
        )

    async def _delete_pods(
        self, ref: identity.JobRef, names: Iterable[str], grace_seconds: int | None = None
    ) -> None:
        """Delete these pods of the job, each only as the very object (UID) the cache holds as the job's.

        The cache may be a moment behind: a name it still lists may already belong to
        another object (a namesake job's pod, another tenant's); that one is not touched.
        """
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in self._owned_pods(ref)}
        await self.client.delete_pods(
            namespace=ref.namespace,
            names=[n for n in names if n in uids],
            grace_seconds=grace_seconds,
            uids=uids,
        )

    def _owned_pods(self, ref: identity.JobRef) -> list[dict[str, Any]]:
        """The job's pods: labelled with its name and owned by its UID (a namesake's pods are not)."""
        return [
            p for p in self.cache.job_pods(ref.namespace, ref.name) if capacity.owned_by(p, ref.uid)
        ]

    def _freed_by_replacing(self, job: lifecycle.JobState) -> list[dict[str, Any]]:
        return capacity.freed_by_replacing(
            self._owned_pods(job.ref), int(job.status.get("restarts") or 0)
        )

    async def _wait_for_leaving(
        self, body: dict[str, Any], job: lifecycle.JobState
    ) -> tuple[dict[str, Any], lifecycle.JobState, bool] | None:
        """Hold a new gang back while the old one's pods still terminate (None: none left).

        Planned beside them, it would be sized down for a moment's shortage; planned onto
        their GPUs, kube-scheduler would refuse it until they are gone.  Their deletion
        wakes the job.
        """
        leaving = capacity.still_leaving(
            self._owned_pods(job.ref), int(job.status.get("restarts") or 0)
        )
        if not leaving:
            return None
        names = ", ".join(sorted(p["metadata"]["name"] for p in leaving))
        message = f"waiting for pod(s) of the earlier gang to terminate (they hold their GPUs until gone): {names}"
        return await self._set_status(
            body,
            job,
            lifecycle.unschedulable(job, conditions.OLD_PODS_TERMINATING, message, _now()),
        )

    async def _set_status(
        self, body: dict[str, Any], job: lifecycle.JobState, changes: dict[str, Any]
    ) -> tuple[dict[str, Any], lifecycle.JobState, bool]:
        if _same(dict(job.status), changes):
            return body, job, False
        ref = job.ref
        version = (body.get("metadata") or {}).get("resourceVersion")
        for _ in range(CONFLICT_RETRIES):
            try:
                answer = await self.client.patch_job_status(
                    namespace=ref.namespace, name=ref.name, status=changes, resource_version=version
                )
                break
            except kube.Conflict:
                # Re-read: a write that left spec and status as decided on (kopf's finalizer
                # and annotations) does not change the decision; anything else does.
                fresh = await self.client.get_job(namespace=ref.namespace, name=ref.name)
                if fresh is None or not _decided_on(body, fresh):
                    raise
                version = (fresh.get("metadata") or {}).get("resourceVersion")
        else:
            raise kube.Conflict(409, "patch", "trainingjobs/status", "kept changing")
        if answer is None:
            return body, job, False
        if changes.get("restarts", 0) > int(job.status.get("restarts") or 0):
            metrics.RESTARTS.labels(namespace=job.ref.namespace, trainingjob=job.ref.name).inc()
        return answer, lifecycle.job_state(answer), True

    async def _emit(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        try:
            await self.client.create_event(
                job=body,
                type_=type_,
                reason=reason,
                message=message,
                now=conditions.timestamp(_now()),
            )
        except (kube.ApiError, OSError) as err:  # events are best effort
            logger.warning("could not record event %s: %s", reason, err)

    async def _emit_on_node(
        self, node: str, ref: identity.JobRef, actions: Iterable[lifecycle.Action]
    ) -> None:
        note = next((a for a in actions if isinstance(a, lifecycle.Emit)), None)
        if note is None:
            return
        raw = self.cache.nodes.get(("", node)) or {}
        try:
            await self.client.create_node_event(
                node=node,
                uid=(raw.get("metadata") or {}).get("uid"),
                type_=note.type,
                reason=note.reason,
                message=f"TrainingJob {ref.namespace}/{ref.name}: {note.message}",
                now=conditions.timestamp(_now()),
            )
        except (kube.ApiError, OSError) as err:  # events are best effort
            logger.warning("could not record event %s on node %s: %s", note.reason, node, err)

    async def _act(
        self, action: lifecycle.Action, body: dict[str, Any], job: lifecycle.JobState
    ) -> tuple[dict[str, Any], lifecycle.JobState, bool]:
        ref = job.ref
        if isinstance(action, lifecycle.SetStatus):
            return await self._set_status(body, job, dict(action.changes))
        if isinstance(action, lifecycle.Emit):
            await self._emit(body, action.type, action.reason, action.message)
            return body, job, False
        if isinstance(action, lifecycle.DeletePods):
            await self._delete_pods(ref, action.names, action.grace_seconds)
            return body, job, True
        if isinstance(action, lifecycle.LiftGates):
            async with self.placement_lock:
                moved = await self._planned_nodes_changed(job)
                if moved:
                    message = (
                        f"planned node(s) can no longer take the gang before its gates were lifted "
                        f"({_describe(moved)}); placing it again"
                    )
                    return await self._replace(body, job, conditions.NODES_CHANGED, message)
                uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in self._owned_pods(ref)}
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
        if isinstance(action, lifecycle.DeleteJob):
            logger.info("deleting %s/%s: ttlSecondsAfterFinished elapsed", ref.namespace, ref.name)
            await self.client.delete_job(namespace=ref.namespace, name=ref.name)
            return body, job, True
        if isinstance(action, lifecycle.PollProgress):
            return await self._poll(action, body, job)
        if isinstance(action, lifecycle.Place):
            return await self._place(action, body, job)
        if isinstance(action, resizing.Grow):
            return await self._grow(action, body, job)
        if isinstance(action, rescheduling.ReplaceRefused):
            now = time.monotonic()
            record = self._refusals.get(ref.uid)
            if rescheduling.wait(record, now) is not None:
                return body, job, False
            self._refusals[ref.uid] = rescheduling.replaced(record, action.nodes, now)
            message = rescheduling.message(action.nodes)
            return await self._replace(body, job, conditions.SCHEDULER_REFUSED, message)
        if isinstance(action, lifecycle.ReplaceStraggler):
            fits = self._fits_without(job, frozenset(action.nodes))
            changed = False
            for step in action.replaced if fits else action.otherwise:
                body, job, did = await self._act(step, body, job)
                changed = changed or did
            if fits:  # where an SRE looking at the node sees it too
                for node in action.nodes:
                    await self._emit_on_node(node, job.ref, action.replaced)
            return body, job, changed
        raise TypeError(f"unknown action {action!r}")

    async def _planned_nodes_changed(self, job: lifecycle.JobState) -> dict[str, str]:
        """Planned nodes that can no longer take their pods of the gang (name -> why).

        The nodes are read from the API server (not the cache, which may lag a watch event
        behind); the pods on them, bound or nominated there, from the cache.
        """
        assert job.spec is not None
        ref = job.ref
        gang = [
            p
            for p in self.cache.job_pods(ref.namespace, ref.name)
            if capacity.owned_by(p, ref.uid) and capacity.holds_gpus(p)
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
            self.cache.usage(without=self._freed_by_replacing(job)),
        )

    async def _replace(
        self, body: dict[str, Any], job: lifecycle.JobState, reason: str, message: str
    ) -> tuple[dict[str, Any], lifecycle.JobState, bool]:
        """A planned node cannot take its pods (before or after the gates were lifted): delete
        the gang's pods and place it again.

        A re-placement, not a restart: no rank started training, ``restarts`` is unchanged.
        """
        ref = job.ref
        logger.info("%s/%s: %s", ref.namespace, ref.name, message)
        body, job, _ = await self._set_status(
            body, job, lifecycle.unplaced(job, _now(), message, reason)
        )
        await self._delete_gang(ref)
        await self._emit(body, "Warning", reason, message)
        return body, job, True

    async def _delete_gang(self, ref: identity.JobRef) -> None:
        """Delete the pods of a dropped placement (written first: a new leader finishes this).

        Never grace 0: the cache may lag a binding (a kubelet would keep GPUs it shows free);
        the API server deletes an unbound pod at once anyway.
        """
        names = [p["metadata"]["name"] for p in self._owned_pods(ref)]
        await self._delete_pods(ref, names, lifecycle.BROKEN_GANG_GRACE_SECONDS)

    async def _grow(
        self, action: resizing.Grow, body: dict[str, Any], job: lifecycle.JobState
    ) -> tuple[dict[str, Any], lifecycle.JobState, bool]:
        """Rebuild a gang running below its largest size when a larger one fits beside everyone else."""
        assert job.declared is not None
        ref = job.ref
        key = (ref.namespace, ref.name)
        backoff = self._grow_backoff.get(key)
        if backoff is not None and time.monotonic() < backoff[0]:
            return body, job, False
        async with self.placement_lock:
            raw_nodes, nodes, _ = self._candidates(job, job.declared.resources.gpu_resource_name)
            demand = feasibility.demand_of(builders.build_pod(ref, job.declared, 0, 0, ""))
            # Only the size a placement would pick (rules and memory admission included): growing to
            # one it would not pick rebuilds the gang at the running size, again and again.
            sized = self._plan_sizes(job, raw_nodes, nodes, demand)
            size = sized.size
            if (
                size is None
                or size.data <= action.running
                or not isinstance(sized.answer, placement.Placement)
            ):
                interval = resizing.next_grow_check(backoff[1] if backoff else None)
                self._grow_backoff[key] = (time.monotonic() + interval, interval)
                return await self._set_status(body, job, resizing.no_room(job.status))
        self._grow_backoff.pop(key, None)  # room: check again at every pass until it is stable
        checked = resizing.room_found(job.declared, job.status, action.running, size.data, _now())
        if not checked.grow:
            body, job, changed = await self._set_status(body, job, checked.fields)
            if checked.message is not None:
                logger.info("%s/%s: %s", ref.namespace, ref.name, checked.message)
                await self._emit(body, "Normal", conditions.ELASTIC_GROW_PENDING, checked.message)
            return body, job, changed
        fields, message = resizing.growing(job.status, action.running, size, _now())
        logger.info("%s/%s: %s", ref.namespace, ref.name, message)
        # roomSince written with it: the placement that follows may then pick the larger size
        body, job, _ = await self._set_status(
            body, job, {**checked.fields, **fields, "observedGeneration": job.generation}
        )
        await self._emit(body, "Normal", conditions.ELASTIC_GROWING, message)
        await self._delete_pods(ref, [p["metadata"]["name"] for p in self._owned_pods(ref)])
        return body, job, True

    def _candidates(
        self, job: lifecycle.JobState, gpu: str, also_avoid: frozenset[str] = frozenset()
    ) -> tuple[list[dict[str, Any]], list[placement.Node], frozenset[str]]:
        """The nodes a placement of ``job`` may use (raw, and as the planner sees them), and the
        nodes it avoids (replaced stragglers, scheduler refusals)."""
        raw_nodes, nodes = self._nodes(gpu)
        refused = rescheduling.excluded(self._refusals.get(job.ref.uid), time.monotonic())
        avoid = stragglers.excluded(job.status, _now()) | refused | also_avoid
        if avoid:
            raw_nodes = [n for n in raw_nodes if n["metadata"]["name"] not in avoid]
            nodes = [n for n in nodes if n.name not in avoid]
        return raw_nodes, nodes, avoid

    def _fits_without(self, job: lifecycle.JobState, slow: frozenset[str]) -> bool:
        """Whether the gang fits now at its running data-parallel degree without the ``slow`` nodes and the
        job's excluded nodes, counting its own pods' resources as free.

        A smaller elastic size does not count: trading a slow replica for a shrunk gang (and a
        restart) loses more throughput than the straggler costs.
        """
        assert job.spec is not None
        declared = job.declared or job.spec
        gpu = declared.resources.gpu_resource_name
        raw_nodes, nodes, _ = self._candidates(job, gpu, slow)
        demand = feasibility.demand_of(builders.build_pod(job.ref, declared, 0, 0, ""))
        running = job.spec.parallelism.data
        sized = self._plan_sizes(job, raw_nodes, nodes, demand, cap=running)
        fits = isinstance(sized.answer, placement.Placement) and (
            sized.size is None or sized.size.data >= running
        )
        if not fits:
            logger.info(
                "%s/%s: straggler node(s) %s kept: no placement without them fits now at the running size",
                job.ref.namespace,
                job.ref.name,
                ", ".join(sorted(slow)),
            )
        return fits

    async def _poll(
        self, action: lifecycle.PollProgress, body: dict[str, Any], job: lifecycle.JobState
    ) -> tuple[dict[str, Any], lifecycle.JobState, bool]:
        key = (job.ref.namespace, job.ref.name)
        if time.monotonic() - self._last_progress.get(key, 0.0) < self.settings.progress_seconds:
            return body, job, False
        self._last_progress[key] = time.monotonic()
        try:
            report = await kube.get_progress(
                ip=action.ip, port=action.port, timeout=self.settings.progress_timeout_seconds
            )
        except Exception as err:  # noqa: BLE001 - the exporter may not be up yet; tolerated
            logger.debug("progress of %s unavailable: %s", action.pod, err)
            return body, job, False
        changes = progress_status.polled_changes(report)
        changes |= resizing.baseline(job.status, changes)
        if job.spec is not None:
            changes |= stragglers.observed(job.spec, job.status, report, _now())
        if not changes:
            return body, job, False
        warning = None
        if job.spec is not None:  # on top of the conditions the straggler policy may have set
            before = changes.get("conditions", job.status.get("conditions") or [])
            conds, warning = noise_condition.changes(
                before,
                job.spec.global_batch,
                (changes.get("progress") or {}).get("gradientNoiseScale"),
                (changes.get("progress") or {}).get("step"),
                _now(),
            )
            if conds != list(before):
                changes["conditions"] = conds
        body, job, _ = await self._set_status(body, job, changes)
        if warning is not None:
            await self._emit(
                body, "Warning", conditions.GLOBAL_BATCH_FAR_ABOVE_NOISE_SCALE, warning
            )
        return body, job, False

    async def _pod_group(
        self,
        ref: identity.JobRef,
        spec: api_spec.TrainingJobSpec,
        attempt: int,
        stamped: str | None = None,
    ) -> dict[str, Any] | None:
        """The gang's PodGroup where the API server serves the native gang API (asked once), else None."""
        if self._gang_api is None:
            self._gang_api = await self.client.serves_pod_groups()
            logger.info(
                "native gang scheduling (scheduling.k8s.io/v1alpha2 PodGroup): %s",
                "served, used" if self._gang_api else "not served; gang held by scheduling gates",
            )
        return builders.build_pod_group(ref, spec, attempt, stamped) if self._gang_api else None

    def _rejected(self, job: lifecycle.JobState) -> tuple[str, bool] | None:
        """Why the job's Workload was refused for this generation, and whether to try again now."""
        found = self._workload_rejections.current(job.ref.uid, job.generation)
        return None if found is None else (found.why, found.not_before <= time.monotonic())

    def _workload_refused(self, job: lifecycle.JobState, message: str) -> bool:
        """Back off before creating the refused Workload again; the next pass says why (Queued)."""
        tries = self._workload_rejections.refused(
            job.ref.uid, job.generation, time.monotonic(), message
        )
        logger.warning(
            "%s/%s: %s (try %d)", job.ref.namespace, job.ref.name, message, tries.failures
        )
        return True

    async def _refused(
        self, body: dict[str, Any], job: lifecycle.JobState, refused: children.Refused
    ) -> tuple[dict[str, Any], lifecycle.JobState, bool]:
        """Children refused: remove what was created, drop the placement, say why, wait longer each time."""
        ref, now = job.ref, time.monotonic()
        tries = self._create_failures.refused(ref.uid, job.generation, now)
        message = (
            f"{refused.message} (try {tries.failures}; next in {tries.not_before - now:.0f} s)"
        )
        logger.warning("%s/%s: %s", ref.namespace, ref.name, message)
        changes = {
            **lifecycle.unschedulable(job, refused.reason, message, _now()),
            "placement": [],
        }
        body, job, _ = await self._set_status(body, job, changes)
        await self._delete_gang(ref)
        await self._emit(body, "Warning", refused.reason, refused.message)
        return body, job, True

    async def _place(
        self, action: lifecycle.Place, body: dict[str, Any], job: lifecycle.JobState
    ) -> tuple[dict[str, Any], lifecycle.JobState, bool]:
        assert job.spec is not None
        ref, spec = job.ref, job.spec
        if (
            action.missing is None
            and self._create_failures.wait(ref.uid, job.generation, time.monotonic()) is not None
        ):
            return body, job, False  # refused recently: wait (outside the lock) for the backoff
        if action.missing is None and (waiting := await self._wait_for_leaving(body, job)):
            return waiting
        where = await workloads.flavors(self.client, action.flavors)
        if isinstance(where, queueing.Unassignable):
            return await self._unassignable(body, job, where)
        try:
            template = queueing.assign(builders.build_pod(ref, spec, action.attempt, 0, ""), where)
        except queueing.AssignmentConflict as conflict:
            unassignable = queueing.Unassignable(queueing.FLAVOR_CONFLICT, str(conflict))
            return await self._unassignable(body, job, unassignable)
        gpu = spec.resources.gpu_resource_name
        claim = self._claims[ref.uid] = await claims.topology(self.client, ref.namespace, spec)
        async with self.placement_lock:
            started = time.perf_counter()
            raw_nodes, nodes, avoid = self._candidates(job, gpu)
            demand = feasibility.demand_of(template)
            now = _now()
            if action.missing is not None:
                wanted = lifecycle.missing_per_node(job, action.missing)
                blocked = capacity.infeasible_nodes(demand, wanted, raw_nodes, self.cache.usage())
                recovery = lifecycle.recover_missing(job, action.missing, blocked, now)
                if isinstance(recovery, lifecycle.Recreate):
                    group = await self._pod_group(
                        ref, spec, action.attempt, job.status.get("specHash")
                    )
                    pods = [
                        queueing.assign(
                            builders.build_pod(
                                ref,
                                spec,
                                action.attempt,
                                i,
                                node,
                                default_image=self.settings.trainer_image,
                                pod_group=group["metadata"]["name"] if group else None,
                            ),
                            where,
                        )
                        for i, node in recovery.nodes
                    ]
                    refused = await children.ensure(self.client, ref.uid, [], pods)
                    if refused is not None:
                        return await self._refused(body, job, refused)
                    logger.info(
                        "re-created %d missing pod(s) of %s/%s", len(pods), ref.namespace, ref.name
                    )
                    return body, job, True
                live = [p for p in self._owned_pods(ref) if feasibility.holds_resources(p)]
                await self._delete_pods(ref, [p["metadata"]["name"] for p in live])
                return await self._set_status(body, job, recovery.status)
            cap = resizing.largest_allowed(job.declared or spec, job.status, now)
            sized = self._plan_sizes(job, raw_nodes, nodes, demand, cap)
            size, verdict, answer, refusals = (
                sized.size,
                sized.verdict,
                sized.answer,
                sized.refusals,
            )
            previous = job.spec.parallelism.data if job.status.get("elastic") else None
            job = dataclasses.replace(job, spec=sized.spec)
            spec = sized.spec
            if isinstance(verdict, sizing.Refused):
                logger.info("%s/%s refused: %s", ref.namespace, ref.name, verdict.message)
                metrics.PLACEMENT_FAILURES.labels(reason=verdict.reason).inc()
                body, job, changed = await self._set_status(
                    body, job, lifecycle.wont_fit(job, verdict.message, now, verdict.summary)
                )
                await self._emit(body, "Warning", verdict.reason, verdict.message)
                return body, job, changed
            plan = verdict.summary if verdict is not None else None
            metrics.PLACEMENT_SECONDS.observe(time.perf_counter() - started)
            assert answer is not None  # only a refused size has no answer
            if isinstance(answer, placement.Unschedulable):
                metrics.PLACEMENT_FAILURES.labels(reason=answer.reason).inc()
                bounds = (job.declared or spec).run_policy.elastic
                tried = (
                    f"; no data-parallel degree from {bounds.max_data} down to {bounds.min_data} fits"
                    if bounds is not None
                    else ""
                )
                if avoid:
                    tried += f"; excluded for this job (stragglers, scheduler refusals): {', '.join(sorted(avoid))}"
                if claim is not None and volumes.CONFLICT in refusals:
                    tried += f"; claim {claim.claim} allows only the nodes of {claim.why}"
                answer = dataclasses.replace(
                    answer,
                    message=f"{answer.message}{tried}; {feasibility.summary(refusals, len(raw_nodes))}",
                )
                before = (
                    conditions.find(job.status.get("conditions") or [], conditions.PLACED) or {}
                )
                body, job, changed = await self._set_status(
                    body,
                    job,
                    lifecycle.unschedulable(job, answer.reason, answer.message, now, plan),
                )
                if (before.get("reason"), before.get("message")) != (answer.reason, answer.message):
                    logger.info(
                        "%s/%s unschedulable: %s: %s",
                        ref.namespace,
                        ref.name,
                        answer.reason,
                        answer.message,
                    )
                    await self._emit(body, "Warning", answer.reason, answer.message)
                return body, job, changed
            nodes_used = len(set(answer.nodes))
            if shared := await claims.access_refusal(self.client, ref.namespace, spec, nodes_used):
                unshared = queueing.Unassignable(conditions.CLAIM_NOT_SHARED, shared)
                return await self._unassignable(body, job, unshared)
            declared = job.declared or spec
            fields = lifecycle.placed(job, answer.nodes, answer.level_bytes, now, plan)
            fields |= resizing.placed_fields(declared, size, {**job.status, **fields}, now)
            body, job, _ = await self._set_status(body, job, fields)
            direction = resizing.change(previous, size)
            if direction is not None and size is not None:
                metrics.resized(ref.namespace, ref.name, direction)
                message = fields["elastic"]["message"]
                logger.info("%s/%s elastic %s: %s", ref.namespace, ref.name, direction, message)
                await self._emit(
                    body,
                    "Warning" if direction == "shrink" else "Normal",
                    conditions.ELASTIC_SHRUNK
                    if direction == "shrink"
                    else conditions.ELASTIC_GROWN,
                    f"data-parallel degree {previous} -> {size.data}: {message}",
                )
            group = await self._pod_group(ref, spec, action.attempt)
            refused = await children.ensure(
                self.client,
                ref.uid,
                [
                    builders.build_configmap(ref, spec),
                    builders.build_service(ref, spec),
                    *([group] if group else []),
                ],
                [
                    queueing.assign(pod, where)
                    for pod in builders.build_pods(
                        ref,
                        spec,
                        action.attempt,
                        answer.nodes,
                        default_image=self.settings.trainer_image,
                        pod_group=group["metadata"]["name"] if group else None,
                    )
                ],
            )
            if refused is not None:
                return await self._refused(body, job, refused)
            self._create_failures.forget(ref.uid)
        logger.info(
            "placed %s/%s %s on %d node(s)",
            ref.namespace,
            ref.name,
            spec.parallelism.layout_string,
            len(set(answer.nodes)),
        )
        await self._emit(
            body,
            "Normal",
            conditions.GANG_PLACED,
            f"{spec.pods} pod(s) of {spec.parallelism.layout_string} placed on {len(set(answer.nodes))} node(s)",
        )
        return body, job, True

    async def _unassignable(
        self, body: dict[str, Any], job: lifecycle.JobState, why: queueing.Unassignable
    ) -> tuple[dict[str, Any], lifecycle.JobState, bool]:
        """The admitted flavors give the gang nowhere to go: no pods; say why (once) and look again."""
        before = conditions.find(job.status.get("conditions") or [], conditions.PLACED) or {}
        body, job, changed = await self._set_status(
            body, job, lifecycle.unschedulable(job, why.reason, why.message, _now())
        )
        if (before.get("reason"), before.get("message")) != (why.reason, why.message):
            logger.info("%s/%s: %s", job.ref.namespace, job.ref.name, why.message)
            await self._emit(body, "Warning", why.reason, why.message)
        return body, job, changed

    def _plan_sizes(
        self,
        job: lifecycle.JobState,
        raw_nodes: list[dict[str, Any]],
        nodes: list[placement.Node],
        demand: feasibility.Demand,
        cap: int | None = None,
    ) -> _Sized:
        """Plan the gang at each size runPolicy.elastic allows (none above ``cap``), largest first;
        the first that fits.

        Without one that fits: the largest size's answer (a memory refusal only when every size is refused).
        """
        assert job.spec is not None
        declared = job.declared or job.spec
        usage = self.cache.usage(without=self._freed_by_replacing(job))
        first: _Sized | None = None
        waiting: _Sized | None = None
        for size, spec in resizing.no_larger_than(resizing.candidates(declared), cap):
            verdict = self._admissions.admit(dataclasses.replace(job, spec=spec), nodes)
            answer: placement.Placement | placement.Unschedulable | None = None
            refusals: list[str] = []
            if not isinstance(verdict, sizing.Refused):
                offered, refusals = capacity.offered_nodes(
                    demand,
                    raw_nodes,
                    usage,
                    gpus_per_pod=spec.resources.gpus_per_node,
                    pods_wanted=spec.pods,
                    claim=self._claims.get(job.ref.uid),
                )
                answer = placement.plan(placement_request.request_from_spec(spec), offered, [])
            sized = _Sized(size, spec, verdict, answer, refusals)
            if isinstance(answer, placement.Placement):
                return sized
            first = first or sized
            if waiting is None and answer is not None:
                waiting = sized
        assert first is not None
        return waiting or first

    def _nodes(self, gpu: str) -> tuple[list[dict[str, Any]], list[placement.Node]]:
        """The cached nodes, and as the planner sees them (rebuilt only when a node changed)."""
        key = (self.cache.nodes.changes, gpu)
        if self._planner_nodes[0] != key:
            raw = list(self.cache.nodes.values())
            self._planner_nodes = (key, raw, [placement.node_from_manifest(n, gpu) for n in raw])
        return self._planner_nodes[1], self._planner_nodes[2]

    async def report_api_errors(
        self, *, namespace: str, name: str, failures: int, error: str | None
    ) -> None:
        """Condition ApiErrors (and a Warning Event) after ``failures`` failed passes; False when ``error`` is None."""
        body = await self.client.get_job(namespace=namespace, name=name)
        if body is None:
            return
        job = lifecycle.job_state(body)
        if error is None:
            status, reason = conditions.FALSE, conditions.RECONCILE_RECOVERED
            message = "a reconcile pass succeeded again"
        else:
            status, reason = conditions.TRUE, conditions.RECONCILE_FAILING
            message = f"{failures} reconcile passes in a row failed on the API server, retrying with backoff: {error}"
        conds = conditions.set(
            job.status.get("conditions") or [],
            conditions.API_ERRORS,
            status,
            reason,
            message,
            _now(),
        )
        body, job, _ = await self._set_status(body, job, {"conditions": conds})
        if error is not None:
            await self._emit(body, "Warning", reason, message)

    async def job_exists(self, *, namespace: str, name: str, uid: str) -> bool:
        """Whether the TrainingJob of this UID is still there (a namesake created since is not it)."""
        body = await self.client.get_job(namespace=namespace, name=name)
        return body is not None and (body.get("metadata") or {}).get("uid") == uid

    async def delete_children(self, *, namespace: str, name: str, uid: str) -> int:
        """Remove the children this job (``uid``) owns, and nothing else (idempotent).

        Returns how many of its pods still hold their resources while its Workload holds
        Kueue quota: the caller calls again later.  The Workload goes only once they are gone
        (the garbage collector would delete it with the job, and Kueue then admit another job
        onto GPUs the stopping ranks still use).
        """
        ref = identity.JobRef(name=name, namespace=namespace, uid=uid)
        owned = self._owned_pods(ref)
        await self._delete_pods(
            ref,
            [p["metadata"]["name"] for p in owned if not p["metadata"].get("deletionTimestamp")],
        )
        held = await workloads.release_after_pods(
            self.client, namespace=namespace, name=name, uid=uid, pods=owned
        )
        if held:
            return held
        for kind, child in (
            ("Service", naming.service_name(name)),
            ("ConfigMap", naming.configmap_name(name)),
        ):
            await children.delete_owned(self.client, uid, kind, namespace, child)
        self._last_progress.pop((namespace, name), None)
        self._admissions.forget(namespace, name)
        self._create_failures.forget(uid)
        self._workload_rejections.forget(uid)
        self._refusals.pop(uid, None)
        self._claims.pop(uid, None)
        self._grow_backoff.pop((namespace, name), None)
        metrics.forget(namespace, name)
        return 0
