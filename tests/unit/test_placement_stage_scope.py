"""A fabric level required per pipeline stage (``scope: stage``): plan() against a brute force.

Small seeded random fleets (blocks of racks of nodes with 1-2 free pod slots, some cordoned or
unlabelled) and small 3D jobs; an exhaustive enumerator of every pod-to-node assignment says
whether any keeps each stage in one domain of the level (and the job in one domain of a
job-scoped required level).  plan() must return only such placements, and TopologyUnsatisfiable
only where the enumerator finds none.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Sequence

import pytest

from meshtrain import placement
from meshtrain.api import layout
from meshtrain.placement import replacement
from tests.unit.test_placement_properties import Case

BLOCK, RACK = "example.com/block", "example.com/rack"
CLIQUE = "example.com/clique"
LEVELS = (BLOCK, RACK)
ALL = (*LEVELS, CLIQUE)
CASES = 400


def draw(seed: int) -> Case:
    """A small fleet (blocks, racks, sometimes NVLink cliques inside racks) and a job with one
    level required per stage (a fabric level or the clique), sometimes another for the job."""
    rng = random.Random(seed)
    per_node = rng.choice([4, 8])
    cliques = rng.random() < 0.4
    nodes, reservations = [], []
    for index in range(rng.randint(2, 7)):
        labels = {BLOCK: f"b{rng.randint(0, 1)}", RACK: f"r{rng.randint(0, 2)}"}
        if cliques:
            labels[CLIQUE] = f"c{rng.randint(0, 1)}"
        if rng.random() < 0.1:
            labels.pop(rng.choice(sorted(labels)))
        name = f"n{index}"
        nodes.append(placement.Node(name, 2 * per_node, labels, rng.random() < 0.1))
        taken = rng.choice([0, 0, 1, per_node, 2 * per_node])
        if taken:
            reservations.append(placement.Reservation(name, taken, "other"))
    tensor = rng.choice([per_node, per_node // 2])
    grid = layout.ParallelLayout(
        data=rng.choice([1, 2, 2, 3]) * (per_node // tensor),
        pipeline=rng.randint(1, 3),
        context=1,
        tensor=tensor,
    )
    while grid.pods(per_node) > 6:
        grid = dataclasses.replace(grid, pipeline=grid.pipeline - 1)
    depth = len(ALL) if cliques else len(LEVELS)
    stage_level = rng.randrange(depth)
    job_level = rng.choice([None, None, *(i for i in range(depth) if i != stage_level)])
    every = [
        placement.FabricLevel(
            label,
            required=index in (stage_level, job_level),
            scope="stage" if index == stage_level else "job",
        )
        for index, label in enumerate(ALL[:depth])
    ]
    request = placement.PlacementRequest(
        gpus_per_node=per_node,
        layout=grid,
        dp_bytes_per_step=rng.choice([1e6, 1e9]),
        pp_bytes_per_step=rng.choice([1e6, 1e9]),
        levels=tuple(every[: len(LEVELS)]),
        nvlink_domain_label=CLIQUE if cliques else None,
        nvlink_domain_level=every[len(LEVELS)] if cliques else None,
    )
    return Case(seed, tuple(nodes), tuple(reservations), request)


def _domain(node: placement.Node, depth: int) -> tuple[str, ...]:
    """The node's domain at depth ``depth`` (1 = block, 2 = rack, 3 = clique); a missing label
    is the node alone at that level."""
    return tuple(node.labels.get(label, f"<{node.name}>") for label in ALL[:depth])


def _free(case: Case) -> dict[str, int]:
    per = case.request.gpus_per_node
    taken = {r.node: r.gpus for r in case.reservations}
    return {
        n.name: (n.allocatable_gpus - taken.get(n.name, 0)) // per
        for n in case.nodes
        if not n.unschedulable and (n.allocatable_gpus - taken.get(n.name, 0)) // per > 0
    }


def _constraints(request: placement.PlacementRequest) -> tuple[list[int], list[int]]:
    """Depths (1 = block) that each stage / the whole job must share one domain of."""
    every = [*request.levels]
    if request.nvlink_domain_level is not None:
        every.append(request.nvlink_domain_level)
    stage = [i + 1 for i, lv in enumerate(every) if lv.required and lv.scope == "stage"]
    job = [i + 1 for i, lv in enumerate(every) if lv.required and lv.scope == "job"]
    return stage, job


def legal(case: Case, nodes: Sequence[str]) -> bool:
    """Whether pod i on ``nodes[i]`` keeps the slots and every required level of ``case``."""
    by_name = {n.name: n for n in case.nodes}
    free = _free(case)
    if any(nodes.count(name) > free.get(name, 0) for name in set(nodes)):
        return False
    stage_depths, job_depths = _constraints(case.request)
    size = case.request.layout.data * case.request.layout.tensor // case.request.gpus_per_node
    stages = [nodes[k : k + size] for k in range(0, len(nodes), size)]
    for depth in stage_depths:
        for stage in stages:
            if len({_domain(by_name[n], depth) for n in stage}) != 1:
                return False
    return all(len({_domain(by_name[n], d) for n in nodes}) == 1 for d in job_depths)


def brute_force(case: Case) -> list[str] | None:
    """Some legal assignment, trying every node for every pod (slots pruned), or None."""
    free = _free(case)
    names = sorted(free)
    pods = case.request.pods
    chosen: list[str] = []

    def extend() -> bool:
        if len(chosen) == pods:
            return legal(case, chosen)
        for name in names:
            if chosen.count(name) < free[name]:
                chosen.append(name)
                if extend():
                    return True
                chosen.pop()
        return False

    return list(chosen) if extend() else None


@pytest.mark.parametrize("seed", range(CASES))
def test_plan_keeps_stages_and_fails_only_when_nothing_can(seed: int) -> None:
    case = draw(seed)
    answer = placement.plan(case.request, case.nodes, case.reservations)
    witness = brute_force(case)
    if isinstance(answer, placement.Placement):
        assert legal(case, answer.nodes), (seed, answer.nodes)
        return
    assert witness is None, (seed, answer.message, witness)
    if sum(_free(case).values()) >= case.request.pods:
        assert answer.reason == placement.TOPOLOGY_UNSATISFIABLE, (seed, answer)
    else:
        assert answer.reason == placement.INSUFFICIENT_GPUS, (seed, answer)


def test_the_cases_cover_both_answers() -> None:
    """The random cases hold placements and stage-unsatisfiable ones alike (a test that can fail)."""
    placed = unsatisfiable = 0
    for seed in range(CASES):
        case = draw(seed)
        answer = placement.plan(case.request, case.nodes, case.reservations)
        placed += isinstance(answer, placement.Placement) and case.request.layout.pipeline > 1
        unsatisfiable += (
            isinstance(answer, placement.Unschedulable)
            and answer.reason == placement.TOPOLOGY_UNSATISFIABLE
        )
    assert placed > CASES // 10 and unsatisfiable > CASES // 20, (placed, unsatisfiable)


def _rack_fleet(free: Sequence[int]) -> list[placement.Node]:
    """One block; rack i has ``free[i]`` nodes of one free 8-GPU slot each."""
    return [
        placement.Node(f"r{rack}-n{i}", 8, {BLOCK: "b0", RACK: f"r{rack}"})
        for rack, count in enumerate(free)
        for i in range(count)
    ]


def _request(data: int, pipeline: int, scope: str) -> placement.PlacementRequest:
    return placement.PlacementRequest(
        gpus_per_node=8,
        layout=layout.ParallelLayout(data=data, pipeline=pipeline, tensor=8),
        dp_bytes_per_step=1e9,
        pp_bytes_per_step=1e6,
        levels=(
            placement.FabricLevel(BLOCK),
            placement.FabricLevel(RACK, required=scope != "preferred", scope="stage"),
        )
        if scope != "preferred"
        else (placement.FabricLevel(BLOCK), placement.FabricLevel(RACK)),
    )


def test_a_stage_is_never_cut_where_racks_hold_whole_stages() -> None:
    # racks of 3, 3 and 2 free nodes; 4 stages of 2 pods: a best fit by count alone fills the
    # racks of 3 first and cuts a stage; racks of whole stages hold 1 + 1 + 1 = 3 stages only,
    # so 4 stages are unsatisfiable, 3 fit
    fleet = _rack_fleet([3, 3, 2])
    free = placement.plan(_request(2, 3, "preferred"), fleet, [])
    assert isinstance(free, placement.Placement)
    staged = placement.plan(_request(2, 3, "stage"), fleet, [])
    assert isinstance(staged, placement.Placement)
    racks = [name.split("-")[0] for name in staged.nodes]
    assert all(racks[k] == racks[k + 1] for k in range(0, 6, 2)), racks
    refused = placement.plan(_request(2, 4, "stage"), fleet, [])
    assert isinstance(refused, placement.Unschedulable)
    assert refused.reason == placement.TOPOLOGY_UNSATISFIABLE
    assert RACK in refused.message and "stages of 2 pods" in refused.message
    assert "could hold 3 such stages" in refused.message, refused.message


def test_column_major_is_never_chosen_under_a_stage_requirement() -> None:
    # heavy pipeline traffic makes column-major (a pipeline per rack) the cheaper order; it would
    # put each stage's two pods in two racks
    request = dataclasses.replace(
        _request(2, 2, "stage"), dp_bytes_per_step=1e3, pp_bytes_per_step=1e12
    )
    fleet = _rack_fleet([2, 2])
    preferred = (placement.FabricLevel(BLOCK), placement.FabricLevel(RACK))
    free = placement.plan(dataclasses.replace(request, levels=preferred), fleet, [])
    staged = placement.plan(request, fleet, [])
    assert isinstance(free, placement.Placement) and isinstance(staged, placement.Placement)
    assert free.nodes[0][:2] != free.nodes[1][:2]  # column-major without the requirement
    assert staged.nodes[0][:2] == staged.nodes[1][:2] and staged.nodes[2][:2] == staged.nodes[3][:2]


def test_stage_scope_needs_whole_pod_stages_and_a_required_level() -> None:
    grid = layout.ParallelLayout(data=1, pipeline=2, tensor=4)
    with pytest.raises(ValueError, match="do not fill"):
        placement.PlacementRequest(
            gpus_per_node=8, layout=grid, levels=(placement.FabricLevel(RACK, True, "stage"),)
        )
    with pytest.raises(ValueError, match="required levels only"):
        placement.PlacementRequest(
            gpus_per_node=8,
            layout=layout.ParallelLayout(data=1, pipeline=2, tensor=8),
            levels=(placement.FabricLevel(RACK, False, "stage"),),
        )


def _lost_case(seed: int) -> tuple[Case, list[str], set[int], dict[str, int]] | None:
    """A placed case, some pods lost with their nodes, and the slots left for replacements."""
    case = draw(seed)
    answer = placement.plan(case.request, case.nodes, case.reservations)
    if not isinstance(answer, placement.Placement) or len(set(answer.nodes)) < 2:
        return None  # a gang lost whole is placed again, not replaced
    rng = random.Random(seed + 10_000)
    gone = set(rng.sample(sorted(set(answer.nodes)), k=1))
    lost = {i for i, node in enumerate(answer.nodes) if node in gone}
    free = _free(case)
    for node in answer.nodes:
        free[node] -= 1
    for name in gone:
        free.pop(name, None)
    return case, list(answer.nodes), lost, {n: c for n, c in free.items() if c > 0}


@pytest.mark.parametrize("seed", range(CASES))
def test_a_replacement_stays_in_its_stage_domain(seed: int) -> None:
    found = _lost_case(seed)
    if found is None:
        return
    case, placed, lost, free = found
    got = replacement.replace(case.request, placed, lost, case.nodes, free)
    # brute force: every choice of a free slot for each lost pod, survivors where they are
    room = dict(free)
    options = [n for n in sorted(room) for _ in range(room[n])]
    witness = None
    for choice in itertools.permutations(options, len(lost)):
        nodes = list(placed)
        for index, node in zip(sorted(lost), choice, strict=True):
            nodes[index] = node
        if _legal_beside(case, nodes, lost, free):
            witness = nodes
            break
    if isinstance(got, placement.Unschedulable):
        assert witness is None, (seed, got.message, witness)
        return
    nodes = list(placed)
    for index, node in got.nodes.items():
        nodes[index] = node
    assert _legal_beside(case, nodes, lost, free), (seed, nodes)


def _legal_beside(case: Case, nodes: Sequence[str], lost: set[int], free: dict[str, int]) -> bool:
    """The survivors stay put; the replacements use only ``free``; every required level kept."""
    new = [nodes[i] for i in sorted(lost)]
    if any(new.count(n) > free.get(n, 0) for n in set(new)):
        return False
    by_name = {n.name: n for n in case.nodes}
    stage_depths, job_depths = _constraints(case.request)
    size = case.request.stage_pods
    for depth in stage_depths:
        for k in range(0, len(nodes), size):
            if len({_domain(by_name[n], depth) for n in nodes[k : k + size]}) != 1:
                return False
    return all(len({_domain(by_name[n], d) for n in nodes}) == 1 for d in job_depths)


def test_spares_lie_in_the_domains_of_the_gang_s_stages() -> None:
    fleet = _rack_fleet([3, 3, 3])
    placed = ["r0-n0", "r0-n1", "r1-n0", "r1-n1"]  # two stages of two pods, one per rack
    free = {node.name: 1 for node in fleet if node.name not in placed}
    spares = replacement.spares(_request(2, 2, "stage"), placed, fleet, free, 4)
    assert set(spares) == {"r0-n2", "r1-n2"}
    anywhere = replacement.spares(_request(2, 2, "preferred"), placed, fleet, free, 4)
    assert {name.split("-")[0] for name in anywhere} >= {"r2"}


def test_a_wholly_lost_stage_leaves_a_partly_lost_stage_the_slots_of_its_own_rack() -> None:
    # racks r0 (2 nodes), r1 (3), r2 (2); stage 0 on r0, stage 1 on r1 (pods 2, 3); pods 0, 1
    # and 2 lost; free: r1-n0, r1-n2, r2-n0, r2-n1. Pod 2 must return to r1, so stage 0 must go
    # to r2 even though pipeline traffic pulls it next to stage 1 on r1.
    fleet = _rack_fleet([2, 3, 2])
    placed = ["r0-n0", "r0-n1", "r1-n1", "r1-n1"]
    free = {"r1-n0": 1, "r1-n2": 1, "r2-n0": 1, "r2-n1": 1}
    got = replacement.replace(_request(2, 2, "stage"), placed, {0, 1, 2}, fleet, free)
    assert isinstance(got, replacement.Replacement), got
    racks = {i: node.split("-")[0] for i, node in got.nodes.items()}
    assert racks == {0: "r2", 1: "r2", 2: "r1"}
