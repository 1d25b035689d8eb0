"""Table-driven tests of the placement planner, its cost model and its request builder."""

from __future__ import annotations

import dataclasses

import pytest

from meshtrain import placement
from meshtrain.api import layout, loading
from meshtrain.placement import fabric_cost, topology
from meshtrain.planner import comm, placement_request, precision
from tests.builders import JobBuilder

BLOCK, SPINE, LEAF = (
    "network.topology.nvidia.com/block",
    "network.topology.nvidia.com/spine",
    "network.topology.nvidia.com/leaf",
)
CLIQUE = "nvidia.com/gpu.clique"


@dataclasses.dataclass
class ClusterBuilder:
    """Fluent builder of NVIDIA-labelled clusters: blocks x spines x leaves x nodes."""

    nodes: list[placement.Node] = dataclasses.field(default_factory=list)
    reservations: list[placement.Reservation] = dataclasses.field(default_factory=list)

    def fabric(
        self, blocks: int, spines: int, leaves: int, per_leaf: int, gpus: int = 8
    ) -> ClusterBuilder:
        for b in range(blocks):
            for s in range(spines):
                for leaf in range(leaves):
                    for n in range(per_leaf):
                        labels = {BLOCK: f"b{b}", SPINE: f"s{b}{s}", LEAF: f"l{b}{s}{leaf}"}
                        self.nodes.append(placement.Node(f"n{b}{s}{leaf}{n:02d}", gpus, labels))
        return self

    def node(
        self, name: str, gpus: int = 8, unschedulable: bool = False, **labels: str
    ) -> ClusterBuilder:
        self.nodes.append(placement.Node(name, gpus, dict(labels), unschedulable))
        return self

    def reserve(self, *names: str, gpus: int = 8) -> ClusterBuilder:
        self.reservations.extend(placement.Reservation(name, gpus, "other/job") for name in names)
        return self

    def cordon(self, *names: str) -> ClusterBuilder:
        self.nodes = [
            dataclasses.replace(node, unschedulable=node.unschedulable or node.name in names)
            for node in self.nodes
        ]
        return self

    def plan(
        self, request: placement.PlacementRequest
    ) -> placement.Placement | placement.Unschedulable:
        return placement.plan(request, self.nodes, self.reservations)


def job(
    data: int = 1, pipeline: int = 1, tensor: int = 8, per_node: int = 8, **extra
) -> placement.PlacementRequest:
    extra.setdefault("dp_bytes_per_step", 1000.0)
    extra.setdefault("pp_bytes_per_step", 10.0)
    return placement.PlacementRequest(
        gpus_per_node=per_node, layout=layout.ParallelLayout(data, pipeline, tensor), **extra
    )


def placed(result: placement.Placement | placement.Unschedulable) -> placement.Placement:
    assert isinstance(result, placement.Placement), result
    return result


def leaves_of(result: placement.Placement, cluster: ClusterBuilder) -> list[str]:
    by_name = {node.name: node for node in cluster.nodes}
    return [by_name[name].labels.get(LEAF, "") for name in result.nodes]


# --- choosing nodes -------------------------------------------------------------------------


def test_single_pod_takes_the_tightest_node() -> None:
    cluster = ClusterBuilder().node("big", gpus=16).node("small", gpus=8).node("bigger", gpus=24)
    assert placed(cluster.plan(job(tensor=8))).nodes == ("small",)


def test_job_that_fits_a_leaf_stays_in_one_leaf() -> None:
    cluster = ClusterBuilder().fabric(1, 2, 2, 4).reserve("n00000", "n00101")
    result = placed(cluster.plan(job(data=2, pipeline=2)))
    assert len(set(leaves_of(result, cluster))) == 1
    assert result.level_bytes[LEAF] == result.level_bytes[SPINE] == result.level_bytes[BLOCK] == 0
    assert result.domains_used[LEAF] == 1


@pytest.mark.parametrize(
    ("taken", "expected_leaves"),
    [
        # leaf l000 has 3 free nodes, l001 and l002 4 each: each 4-pod stage gets a whole leaf
        (("n00000",), {"l001", "l002"}),
        # l000 and l001 have 3 free: stages go to l002 and l003
        (("n00000", "n00100"), {"l002", "l003"}),
    ],
)
def test_dp_groups_of_a_stage_share_a_leaf(
    taken: tuple[str, ...], expected_leaves: set[str]
) -> None:
    cluster = ClusterBuilder().fabric(1, 1, 4, 4).reserve(*taken)
    result = placed(cluster.plan(job(data=4, pipeline=2)))
    leaves = leaves_of(result, cluster)
    assert set(leaves) == expected_leaves
    assert leaves[:4] == [leaves[0]] * 4 and leaves[4:] == [leaves[4]] * 4
    assert result.level_bytes[LEAF] == 4 * 8 * 10  # only PP crosses leaves: 4 pods x 8 ranks


def test_pipeline_heavy_job_keeps_each_pipeline_in_a_leaf() -> None:
    cluster = ClusterBuilder().fabric(1, 1, 2, 4)
    result = placed(
        cluster.plan(job(data=2, pipeline=4, dp_bytes_per_step=1.0, pp_bytes_per_step=1e6))
    )
    leaves = leaves_of(result, cluster)
    assert [leaves[stage * 2] for stage in range(4)] == [leaves[0]] * 4
    assert [leaves[stage * 2 + 1] for stage in range(4)] == [leaves[1]] * 4
    assert leaves[0] != leaves[1]


def test_reserved_cordoned_and_unselected_nodes_are_skipped() -> None:
    cluster = (
        ClusterBuilder()
        .node("full", pool="a")
        .node("cordoned", pool="a", unschedulable=True)
        .node("other-pool", pool="b")
        .node("free", pool="a")
        .reserve("full", gpus=4)
    )
    result = placed(cluster.plan(job(node_selector={"pool": "a"})))
    assert result.nodes == ("free",)


def test_smaller_pods_share_a_node() -> None:
    cluster = ClusterBuilder().node("a", gpus=16).node("b", gpus=8)
    result = placed(cluster.plan(job(data=2, tensor=4, per_node=4, pipeline=2)))
    assert sorted(result.nodes) == ["a", "a", "a", "a"]
    assert result.level_bytes["nvlink"] > 0 and result.level_bytes["kubernetes.io/hostname"] == 0


def test_nvlink_clique_keeps_talking_pods_together() -> None:
    cluster = ClusterBuilder()
    for index, clique in enumerate(["c1", "c0", "c1", "c2", "c0"]):
        cluster.node(f"n{index}", **{CLIQUE: clique, LEAF: "l0"})
    result = placed(cluster.plan(job(data=2, tensor=8, nvlink_domain_label=CLIQUE)))
    assert sorted(result.nodes) in (["n1", "n4"], ["n0", "n2"])
    assert result.level_bytes[CLIQUE] == 0 and result.level_bytes["nvlink"] == 2 * 8 * 1000


# --- defaults and labels --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({BLOCK: "b", SPINE: "s", LEAF: "l"}, (BLOCK, SPINE, LEAF)),
        ({BLOCK: "b", LEAF: "l"}, (BLOCK, LEAF)),
        (
            {
                "cloud.google.com/gce-topology-block": "b",
                "cloud.google.com/gce-topology-subblock": "s",
            },
            ("cloud.google.com/gce-topology-block", "cloud.google.com/gce-topology-subblock"),
        ),
        (
            {f"topology.k8s.aws/network-node-layer-{i}": "x" for i in (3, 1, 2)},
            tuple(f"topology.k8s.aws/network-node-layer-{i}" for i in (1, 2, 3)),
        ),
        ({"topology.k8s.aws/network-node-layer-3": "x", BLOCK: "b"}, (BLOCK,)),
        ({"kubernetes.io/arch": "amd64"}, ()),
    ],
)
def test_label_family_is_detected(labels: dict[str, str], expected: tuple[str, ...]) -> None:
    nodes = [placement.Node("a", 8, labels), placement.Node("b", 8, {})]
    assert tuple(level.label for level in topology.detect_levels(nodes)) == expected
    assert all(not level.required for level in topology.detect_levels(nodes))


def test_default_weights_rise_towards_the_top() -> None:
    levels = [
        placement.FabricLevel(BLOCK),
        placement.FabricLevel(SPINE, weight=10.0),
        placement.FabricLevel(LEAF),
    ]
    assert topology.level_keys(levels, None) == (
        BLOCK,
        SPINE,
        LEAF,
        "kubernetes.io/hostname",
        "nvlink",
    )
    assert topology.weights(levels) == (64.0, 10.0, 4.0, 1.0, 0.0)


def test_missing_label_is_a_domain_of_its_own() -> None:
    levels = [placement.FabricLevel(LEAF)]
    a = topology.node_path(placement.Node("a", 8, {}), levels, None)
    b = topology.node_path(placement.Node("b", 8, {}), levels, None)
    c = topology.node_path(placement.Node("c", 8, {LEAF: "l"}), levels, None)
    assert topology.crossing(a, b) == 0 and topology.crossing(a, c) == 0


# --- unschedulable ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cluster", "request_", "reason", "words"),
    [
        (
            ClusterBuilder().fabric(1, 1, 1, 3).reserve("n00001", gpus=1).cordon("n00002"),
            job(data=4, pipeline=2),
            placement.INSUFFICIENT_GPUS,
            [
                "needs 8 pods of 8 GPUs (64 GPUs)",
                "1 eligible nodes with 1 free pod slots",
                "1 unschedulable",
                "1 with fewer than 8 free GPUs",
            ],
        ),
        (
            ClusterBuilder().fabric(1, 1, 1, 2),
            job(node_selector={"pool": "x"}),
            placement.INSUFFICIENT_GPUS,
            ["found 0 eligible nodes", "2 not matching the node selector"],
        ),
        (
            ClusterBuilder().fabric(3, 1, 1, 4).reserve("n00000", "n10000"),
            job(
                data=5,
                levels=(placement.FabricLevel(BLOCK, required=True), placement.FabricLevel(LEAF)),
            ),
            placement.TOPOLOGY_UNSATISFIABLE,
            [
                "needs 5 pods of 8 GPUs inside one network.topology.nvidia.com/block domain",
                "'b2', has 4 free pod slots",
                "10 free pod slots cluster-wide in 3 domains",
            ],
        ),
    ],
)
def test_unschedulable_reason_and_message(cluster, request_, reason: str, words: list[str]) -> None:
    result = cluster.plan(request_)
    assert isinstance(result, placement.Unschedulable)
    assert result.reason == reason
    for word in words:
        assert word in result.message


def test_required_level_is_honoured_when_it_can_be() -> None:
    cluster = ClusterBuilder().fabric(2, 2, 1, 3).reserve("n00000", "n00001", "n01000", "n10000")
    required = job(
        data=4,
        levels=(
            placement.FabricLevel(BLOCK, required=True),
            placement.FabricLevel(SPINE),
            placement.FabricLevel(LEAF),
        ),
    )
    result = placed(cluster.plan(required))
    assert {name[1] for name in result.nodes} == {"1"}
    preferred = placed(cluster.plan(dataclasses.replace(required, levels=())))
    assert preferred.cost <= result.cost


def test_invalid_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="does not divide gpusPerNode"):
        job(tensor=3)
    with pytest.raises(ValueError, match="not a multiple"):
        job(tensor=2, data=3)
    with pytest.raises(ValueError, match="unique"):
        placement.plan(job(), [placement.Node("a", 8), placement.Node("a", 8)], [])


# --- cost model -------------------------------------------------------------------------------


def test_pod_traffic_of_a_small_layout() -> None:
    # dp2 pp2 tp4 on 8-GPU pods: pod 0 = stage 0 (both replicas), pod 1 = stage 1; DP stays inside
    assert fabric_cost.pod_traffic(job(data=2, pipeline=2, tensor=4)) == [(0, 1, 8 * 10.0)]
    # dp4 pp1 tp8: a ring of 4 pods, 8 edges (one per tp index) between neighbours
    assert fabric_cost.pod_traffic(job(data=4)) == [
        (0, 1, 8000.0),
        (0, 3, 8000.0),
        (1, 2, 8000.0),
        (2, 3, 8000.0),
    ]
    # dp2 tp8: both ring directions join the same pair
    assert fabric_cost.pod_traffic(job(data=2)) == [(0, 1, 16000.0)]


def test_request_from_spec() -> None:
    spec = loading.parse_spec(
        JobBuilder()
        .layout(data=2, pipeline=2, tensor=4, gpus_per_node=8)
        .parallelism(microBatches=4)
        .resources(nodeSelector={"pool": "gpu"})
        .model({"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seqLen": 32})
        .training(microBatch=2)
        .topology(
            nvlinkDomainLabel=CLIQUE,
            levels=[{"label": BLOCK, "mode": "required"}, {"label": LEAF}],
        )
        .raw()
    )
    request = placement_request.request_from_spec(spec)
    assert (
        request.layout.data,
        request.layout.pipeline,
        request.layout.tensor,
        request.gpus_per_node,
        request.pods,
    ) == (2, 2, 4, 8, 2)
    assert request.levels == (
        placement.FabricLevel(BLOCK, required=True),
        placement.FabricLevel(LEAF),
    )
    assert request.nvlink_domain_label == CLIQUE and dict(request.node_selector) == {"pool": "gpu"}
    dp_bytes, pp_bytes = comm.placement_traffic(spec, precision.scheme_for("bf16"))
    assert (request.dp_bytes_per_step, request.pp_bytes_per_step) == (dp_bytes, pp_bytes)
    # pipeline traffic: activations forward and gradients back, per micro-batch, in bf16 on the
    # wire under bf16 autocast (2 bytes per element)
    assert pp_bytes == 2 * 4 * (2 * 32 * 64 * 2)


# --- context parallelism ----------------------------------------------------------------------


def cp_job(data: int, context: int, tensor: int, **extra) -> placement.PlacementRequest:
    return placement.PlacementRequest(
        gpus_per_node=8,
        layout=layout.ParallelLayout(data, 1, tensor, context=context),
        **{"dp_bytes_per_step": 1.0, "cp_bytes_per_step": 1000.0, **extra},
    )


def test_pod_traffic_counts_context_rings() -> None:
    # cp4 tp4 on 8-GPU pods: ring k of tp index k is ranks k, k+4, k+8, k+12, pods 0, 0, 1, 1:
    # it crosses twice (4 -> 8 and 12 -> 0), 4 rings; at data 1 the gradient ring is the same
    # ranks (the data x context ranks of tp index k sum its gradients)
    assert fabric_cost.pod_traffic(cp_job(1, 4, 4)) == [(0, 1, 2 * 4 * 1000.0 + 2 * 4 * 1.0)]
    # dp2 cp2 tp4: a context ring is 8 consecutive ranks, one pod; only the 4 gradient rings
    # (k, k+4 in pod 0; k+8, k+12 in pod 1) cross, twice each
    assert fabric_cost.pod_traffic(cp_job(2, 2, 4)) == [(0, 1, 4 * 2 * 1.0)]


def test_context_rings_spanning_pods_stay_in_a_leaf_where_one_holds_them() -> None:
    # dp2 cp4 tp4: two context rings of two pods each; both leaves have three free nodes, so
    # filling the first leaf with three pods would cut ring 1 across leaves
    cluster = ClusterBuilder().fabric(1, 1, 2, 4).reserve("n00000", "n00100")
    result = placed(cluster.plan(cp_job(2, 4, 4, dp_bytes_per_step=1.0, cp_bytes_per_step=1e9)))
    leaves = leaves_of(result, cluster)
    assert leaves[0] == leaves[1] and leaves[2] == leaves[3] and leaves[0] != leaves[2]
    # only the 4 gradient rings (8 ranks each, through pods 0, 0, 1, 1, 2, 2, 3, 3) cross leaves,
    # at 1 -> 2 and 3 -> 0
    assert result.level_bytes[LEAF] == 4 * 2 * 1.0


def test_request_from_spec_carries_the_context_ring() -> None:
    spec = loading.parse_spec(
        JobBuilder()
        .layout(data=1, pipeline=1, tensor=1, gpus_per_node=2)
        .parallelism(context=2, microBatches=4)
        .model({"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seqLen": 32})
        .training(microBatch=2)
        .raw()
    )
    request = placement_request.request_from_spec(spec)
    assert request.layout.context == 2 and request.pods == 1
    # per layer and micro-batch (trainer/parallel/context.py at cp2) forward sends a K/V block
    # (2 x 2 sequences x 16 tokens x 64 wide x 2 bytes), backward the K/V again and the fp32
    # dK/dV twice (to the peer, then home): 2 blocks and 2 of twice the bytes
    block = 2 * 2 * 16 * 64 * 2
    assert request.cp_bytes_per_step == 4 * 4 * (2 * block + 2 * 2 * block)
