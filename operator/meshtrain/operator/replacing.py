"""Replacing the lost pods of a running gang, and nothing else, under the placement lock.

:class:`Replacer` carries out ``job_actions.ReplacePods``: it picks a node for each lost pod
(``meshtrain.placement.replacement``: the survivors' domain kept where the plan requires it,
spare nodes first (``sparing``), else the fabric cost model), writes the replacements into
``status.placement`` (``pending``) and ``status.recovery`` first, deletes the lost pods, then,
once a lost pod stopped or its node is known dead (``replacement.holders``), releases the spare
its replacement takes and creates the replacement (already released: the gang it joins runs),
and marks it created.  A pass after a crash, or after the lost pod stopped, finds the pending name and creates
it (the create is idempotent).
Without room it answers None: the reconciler then rebuilds the gang as before.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping
from typing import Any

from meshtrain import placement
from meshtrain.operator import placing, sparing
from meshtrain.operator.cluster import children, clock, owned, workloads
from meshtrain.operator.cluster.status_writes import Step
from meshtrain.operator.policy import (
    builders,
    capacity,
    conditions,
    device_errors,
    devices,
    feasibility,
    identity,
    job_actions,
    job_state,
    kueue_topology,
    kueue_workload,
    naming,
    pod_failure,
    pod_state,
    replacement,
    reservation,
)
from meshtrain.placement import replacement as choice
from meshtrain.planner import placement_request

logger = logging.getLogger("meshtrain.operator")


class Replacer:
    """Replaces lost pods for every job of the process, under the placer's lock."""

    def __init__(self, placer: placing.Placer) -> None:
        self.placer = placer

    async def replace(
        self, action: job_actions.ReplacePods, body: dict[str, Any], job: job_state.JobState
    ) -> Step | None:
        """Replace the lost pods of ``action``; None: not replaced (no node takes them now, or the
        API server refused the replacement): the caller rebuilds the gang instead."""
        assert job.spec is not None
        ref, spec, placer = job.ref, job.spec, self.placer
        where = await workloads.flavors(placer.client, action.flavors)
        if isinstance(where, kueue_workload.Unassignable):
            return None
        if self._recovery_changed(job, action.attempt, where):
            message = "runPolicy.recovery changed since the gang started: the gang is rebuilt"
            await placer.writer.emit(body, "Warning", conditions.POD_NOT_REPLACED, message)
            return None
        async with placer.lock:
            chosen = self._recorded(action, job, where)
            fresh = [i for i in action.indices if i not in chosen]
            made: list[replacement.Replaced] = []
            if fresh:
                answer = self._choose(action, job, fresh, where, chosen)
                if isinstance(answer, placement.Unschedulable):
                    message = f"lost pod(s) {fresh} not replaced alone: {answer.message}"
                    logger.info("%s/%s: %s", ref.namespace, ref.name, message)
                    await placer.writer.emit(body, "Warning", conditions.POD_NOT_REPLACED, message)
                    return None
                made = self._replaced(action, job, answer)
                changes = replacement.status_changes(
                    job, made, spec.resources.gpus_per_node, clock.now()
                )
                body, job, _ = await placer.writer.set_status(body, job, changes)
                chosen.update({r.index: (r.pod, r.node) for r in made})
            # The lost pods go first, and a replacement waits until its lost pod stopped (or its
            # node is known dead): a gang slot never has two live holders.
            await owned.delete_pods(placer.client, placer.cache, ref, action.doomed)
            ready = self._vacated(job, action.attempt, chosen)
            # A spare holds its node until the replacement that takes it can be created.
            await self._release(job, action.attempt, tuple(chosen[i][1] for i in ready))
            pods = [
                await placer.gang_pod(self._pod(job, action, i, *chosen[i], where)) for i in ready
            ]
            refused = await children.ensure(placer.client, ref.uid, [], pods)
            if refused is None and ready:
                created = replacement.created(job.status, ready)
                body, job, _ = await placer.writer.set_status(body, job, created)
        if refused is not None:
            logger.warning(
                "%s/%s: replacement refused: %s", ref.namespace, ref.name, refused.message
            )
            return None
        if made:
            message = replacement.message(made)
            logger.info("%s/%s: %s", ref.namespace, ref.name, message)
            await placer.writer.emit(body, "Normal", conditions.POD_REPLACED, message)
        return body, job, bool(made or ready or action.doomed)

    def _recorded(
        self,
        action: job_actions.ReplacePods,
        job: job_state.JobState,
        where: kueue_workload.Assignment,
    ) -> dict[int, tuple[str, str]]:
        """Replacements recorded but not created yet (``pending``: their lost pod was still
        stopping, or a crash came between the status write and the create), whose node can still
        take them: index -> (pod, node).  A replacement created and lost since is not here: it is
        a new loss, replaced afresh (counted, announced)."""
        ref = job.ref
        placed = replacement.entries(job.status)
        cached = {p["metadata"]["name"] for p in owned.owned_pods(self.placer.cache, ref)}
        found: dict[int, tuple[str, str]] = {}
        for index in action.indices:
            entry = placed.get(index) or {}
            name, node = entry.get("pod"), entry.get("node")
            fits = isinstance(node, str) and node not in action.avoid
            pending = replacement.pending(entry) and name not in cached
            if isinstance(name, str) and isinstance(node, str) and fits and pending:
                found[index] = (name, node)
        if not found:
            return found
        demand = feasibility.demand_of(self._template(job, action.attempt, where))
        wanted = collections.Counter(node for _, node in found.values())
        cache = self.placer.cache
        pods = owned.owned_pods(cache, ref)
        back = {index: node for index, (_, node) in found.items()}
        theirs = [*sparing.held(pods, action.attempt), *_vacating(pods, action, back).values()]
        raw = list(cache.nodes.values())
        ask = devices.ask_of(job.spec, cache.inventory()) if job.spec is not None else None
        blocked = capacity.infeasible_nodes(demand, wanted, raw, cache.usage(without=theirs), ask)
        return {i: pn for i, pn in found.items() if pn[1] not in blocked}

    def _recovery_changed(
        self, job: job_state.JobState, attempt: int, where: kueue_workload.Assignment
    ) -> bool:
        """Whether a replacement built now would carry another ``runPolicy.recovery`` than the
        gang's running pods (the spec hash leaves runPolicy out: no gang rebuild followed the
        edit): pod 0's, or, when pod 0 is being replaced too (a store pod hosts the rendezvous),
        another pod of the attempt that is not being deleted."""
        first = naming.pod_name(job.ref.name, attempt, 0)
        gang = [
            p
            for p in owned.owned_pods(self.placer.cache, job.ref)
            if naming.int_label(p["metadata"].get("labels"), naming.LABEL_ATTEMPT) == attempt
            and naming.LABEL_NODE_RANK in (p["metadata"].get("labels") or {})
        ]
        survivor = next((p for p in gang if p["metadata"]["name"] == first), None) or next(
            (p for p in gang if not p["metadata"].get("deletionTimestamp")), None
        )
        return replacement.recovery_changed(survivor, self._template(job, attempt, where))

    def _vacated(
        self, job: job_state.JobState, attempt: int, chosen: dict[int, tuple[str, str]]
    ) -> list[int]:
        """The indices of ``chosen`` whose lost pods no longer run (terminal, gone, or on a node
        known dead): their replacements may be created now; the others wait (a pod event brings
        the next pass)."""
        cache = self.placer.cache
        pods = owned.owned_pods(cache, job.ref)
        ready = []
        for index in sorted(chosen):
            left = replacement.holders(
                pods, attempt, index, chosen[index][0], lambda n: cache.nodes.get(("", n))
            )
            if left:
                logger.info(
                    "%s/%s: pod %d's replacement waits for %s to stop",
                    job.ref.namespace,
                    job.ref.name,
                    index,
                    ", ".join(left),
                )
            else:
                ready.append(index)
        return ready

    def _choose(
        self,
        action: job_actions.ReplacePods,
        job: job_state.JobState,
        fresh: list[int],
        where: kueue_workload.Assignment,
        pending: dict[int, tuple[str, str]],
    ) -> choice.Replacement | placement.Unschedulable:
        """Nodes for the ``fresh`` lost indices, beside the surviving pods and the ``pending``
        replacements (recorded, not created yet: the cache does not count them)."""
        assert job.spec is not None
        spec, fit, cache = job.spec, self.placer.fit, self.placer.cache
        gpu, per_pod = spec.resources.gpu_resource_name, spec.resources.gpus_per_node
        avoid = frozenset(action.avoid)
        raw_nodes, _, _ = fit.candidates(job, gpu, clock.now(), also_avoid=avoid)
        demand = feasibility.demand_of(self._template(job, action.attempt, where))
        pods = owned.owned_pods(cache, job.ref)
        spare_pods = sparing.held(pods, action.attempt)
        spares = {identity.planned_node(p) or "" for p in spare_pods} - avoid

        def room(without: list[dict[str, Any]]) -> dict[str, int]:
            offered, _ = capacity.offered_nodes(
                demand,
                raw_nodes,
                cache.usage(without=without),
                gpus_per_pod=per_pod,
                pods_wanted=len(fresh),
                claim=fit.claims.get(job.ref.uid),
                ask=devices.ask_of(spec, cache.inventory()),
            )
            return {n.name: n.allocatable_gpus // per_pod for n in offered}

        free = room(spare_pods)  # a spare's GPUs are the replacement's
        for _, node in pending.values():
            if free.get(node, 0) > 0:
                free[node] -= 1
        # A lost pod on a node that did not lose it (a deletion) holds a slot there that its
        # own replacement may take (created once the pod stopped), where every filter passes.
        vacating = _vacating(pods, action, dict.fromkeys(fresh))
        returning = {}
        if vacating:
            freed = room([*spare_pods, *vacating.values()])
            returning = {
                i: n for i, p in vacating.items() if (n := identity.planned_node(p)) in freed
            }
        placed = replacement.entries(job.status)
        on = [str((placed.get(i) or {}).get("node") or "") for i in range(spec.pods)]
        every = [placement.node_from_manifest(n, gpu) for n in cache.nodes.values()]
        if action.topology is not None:  # Kueue TAS: only where the survivors leave it room
            labels = {node.name: node.labels for node in every}
            survivors = [node for i, node in enumerate(on) if i not in fresh]
            held = [identity.planned_node(p) or "" for p in spare_pods]
            free = kueue_topology.replacement_room(free, survivors, held, labels, action.topology)
        request = placement_request.request_from_spec(spec)
        kept = self.placer.waiting.excluded_for(job)  # the reservation's nodes: a last resort
        if kept:  # the own node too: a deleted pod's node goes to the longest waiter first
            back = {i: node for i, node in returning.items() if node not in kept}
            away = choice.replace(
                request, on, fresh, every, reservation.outside(free, kept), spares, back
            )
            if not isinstance(away, placement.Unschedulable):
                return away
        return choice.replace(request, on, fresh, every, free, spares, returning)

    async def _release(self, job: job_state.JobState, attempt: int, nodes: tuple[str, ...]) -> None:
        """Delete the spare pods on ``nodes`` (those of the replacements created now): their GPUs
        go to the replacements (the spare exits at SIGTERM; kube-scheduler binds the replacement
        once it is gone).  Until then the spare keeps the node for its replacement."""
        if not nodes:
            return
        cache = self.placer.cache
        spares = sparing.held(owned.owned_pods(cache, job.ref), attempt)
        names = [p["metadata"]["name"] for p in spares if identity.planned_node(p) in nodes]
        await owned.delete_pods(self.placer.client, cache, job.ref, names)

    def _replaced(
        self, action: job_actions.ReplacePods, job: job_state.JobState, answer: choice.Replacement
    ) -> list[replacement.Replaced]:
        placed = replacement.entries(job.status)
        causes = {index: (pod, cause) for index, pod, cause in action.causes}
        return [
            replacement.Replaced(
                index=index,
                lost=causes[index][0]
                or replacement.recorded_pod(job.ref.name, action.attempt, placed.get(index), index),
                cause=causes[index][1],
                pod=replacement.planned_name(
                    job.ref.name, action.attempt, placed.get(index), index
                ),
                node=node,
                spare=node in answer.spares_used,
            )
            for index, node in sorted(answer.nodes.items())
        ]

    def _template(
        self, job: job_state.JobState, attempt: int, where: kueue_workload.Assignment
    ) -> dict[str, Any]:
        assert job.spec is not None
        return kueue_workload.assign(builders.build_pod(job.ref, job.spec, attempt, 0, ""), where)

    def _pod(
        self,
        job: job_state.JobState,
        action: job_actions.ReplacePods,
        index: int,
        name: str,
        node: str,
        where: kueue_workload.Assignment,
    ) -> dict[str, Any]:
        """The replacement: the gang's pod ``index`` under its own name, released at once (the
        gang it joins runs; a PodGroup's gang was bound long ago, so it names none, and binds alone
        through the gang backend's scheduler: ``Placer.gang_pod``); a TAS pod of
        the Workload under Kueue's assignment, as the gang's."""
        assert job.spec is not None
        pod = builders.build_pod(
            job.ref,
            job.spec,
            action.attempt,
            index,
            node,
            default_image=self.placer.trainer_image,
            restart_rules=self.placer.restart_rules,
            restart_all=self.placer.restart_all_on([node]),
            name=name,
            device_errors=device_errors.newest_by_node(job.status, clock.now()),
        )
        pod["spec"]["schedulingGates"] = [
            g for g in pod["spec"].get("schedulingGates") or [] if g.get("name") != naming.GANG_GATE
        ]
        return kueue_workload.gang_pod(pod, where, job=job.ref.name, topology=action.topology)


def _vacating(
    pods: list[dict[str, Any]], action: job_actions.ReplacePods, back: Mapping[int, str | None]
) -> dict[int, dict[str, Any]]:
    """Index -> the lost pod of ``action``'s gang attempt (``back`` holds lost indices only)
    that a deletion, not its node, ended
    (deleting, no ``DisruptionTarget``, its node not in ``action.avoid``) and that still holds its
    node's resources, for the indices of ``back`` whose replacement may go back to that node
    (``back[i]``: the node recorded for it; None: any, being chosen now).  Its replacement is
    created only once it stopped (``replacement.holders``), so the slot is that replacement's
    alone."""
    found: dict[int, dict[str, Any]] = {}
    for pod in pods:
        state = pod_state.read(pod)
        if state is None or state.attempt != action.attempt or state.index not in back:
            continue
        node = state.node
        ended_by_deletion = state.deleting and not pod_failure.disrupted(state)
        if (
            node is not None
            and node not in action.avoid
            and back[state.index] in (None, node)
            and ended_by_deletion
            and state.holds_resources
        ):
            found[state.index] = pod
    return found
