"""Where a lost pod of a running gang goes (``meshtrain.placement.replacement``): the surviving
pods' domain kept where a level is required, spare nodes first, else the fabric cost model."""

from __future__ import annotations

import itertools

from meshtrain import placement
from meshtrain.api import layout
from meshtrain.placement import fabric_cost, replacement, topology

LEAF = "network.topology.nvidia.com/leaf"
SPINE = "network.topology.nvidia.com/spine"


def request(required: bool = False, pods: int = 4) -> placement.PlacementRequest:
    """dp``pods`` on 8-GPU pods: a data-parallel ring across the pods, priced by the cost model."""
    return placement.PlacementRequest(
        gpus_per_node=8,
        layout=layout.ParallelLayout(data=pods, pipeline=1, tensor=8),
        dp_bytes_per_step=1e9,
        levels=(
            placement.FabricLevel(SPINE),
            placement.FabricLevel(LEAF, required=required),
        ),
    )


def nodes() -> list[placement.Node]:
    """Two leaves of three nodes under one spine, one leaf under another spine."""
    found = []
    for spine, leaf, count in (("s0", "l0", 3), ("s0", "l1", 3), ("s1", "l2", 3)):
        found += [
            placement.Node(f"{leaf}-{n}", 8, {SPINE: spine, LEAF: f"{spine}{leaf}"})
            for n in range(count)
        ]
    return found


GANG = ["l0-0", "l0-1", "l0-2", "l1-0"]
"""Pods 0-2 in leaf l0, pod 3 in l1: a gang placed where its leaf was only preferred."""


def cost_of(req: placement.PlacementRequest, on: list[str]) -> float:
    """The whole gang's modelled cost, as the planner prices a placement."""
    levels = req.levels
    paths = {n.name: topology.node_path(n, levels, None) for n in nodes()}
    edges = fabric_cost.pod_traffic(req)
    return fabric_cost.evaluate(edges, [paths[n] for n in on], topology.weights(levels))[1]


def test_a_lost_pod_goes_where_the_cost_model_prices_the_gang_lowest():
    req = request()
    free = {"l1-1": 1, "l1-2": 1, "l2-0": 1, "l2-1": 1}
    got = replacement.replace(req, GANG, {2}, nodes(), free)
    assert isinstance(got, replacement.Replacement)
    priced = {n: cost_of(req, [*GANG[:2], n, GANG[3]]) for n in free}
    assert priced[got.nodes[2]] == min(priced.values())
    assert got.nodes[2].startswith("l1-")  # a leaf under the survivors' spine, not across spines
    assert got.cost == priced[got.nodes[2]] and got.spares_used == ()


def test_a_required_leaf_keeps_the_replacement_in_the_survivors_leaf_or_refuses():
    req = request(required=True)
    gang = ["l0-0", "l0-1", "l0-2", "l0-0"]  # a required leaf: every pod in l0
    got = replacement.replace(req, gang, {2}, nodes(), {"l1-1": 1, "l0-2": 1})
    assert isinstance(got, replacement.Replacement) and got.nodes == {2: "l0-2"}
    refused = replacement.replace(req, gang, {2}, nodes(), {"l1-1": 1, "l2-0": 1})
    assert isinstance(refused, placement.Unschedulable)
    assert refused.reason == placement.TOPOLOGY_UNSATISFIABLE
    assert LEAF in refused.message and "2 free pod slot(s) elsewhere" in refused.message
    # Preferred only, the same offer takes the cheapest node outside the leaf.
    taken = replacement.replace(request(), gang, {2}, nodes(), {"l1-1": 1, "l2-0": 1})
    assert isinstance(taken, replacement.Replacement) and taken.nodes == {2: "l1-1"}


def test_at_equal_cost_a_deleted_pod_goes_back_to_its_own_node():
    """Pod 3 was deleted on l1-2 (offered: the node did not lose it); l1-0 and l1-1 in the same
    leaf price the gang the same and sort before it by name: the own node still wins."""
    req = request()
    gang = ["l0-0", "l0-1", "l0-2", "l1-2"]
    free = {"l1-0": 1, "l1-1": 1, "l1-2": 1}
    priced = {n: cost_of(req, [*gang[:3], n]) for n in free}
    assert len(set(priced.values())) == 1, priced  # a tie, or the test proves nothing
    got = replacement.replace(req, gang, {3}, nodes(), free)
    assert isinstance(got, replacement.Replacement) and got.nodes == {3: "l1-2"}
    # Not offered (the node lost it): the cheapest other node, by name.
    elsewhere = replacement.replace(req, gang, {3}, nodes(), {"l1-0": 1, "l1-1": 1})
    assert isinstance(elsewhere, replacement.Replacement) and elsewhere.nodes == {3: "l1-0"}
    # Cheaper elsewhere beats the own node: the cost model comes first.
    spread = ["l0-0", "l0-1", "l2-0", "l1-0"]
    moved = replacement.replace(req, spread, {2}, nodes(), {"l2-0": 1, "l0-2": 1})
    assert cost_of(req, ["l0-0", "l0-1", "l0-2", "l1-0"]) < cost_of(req, spread)
    assert isinstance(moved, replacement.Replacement) and moved.nodes == {2: "l0-2"}


def test_a_deleted_pods_own_slot_is_its_own_replacements_alone():
    """Pods 1 and 2 lost; pod 1 was deleted on l0-1 and still holds its slot there (returning),
    pod 2's node lost it.  Pod 1 goes back; pod 2, for which l0-1 would be cheapest, cannot take
    that slot and goes where there is room; a genuinely free slot on l0-1 it may take."""
    req = request()
    gang = ["l0-0", "l0-1", "l0-2", "l1-0"]
    got = replacement.replace(req, gang, {1, 2}, nodes(), {"l2-0": 1}, returning={1: "l0-1"})
    assert isinstance(got, replacement.Replacement) and got.nodes == {1: "l0-1", 2: "l2-0"}
    shared = replacement.replace(
        req, gang, {1, 2}, nodes(), {"l2-0": 1, "l0-1": 1}, returning={1: "l0-1"}
    )
    assert isinstance(shared, replacement.Replacement) and shared.nodes == {1: "l0-1", 2: "l0-1"}
    alone = replacement.replace(req, gang, {2}, nodes(), {}, returning={1: "l0-1"})
    assert isinstance(alone, placement.Unschedulable)  # index 1's slot is not index 2's


def test_a_spare_comes_first_even_where_another_node_is_cheaper():
    req = request()
    free = {"l0-2": 1, "l2-0": 1, "l2-1": 1}
    got = replacement.replace(req, GANG, {1}, nodes(), free, spares={"l2-1"})
    assert isinstance(got, replacement.Replacement)
    assert got.nodes == {1: "l2-1"} and got.spares_used == ("l2-1",)
    assert cost_of(req, ["l0-0", "l0-2", "l0-2", "l1-0"]) < got.cost  # l0-2 was cheaper
    # Of two spares, the cheaper; a spare outside a required leaf is no spare for it.
    two = replacement.replace(req, GANG, {1}, nodes(), free, spares={"l0-2", "l2-1"})
    assert isinstance(two, replacement.Replacement) and two.nodes == {1: "l0-2"}
    gang = ["l0-0", "l0-1", "l0-2", "l0-0"]
    kept = replacement.replace(request(True), gang, {1}, nodes(), free, spares={"l2-1"})
    assert isinstance(kept, replacement.Replacement) and kept.nodes == {1: "l0-2"}
    assert kept.spares_used == ()


def test_no_free_node_is_insufficient_gpus():
    got = replacement.replace(request(), GANG, {3}, nodes(), {"l0-0": 0})
    assert isinstance(got, placement.Unschedulable)
    assert got.reason == placement.INSUFFICIENT_GPUS and "pod 3" in got.message


def test_several_lost_pods_share_nodes_only_as_far_as_their_slots_go():
    req = request()
    got = replacement.replace(req, GANG, {1, 3}, nodes(), {"l2-0": 1, "l0-2": 1})
    assert isinstance(got, replacement.Replacement)
    assert sorted(got.nodes.values()) == ["l0-2", "l2-0"]
    # The best of every way to seat both, by the cost model.
    best = min(
        cost_of(req, ["l0-0", a, "l0-2", b]) for a, b in itertools.permutations(["l2-0", "l0-2"])
    )
    assert got.cost == best
    none_left = replacement.replace(req, GANG, {1, 3}, nodes(), {"l2-0": 1})
    assert isinstance(none_left, placement.Unschedulable)


def test_spares_go_beside_the_gang_nearest_pod_zero_and_inside_a_required_leaf():
    req = request()
    free = {"l0-0": 1, "l0-2": 1, "l1-1": 1, "l2-0": 1, "l2-1": 1}
    # l0-0 and l0-2 host the gang's pods: a node lost would take its spare along.
    assert replacement.spares(req, GANG, nodes(), free, 2) == ("l1-1", "l2-0")
    assert replacement.spares(req, GANG, nodes(), {"l2-1": 1, "l2-0": 1}, 1) == ("l2-0",)
    gang = ["l0-0", "l0-1", "l0-0", "l0-1"]
    assert replacement.spares(request(True), gang, nodes(), free, 3) == ("l0-2",)
    assert replacement.spares(req, gang, nodes(), {"l0-2": 0}, 1) == ()
