"""fabric_cost.bound: the placement's cost model on an assignment the cluster actually made.

Small assignments are checked against bytes counted by hand from the rank layout; the planner's
own answers against :func:`fabric_cost.bound` of their own nodes (the two must agree) and against
bytes counted rank by rank from the node labels, apart from the cost model.
"""

from __future__ import annotations

import pytest

from meshtrain import placement
from meshtrain.api import layout
from meshtrain.placement import fabric_cost, topology, values

BLOCK, SPINE, LEAF = (
    "network.topology.nvidia.com/block",
    "network.topology.nvidia.com/spine",
    "network.topology.nvidia.com/leaf",
)
RACK, TOP = "cloud.provider.com/topology-rack", "cloud.provider.com/topology-block"
CLIQUE, HOST = "nvidia.com/gpu.clique", values.HOSTNAME_LABEL


def request(
    data: int = 1, pipeline: int = 1, tensor: int = 8, **extra: object
) -> placement.PlacementRequest:
    return placement.PlacementRequest(
        gpus_per_node=8,
        layout=layout.ParallelLayout(data, pipeline, tensor),
        dp_bytes_per_step=1000.0,
        pp_bytes_per_step=10.0,
        **extra,  # type: ignore[arg-type]
    )


def nvidia_fabric(blocks: int, spines: int, leaves: int, per_leaf: int) -> list[placement.Node]:
    return [
        placement.Node(
            f"n{b}{s}{leaf}{n:02d}", 8, {BLOCK: f"b{b}", SPINE: f"s{b}{s}", LEAF: f"l{b}{s}{leaf}"}
        )
        for b in range(blocks)
        for s in range(spines)
        for leaf in range(leaves)
        for n in range(per_leaf)
    ]


# dp4 tp8: one gradient ring per tp index over pods 0-1-2-3-0, each hop 1000 bytes per rank:
# pods (0,1), (1,2), (2,3), (0,3) exchange 8 x 1000 = 8000 bytes per step
@pytest.mark.parametrize(
    ("assignment", "expected"),
    [
        # pods 0,1 in leaf l000, pods 2,3 in leaf l001: (1,2) and (0,3) cross the leaf level
        (("n00000", "n00001", "n00100", "n00101"), {LEAF: 16000.0, HOST: 16000.0}),
        # the same nodes in the other order: every hop crosses leaves
        (("n00000", "n00100", "n00001", "n00101"), {LEAF: 32000.0}),
        # one pod in the other block: its two hops cross the block level
        (("n00000", "n00001", "n00002", "n10000"), {BLOCK: 16000.0, HOST: 16000.0}),
        # pods 0,1 under spine s00, pods 2,3 under spine s01 of the same block
        (("n00000", "n00001", "n01000", "n01001"), {SPINE: 16000.0, HOST: 16000.0}),
    ],
)
def test_ring_bytes_land_on_the_level_the_hop_crosses(
    assignment: tuple[str, ...], expected: dict[str, float]
) -> None:
    got = fabric_cost.bound(request(data=4), nvidia_fabric(2, 2, 2, 4), assignment)
    keys = (BLOCK, SPINE, LEAF, HOST, values.NVLINK)
    assert got.level_bytes == {key: expected.get(key, 0.0) for key in keys}
    # default weights: block 64, spine 16, leaf 4, leaving a node 1
    weights = dict(zip(keys, topology.weights(got.levels)))
    assert got.cost == sum(weights[key] * size for key, size in expected.items())
    assert got.nodes == assignment


def test_explicit_levels_and_a_spanning_nvlink_domain() -> None:
    # the fleet's labels (no known family: the request names them); dp2 pp2 tp4 on 8-GPU pods:
    # pod 0 holds stage 0, pod 1 stage 1; 8 ranks each send 10 bytes to their next stage
    nodes = [
        placement.Node("a", 8, {TOP: "b0", RACK: "r0", CLIQUE: "c0"}),
        placement.Node("b", 8, {TOP: "b0", RACK: "r0", CLIQUE: "c0"}),
        placement.Node("c", 8, {TOP: "b0", RACK: "r1", CLIQUE: "c1"}),
    ]
    levels = (placement.FabricLevel(TOP), placement.FabricLevel(RACK))
    job = request(data=2, pipeline=2, tensor=4, levels=levels, nvlink_domain_label=CLIQUE)
    inside = fabric_cost.bound(job, nodes, ("a", "b"))
    assert inside.level_bytes == {TOP: 0.0, RACK: 0.0, CLIQUE: 0.0, values.NVLINK: 80.0}
    assert inside.cost == 0.0 and inside.domains_used == {TOP: 1, RACK: 1, CLIQUE: 1}
    across = fabric_cost.bound(job, nodes, ("a", "c"))
    assert across.level_bytes == {TOP: 0.0, RACK: 80.0, CLIQUE: 0.0, values.NVLINK: 0.0}
    assert across.cost == 80.0 * 4  # one fabric level under the top: 4^1


@pytest.mark.parametrize(
    ("job", "reserved"),
    [
        (request(data=4, pipeline=2), ("n00000",)),
        (request(data=2, pipeline=4), ("n00000", "n00100", "n01003")),
        (request(data=8, pipeline=2, tensor=4), ()),
        (request(data=3, pipeline=3), ("n00001", "n00102", "n10000")),
        (request(data=16), ("n00000", "n00001", "n00002")),
    ],
)
def test_the_plan_s_own_assignment_costs_what_the_plan_says(
    job: placement.PlacementRequest, reserved: tuple[str, ...]
) -> None:
    nodes = nvidia_fabric(2, 2, 2, 4)
    taken = [placement.Reservation(name, 8, "other/job") for name in reserved]
    for planner in (placement.plan, placement.first_fit):
        planned = planner(job, nodes, taken)
        assert isinstance(planned, placement.Placement), planned
        assert fabric_cost.bound(job, nodes, planned.nodes) == planned
        assert planned.level_bytes == _counted(job, nodes, planned.nodes)


def _counted(
    job: placement.PlacementRequest, nodes: list[placement.Node], assignment: tuple[str, ...]
) -> dict[str, float]:
    """Bytes per step counted rank by rank, apart from the cost model: each pipeline rank to its
    next-stage peer, each gradient-ring hop, charged to the highest label where the two ranks'
    nodes differ (another node of one leaf: the host level)."""
    labels = {node.name: node.labels for node in nodes}
    counted = dict.fromkeys((BLOCK, SPINE, LEAF, HOST, values.NVLINK), 0.0)
    grid = job.layout

    def talk(rank_a: int, rank_b: int, size: float) -> None:
        a, b = (assignment[grid.pod_of(rank, 8)] for rank in (rank_a, rank_b))
        if a != b:
            level = next(
                (key for key in (BLOCK, SPINE, LEAF) if labels[a][key] != labels[b][key]), HOST
            )
            counted[level] += size

    for stages in grid.all_groups("pp"):
        for rank, following in zip(stages, stages[1:]):
            talk(rank, following, job.pp_bytes_per_step)
    for ring in grid.all_groups("dp_cp"):
        for index, rank in enumerate(ring if len(ring) > 1 else ()):
            talk(rank, ring[(index + 1) % len(ring)], job.dp_bytes_per_step)
    return counted


def test_a_wrong_assignment_is_refused() -> None:
    nodes = nvidia_fabric(1, 1, 1, 4)
    with pytest.raises(ValueError, match="assignment names 1 nodes for 2 pods"):
        fabric_cost.bound(request(data=2), nodes, ("n00000",))
    with pytest.raises(ValueError, match="nodes not given: elsewhere"):
        fabric_cost.bound(request(data=2), nodes, ("n00000", "elsewhere"))
