"""One reconcile pass of a TrainingJob: observe -> decide -> act.

:class:`Reconciler` reads the job and its pods, asks :func:`lifecycle.decide` what to do and
performs the actions: placement through ``placing``, status and Events through
``status_writes``, Kueue's Workload through ``workloads``, pod deletions through ``owned``.  It
also polls rank 0's progress, reports passes failing on the API server, and removes a deleted
job's children.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

from meshtrain import placement
from meshtrain.operator import gang_fit, placing, planning, replacing, sparing
from meshtrain.operator.cluster import (
    children,
    clock,
    informer,
    kube,
    metrics,
    owned,
    progress_client,
    status_writes,
    workloads,
)
from meshtrain.operator.cluster.status_writes import Step
from meshtrain.operator.policy import (
    builders,
    capacity_queue,
    checkpoint_condition,
    conditions,
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
    lifecycle,
    naming,
    noise_condition,
    pod_state,
    progress_status,
    recovery_count,
    rescheduling,
    resizing,
    retries,
    store_pod,
    stragglers,
)
from meshtrain.planner import profiles

logger = logging.getLogger("meshtrain.operator")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Timers of the operator (flags of ``meshtrain operator``)."""

    resync_seconds: float = 30.0
    """Longest wait between two reconciles of a job without events."""
    progress_seconds: float = 10.0
    """How often rank 0's /progress is read while a job runs."""
    progress_timeout_seconds: float = 2.0
    """Deadline of one whole /progress request (connect, headers, body)."""
    gpu_profile: profiles.Profile | None = None
    """Profile a job is judged by when no candidate node names its GPU (``--gpu-profile``); None: not judged."""
    trainer_image: str = naming.DEFAULT_TRAINER_IMAGE
    """Image of jobs whose spec.image is empty (the chart's trainer.image)."""
    planning_deadline_seconds: float = planning.DEFAULT_DEADLINE_SECONDS
    """Longest a gang's plan may take in the planning worker; a job whose plan takes longer is refused."""
    default_queue: str | None = None
    """LocalQueue of jobs that name none (``--default-queue``); None: such jobs bypass Kueue."""
    isolated_namespaces: frozenset[str] = frozenset()
    """Namespaces where each gang gets a NetworkPolicy admitting only its own pods
    (``--gang-network-policy-namespace``); elsewhere none is created."""
    gang_peers: builders.GangPeers = builders.NO_PEERS
    """The operator and Prometheus, admitted by each gang's NetworkPolicy on their ports
    (``--gang-network-policy-operator-peers``, ``--gang-network-policy-metrics-peers``)."""
    container_restart_rules: bool | None = None
    """Whether trainer pods carry container restart rules (``--container-restart-rules``; the
    kubelet tier, ``kubelet_tier``); None: as the API server's version allows (:func:`resolved`)."""
    restart_all_containers: kubelet_tier.RestartAll = "auto"
    """Whether custom trainers' pods carry the ``RestartAllContainers`` rule (KEP-5532,
    ``--restart-all-containers``); ``auto``: where the API server's version serves it
    (:func:`resolved`) and every node of the gang declares it (``kubelet_tier.declares_all``)."""
    gang: gang_backend.GangBackend = gang_backend.AUTO
    """Who binds each gang all or nothing (``--gang-backend`` and its settings)."""
    reserve_after_seconds: float = capacity_queue.RESERVE_AFTER_SECONDS
    """Seconds a job waits for GPUs before it may hold the reservation (``--reserve-after-seconds``)."""


async def resolved(client: kube.Client, settings: Settings) -> Settings:
    """``settings`` with ``container_restart_rules`` decided and ``restart_all_containers`` off
    where the API server does not serve it: its ``/version`` asked once when either is ``auto``
    (1.35 or newer accepts the rules, 1.36 or newer their ``RestartAllContainers`` action);
    unanswered, both are left out."""
    rules, every = settings.container_restart_rules, settings.restart_all_containers
    if rules is not None and every != "auto":
        return settings
    try:
        version = await client.server_version()
    except kube.ApiError as err:
        logger.warning(
            "API server version not read (%s): trainer pods carry no container restart rules "
            "(set --container-restart-rules=on or --restart-all-containers=on to force them)",
            err,
        )
        return dataclasses.replace(
            settings,
            container_restart_rules=False if rules is None else rules,
            restart_all_containers="off" if every == "auto" else every,
        )
    if rules is None:
        rules = kubelet_tier.rules_served(version)
    if every == "auto" and not kubelet_tier.all_containers_served(version):
        every = "off"
    logger.info(
        "API server %s: container restart rules (the kubelet tier of in-place restarts) %s; "
        "RestartAllContainers for custom trainers %s",
        str(version.get("gitVersion") or "of unknown version")[:64],
        "used" if rules else "not served; processes still restart in place, containers do not",
        {"auto": "where every node declares it", "on": "forced", "off": "off"}[every],
    )
    return dataclasses.replace(
        settings, container_restart_rules=rules, restart_all_containers=every
    )


@dataclasses.dataclass(frozen=True)
class Outcome:
    """Result of one pass: whether it changed anything, and when to look again."""

    changed: bool
    requeue_after: float | None
    waiting_for_capacity: bool = False
    gone: bool = False
    done: bool = False
    """The job is finished and nothing is left to do for it (no TTL pending)."""


def _created(action: job_actions.Action, did: bool, body: dict[str, Any]) -> bool:
    """Whether ``action`` placed the gang anew and created it (its placement is recorded)."""
    placed = bool((body.get("status") or {}).get("placement"))
    return did and placed and isinstance(action, job_actions.Place) and action.missing is None


class Reconciler:
    """Reconciles TrainingJobs through one API client; shared by every job of the process."""

    def __init__(self, *, client: kube.Client, cache: informer.Cache, settings: Settings) -> None:
        self.client = client
        self.cache = cache
        self.settings = settings
        self.writer = status_writes.JobWriter(client, cache)
        self.fit = gang_fit.GangFit(
            cache, settings.gpu_profile, planning.Worker(settings.planning_deadline_seconds)
        )
        self.placer = placing.Placer(
            client=client,
            cache=cache,
            writer=self.writer,
            fit=self.fit,
            trainer_image=settings.trainer_image,
            isolated_namespaces=settings.isolated_namespaces,
            gang_peers=settings.gang_peers,
            restart_rules=settings.container_restart_rules is not False,
            restart_all=settings.restart_all_containers,
            gang=settings.gang,
        )
        self.placer.waiting.reserve_after = settings.reserve_after_seconds
        self.replacer = replacing.Replacer(self.placer)
        self.spares = sparing.Spares(self.placer)
        self.progress = progress_client.Poller(
            every=settings.progress_seconds, timeout=settings.progress_timeout_seconds
        )
        self._workload_rejections = retries.Backoff(children.retry_delay)
        """Jobs (by UID) whose Workload the API server refused: when they may try again, and why."""

    async def reconcile(self, *, namespace: str, name: str) -> Outcome:
        """One pass over ``namespace/name``."""
        started = time.perf_counter()
        try:
            return await self._reconcile(namespace, name)
        finally:
            metrics.RECONCILE_SECONDS.labels(namespace=namespace).observe(
                time.perf_counter() - started
            )

    async def _reconcile(self, namespace: str, name: str) -> Outcome:
        await self.cache.synced.wait()
        body = await self.client.get_job(namespace=namespace, name=name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            metrics.forget(namespace, name)
            return Outcome(changed=False, requeue_after=None, gone=True)
        body = await workloads.default_queue(
            self.client, self.writer, body, self.settings.default_queue
        )
        job = job_state.read(body)
        queue = kueue_workload.queue_of((body.get("metadata") or {}).get("labels"))
        released = await self._release_stores(job)  # before a placement could meet a stale one
        decision, kueue, workload = await self._decide(body, job, queue)
        changed, refused_now = released, False
        for action in decision.actions:
            if isinstance(action, workloads.ACTIONS):
                try:
                    did = await workloads.perform(
                        self.client,
                        action,
                        job,
                        queue,
                        workload,
                        self.settings.trainer_image,
                        functools.partial(self.writer.emit, body, "Warning"),
                    )
                except workloads.Rejected as err:
                    did = refused_now = self._workload_refused(job, str(err))
                else:
                    if isinstance(action, kueue_workload.CreateWorkload):
                        self._workload_rejections.forget(job.ref.uid)
            else:
                body, job, did = await self._act(action, body, job)
                if _created(action, did, body):
                    body, job, _ = await self._gates_in_pass(body, job, queue)
            changed = changed or did
        body, job, did = await self._checkpoints_warned(body, job)
        changed = changed or did
        admitted = kueue.state if kueue is not None else None
        flavors = admitted.flavors if isinstance(admitted, kueue_workload.Admitted) else ()
        count = admitted.count if isinstance(admitted, kueue_workload.Admitted) else None
        topology = admitted.topology if isinstance(admitted, kueue_workload.Admitted) else None
        body, job, did = await self.spares.keep(body, job, flavors, count, topology)
        changed = changed or did
        phase = (body.get("status") or {}).get("phase") or "Pending"
        if phase == job_state.Phase.RUNNING.value:  # it ran where it was placed: start afresh
            self.fit.refusals.pop(job.ref.uid, None)
        placed = (
            conditions.find((body.get("status") or {}).get("conditions") or [], conditions.PLACED)
            or {}
        )
        waiting = placed.get("status") == conditions.FALSE and placed.get("reason") in (
            placement.INSUFFICIENT_GPUS,
            placement.TOPOLOGY_UNSATISFIABLE,
            kueue_topology.CONFLICT,  # room may come back inside Kueue's assignment
            conditions.RESERVED,  # room comes back once the reservation's holder starts
        )
        unadmitted = (queue is not None or kueue is not None) and not isinstance(
            admitted, kueue_workload.Admitted
        )
        if not waiting or unadmitted:  # placed, finished, suspended (by Kueue too): no place
            self.placer.waiting.leave(job.ref)
        metrics.observe_job(body, unschedulable=waiting, placed_condition=placed)
        requeue = decision.requeue_after
        retry = self.placer.create_failures.wait(job.ref.uid, job.generation, time.monotonic())
        rejected = self._workload_rejections.current(job.ref.uid, job.generation)
        if rejected is not None:
            # Just refused: a pass now writes why (Queued); then the backoff's remaining time.
            left = max(rejected.not_before - time.monotonic(), 0.0) if not refused_now else 0.0
            retry = left if retry is None else min(retry, left)
        if any(isinstance(a, rescheduling.ReplaceRefused) for a in decision.actions):
            spaced = rescheduling.wait(self.fit.refusals.get(job.ref.uid), time.monotonic())
            retry = spaced if retry is None or spaced is None else min(retry, spaced)
        if (spaced_plan := self.placer.spaced_for(job.ref.uid)) is not None:
            retry = spaced_plan if retry is None else min(retry, spaced_plan)
        if (timed := self.placer.waiting.time_left(job.ref.uid)) is not None:
            timed = max(timed, spaced_plan or 0.0)  # a hold ends, a node returns: not before the
            retry = timed if retry is None else min(retry, timed)  # job's plans may start again
        if retry is not None:
            requeue = retry if requeue is None else min(requeue, retry)
        if (deadline := failure.pass_at_deadline(job, phase, clock.now())) is not None:
            requeue = deadline if requeue is None else min(requeue, deadline)
        if any(isinstance(a, job_actions.PollProgress) for a in decision.actions):
            requeue = (
                self.settings.progress_seconds
                if requeue is None
                else min(requeue, self.settings.progress_seconds)
            )
        done = phase in job_state.FINAL and requeue is None and not changed
        return Outcome(
            changed=changed, requeue_after=requeue, waiting_for_capacity=waiting, done=done
        )

    async def _release_stores(self, job: job_state.JobState) -> bool:
        """Delete the job's store pods no gang needs any more (``store_pod.doomed``)."""
        doomed = store_pod.doomed(owned.owned_pods(self.cache, job.ref), job.status)
        if doomed:
            ref = job.ref
            logger.info("%s/%s: store pod(s) no gang needs: %s", ref.namespace, ref.name, doomed)
            await owned.delete_pods(self.client, self.cache, job.ref, doomed)
        return bool(doomed)

    async def _decide(
        self, body: dict[str, Any], job: job_state.JobState, queue: kueue_workload.Queue | None
    ) -> tuple[job_actions.Decision, kueue_workload.Gate | None, dict[str, Any] | None]:
        """What the job's pods in the cache and Kueue's answer say to do (``lifecycle.decide``),
        with that answer and the job's Workload."""
        pods = owned.owned_pods(self.cache, job.ref)
        states = [s for s in (pod_state.read(p) for p in pods) if s is not None]
        kueue, workload = await workloads.gate(self.client, body, queue, self._rejected(job))
        planned = {p.get("node") for p in job.status.get("placement") or [] if isinstance(p, dict)}
        gone = frozenset(
            n for n in planned if isinstance(n, str) and self.cache.nodes.get(("", n)) is None
        )
        if states and job.status.get("phase") not in job_state.FINAL:
            await self.placer.check_gang_policy(job)
        spares = sum(feasibility.holds_resources(p) for p in sparing.spare_pods(pods))
        on = {n for n in planned if isinstance(n, str)} | {s.node for s in states if s.node}
        labels = kueue_reassigned.node_labels(on, lambda n: self.cache.nodes.get(("", n)))
        departed = owned.departed_store(self.cache, job.ref, int(job.status.get("restarts") or 0))
        stores_on = {
            n
            for p in [*store_pod.store_pods(pods), *([departed] if departed else [])]
            if (n := (p.get("spec") or {}).get("nodeName"))
        }
        down = frozenset(  # a node gone from the cache (deleted) is not Ready either
            n for n in stores_on if not feasibility.ready(self.cache.nodes.get(("", n)) or {})
        )
        lost = store_pod.loss(pods, job.status, job.ref.name, down, departed)
        decision = lifecycle.decide(job, states, clock.now(), kueue, gone, spares, labels, lost)
        return decision, kueue, workload

    async def _gates_in_pass(
        self, body: dict[str, Any], job: job_state.JobState, queue: kueue_workload.Queue | None
    ) -> Step:
        """The gang this pass just created: lift its gates now, not a pass later.

        The decision is the one the next pass would make (the cache has learnt the created pods,
        Kueue's answer is read again), so every check before the gates are lifted still holds:
        Placed=True first, the planned nodes checked under the lock's urgent lane.  Only a
        decision that lifts gates and needs nothing of Kueue's Workload is acted on here; any
        other (a pod not seen yet, Kueue's own step first) waits for the next pass, as before.
        """
        decision, _, _ = await self._decide(body, job, queue)
        actions = decision.actions
        if not any(isinstance(a, job_actions.LiftGates) for a in actions) or any(
            isinstance(a, workloads.ACTIONS) for a in actions
        ):
            return body, job, False
        changed = False
        for action in actions:
            body, job, did = await self._act(action, body, job)
            changed = changed or did
        return body, job, changed

    async def _act(
        self, action: job_actions.Action, body: dict[str, Any], job: job_state.JobState
    ) -> Step:
        ref = job.ref
        if isinstance(action, job_actions.SetStatus):
            return await self.writer.set_status(body, job, dict(action.changes))
        if isinstance(action, job_actions.Emit):
            await self.writer.emit(body, action.type, action.reason, action.message)
            return body, job, False
        if isinstance(action, job_actions.EmitOnNode):
            await self.writer.emit_on_node(action.node, ref, action.note)
            return body, job, False
        if isinstance(action, job_actions.DeletePods):
            await owned.delete_pods(
                self.client, self.cache, ref, action.names, action.grace_seconds
            )
            return body, job, True
        if isinstance(action, job_actions.LiftGates):
            return await self.placer.lift_gates(action, body, job)
        if isinstance(action, job_actions.DeleteJob):
            logger.info("deleting %s/%s: ttlSecondsAfterFinished elapsed", ref.namespace, ref.name)
            await self.client.delete_job(namespace=ref.namespace, name=ref.name)
            return body, job, True
        if isinstance(action, job_actions.PollProgress):
            return await self._poll(action, body, job)
        if isinstance(action, job_actions.Place):
            return await self.placer.place(action, body, job)
        if isinstance(action, resizing.Grow):
            return await self.placer.grow(action, body, job)
        if isinstance(action, rescheduling.ReplaceRefused):
            return await self.placer.replace_refused(action, body, job)
        if isinstance(action, job_actions.ReplacePods):
            replaced = await self.replacer.replace(action, body, job)
            return replaced or await self._all(action.otherwise, body, job)
        if isinstance(action, job_actions.ReplaceStraggler):
            slow = frozenset(action.nodes)
            kept = self.placer.waiting.excluded_for(job)  # a rebuild may not take them
            fits = await self.fit.fits_without(job, slow | kept, clock.now(), action.topology)
            changed = False
            for step in action.replaced if fits else action.otherwise:
                body, job, did = await self._act(step, body, job)
                changed = changed or did
            note = next((a for a in action.replaced if isinstance(a, job_actions.Emit)), None)
            if fits and note is not None:  # where an SRE looking at the node sees it too
                for node in action.nodes:
                    await self.writer.emit_on_node(node, job.ref, note)
            return body, job, changed
        raise TypeError(f"unknown action {action!r}")

    async def _all(
        self, actions: tuple[job_actions.Action, ...], body: dict[str, Any], job: job_state.JobState
    ) -> Step:
        """Each of ``actions`` in turn; changed when any changed something."""
        changed = False
        for step in actions:
            body, job, did = await self._act(step, body, job)
            changed = changed or did
        return body, job, changed

    async def _poll(
        self, action: job_actions.PollProgress, body: dict[str, Any], job: job_state.JobState
    ) -> Step:
        report = await self.progress.poll(job.ref, ip=action.ip, port=action.port)
        if report is None:  # not due, or no usable answer (the poller logs why)
            return body, job, False
        changes = progress_status.polled_changes(report)
        changes |= resizing.baseline(job.status, changes)
        restarted: tuple[str, ...] = ()
        if job.spec is not None:
            changes |= stragglers.observed(job.spec, job.status, report, clock.now())
            recovered, restarted = progress_status.recovery_changes(
                job.status, report, job.spec, clock.now()
            )
            changes |= recovered
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
                clock.now(),
            )
            if conds != list(before):
                changes["conditions"] = conds
        body, job, _ = await self.writer.set_status(body, job, changes)
        for told in restarted:  # each in-place restart the trainer made, named
            await self.writer.emit(body, "Warning", recovery_count.RESTARTED, told)
        if warning is not None:
            await self.writer.emit(
                body, "Warning", conditions.GLOBAL_BATCH_FAR_ABOVE_NOISE_SCALE, warning
            )
        return body, job, False

    async def _checkpoints_warned(self, body: dict[str, Any], job: job_state.JobState) -> Step:
        """``CheckpointsNotPersistent`` as the spec says, after the pass's own writes (which it must not undo)."""
        if job.spec is None or job.status.get("phase") in job_state.FINAL:
            return body, job, False
        before = job.status.get("conditions") or []
        conds, warning = checkpoint_condition.changes(before, job.spec, clock.now())
        if conds == list(before):
            return body, job, False
        body, job, did = await self.writer.set_status(
            body, job, dict(job_actions.set_status(job, conditions=conds).changes)
        )
        if warning is not None:
            await self.writer.emit(body, "Warning", conditions.EMPTY_DIR_CHECKPOINTS, warning)
        return body, job, did

    def _rejected(self, job: job_state.JobState) -> tuple[str, bool] | None:
        """Why the job's Workload was refused for this generation, and whether to try again now."""
        found = self._workload_rejections.current(job.ref.uid, job.generation)
        return None if found is None else (found.why, found.not_before <= time.monotonic())

    def _workload_refused(self, job: job_state.JobState, message: str) -> bool:
        """Back off before creating the refused Workload again; the next pass says why (Queued)."""
        tries = self._workload_rejections.refused(
            job.ref.uid, job.generation, time.monotonic(), message
        )
        logger.warning(
            "%s/%s: %s (try %d)", job.ref.namespace, job.ref.name, message, tries.failures
        )
        return True

    async def report_api_errors(
        self, *, namespace: str, name: str, failures: int, error: str | None
    ) -> None:
        """Condition ApiErrors (and a Warning Event) after ``failures`` failed passes; False when ``error`` is None."""
        body = await self.client.get_job(namespace=namespace, name=name)
        if body is None:
            return
        job = job_state.read(body)
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
            clock.now(),
        )
        body, job, _ = await self.writer.set_status(body, job, {"conditions": conds})
        if error is not None:
            await self.writer.emit(body, "Warning", reason, message)

    async def job_exists(self, *, namespace: str, name: str, uid: str) -> bool:
        """Whether the TrainingJob of this UID is still there (a namesake created since is not it)."""
        body = await self.client.get_job(namespace=namespace, name=name)
        return body is not None and (body.get("metadata") or {}).get("uid") == uid

    async def delete_children(self, *, namespace: str, name: str, uid: str) -> int:
        """Remove the children this job (``uid``) owns (``owned.delete_children``), then forget the job.

        Returns how many of its pods still hold resources while its Workload holds Kueue
        quota: the caller calls again later.
        """
        ref = identity.JobRef(name=name, namespace=namespace, uid=uid)
        isolated = namespace in self.settings.isolated_namespaces
        held = await owned.delete_children(self.client, self.cache, ref, isolated=isolated)
        if held:
            return held
        self.progress.forget(uid)
        self._workload_rejections.forget(uid)
        self.placer.forget(ref)
        metrics.forget(namespace, name)
        return 0
