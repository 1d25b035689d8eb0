"""Where a lost pod of a running gang goes: one node per lost index, beside the pods that survive.

:func:`replace` keeps every surviving pod where it is and picks a node for each lost pod index:
only a node that shares the survivors' domain at every ``required`` fabric level may take it (the
gang's plan required one domain there), and at a level required per stage only a node in the
domain of the lost pod's stage (a whole stage lost: a domain with room for it); among those, a
spare node reserved for the job comes first, then the node whose traffic to the surviving pods
costs least by the fabric cost model (:mod:`.fabric_cost`).  :func:`spares` picks the nodes a running gang keeps in reserve for
that.  Pure and deterministic, like :func:`meshtrain.placement.plan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence

from meshtrain.placement import fabric_cost, topology, values


@dataclasses.dataclass(frozen=True)
class Replacement:
    """Nodes for the lost pods of a gang."""

    nodes: Mapping[int, str]
    """Pod index -> the node its replacement goes to."""
    spares_used: tuple[str, ...]
    """The spare nodes among them (their reservations are released for the replacements)."""
    cost: float
    """Modelled cost of the whole gang's traffic with the replacements in place."""


def replace(
    request: values.PlacementRequest,
    placed: Sequence[str],
    lost: Collection[int],
    nodes: Iterable[values.Node],
    free: Mapping[str, int],
    spares: Collection[str] = (),
    returning: Mapping[int, str] | None = None,
) -> Replacement | values.Unschedulable:
    """Nodes for the ``lost`` pod indices of a gang placed on ``placed`` (node per pod index).

    ``nodes``: every node whose labels the fabric is read from (the survivors' included);
    ``free``: node -> free pod slots for this gang (a spare's reserved slots counted free);
    ``spares``: nodes reserved for the job, used first; ``returning``: lost index -> the node its
    lost pod still holds a slot on that only its own replacement may take (a deleted pod on a
    node that did not lose it: the replacement is created once the pod stopped).  Lost indices
    are placed lowest first, each priced against the survivors and the replacements chosen
    before it; at equal cost a pod goes back to its own node.
    """
    returning = returning or {}
    known = {node.name: node for node in nodes}
    levels = request.levels or topology.detect_levels(known.values())
    label = request.nvlink_domain_label
    path = {name: topology.node_path(node, levels, label) for name, node in known.items()}
    depth, stage_depth = _depths(request.constrained(levels))
    where = {i: node for i, node in enumerate(placed) if i not in lost}
    anchor = next((path[n] for n in where.values() if n in path), None)
    if depth and anchor is None:
        return values.Unschedulable(
            values.TOPOLOGY_UNSATISFIABLE, "no surviving pod's node is known: no domain to keep"
        )
    weights = topology.weights(levels)
    edges = fabric_cost.pod_traffic(request)
    slots = {name: count for name, count in free.items() if count > 0 and name in path}
    chosen: dict[int, str] = {}
    for index in _order(request, lost, where, stage_depth):
        back = returning.get(index)
        offer = dict(slots)
        if back in path:
            offer[back] = offer.get(back, 0) + 1  # its own slot, for it alone
        inside = [n for n in offer if anchor is None or path[n][:depth] == anchor[:depth]]
        if not inside:
            return _none_left(request, index, slots, depth, request.constrained(levels))
        if stage_depth:
            inside = _in_stage_domain(request, index, inside, where, lost, offer, path, stage_depth)
            if not inside:
                return _none_left(
                    request, index, slots, stage_depth, request.constrained(levels), stage=True
                )
        pool = [n for n in inside if n in spares] or inside
        # At equal cost the pod's own node (offered when a deletion, not the node, lost it) wins:
        # the plan chose it, and the replacement lands where its volumes and image already are.
        own = placed[index] if index < len(placed) else None
        best = min(pool, key=lambda n: (_cost(index, n, where, edges, path, weights), n != own, n))
        where[index] = chosen[index] = best
        if best != back:  # its own returning slot is not shared
            slots[best] -= 1
            if slots[best] == 0:
                del slots[best]
    total = fabric_cost.evaluate(edges, [path[where[i]] for i in range(len(placed))], weights)[1]
    used = tuple(sorted({n for n in chosen.values() if n in spares}))
    return Replacement(nodes=chosen, spares_used=used, cost=total)


def _order(
    request: values.PlacementRequest,
    lost: Collection[int],
    survivors: Mapping[int, str],
    stage_depth: int,
) -> list[int]:
    """Lost indices in the order they are placed: lowest first, but under a per-stage level the
    pods of stages that kept a pod first (their domain is fixed), then the wholly lost stages,
    so a lost stage never takes the slots a partly lost stage needs in its own domain."""
    ordered = sorted(lost)
    if not stage_depth:
        return ordered
    size = request.stage_pods
    kept = {i // size for i in survivors}
    return [i for i in ordered if i // size in kept] + [i for i in ordered if i // size not in kept]


def _cost(
    index: int,
    node: str,
    where: Mapping[int, str],
    edges: Sequence[fabric_cost.Edge],
    path: Mapping[str, tuple[str, ...]],
    weights: Sequence[float],
) -> float:
    """Weighted bytes per step between pod ``index`` on ``node`` and the pods already placed."""
    total = 0.0
    for a, b, size in edges:
        other = b if a == index else a if b == index else None
        if other is None or other not in where:
            continue
        total += size * weights[topology.crossing(path[node], path[where[other]])]
    return total


def _depths(levels: Sequence[values.FabricLevel]) -> tuple[int, int]:
    """Depth (level index + 1; 0: none) of the lowest required level for the job, and for each stage."""
    job = [i + 1 for i, level in enumerate(levels) if level.required and level.scope == "job"]
    stage = [i + 1 for i, level in enumerate(levels) if level.required and level.scope == "stage"]
    return (job[-1] if job else 0), (stage[-1] if stage else 0)


def _in_stage_domain(
    request: values.PlacementRequest,
    index: int,
    candidates: Sequence[str],
    where: Mapping[int, str],
    lost: Collection[int],
    slots: Mapping[str, int],
    path: Mapping[str, tuple[str, ...]],
    depth: int,
) -> list[str]:
    """The ``candidates`` that keep pod ``index`` in its stage's domain at ``depth``: the domain of
    a placed pod of its stage, or (the whole stage lost) any domain with room for all of its
    lost pods still unplaced."""
    size = request.stage_pods
    stage = range(index // size * size, (index // size + 1) * size)
    anchor = next((path[where[i]] for i in stage if i in where and where[i] in path), None)
    if anchor is not None:
        return [n for n in candidates if path[n][:depth] == anchor[:depth]]
    pending = sum(1 for i in stage if i in lost and i not in where)
    room: dict[tuple[str, ...], int] = {}
    for name in candidates:
        room[path[name][:depth]] = room.get(path[name][:depth], 0) + slots[name]
    return [n for n in candidates if room[path[n][:depth]] >= pending]


def _none_left(
    request: values.PlacementRequest,
    index: int,
    slots: Mapping[str, int],
    depth: int,
    levels: Sequence[values.FabricLevel],
    stage: bool = False,
) -> values.Unschedulable:
    """Why pod ``index`` has nowhere to go: no free slot at all, or none inside the required domain
    (the surviving pods', or with ``stage`` its pipeline stage's)."""
    per = request.gpus_per_node
    if not slots:
        return values.Unschedulable(
            values.INSUFFICIENT_GPUS,
            f"no node has {per} free GPUs for the replacement of pod {index}",
        )
    level = levels[depth - 1].label
    whose = (
        f"its pipeline stage's {level} domain (required per stage, stages of "
        f"{request.stage_pods} pods)"
        if stage
        else f"the surviving pods' {level} domain (required)"
    )
    return values.Unschedulable(
        values.TOPOLOGY_UNSATISFIABLE,
        f"pod {index} must stay in {whose}, which has no node with {per} free GPUs; "
        f"{sum(slots.values())} free pod slot(s) elsewhere",
    )


def spares(
    request: values.PlacementRequest,
    placed: Sequence[str],
    nodes: Iterable[values.Node],
    free: Mapping[str, int],
    count: int,
) -> tuple[str, ...]:
    """Up to ``count`` nodes to hold in reserve for a gang placed on ``placed``.

    Each is a node with a free pod slot that hosts no pod of the gang (a node lost takes its own
    spare with it), inside the gang's domain at every required level (where a replacement may
    go; at a level required per stage, inside one of its stages' domains), nearest pod 0's node in the fabric first (the deepest level they share), then by name.
    """
    known = {node.name: node for node in nodes}
    if not placed or placed[0] not in known:
        return ()
    levels = request.levels or topology.detect_levels(known.values())
    label = request.nvlink_domain_label
    anchor = topology.node_path(known[placed[0]], levels, label)
    depth, stage_depth = _depths(request.constrained(levels))
    gang = set(placed)
    stage_domains = {
        topology.node_path(known[n], levels, label)[:stage_depth] for n in gang if n in known
    }
    ranked = []
    for name, slots in free.items():
        if slots < 1 or name in gang or name not in known:
            continue
        path = topology.node_path(known[name], levels, label)
        if path[:depth] == anchor[:depth] and path[:stage_depth] in stage_domains:
            ranked.append((-topology.crossing(path, anchor), name))
    return tuple(name for _, name in sorted(ranked)[: max(count, 0)])
