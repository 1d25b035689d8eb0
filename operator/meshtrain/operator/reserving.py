"""The reservation's node set: planned for its holder, kept from every other path that takes GPUs.

``policy.reservation`` says what the reservation is and who may use it; here the holder's node
set is planned (``gang_fit`` on the cache, in the planning worker, under the placer's lock, at
most as often as ``reservation.due`` allows) and applied to the nodes a plan, a grow, a spare or
a replacement may take.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import time
from typing import Any

from meshtrain import placement
from meshtrain.operator import gang_fit, planning, waiting
from meshtrain.operator.cluster import clock, metrics
from meshtrain.operator.policy import (
    capacity,
    conditions,
    devices,
    failure,
    feasibility,
    job_state,
    placement_outcome,
    reservation,
    resizing,
)

logger = logging.getLogger("meshtrain.operator")


async def refresh(
    queue: waiting.Queue, fit: gang_fit.GangFit, job: job_state.JobState, demand: feasibility.Demand
) -> reservation.Reservation | None:
    """Plan the node set kept for ``job``, whose last plan placed nothing, when it holds the
    reservation and a plan is due (the new reservation; None: none was due).  Its gang is not
    planned for this: only a change that could admit it plans that (``waiting.Queue.unchanged``).

    Planned at its smallest allowed size (the plan tries larger ones first, and takes any that
    fits), on the nodes it may use, with the GPUs of meshtrain's own pods counted free.  No place
    even then: it may not hold (the reservation passes on).  A plan that got no verdict keeps no
    nodes until the next is due.
    """
    ref = job.ref
    try:
        if queue.reservation_due(ref.uid):
            return await _plan(queue, fit, job, demand)
        return None
    finally:
        queue.settled(ref.uid)


async def _plan(
    queue: waiting.Queue, fit: gang_fit.GangFit, job: job_state.JobState, demand: feasibility.Demand
) -> reservation.Reservation:
    """The holder's node set, planned now (see :func:`refresh`)."""
    assert job.spec is not None
    ref, declared = job.ref, job.declared or job.spec
    raw_nodes, nodes, _ = fit.candidates(job, declared.resources.gpu_resource_name, clock.now())
    drained = fit.cache.usage(ours_free=True)  # assumed pods are meshtrain's too
    smallest = min(spec.parallelism.data for _, spec in resizing.candidates(declared))
    metrics.RESERVATION_PLANS.labels(namespace=ref.namespace).inc()
    per_pod = declared.resources.gpus_per_node
    offered, _ = capacity.offered_nodes(
        demand,
        raw_nodes,
        drained,
        gpus_per_pod=per_pod,
        pods_wanted=1,
        claim=fit.claims.get(ref.uid),
        ask=devices.ask_of(declared, fit.cache.inventory()),
    )
    slots = {n.name: n.allocatable_gpus // per_pod for n in offered}
    ends = queue.node_ends([name for name, room in slots.items() if room])
    before = queue.reservation
    kept_clear = None  # the set planned before for this holder: when it clears, counted now
    if before is not None and before.holder == ref.uid and before.nodes:
        kept_clear = max((ends.get(n, math.inf) for n in before.nodes), default=None)
    pods = queue.entries[ref.uid].need.pods
    limits = reservation.clearing_limits(ends, slots, pods, kept_clear)
    sized, cut = None, False
    for limit in limits:
        last = limit == math.inf
        names = {n for n, end in ends.items() if end <= limit}
        if not last and (cut or len(names) == len(ends)):
            continue  # cut off before, or every node that could take a pod: the last try
        try:
            sized = await fit.plan_sizes(
                job,
                raw_nodes if last else [n for n in raw_nodes if name_of(n) in names],
                nodes if last else [n for n in nodes if n.name in names],
                *(demand, smallest),
                usage=drained,
            )
        except (planning.DeadlineExceeded, planning.WorkerFailed) as err:
            logger.info("%s/%s: reservation not planned: %s", ref.namespace, ref.name, err)
            sized, cut = None, True  # a try cut off: plan on every node, as without limits
            continue
        if isinstance(sized.answer, placement.Placement):
            break  # the node set that clears soonest by the declared limits
    answer = None if sized is None else sized.answer
    kept = frozenset(answer.nodes) if isinstance(answer, placement.Placement) else frozenset()
    planned = reservation.Reservation(ref.uid, kept, queue.basis(), time.monotonic())
    queue.reservation = planned
    if before is not None and before.nodes - kept:  # nodes other waiting jobs may take again
        queue.released()
    if sized is not None and not kept:
        queue.unfit(ref.uid)
        logger.info(
            "%s/%s: no place even with meshtrain's pods gone: holds no reservation",
            *(ref.namespace, ref.name),
        )
        return planned
    # the clear time is counted on the set now in place, so it is set first, then carried on it
    planned = queue.reservation = dataclasses.replace(planned, clear=queue.reserved_clear())
    logger.info(
        "%s/%s holds the reservation: %d node(s) kept for it; %s",
        *(ref.namespace, ref.name, len(kept), _backfill_note(planned.clear)),
    )
    return planned


def _backfill_note(cleared: float | None) -> str:
    if cleared is None:
        return "no backfill (a job on them declares no runPolicy.activeDeadlineSeconds)"
    return (
        f"backfill by jobs gone within {cleared - time.time():.0f} s (deadline, grace and "
        f"{reservation.ENFORCE_SLACK_SECONDS:.0f} s) while it cannot start"
    )


def name_of(node: dict[str, Any]) -> str:
    return str((node.get("metadata") or {}).get("name") or "")


def outside(
    queue: waiting.Queue,
    job: job_state.JobState,
    raw_nodes: list[dict[str, Any]],
    nodes: list[placement.Node],
) -> tuple[list[dict[str, Any]], list[placement.Node]]:
    """The candidate nodes (raw, and as the planner sees them) ``job`` may take."""
    kept = queue.excluded_for(job)
    if not kept:
        return raw_nodes, nodes
    return (
        [n for n in raw_nodes if (n.get("metadata") or {}).get("name") not in kept],
        [n for n in nodes if n.name not in kept],
    )


def backfilled(
    queue: waiting.Queue,
    job: job_state.JobState,
    placed: tuple[placement_outcome.Placed, Any] | None,
) -> tuple[str, dict[str, str]] | None:
    """When ``job``'s placement took reserved nodes (its declared limit let it backfill): the
    ``Backfilled`` Event's message and ``status.backfill`` (the deadline then in force, which a
    later edit of the spec does not move); None when it took none."""
    held = queue.holder()
    if placed is None or held is None or held.uid == job.ref.uid:
        return None
    taken = frozenset(placed[0].nodes) & queue.reserved_nodes()
    if not taken:
        return None
    key = queue.key_of(held.uid)
    holder = "another job" if key is None else f"{key[0]}/{key[1]}"
    spec = job.declared or job.spec
    ends = None if spec is None else reservation.job_end(spec, job.status, time.time())
    said = reservation.backfilled(len(taken), holder, ends, queue.reserved_clear())
    now = clock.now()
    left = None if spec is None else failure.deadline_left(spec, job.status, now)
    if left is None:  # cannot be: it backfilled by its deadline
        return said, {}
    deadline_at = now + datetime.timedelta(seconds=left)
    return said, {"holder": holder, "deadlineAt": conditions.timestamp(deadline_at)}


def unplaced(
    queue: waiting.Queue,
    job: job_state.JobState,
    demand: feasibility.Demand,
    outcome: placement_outcome.Unplaced,
) -> placement_outcome.Unplaced:
    """``outcome``, said as waiting for the reservation when a reserved node has room for a pod
    of the job now (the reserved nodes kept it from placing, as far as the cache can tell)."""
    kept = queue.excluded_for(job)
    held = queue.holder()
    if not kept or held is None:
        return outcome
    usage = queue.cache.usage()
    room = any(
        feasibility.slots(demand, node, usage.get(name) or feasibility.Usage(), 1) > 0
        for name in kept
        if (node := queue.cache.nodes.get(("", name))) is not None
    )
    if not room:
        return outcome
    message = reservation.message(held.need.pods, len(kept), queue.reserved_clear() is not None)
    return placement_outcome.unplaced(job, conditions.RESERVED, message, clock.now())
