"""A preferred fabric level that holds a waiting gang for one domain (``waitSeconds``):
``policy.topology_hold`` says which levels hold and until when, and a plan with them held places
the gang inside one domain or not at all, checked against a brute force over the domains."""

from __future__ import annotations

import datetime
import itertools
import random
from typing import Any

import pytest

from meshtrain import placement
from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import conditions, job_state, topology_hold
from meshtrain.planner import placement_request
from tests.builders import JobBuilder

RACK = "example.com/rack"
BLOCK = "example.com/block"
T0 = datetime.datetime(2026, 11, 30, 12, 0, tzinfo=datetime.UTC)


def _builder(pods: int, levels: list[dict[str, Any]], **resources: Any) -> JobBuilder:
    builder = JobBuilder().layout(data=8 * pods, gpus_per_node=8).topology(levels=levels)
    return builder.resources(**resources) if resources else builder


def _spec(pods: int, levels: list[dict[str, Any]], **resources: Any) -> api_spec.TrainingJobSpec:
    return api_spec.TrainingJobSpec.model_validate(_builder(pods, levels, **resources).raw())


def _nodes(racks: list[int], block_of=lambda rack: "b0", **extra: Any) -> list[placement.Node]:
    """Nodes of 8 GPUs: ``racks[i]`` of them in rack i."""
    return [
        placement.Node(f"r{rack}-n{i}", 8, {RACK: f"r{rack}", BLOCK: block_of(rack), **extra})
        for rack, count in enumerate(racks)
        for i in range(count)
    ]


def _at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def _empty(racks: list[int]) -> list[tuple[str, dict[str, str], int]]:
    """(name, labels, pod slots when empty) of one-pod nodes, ``racks[i]`` of them in rack i."""
    return [(node.name, dict(node.labels), 1) for node in _nodes(racks)]


def test_each_preferred_level_holds_until_its_own_wait_runs_out():
    spec = _spec(2, [{"label": BLOCK, "waitSeconds": 120}, {"label": RACK, "waitSeconds": 30}])
    first = topology_hold.hold(spec, T0, _at(0), _empty([2, 2]))
    assert first is not None and first.labels == {BLOCK, RACK}
    assert first.until == _at(30)  # the first hold to end: a plan is owed then
    assert f"levels[0] ({BLOCK}, waitSeconds 120) until 2026-11-30T12:02:00Z" in first.note
    assert f"levels[1] ({RACK}, waitSeconds 30) until 2026-11-30T12:00:30Z" in first.note
    later = topology_hold.hold(spec, T0, _at(29), _empty([2, 2]))
    assert later is not None and later.note == first.note  # the same words for the same hold
    block_only = topology_hold.hold(spec, T0, _at(30), _empty([2, 2]))
    assert block_only is not None and block_only.labels == {BLOCK}
    assert block_only.until == _at(120)
    assert topology_hold.hold(spec, T0, _at(120), _empty([2, 2])) is None


def test_no_hold_where_no_domain_has_slots_for_the_gang_even_empty():
    waits = [{"label": RACK, "waitSeconds": 60}]
    assert topology_hold.hold(_spec(3, waits), T0, T0, _empty([2, 2, 2])) is None  # racks of 2
    assert topology_hold.hold(_spec(2, waits), T0, T0, _empty([2, 2])) is not None
    # a node that takes none of the gang's pods (tainted, another pool, too small) counts nothing
    none_here = [(n, labels, i % 2) for i, (n, labels, _) in enumerate(_empty([2, 2]))]
    assert topology_hold.hold(_spec(2, waits), T0, T0, none_here) is None
    # a node without the label is a domain of its own, as the planner counts it
    unlabelled = [(f"u{i}", {}, 1) for i in range(4)]
    assert topology_hold.hold(_spec(2, waits), T0, T0, unlabelled) is None
    big = [("big", {}, 2)]
    assert topology_hold.hold(_spec(2, waits), T0, T0, unlabelled + big) is not None


def _job(levels: list[dict[str, Any]], labels: dict[str, str] | None = None, **status: Any):
    body = _builder(2, levels).manifest()
    body["metadata"] |= {"uid": "u", "generation": 1, "labels": labels or {}}
    return job_state.read({**body, "status": status})


def test_only_a_first_placement_outside_kueue_of_a_fixed_size_may_be_held():
    waits = [{"label": RACK, "waitSeconds": 60}]
    assert topology_hold.may_hold(_job(waits), kueue=False)
    assert not topology_hold.may_hold(_job([{"label": RACK}]), kueue=False)  # no wait asked
    assert not topology_hold.may_hold(_job(waits), kueue=True)
    # it ran once: re-placed at once after a failure, a straggler, a spec change or a grow
    assert not topology_hold.may_hold(_job(waits, startTime="2026-11-30T11:00:00Z"), kueue=False)
    elastic = _builder(2, waits).run_policy(elastic={"minData": 8, "maxData": 16}).manifest()
    elastic["metadata"] |= {"uid": "u", "generation": 1}
    assert not topology_hold.may_hold(job_state.read(elastic), kueue=False)


def test_the_wait_counts_from_the_placed_false_transition():
    placed = {
        "type": conditions.PLACED,
        "status": conditions.FALSE,
        "reason": placement.TOPOLOGY_UNSATISFIABLE,
        "lastTransitionTime": "2026-11-30T12:00:00Z",
    }
    job = _job([{"label": RACK, "waitSeconds": 60}], conditions=[placed])
    assert topology_hold.of_job(job, _empty([2, 2]), _at(59)) is not None
    assert topology_hold.of_job(job, _empty([2, 2]), _at(60)) is None
    fresh = _job([{"label": RACK, "waitSeconds": 60}])  # no condition yet: it starts now
    first = topology_hold.of_job(fresh, _empty([2, 2]), _at(0.7))
    assert first is not None and first.until == _at(60)  # whole seconds, as the condition keeps


def test_the_spec_refuses_a_wait_on_a_required_level():
    raw = _builder(2, [{"label": RACK, "mode": "required", "waitSeconds": 10}]).raw()
    with pytest.raises(loading.SpecError, match=r"levels\[0\].*waitSeconds with mode required"):
        loading.parse_spec(raw, "TrainingJob ns/job")


@pytest.mark.parametrize("seed", range(40))
def test_a_held_plan_is_inside_one_domain_exactly_when_one_has_room(seed: int):
    """Random racks and blocks with random free GPUs: with the rack level held, the gang is
    placed iff some rack has free slots for all its pods (counted here, node by node), and then
    on one rack; with the block level held, the same one block up."""
    rng = random.Random(seed)
    racks = [rng.randint(1, 4) for _ in range(rng.randint(2, 6))]
    nodes = [
        placement.Node(n.name, rng.choice([0, 8, 8, 16]), n.labels)
        for n in _nodes(racks, block_of=lambda rack: f"b{rack // 2}")
    ]
    pods = rng.randint(2, 5)
    for label in (RACK, BLOCK):
        spec = _spec(pods, [{"label": BLOCK}, {"label": RACK}])
        slots = {
            domain: sum(n.allocatable_gpus // 8 for n in members)
            for domain, members in itertools.groupby(
                sorted(nodes, key=lambda n: n.labels[label]), key=lambda n: n.labels[label]
            )
        }
        held = placement.plan(
            placement_request.request_from_spec(spec, frozenset({label})), nodes, []
        )
        if max(slots.values()) >= pods:
            assert isinstance(held, placement.Placement), (label, slots, held)
            used = {n.labels[label] for n in nodes if n.name in held.nodes}
            assert len(used) == 1, (label, held.nodes)
        else:
            assert isinstance(held, placement.Unschedulable), (label, slots, held)
        free = placement.plan(placement_request.request_from_spec(spec), nodes, [])
        assert isinstance(free, placement.Placement) == (sum(slots.values()) >= pods)
