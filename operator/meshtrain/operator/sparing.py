"""Spare nodes: the nodes a running gang keeps in reserve (``runPolicy.recovery.spareNodes``).

A spare is a pod of the job on a node beside the gang (``builders.build_spare_pod``): it requests
what a gang pod requests and idles, so kube-scheduler and every other job's plan (both count pods)
leave those GPUs alone, the reservation outlives an operator restart (it is an object, not the
operator's memory), and Kueue charges it to the job's quota (the Workload counts the spares; a job
holds no more spares than its admitted Workload counts, whatever ``spareNodes`` says since).
:class:`Spares` keeps ``spareNodes`` of them while the gang runs, chosen by the topology rules
(``meshtrain.placement.replacement.spares``), deletes them when the gang stops or is rebuilt, and
shows them in ``status.spares``.  ``replacing`` takes a spare first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from meshtrain import placement
from meshtrain.operator import placing
from meshtrain.operator.cluster import children, owned, workloads
from meshtrain.operator.cluster.status_writes import Step
from meshtrain.operator.policy import (
    builders,
    capacity,
    devices,
    feasibility,
    identity,
    job_state,
    kueue_topology,
    kueue_workload,
    naming,
    replacement,
    reservation,
    retries,
)
from meshtrain.placement import replacement as choice
from meshtrain.planner import placement_request

logger = logging.getLogger("meshtrain.operator")


def spare_pods(pods: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The job's spare pods among ``pods`` (labelled ``naming.LABEL_SPARE``)."""
    return [
        p for p in pods if naming.LABEL_SPARE in ((p.get("metadata") or {}).get("labels") or {})
    ]


def held(pods: Sequence[dict[str, Any]], attempt: int) -> list[dict[str, Any]]:
    """The spare pods of gang ``attempt`` that hold their node for it (not being deleted)."""
    return [
        p
        for p in spare_pods(pods)
        if naming.int_label(p["metadata"].get("labels"), naming.LABEL_ATTEMPT) == attempt
        and not p["metadata"].get("deletionTimestamp")
    ]


def wanted(job: job_state.JobState, admitted: int | None = None) -> int:
    """How many spares the job holds now: ``spareNodes`` while its gang runs and rejoins, else
    none; under Kueue no more than its Workload admitted beside the gang (``admitted``: the pods
    Kueue admitted, None without Kueue): ``spareNodes`` raised after admission, which does not
    make a new Workload, must not take GPUs outside the quota."""
    spec = job.spec
    if spec is None or job.status.get("phase") != job_state.Phase.RUNNING.value:
        return 0
    want = spec.run_policy.recovery.spare_nodes if replacement.rejoins(spec) else 0
    return want if admitted is None else max(0, min(want, admitted - spec.pods))


def shown(pods: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """``status.spares``: each spare pod and its node, by name."""
    return sorted(
        ({"pod": p["metadata"]["name"], "node": identity.planned_node(p) or ""} for p in pods),
        key=lambda s: s["pod"],
    )


class Spares:
    """Keeps each running gang's spare nodes, under the placer's lock."""

    def __init__(self, placer: placing.Placer) -> None:
        self.placer = placer
        self.short = retries.Backoff(children.retry_delay)
        """Jobs whose last reservation found no room for every spare: the next waits (doubling,
        at most ``children.RETRY_CAP_SECONDS``), not every pass; a pod event does not cut it short."""

    async def keep(
        self,
        body: dict[str, Any],
        job: job_state.JobState,
        flavors: tuple[str, ...] = (),
        admitted: int | None = None,
        topology: kueue_topology.Assignment | None = None,
    ) -> Step:
        """Delete the spares the job no longer holds, reserve the ones it lacks (on the nodes the
        admitted Kueue ``flavors`` allow, within the ``admitted`` pod count and Kueue TAS's
        ``topology`` assignment), show them."""
        placer, ref = self.placer, job.ref
        attempt, want = int(job.status.get("restarts") or 0), wanted(job, admitted)
        pods = owned.owned_pods(placer.cache, ref)
        kept = sorted(held(pods, attempt), key=lambda p: p["metadata"]["name"])[:want]
        names = {p["metadata"]["name"] for p in kept}
        doomed = [
            p["metadata"]["name"]
            for p in spare_pods(pods)
            if p["metadata"]["name"] not in names and not p["metadata"].get("deletionTimestamp")
        ]
        if doomed:
            await owned.delete_pods(placer.client, placer.cache, ref, doomed)
        changed = bool(doomed)
        if want == 0:
            self.short.forget(ref.uid)
        elif (
            len(kept) < want
            and self.short.wait(ref.uid, job.generation, time.monotonic()) is None
            and not placer.waiting.unsettled(ref.uid)  # just restarted: the holder's nodes first
        ):
            taken = {p["metadata"]["name"] for p in spare_pods(pods)}
            where = await workloads.flavors(placer.client, flavors)
            if isinstance(where, kueue_workload.Assignment):
                async with placer.lock:
                    made = await self._reserve(
                        job, attempt, want - len(kept), taken, where, (topology, kept)
                    )
                kept += made
                changed = changed or bool(made)
                if len(kept) < want:
                    self.short.refused(ref.uid, job.generation, time.monotonic(), "no room")
                else:
                    self.short.forget(ref.uid)
        listed = shown(kept)
        if listed != (job.status.get("spares") or []):
            body, job, _ = await placer.writer.set_status(
                body, job, {"spares": listed, "observedGeneration": job.generation}
            )
            changed = True
        return body, job, changed

    async def _reserve(
        self,
        job: job_state.JobState,
        attempt: int,
        count: int,
        taken: set[str],
        where: kueue_workload.Assignment,
        tas: tuple[kueue_topology.Assignment | None, list[dict[str, Any]]] = (None, []),
    ) -> list[dict[str, Any]]:
        """Create up to ``count`` spare pods on nodes the topology rules pick (fewer without room).

        ``tas``: Kueue TAS's assignment (None: none) and the spares already held.
        """
        assert job.spec is not None
        spec, ref, placer = job.spec, job.ref, self.placer
        gpu, per_pod = spec.resources.gpu_resource_name, spec.resources.gpus_per_node
        template = kueue_workload.assign(builders.build_pod(ref, spec, attempt, 0, ""), where)
        offered, _ = capacity.offered_nodes(
            feasibility.demand_of(template),
            list(placer.cache.nodes.values()),
            placer.cache.usage(),
            gpus_per_pod=per_pod,
            pods_wanted=1,
            claim=placer.fit.claims.get(ref.uid),
            ask=devices.ask_of(spec, placer.cache.inventory()),
        )
        free = {n.name: n.allocatable_gpus // per_pod for n in offered}
        free = reservation.outside(free, placer.waiting.excluded_for(job))  # never reserved nodes
        placed = replacement.entries(job.status)
        on = [str((placed.get(i) or {}).get("node") or "") for i in range(spec.pods)]
        every = [placement.node_from_manifest(n, gpu) for n in placer.cache.nodes.values()]
        if tas[0] is not None:  # the spares count in Kueue's pod set: only its domains' rest
            labels = {node.name: node.labels for node in every}
            used = [*on, *(identity.planned_node(p) or "" for p in tas[1])]
            free = kueue_topology.spare_room(free, used, labels, tas[0])
        nodes = choice.spares(placement_request.request_from_spec(spec), on, every, free, count)
        numbers = (
            n for n in range(2 * len(taken) + count + 1) if _name(ref, attempt, n) not in taken
        )
        pods = [
            kueue_workload.gang_pod(
                await placer.gang_pod(
                    builders.build_spare_pod(
                        ref, spec, attempt, number, node, default_image=placer.trainer_image
                    )
                ),
                where,
                job=ref.name,
                topology=tas[0],
            )
            for number, node in zip(numbers, nodes)
        ]
        refused = await children.ensure(placer.client, ref.uid, [], pods)
        if refused is not None:
            logger.warning("%s/%s: spare refused: %s", ref.namespace, ref.name, refused.message)
            return []
        if pods:
            logger.info(
                "%s/%s: %d spare node(s) reserved: %s",
                ref.namespace,
                ref.name,
                len(pods),
                ", ".join(nodes[: len(pods)]),
            )
        return pods


def _name(ref: identity.JobRef, attempt: int, number: int) -> str:
    return naming.spare_pod_name(ref.name, attempt, number)
