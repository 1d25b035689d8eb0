"""Which size of the gang a placement takes, table-driven: the plans at each size -> the one chosen."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import pytest

from meshtrain import placement
from meshtrain.api import elastic, loading
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import (
    capacity,
    feasibility,
    memory_admission,
    placement_outcome,
    resizing,
)
from meshtrain.planner import placement_request, profiles
from tests.unit.test_operator_running import ELASTIC

SPEC = loading.parse_spec(ELASTIC.raw())  # dp4, allowed down to dp2
CHOICE = memory_admission.Choice(None, "the operator default")
REFUSED = memory_admission.Refused(CHOICE, "WontFit", "needs 90 GiB", {})
FITS = placement.Placement(("n0",), {"nvlink": 0.0}, 0.0, (), {})
NO_ROOM = placement.Unschedulable(placement.INSUFFICIENT_GPUS, "needs 4 GPUs, 3 free")


def sized(data: int, answer: str) -> placement_outcome.Sized:
    """The plan at data-parallel degree ``data``: ``fits``, ``no room`` or refused by ``memory``."""
    verdict = REFUSED if answer == "memory" else None
    found = {"fits": FITS, "no room": NO_ROOM, "memory": None}[answer]
    return placement_outcome.Sized(elastic.size_at(SPEC, data), SPEC, verdict, found, [])


CASES = [
    # name, the answers at 4, 3, 2 (largest first), the degree chosen
    ("the largest that fits", ["fits", "fits", "fits"], 4),
    ("the first that fits, largest first", ["no room", "fits", "fits"], 3),
    ("a size refused by memory is passed over", ["memory", "no room", "fits"], 2),
    ("none fits: the largest size's reason", ["no room", "no room", "no room"], 4),
    (
        "none fits: the first a plan answered, not a memory refusal",
        ["memory", "no room", "memory"],
        3,
    ),
    ("memory refuses every size: the largest's refusal", ["memory", "memory", "memory"], 4),
]


@pytest.mark.parametrize(("name", "answers", "chosen"), CASES, ids=[c[0] for c in CASES])
def test_the_size_chosen(name, answers, chosen):
    tried = [sized(data, answer) for data, answer in zip((4, 3, 2), answers, strict=True)]
    found = placement_outcome.choose(tried)
    assert found.size is not None and found.size.data == chosen


def test_sizes_below_the_first_that_fits_are_not_planned():
    def plans() -> Iterator[placement_outcome.Sized]:
        yield sized(4, "no room")
        yield sized(3, "fits")
        raise AssertionError("planned a size below one that fits")

    assert placement_outcome.choose(plans()).answer is FITS


def test_a_job_without_elastic_sizes_takes_its_one_answer():
    only = placement_outcome.Sized(None, SPEC, None, NO_ROOM, ["n1: Insufficient nvidia.com/gpu"])
    assert placement_outcome.choose([only]) is only


def _plan_each_size_alone(
    declared: api_spec.TrainingJobSpec,
    raw_nodes: list[dict[str, Any]],
    used: dict[str, feasibility.Usage],
    demand: feasibility.Demand,
    cap: int | None,
) -> placement_outcome.Sized:
    """The rule ``plan_sizes`` must keep: at each size, admission, then the nodes' offer at that
    size's own pods (``capacity.offered_nodes``) and a plan on it."""

    def at(size: elastic.Size | None, spec: api_spec.TrainingJobSpec) -> placement_outcome.Sized:
        verdict = memory_admission.admit(spec, PROFILED)
        if isinstance(verdict, memory_admission.Refused):
            return placement_outcome.Sized(size, spec, verdict, None, [])
        offered, refusals = capacity.offered_nodes(
            demand,
            raw_nodes,
            used,
            gpus_per_pod=spec.resources.gpus_per_node,
            pods_wanted=spec.pods,
        )
        answer = placement.plan(placement_request.request_from_spec(spec), offered, [])
        return placement_outcome.Sized(size, spec, verdict, answer, refusals)

    return placement_outcome.choose(
        at(size, spec) for size, spec in resizing.no_larger_than(resizing.candidates(declared), cap)
    )


PROFILED = memory_admission.Choice(profiles.get("h100-sxm"), "the test's profile")


@pytest.mark.parametrize("seed", range(12))
def test_one_offer_capped_per_size_plans_as_each_size_alone(seed: int) -> None:
    """``plan_sizes`` reads the nodes' offer once, at the most pods of any size, and caps it per
    size: the same plan as an offer read at each size's own pods."""
    rng = random.Random(seed)
    raw_nodes = [
        {
            "metadata": {"name": f"n{i}", "labels": {"pool": "a"}},
            "spec": {},
            "status": {
                "allocatable": {"nvidia.com/gpu": str(rng.choice([1, 2, 4])), "pods": "110"},
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
        for i in range(rng.randrange(1, 5))
    ]
    used = {
        f"n{i}": feasibility.Usage({"nvidia.com/gpu": rng.randrange(0, 3)}, 1) for i in range(4)
    }
    demand = feasibility.Demand(requests={"nvidia.com/gpu": 1}, tolerations=(), node_selector={})
    cap = rng.choice([None, 2, 3])
    offered, refusals = capacity.offered_nodes(
        demand, raw_nodes, used, gpus_per_pod=1, pods_wanted=placement_outcome.most_pods(SPEC)
    )
    ask = placement_outcome.Ask(declared=SPEC, cap=cap, choice=PROFILED, offered=tuple(offered))
    sized = placement_outcome.plan_sizes(ask)
    sized = dataclasses.replace(sized, refusals=refusals if sized.answer is not None else [])
    assert sized == _plan_each_size_alone(SPEC, raw_nodes, used, demand, cap)
