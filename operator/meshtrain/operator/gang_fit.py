"""Where a job's gang fits now: the candidate nodes, and a plan at each size it may take.

Read from the informer cache only (no API call, no write): ``placing`` acts on the answer under
its lock, and the straggler step asks whether the gang would fit without its slow nodes.  The
nodes' offer is read here; the plan at each size is made in the planning worker (``planning``),
off the event loop and under its deadline.  Not policy, since it reads the caches and remembers
per job (refusals, claims).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from meshtrain import placement
from meshtrain.operator import admitting, planning
from meshtrain.operator.cluster import informer, owned
from meshtrain.operator.policy import (
    builders,
    capacity,
    devices,
    excluded_nodes,
    feasibility,
    job_state,
    kueue_topology,
    placement_outcome,
    rescheduling,
    volumes,
)
from meshtrain.planner import profiles

logger = logging.getLogger("meshtrain.operator")


class GangFit:
    """What the cluster offers each job's gang, as the cache sees it."""

    def __init__(
        self,
        cache: informer.Cache,
        gpu_profile: profiles.Profile | None,
        worker: planning.Worker,
    ) -> None:
        self.cache = cache
        self.worker = worker
        self._planner_nodes: tuple[Any, list[dict[str, Any]], list[placement.Node]] = (None, [], [])
        self._admissions = admitting.Admissions(gpu_profile)
        self.refusals: dict[str, rescheduling.Record] = {}
        """Jobs (by UID) re-placed after kube-scheduler refused their released pods."""
        self.claims: dict[str, volumes.Topology | None] = {}
        """Where each job's claim lets its pods go, as its last placement read it (by UID)."""

    def forget(self, namespace: str, name: str, uid: str) -> None:
        self.refusals.pop(uid, None)
        self.claims.pop(uid, None)

    def candidates(
        self,
        job: job_state.JobState,
        gpu: str,
        now: datetime.datetime,
        also_avoid: frozenset[str] = frozenset(),
        at: float | None = None,
    ) -> tuple[list[dict[str, Any]], list[placement.Node], frozenset[str]]:
        """The nodes a placement of ``job`` may use at ``now`` (``at`` on the monotonic clock;
        None: read now) (raw, and as the planner sees them), and the nodes it avoids (replaced
        stragglers, scheduler refusals)."""
        raw_nodes, nodes = self._nodes(gpu)
        at = time.monotonic() if at is None else at
        refused = rescheduling.excluded(self.refusals.get(job.ref.uid), at)
        avoid = excluded_nodes.excluded(job.status, now) | refused | also_avoid
        if avoid:
            raw_nodes = [n for n in raw_nodes if n["metadata"]["name"] not in avoid]
            nodes = [n for n in nodes if n.name not in avoid]
        return raw_nodes, nodes, avoid

    def avoided_until(
        self, job: job_state.JobState, gpu: str, now: datetime.datetime, at: float
    ) -> tuple[float, frozenset[str]] | None:
        """Monotonic time the first nodes :meth:`candidates` avoided for ``job`` at ``now``
        (``at`` on the monotonic clock) may take its pods again, and those nodes: the latest end
        of the rules that avoid each, for nodes that exist (None: none will by time alone).  The
        plan's candidates change then, with no capacity change."""
        refused = rescheduling.returns_in(self.refusals.get(job.ref.uid), at)
        replaced = excluded_nodes.returns_in(job.status, now)
        present = {node["metadata"]["name"] for node in self._nodes(gpu)[0]}
        ends = {
            node: max(refused.get(node, 0.0), replaced.get(node, 0.0))
            for node in (refused.keys() | replaced.keys()) & present
        }
        left = min((end for end in ends.values() if end != math.inf), default=None)
        if left is None:
            return None
        return at + left, frozenset(node for node, end in ends.items() if end == left)

    async def fits_without(
        self,
        job: job_state.JobState,
        slow: frozenset[str],
        now: datetime.datetime,
        topology: kueue_topology.Assignment | None = None,
    ) -> bool:
        """Whether the gang fits now at its running data-parallel degree without the ``slow`` nodes and the
        job's excluded nodes, counting its own pods' resources as free.

        A smaller elastic size does not count: trading a slow replica for a shrunk gang (and a
        restart) loses more throughput than the straggler costs.  ``topology``: Kueue TAS's
        assignment, inside which the gang must fit (the slow nodes' places taken elsewhere in it).
        """
        assert job.spec is not None
        declared = job.declared or job.spec
        gpu = declared.resources.gpu_resource_name
        raw_nodes, nodes, _ = self.candidates(job, gpu, now, slow)
        demand = feasibility.demand_of(builders.build_pod(job.ref, declared, 0, 0, ""))
        running = job.spec.parallelism.data
        try:
            sized = await self.plan_sizes(job, raw_nodes, nodes, demand, running, topology)
        except (planning.DeadlineExceeded, planning.WorkerFailed) as err:
            logger.info("%s/%s: straggler node(s) kept: %s", job.ref.namespace, job.ref.name, err)
            return False
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

    def freed_by_replacing(self, job: job_state.JobState) -> list[dict[str, Any]]:
        return capacity.freed_by_replacing(
            owned.owned_pods(self.cache, job.ref), int(job.status.get("restarts") or 0)
        )

    async def plan_sizes(
        self,
        job: job_state.JobState,
        raw_nodes: list[dict[str, Any]],
        nodes: list[placement.Node],
        demand: feasibility.Demand,
        cap: int | None = None,
        topology: kueue_topology.Assignment | None = None,
        usage: Mapping[str, feasibility.Usage] | None = None,
        held: frozenset[str] = frozenset(),
    ) -> placement_outcome.Sized:
        """The plan at the size ``placement_outcome.choose`` picks among those runPolicy.elastic allows
        (none above ``cap``), planned largest first until one fits, in the planning worker.

        Raises ``planning.DeadlineExceeded`` when that takes longer than the worker's deadline, and
        ``planning.WorkerFailed`` when the worker dies.  ``topology``: Kueue TAS's assignment, the
        only nodes (and pods per domain) the plan may use; ``usage``: what the pods on each node
        take (None: the cache's, the job's own replaced pods left out); ``held``: preferred
        levels required of the whole gang for this plan (``topology_hold``).
        """
        assert job.spec is not None
        declared = job.declared or job.spec
        offered, refusals = capacity.offered_nodes(
            demand,
            raw_nodes,
            self.cache.usage(without=self.freed_by_replacing(job)) if usage is None else usage,
            gpus_per_pod=declared.resources.gpus_per_node,
            pods_wanted=placement_outcome.most_pods(declared),
            claim=self.claims.get(job.ref.uid),
            ask=devices.ask_of(declared, self.cache.inventory()),
        )
        if topology is not None:
            offered = kueue_topology.restrict(offered, topology, declared.resources.gpus_per_node)
        ask = placement_outcome.Ask(
            declared=declared,
            cap=cap,
            choice=self._admissions.choice(declared, nodes),
            offered=tuple(offered),
            held=held,
        )
        sized = await self.worker.plan(ask)
        return dataclasses.replace(sized, refusals=refusals if sized.answer is not None else [])

    def _nodes(self, gpu: str) -> tuple[list[dict[str, Any]], list[placement.Node]]:
        """The cached nodes, and as the planner sees them (rebuilt only when a node changed)."""
        key = (self.cache.nodes.changes, gpu)
        if self._planner_nodes[0] != key:
            raw = list(self.cache.nodes.values())
            self._planner_nodes = (key, raw, [placement.node_from_manifest(n, gpu) for n in raw])
        return self._planner_nodes[1], self._planner_nodes[2]
