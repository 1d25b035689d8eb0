"""Property tests of the placement planner over seeded random clusters and jobs.

Every case is drawn from ``random.Random(seed)``: a fabric (NVIDIA, GKE, AWS
labels, or none; sometimes NVLink cliques), reservations that fragment it,
cordoned nodes, and a job layout.  The invariants are checked on every case;
the comparison with topology-blind first fit is asserted over the whole set.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from meshtrain import placement
from meshtrain.api import layout
from meshtrain.placement import topology

FAMILIES = {
    "nvidia": (
        "network.topology.nvidia.com/block",
        "network.topology.nvidia.com/spine",
        "network.topology.nvidia.com/leaf",
    ),
    "gke": ("cloud.google.com/gce-topology-block", "cloud.google.com/gce-topology-subblock"),
    "aws": (
        "topology.k8s.aws/network-node-layer-1",
        "topology.k8s.aws/network-node-layer-2",
        "topology.k8s.aws/network-node-layer-3",
    ),
    "none": (),
}
CLIQUE = "nvidia.com/gpu.clique"
CASES = 300


@dataclasses.dataclass(frozen=True)
class Case:
    """One random cluster and job."""

    seed: int
    """Seed the case was drawn from."""
    nodes: tuple[placement.Node, ...]
    """The cluster."""
    reservations: tuple[placement.Reservation, ...]
    """GPUs already taken."""
    request: placement.PlacementRequest
    """The job."""


def draw(seed: int, *, context: bool = False) -> Case:
    """A random fragmented cluster and a job that often, not always, fits; with ``context``, a
    context-parallel degree and ring traffic drawn last (the 3D cases' draws are unchanged)."""
    rng = random.Random(seed)
    family = rng.choice(sorted(FAMILIES))
    labels = FAMILIES[family]
    fanout = [rng.randint(1, 3) for _ in labels]
    per_leaf = rng.randint(2, 8)
    gpus = rng.choice([8, 8, 8, 16])
    clique = rng.random() < 0.25
    names = rng.sample(range(10_000), k=max(1, per_leaf * _product(fanout)))
    nodes: list[placement.Node] = []
    for index, name in enumerate(names):
        coords, rest = [], index // per_leaf
        for width in reversed(fanout):
            coords.append(rest % width)
            rest //= width
        coords.reverse()
        node_labels = {
            label: f"{label.rsplit('/', 1)[-1]}-{'.'.join(map(str, coords[: depth + 1]))}"
            for depth, label in enumerate(labels)
        }
        if clique:
            node_labels[CLIQUE] = f"clique-{index // per_leaf}-{(index % per_leaf) // 2}"
        if rng.random() < 0.05 and node_labels:
            node_labels.pop(rng.choice(sorted(node_labels)))
        nodes.append(
            placement.Node(f"node-{name:05d}", gpus, node_labels, unschedulable=rng.random() < 0.05)
        )
    reservations = []
    for node in nodes:
        if rng.random() < 0.4:
            reservations.append(
                placement.Reservation(node.name, rng.randint(1, gpus), f"other-{rng.randint(0, 9)}")
            )
    per_node = rng.choice([4, 8, 8, 8])
    tensor = rng.choice([t for t in (1, 2, 4, 8) if per_node % t == 0])
    pipeline = rng.choice([1, 2, 3, 4])
    data = rng.choice([1, 2, 3, 4, 6, 8])
    while (data * pipeline * tensor) % per_node:
        data += 1
    levels = (
        tuple(placement.FabricLevel(label, required=rng.random() < 0.1) for label in labels)
        if rng.random() < 0.5
        else ()
    )
    degree, cp_bytes = (rng.choice([2, 4, 8]), rng.choice([2e9, 1e8])) if context else (1, 0.0)
    request = placement.PlacementRequest(
        gpus_per_node=per_node,
        layout=layout.ParallelLayout(data=data, pipeline=pipeline, tensor=tensor, context=degree),
        dp_bytes_per_step=rng.choice([1e9, 4e8, 1e6]),
        pp_bytes_per_step=rng.choice([5e7, 1e7, 5e9]),
        cp_bytes_per_step=cp_bytes,
        nvlink_domain_label=CLIQUE if clique else None,
        levels=levels,
    )
    return Case(seed, tuple(nodes), tuple(reservations), request)


def _product(values: list[int]) -> int:
    result = 1
    for value in values:
        result *= value
    return result


def free_slots(case: Case) -> dict[str, int]:
    """Independent count of free pod slots per usable node."""
    reserved: dict[str, int] = {}
    for reservation in case.reservations:
        reserved[reservation.node] = reserved.get(reservation.node, 0) + reservation.gpus
    return {
        node.name: (node.allocatable_gpus - reserved.get(node.name, 0))
        // case.request.gpus_per_node
        for node in case.nodes
        if not node.unschedulable
    }


def effective_levels(case: Case) -> tuple[placement.FabricLevel, ...]:
    return case.request.levels or topology.detect_levels(case.nodes)


def paths(case: Case) -> dict[str, tuple[str, ...]]:
    levels = effective_levels(case)
    return {
        node.name: topology.node_path(node, levels, case.request.nvlink_domain_label)
        for node in case.nodes
    }


@pytest.fixture(scope="module")
def cases() -> list[tuple[Case, placement.Placement | placement.Unschedulable]]:
    drawn = [draw(seed) for seed in range(CASES)]
    return [(case, placement.plan(case.request, case.nodes, case.reservations)) for case in drawn]


def test_the_random_set_exercises_both_answers(cases) -> None:
    placed = sum(isinstance(result, placement.Placement) for _, result in cases)
    reasons = {result.reason for _, result in cases if isinstance(result, placement.Unschedulable)}
    assert placed > CASES // 2
    assert reasons == {placement.INSUFFICIENT_GPUS, placement.TOPOLOGY_UNSATISFIABLE}


def test_whole_gang_on_usable_nodes_without_oversubscription(cases) -> None:
    for case, result in cases:
        if not isinstance(result, placement.Placement):
            continue
        assert len(result.nodes) == case.request.pods, case.seed
        slots = free_slots(case)
        used: dict[str, int] = {}
        for name in result.nodes:
            used[name] = used.get(name, 0) + 1
        for name, pods in used.items():
            assert pods <= slots.get(name, 0), (case.seed, name)


def test_tensor_groups_never_leave_an_nvlink_domain(cases) -> None:
    for case, result in cases:
        if not isinstance(result, placement.Placement):
            continue
        request = case.request
        grid = request.layout
        node_paths = paths(case)
        for group in grid.all_groups("tp"):
            domains = {
                node_paths[result.nodes[grid.pod_of(rank, request.gpus_per_node)]] for rank in group
            }
            assert len(domains) == 1, case.seed


def test_required_levels_hold_the_whole_gang(cases) -> None:
    for case, result in cases:
        required = [index for index, level in enumerate(effective_levels(case)) if level.required]
        if not required or not isinstance(result, placement.Placement):
            continue
        node_paths = paths(case)
        assert len({node_paths[name][: required[-1] + 1] for name in result.nodes}) == 1, case.seed


def test_unschedulable_only_when_it_truly_does_not_fit(cases) -> None:
    for case, result in cases:
        slots = free_slots(case)
        total = sum(max(0, count) for count in slots.values())
        if total < case.request.pods:
            assert isinstance(result, placement.Unschedulable), case.seed
            assert result.reason == placement.INSUFFICIENT_GPUS
            assert f"needs {case.request.pods} pods" in result.message
            continue
        required = [index for index, level in enumerate(effective_levels(case)) if level.required]
        node_paths = paths(case)
        if required:
            per_domain: dict[tuple[str, ...], int] = {}
            for name, count in slots.items():
                key = node_paths[name][: required[-1] + 1]
                per_domain[key] = per_domain.get(key, 0) + max(0, count)
            if max(per_domain.values()) < case.request.pods:
                assert isinstance(result, placement.Unschedulable), case.seed
                assert result.reason == placement.TOPOLOGY_UNSATISFIABLE
                continue
        assert isinstance(result, placement.Placement), (case.seed, result)


def test_same_input_same_output_in_any_order(cases) -> None:
    for case, result in cases[:120]:
        rng = random.Random(case.seed)
        nodes, reservations = list(case.nodes), list(case.reservations)
        rng.shuffle(nodes)
        rng.shuffle(reservations)
        assert placement.plan(case.request, nodes, reservations) == result, case.seed
        assert placement.plan(case.request, case.nodes, case.reservations) == result, case.seed


def test_level_bytes_add_up_to_the_traffic_between_pods(cases) -> None:
    for case, result in cases[:60]:
        if not isinstance(result, placement.Placement):
            continue
        blind = placement.first_fit(case.request, case.nodes, case.reservations)
        assert isinstance(blind, placement.Placement)
        assert sum(result.level_bytes.values()) == pytest.approx(sum(blind.level_bytes.values()))


def test_cheaper_than_topology_blind_first_fit_on_fragmented_clusters(cases) -> None:
    planned_cost = blind_cost = 0.0
    planned_top = blind_top = 0.0
    wins = ties = losses = 0
    for case, result in cases:
        if not isinstance(result, placement.Placement) or any(
            level.required for level in effective_levels(case)
        ):
            continue
        node_paths = paths(case)
        by_name = sorted(case.nodes, key=lambda node: node.name)
        by_rack = sorted(case.nodes, key=lambda node: (node_paths[node.name], node.name))
        for ordered in (by_name, by_rack):
            blind = placement.first_fit(case.request, ordered, case.reservations)
            assert isinstance(blind, placement.Placement)
            planned_cost += result.cost
            blind_cost += blind.cost
            planned_top += _top_bytes(result)
            blind_top += _top_bytes(blind)
            if result.cost < blind.cost - 1e-6:
                wins += 1
            elif result.cost <= blind.cost + 1e-6:
                ties += 1
            else:
                losses += 1
    assert planned_cost < 0.7 * blind_cost, (planned_cost, blind_cost)
    assert planned_top < blind_top
    assert losses <= 0.02 * (wins + ties + losses), (wins, ties, losses)
    assert wins > (wins + ties + losses) // 3, (wins, ties, losses)


def _top_bytes(result: placement.Placement) -> float:
    """Bytes crossing the most expensive level the placement was priced with."""
    return next(iter(result.level_bytes.values()))


# --- context parallelism: the same invariants with a fourth degree and its ring's traffic --------


@pytest.fixture(scope="module")
def context_cases() -> list[tuple[Case, placement.Placement | placement.Unschedulable]]:
    drawn = [draw(seed, context=True) for seed in range(CASES // 3)]
    return [(case, placement.plan(case.request, case.nodes, case.reservations)) for case in drawn]


def test_context_jobs_keep_the_placement_invariants(context_cases) -> None:
    placed = 0
    for case, result in context_cases:
        if not isinstance(result, placement.Placement):
            continue
        placed += 1
        request, node_paths = case.request, paths(case)
        assert len(result.nodes) == request.pods, case.seed
        used: dict[str, int] = {}
        for name in result.nodes:
            used[name] = used.get(name, 0) + 1
        assert all(pods <= free_slots(case)[name] for name, pods in used.items()), case.seed
        for group in request.layout.all_groups("tp"):
            pods = {
                result.nodes[request.layout.pod_of(rank, request.gpus_per_node)] for rank in group
            }
            assert len({node_paths[name] for name in pods}) == 1, case.seed
        blind = placement.first_fit(case.request, case.nodes, case.reservations)
        assert isinstance(blind, placement.Placement)
        assert sum(result.level_bytes.values()) == pytest.approx(sum(blind.level_bytes.values()))
    assert placed > len(context_cases) // 3  # a context degree multiplies the gang: fewer fit


def test_context_rings_that_fit_a_pod_never_cross_one(context_cases) -> None:
    """The layout puts a context group in ``tensor x context`` consecutive ranks: inside one pod
    when that divides gpusPerNode, so the ring's traffic never reaches the fabric."""
    for case, _ in context_cases:
        request = case.request
        grid, per_node = request.layout, request.gpus_per_node
        if per_node % (grid.tensor * grid.context):
            continue
        for group in grid.all_groups("cp"):
            assert len({grid.pod_of(rank, per_node) for rank in group}) == 1, case.seed


def test_context_jobs_cost_less_than_topology_blind_first_fit(context_cases) -> None:
    planned = blind = 0.0
    for case, result in context_cases:
        if not isinstance(result, placement.Placement) or any(
            level.required for level in effective_levels(case)
        ):
            continue
        ordered = sorted(case.nodes, key=lambda node: node.name)
        other = placement.first_fit(case.request, ordered, case.reservations)
        assert isinstance(other, placement.Placement)
        assert result.cost <= other.cost * 1.02 + 1e-6, case.seed
        planned += result.cost
        blind += other.cost
    assert planned < 0.7 * blind, (planned, blind)
