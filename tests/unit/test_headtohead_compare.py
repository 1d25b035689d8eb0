"""What the head to head reports (benchmarks/fleet/compare.py): bytes by switch level on a binding,
per-size comparison, utilisation."""

from __future__ import annotations

import pytest

from benchmarks.fleet import compare
from meshtrain.api import loading
from meshtrain.placement import fabric_cost, values
from meshtrain.planner import placement_request
from tests.builders import JobBuilder

BLOCK, RACK = "cloud.provider.com/topology-block", "cloud.provider.com/topology-rack"
CLIQUE = "nvidia.com/gpu.clique"
NODES = [
    values.Node(name, 8, {BLOCK: block, RACK: rack, CLIQUE: clique})
    for name, block, rack, clique in (
        ("a", "b0", "r0", "c0"),
        ("b", "b0", "r0", "c0"),
        ("c", "b0", "r0", "c1"),
        ("d", "b0", "r1", "c2"),
        ("e", "b1", "r2", "c3"),
    )
]


def spec(data: int):
    builder = JobBuilder().layout(data=data, pipeline=1, tensor=8, gpus_per_node=8)
    builder = builder.model({"layers": 8, "hidden": 64, "heads": 8, "vocab": 256, "seqLen": 32})
    levels = [{"label": BLOCK}, {"label": RACK}]
    return loading.parse_spec(builder.topology(levels=levels, nvlinkDomainLabel=CLIQUE).raw())


@pytest.mark.parametrize(
    ("binding", "level"),
    [(("a", "b"), "nvlink"), (("a", "c"), "leaf"), (("a", "d"), "block"), (("a", "e"), "spine")],
)
def test_a_two_pod_ring_lands_on_the_one_level_its_nodes_differ_at(binding, level) -> None:
    job = spec(2)
    total = sum(
        size for _, _, size in fabric_cost.pod_traffic(placement_request.request_from_spec(job))
    )
    got = compare.bound(job, NODES, binding)
    expected = {
        name: (total if name == level else 0.0) for name in ("nvlink", "leaf", "block", "spine")
    }
    assert {name: getattr(got, name) for name in expected} == expected
    assert got.cross_leaf == (total if level in ("block", "spine") else 0.0)
    assert got.cross_block == (total if level == "spine" else 0.0)


def test_by_size_compares_only_jobs_both_bound() -> None:
    low, high = compare.Bound(0, 0, 1.0, 0), compare.Bound(0, 0, 4.0, 2.0)
    meshtrain = {
        "x": compare.Outcome(8, 1.0, low),
        "y": compare.Outcome(8, 3.0, low),
        "z": compare.Outcome(16, None, None),
    }
    kueue = {
        "x": compare.Outcome(8, 2.0, high),
        "y": compare.Outcome(8, None, None),
        "z": compare.Outcome(16, 5.0, high),
    }
    rows = compare.by_size(meshtrain, kueue)
    assert rows["8"]["bound_by_both"] == 1 and rows["8"]["meshtrain"]["started"] == 2
    assert rows["8"]["kueue"]["cross_leaf_bytes_per_step"] == 6.0
    assert rows["8"]["meshtrain_lower"] == {"cross_leaf": True, "cross_block": True}
    assert rows["16"]["bound_by_both"] == 0 and "meshtrain_lower" not in rows["16"]
    assert rows["16"]["kueue"]["start_seconds"]["p50"] == 5.0


def test_utilisation_weighs_each_sample_until_the_next() -> None:
    samples = [(0.0, 8, 0), (10.0, 16, 0), (20.0, 0, 0), (99.0, 16, 0)]
    assert compare.utilisation(samples, 16, 0.0, 20.0) == pytest.approx(0.75)
