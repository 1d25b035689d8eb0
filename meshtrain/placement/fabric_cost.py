"""The traffic and cost model of a placement (docs/placement.md).

:func:`pod_traffic` sums, per pair of pods, the bytes per step their ranks exchange under the
fixed rank layout: each gradient ring over the data x context ranks holding the same parameters
(``dp_cp`` groups, rank order: the data-parallel ring without context parallelism), each
context-parallel ring in cp order (ring attention's K/V), each rank with its next-stage peer (tensor-parallel traffic never leaves a
pod, so placement cannot change it and it is not counted).
:func:`evaluate` prices them at the highest fabric level the two nodes' paths differ at,
``bytes x weight(level)``.  :func:`bound` prices any pod-to-node assignment (one the cluster
actually bound, Kueue's or meshtrain's) the way :func:`~.algorithm.plan` prices its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from meshtrain.placement import topology, values

Edge = tuple[int, int, float]
"""Traffic between two pods: (lower pod index, higher pod index, bytes per step)."""


def pod_traffic(request: values.PlacementRequest) -> list[Edge]:
    """Bytes per step between every pair of pods that talk, in pod order."""
    grid = request.layout
    per_node = request.gpus_per_node
    pairs: dict[tuple[int, int], float] = {}

    def add(rank_a: int, rank_b: int, size: float) -> None:
        pod_a, pod_b = grid.pod_of(rank_a, per_node), grid.pod_of(rank_b, per_node)
        if pod_a != pod_b and size > 0:
            key = (pod_a, pod_b) if pod_a < pod_b else (pod_b, pod_a)
            pairs[key] = pairs.get(key, 0.0) + size

    def ring(members: list[int], size: float) -> None:
        if len(members) > 1:
            for index, rank in enumerate(members):
                add(rank, members[(index + 1) % len(members)], size)

    for stages in grid.all_groups("pp"):  # each rank with its next-stage peer
        for rank, following in zip(stages, stages[1:]):
            add(rank, following, request.pp_bytes_per_step)
    # the gradients are summed over data x context ranks (dp_bytes_per_step is priced so)
    for group in grid.all_groups("dp_cp"):
        ring(group, request.dp_bytes_per_step)
    if grid.context > 1:
        for group in grid.all_groups("cp"):
            ring(group, request.cp_bytes_per_step)
    return [(a, b, size) for (a, b), size in sorted(pairs.items())]


def evaluate(
    edges: Sequence[Edge], pod_paths: Sequence[tuple[str, ...]], level_weights: Sequence[float]
) -> tuple[list[float], float]:
    """Bytes per step by crossed level (aligned with ``level_weights``) and the weighted cost.

    ``pod_paths[i]`` is the path (see :func:`topology.node_path`) of pod i's node.
    """
    crossed = [0.0] * len(level_weights)
    for pod_a, pod_b, size in edges:
        crossed[topology.crossing(pod_paths[pod_a], pod_paths[pod_b])] += size
    return crossed, sum(size * weight for size, weight in zip(crossed, level_weights))


def bound(
    request: values.PlacementRequest, nodes: Iterable[values.Node], assignment: Sequence[str]
) -> values.Placement:
    """The placement's cost model applied to ``assignment`` (pod i on node ``assignment[i]``).

    Levels and weights are the ones :func:`~.algorithm.plan` uses for ``request`` on ``nodes``
    (the request's levels, else the label family detected on ``nodes``), so for a plan's own
    nodes this returns that plan's :class:`~.values.Placement`.  ``nodes`` must hold every
    assigned node; free capacity and eligibility are not checked (the cluster already bound
    the pods).
    """
    nodes = list(nodes)
    if len(assignment) != request.pods:
        raise ValueError(f"assignment names {len(assignment)} nodes for {request.pods} pods")
    levels = request.levels or topology.detect_levels(nodes)
    paths = topology.paths(nodes, set(assignment), levels, request.nvlink_domain_label)
    missing = sorted(set(assignment) - paths.keys())
    if missing:
        raise ValueError(f"assignment names nodes not given: {', '.join(missing[:5])}")
    keys = topology.level_keys(levels, request.nvlink_domain_label)
    return priced(assignment, pod_traffic(request), paths, keys, topology.weights(levels), levels)


def priced(
    assignment: Sequence[str],
    edges: Sequence[Edge],
    paths: Mapping[str, tuple[str, ...]],
    keys: Sequence[str],
    level_weights: Sequence[float],
    levels: Sequence[values.FabricLevel],
) -> values.Placement:
    """A Placement for ``assignment`` with its modelled traffic, cost and spread."""
    pod_paths = [paths[name] for name in assignment]
    crossed, total = evaluate(edges, pod_paths, level_weights)
    used = {
        key: len({path[: depth + 1] for path in pod_paths}) for depth, key in enumerate(keys[:-1])
    }
    return values.Placement(
        nodes=tuple(assignment),
        level_bytes=dict(zip(keys, crossed)),
        cost=total,
        levels=tuple(levels),
        domains_used=used,
    )
