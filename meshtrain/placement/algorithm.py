"""The placement algorithm: :func:`plan`, and :func:`first_fit`, the topology-blind packing it is measured against.

:func:`plan` descends the domain tree (:mod:`.topology`) into the smallest subtree that holds the
gang, splits the gang at whole stages or pipelines where no child holds it, and keeps the cheaper
of two pod orders by the cost model (:mod:`.fabric_cost`); docs/placement.md has the steps.
Nothing is reserved here: the operator records the answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from meshtrain.placement import fabric_cost, stages, topology, values


def plan(
    request: values.PlacementRequest,
    nodes: Iterable[values.Node],
    reservations: Iterable[values.Reservation],
) -> values.Placement | values.Unschedulable:
    """Place the whole gang of ``request`` on ``nodes`` around ``reservations``, or say why not."""
    nodes = _unique(nodes)
    levels = request.levels or topology.detect_levels(nodes)
    slots, refused = _free_slots(request, nodes, reservations)
    shortage = _check_capacity(request, slots, refused, len(nodes))
    if shortage is not None:
        return shortage
    paths = topology.paths(nodes, slots, levels, request.nvlink_domain_label)
    fabric = topology.build(
        slots,
        paths,
        topology.level_keys(levels, request.nvlink_domain_label),
        topology.weights(levels),
        node_is_domain=request.nvlink_domain_label is None,
    )
    kept = request.constrained(levels)
    required = [i for i, level in enumerate(kept) if level.required and level.scope == "job"]
    if required and fabric.root.maxcap[required[-1] + 1] < request.pods:
        return _unsatisfiable(request, fabric, kept[required[-1]], required[-1] + 1)
    root = fabric.root
    staged = [i for i, level in enumerate(kept) if level.required and level.scope == "stage"]
    if staged:
        job_depth = required[-1] + 1 if required else 0
        found = stages.whole_stages(root, staged[-1] + 1, request.stage_pods)
        if found is None or found.maxcap[job_depth] < request.pods:
            return stages.unsatisfiable(request, root, kept, staged[-1] + 1, job_depth)
        root = found

    edges = fabric_cost.pod_traffic(request)
    best: values.Placement | None = None
    for order, unit in _orders(request, stage_major_only=bool(staged)):
        assignment: list[str] = [""] * request.pods
        _fill(root, order, 0, request.pods, unit, assignment)
        candidate = fabric_cost.priced(
            assignment, edges, fabric.paths, fabric.keys, fabric.weights, levels
        )
        if best is None or candidate.cost < best.cost:
            best = candidate
    assert best is not None
    return best


def first_fit(
    request: values.PlacementRequest,
    nodes: Iterable[values.Node],
    reservations: Iterable[values.Reservation],
) -> values.Placement | values.Unschedulable:
    """Topology-blind reference: fill free slots in the order the nodes are given.

    It honours eligibility and capacity like :func:`plan` but ignores fabric
    levels (required ones too); pod i goes to the i-th free slot.  Its cost is
    priced with the same model so the two can be compared.
    """
    nodes = _unique(nodes)
    levels = request.levels or topology.detect_levels(nodes)
    slots, refused = _free_slots(request, nodes, reservations)
    shortage = _check_capacity(request, slots, refused, len(nodes))
    if shortage is not None:
        return shortage
    assignment: list[str] = []
    for node in nodes:
        assignment.extend([node.name] * slots.get(node.name, 0))
    assignment = assignment[: request.pods]
    paths = topology.paths(nodes, slots, levels, request.nvlink_domain_label)
    keys = topology.level_keys(levels, request.nvlink_domain_label)
    return fabric_cost.priced(
        assignment, fabric_cost.pod_traffic(request), paths, keys, topology.weights(levels), levels
    )


def _unique(nodes: Iterable[values.Node]) -> list[values.Node]:
    """The nodes as a list; duplicate names are a caller bug."""
    listed = list(nodes)
    if len({node.name for node in listed}) != len(listed):
        raise ValueError("node names must be unique")
    return listed


def _free_slots(
    request: values.PlacementRequest,
    nodes: Sequence[values.Node],
    reservations: Iterable[values.Reservation],
) -> tuple[dict[str, int], dict[str, int]]:
    """Free pod slots per eligible node (only nodes with >= 1), and why the others are out."""
    reserved: dict[str, int] = {}
    for reservation in reservations:
        reserved[reservation.node] = reserved.get(reservation.node, 0) + reservation.gpus
    slots: dict[str, int] = {}
    refused = {"unschedulable": 0, "selector": 0, "full": 0}
    selector = tuple(request.node_selector.items())
    per_node = request.gpus_per_node
    for node in nodes:
        if node.unschedulable:
            refused["unschedulable"] += 1
        elif selector and any(node.labels.get(key) != value for key, value in selector):
            refused["selector"] += 1
        else:
            free = (node.allocatable_gpus - reserved.get(node.name, 0)) // per_node
            if free > 0:
                slots[node.name] = free
            else:
                refused["full"] += 1
    return slots, refused


def _check_capacity(
    request: values.PlacementRequest,
    slots: dict[str, int],
    refused: dict[str, int],
    total_nodes: int,
) -> values.Unschedulable | None:
    """InsufficientGPUs when the eligible nodes hold fewer slots than the gang has pods."""
    free = sum(slots.values())
    if free >= request.pods:
        return None
    per = request.gpus_per_node
    message = (
        f"needs {request.pods} pods of {per} GPUs ({request.pods * per} GPUs) on nodes with "
        f"{per} free GPUs each; found {len(slots)} eligible nodes with {free} free pod slots "
        f"among {total_nodes} nodes ({refused['unschedulable']} unschedulable, "
        f"{refused['selector']} not matching the node selector, "
        f"{refused['full']} with fewer than {per} free GPUs)"
    )
    return values.Unschedulable(reason=values.INSUFFICIENT_GPUS, message=message)


def _unsatisfiable(
    request: values.PlacementRequest, fabric: topology.Fabric, level: values.FabricLevel, depth: int
) -> values.Unschedulable:
    """TopologyUnsatisfiable naming the required level and its largest domain."""
    largest: topology.Domain | None = None
    frontier = [fabric.root]
    while frontier and frontier[0].depth < depth:
        frontier = [child for domain in frontier for child in domain.children]
    for domain in frontier:
        if largest is None or domain.cap > largest.cap:
            largest = domain
    assert largest is not None
    message = (
        f"needs {request.pods} pods of {request.gpus_per_node} GPUs inside one "
        f"{level.label} domain ({level.why_one_domain}); the largest, {largest.value!r}, has "
        f"{largest.cap} free pod slots; {fabric.root.cap} free pod slots cluster-wide "
        f"in {len(frontier)} domains"
    )
    return values.Unschedulable(reason=values.TOPOLOGY_UNSATISFIABLE, message=message)


def _orders(
    request: values.PlacementRequest, stage_major_only: bool = False
) -> list[tuple[list[int], int]]:
    """Pod orders to lay along the tree, each with its alignment unit (in pods).

    Stage-major is pod index order; its unit is the smallest run of pods that
    starts and ends on a stage boundary.  Column-major (only when every stage
    fills whole pods) walks one pipeline (a column of pods, one per stage)
    after another; its unit is one column.  Runs are consecutive in the order,
    so stage-major keeps DP rings together and column-major pipelines;
    :func:`plan` keeps the one with the lower modelled cost.  Where a context group spans pods
    (``tensor x context`` a multiple of ``gpusPerNode``), stage-major is also tried with one
    context group as its unit, so a stage that no domain holds is cut between context rings
    rather than through one.  ``stage_major_only`` (a level required per stage) leaves out
    column-major, which would lay a stage's pods apart.
    """
    pods, grid = request.pods, request.layout
    per_stage = grid.data * grid.context * grid.tensor
    unit = math.lcm(per_stage, request.gpus_per_node) // request.gpus_per_node
    orders = [(list(range(pods)), unit)]
    ring = grid.context * grid.tensor
    if grid.context > 1 and ring % request.gpus_per_node == 0:
        ring_pods = ring // request.gpus_per_node
        if 1 < ring_pods < unit:
            orders.append((list(range(pods)), ring_pods))
    if per_stage % request.gpus_per_node == 0 and unit > 1 and grid.pipeline > 1:
        if stage_major_only:
            return orders
        count = grid.pipeline
        orders.append(([(q % count) * unit + q // count for q in range(pods)], count))
    return orders


def _fill(
    domain: topology.Domain, order: list[int], start: int, count: int, unit: int, out: list[str]
) -> None:
    """Put the pods at positions ``[start, start+count)`` of ``order`` into ``domain``."""
    if domain.node is not None:
        for position in range(start, start + count):
            out[order[position]] = domain.node
        return
    for child, child_start, child_count in _split(domain, start, count, unit, _choose):
        _fill(child, order, child_start, child_count, unit, out)


Chooser = Callable[[list[topology.Domain], int, int, int], topology.Domain]
"""Picks the child that takes a run of pods: (candidates, start, count, unit) -> child."""


def _split(
    domain: topology.Domain, start: int, count: int, unit: int, choose: Chooser
) -> list[tuple[topology.Domain, int, int]]:
    """How ``domain`` shares the run ``[start, start+count)`` among its children.

    One child when one holds it all (picked by ``choose``); else the largest
    children first, each cut back to a unit boundary when the others can take
    the rest, and the last run in the child ``choose`` picks among those that
    hold it.
    """
    fitting = [child for child in domain.children if child.cap >= count]
    if fitting:
        return [(choose(fitting, start, count, unit), start, count)]
    pool = sorted(domain.children, key=lambda child: -child.cap)
    spare = sum(child.cap for child in pool)  # domain.cap, or more where whole stages cut it
    position, end = start, start + count
    parts: list[tuple[topology.Domain, int, int]] = []
    for index, child in enumerate(pool):
        need = end - position
        if child.cap >= need:
            fitting = [other for other in pool[index:] if other.cap >= need]
            parts.append((choose(fitting, position, need, unit), position, need))
            return parts
        spare -= child.cap
        take = child.cap
        cut = (position + take) // unit * unit
        if cut > position and spare >= end - cut:
            take = cut - position
        parts.append((child, position, take))
        position += take
    raise AssertionError("domain capacity was checked before splitting")


def _choose(
    candidates: list[topology.Domain], start: int, count: int, unit: int
) -> topology.Domain:
    """The candidate where the run lands deepest, then with the smallest footprint, then the smallest.

    The footprint (domains used at each depth, top first) is only simulated
    when the run does not fit on one node of every deepest candidate.
    """
    depths = [child.fit_depth(count) for child in candidates]
    deepest = max(depths)
    best = [child for child, depth in zip(candidates, depths) if depth == deepest]
    if len(best) == 1 or deepest == len(best[0].maxcap) - 1:
        return min(best, key=lambda child: child.cap)
    return min(best, key=lambda child: (_footprint(child, start, count, unit), child.cap))


def _choose_quickly(
    candidates: list[topology.Domain], start: int, count: int, unit: int
) -> topology.Domain:
    """Cheaper chooser for footprint simulation: deepest fit, fewest children needed, smallest."""
    return min(
        candidates, key=lambda child: (-child.fit_depth(count), _spread(child, count), child.cap)
    )


def _spread(domain: topology.Domain, count: int) -> int:
    """Children of ``domain`` needed to hold ``count`` pods, largest first."""
    needed = 0
    for cap in sorted((child.cap for child in domain.children), reverse=True):
        if count <= 0:
            break
        count -= cap
        needed += 1
    return needed


def _footprint(domain: topology.Domain, start: int, count: int, unit: int) -> tuple[int, ...]:
    """Domains a run would use at each depth below ``domain`` (quick chooser), top first."""
    used = [0] * len(domain.maxcap)
    stack = [(domain, start, count, 0)]
    while stack:
        current, run_start, run_count, depth = stack.pop()
        used[depth] += 1
        if current.node is None:
            for child, child_start, child_count in _split(
                current, run_start, run_count, unit, _choose_quickly
            ):
                stack.append((child, child_start, child_count, depth + 1))
    return tuple(used)
