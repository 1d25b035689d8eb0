"""What a placement pass does with its plan, table-driven: (job, sized plan) -> won't fit | unplaced | placed."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from meshtrain import placement
from meshtrain.api import elastic, loading
from meshtrain.operator.policy import (
    conditions,
    job_state,
    memory_admission,
    placement_outcome,
    resizing,
    volumes,
)
from tests.builders import JobBuilder

NOW = datetime.datetime(2026, 1, 1, 12, tzinfo=datetime.UTC)
CHOICE = memory_admission.Choice(None, "the operator default")
NO_ROOM = placement.Unschedulable(placement.INSUFFICIENT_GPUS, "needs 2 GPUs, 1 free")


def raw(elastic_bounds: tuple[int, int] | None = None) -> dict[str, Any]:
    builder = JobBuilder().layout(data=4 if elastic_bounds else 2, gpus_per_node=1)
    if elastic_bounds:
        builder.checkpoint(claimName="ckpt").run_policy(
            elastic={"minData": elastic_bounds[0], "maxData": elastic_bounds[1]}
        )
    return builder.raw()


def job(spec: dict[str, Any] | None = None, **status: Any) -> job_state.JobState:
    body = {
        "metadata": {"name": "j", "namespace": "ns", "uid": "u1", "generation": 2},
        "spec": spec if spec is not None else raw(),
        "status": status,
    }
    return job_state.read(body)


def placed_on(*nodes: str) -> placement.Placement:
    return placement.Placement(tuple(nodes), {"nvlink": 0.0}, 0.0, (), {})


def sized(
    the_job: job_state.JobState,
    answer: placement.Placement | placement.Unschedulable | None,
    verdict: memory_admission.Admitted | memory_admission.Refused | None = None,
    refusals: tuple[str, ...] = (),
    size: elastic.Size | None = None,
    spec: Any = None,
) -> placement_outcome.Sized:
    assert the_job.spec is not None
    return placement_outcome.Sized(size, spec or the_job.spec, verdict, answer, list(refusals))


def judge(the_job: job_state.JobState, plan: placement_outcome.Sized, **kw: Any) -> Any:
    options: dict[str, Any] = {"avoid": frozenset(), "claim": None, "nodes_seen": 3, "now": NOW}
    return placement_outcome.judge(the_job, plan, **(options | kw))


def test_a_refused_memory_plan_fails_the_job_with_no_pods():
    refused = memory_admission.Refused(
        CHOICE, conditions.WONT_FIT, "rank 0 needs 90 GiB", {"fits": False}
    )
    outcome = judge(job(), sized(job(), None, refused))
    assert isinstance(outcome, placement_outcome.WontFit)
    assert (outcome.reason, outcome.message) == (conditions.WONT_FIT, "rank 0 needs 90 GiB")
    assert outcome.status["phase"] == "Failed" and outcome.status["plan"] == {"fits": False}
    assert conditions.find(outcome.status["conditions"], conditions.WONT_FIT)["status"] == "True"


BOUNDED = job(raw((2, 4)))
CLAIM = volumes.Topology("ckpt", (), "zone a")

UNSCHEDULABLE = [
    # name, job, refusals, options, what the message adds after the planner's own
    ("plain", job(), (), {}, "; 3 node(s) considered"),
    (
        "the nodes' filter reasons are counted",
        job(),
        ("Insufficient cpu", "Insufficient cpu"),
        {},
        "; 1/3 nodes are available: 2 Insufficient cpu.",
    ),
    (
        "every elastic size was tried",
        BOUNDED,
        (),
        {},
        "; no data-parallel degree from 4 down to 2 fits; 3 node(s) considered",
    ),
    (
        "nodes left out for the job are named",
        job(),
        (),
        {"avoid": frozenset({"n2", "n1"})},
        "; excluded for this job (stragglers, scheduler refusals): n1, n2; 3 node(s) considered",
    ),
    (
        "a claim that allows only some nodes is named",
        job(),
        (volumes.CONFLICT,),
        {"claim": CLAIM},
        f"; claim ckpt allows only the nodes of zone a; 2/3 nodes are available: 1 {volumes.CONFLICT}.",
    ),
    (
        "a claim without a conflict is not",
        job(),
        (),
        {"claim": CLAIM},
        "; 3 node(s) considered",
    ),
]


@pytest.mark.parametrize(
    ("name", "the_job", "refusals", "options", "added"),
    UNSCHEDULABLE,
    ids=[c[0] for c in UNSCHEDULABLE],
)
def test_an_unschedulable_gang_waits_and_says_what_was_tried(
    name: str,
    the_job: job_state.JobState,
    refusals: tuple[str, ...],
    options: dict[str, Any],
    added: str,
):
    outcome = judge(the_job, sized(the_job, NO_ROOM, refusals=refusals), **options)
    assert isinstance(outcome, placement_outcome.Unplaced)
    assert outcome.reason == placement.INSUFFICIENT_GPUS
    assert outcome.message == NO_ROOM.message + added
    assert outcome.news and outcome.status["phase"] == "Pending"
    placed = conditions.find(outcome.status["conditions"], conditions.PLACED)
    assert (placed["status"], placed["message"]) == ("False", outcome.message)


def test_the_same_reason_again_is_no_news():
    first = judge(job(), sized(job(), NO_ROOM))
    again = job(**first.status)
    outcome = judge(again, sized(again, NO_ROOM))
    assert isinstance(outcome, placement_outcome.Unplaced) and not outcome.news
    assert outcome.status == first.status


def test_a_placed_gang_records_its_nodes_and_the_plan_before_its_pods():
    admitted = memory_admission.Admitted(CHOICE, {"fits": True})
    outcome = judge(job(), sized(job(), placed_on("n0", "n1"), admitted))
    assert isinstance(outcome, placement_outcome.Placed)
    assert outcome.nodes == ("n0", "n1") and outcome.resized is None
    assert outcome.status["phase"] == "Placing" and outcome.status["plan"] == {"fits": True}
    assert outcome.status["placement"] == [
        {"podIndex": 0, "node": "n0"},
        {"podIndex": 1, "node": "n1"},
    ]
    assert outcome.message == "2 pod(s) of dp2·pp1·tp1 placed on 2 node(s)"


@pytest.mark.parametrize(
    ("ran", "placed", "direction", "event_type", "reason"),
    [
        (4, 2, "shrink", "Warning", conditions.ELASTIC_SHRUNK),
        (2, 3, "grow", "Normal", conditions.ELASTIC_GROWN),
        (3, 3, None, None, None),
    ],
)
def test_a_gang_placed_at_another_degree_than_it_ran_is_announced(
    ran: int, placed: int, direction: str | None, event_type: str | None, reason: str | None
):
    declared = loading.parse_spec(raw((2, 4)))
    record = resizing.placed_fields(declared, elastic.size_at(declared, ran), {}, NOW)["elastic"]
    running = job(raw((2, 4)), elastic=record)
    size = elastic.size_at(declared, placed)
    assert size is not None
    plan = sized(
        running,
        placed_on(*(f"n{i}" for i in range(placed))),
        size=size,
        spec=elastic.resized(declared, size),
    )
    outcome = judge(running, plan)
    assert isinstance(outcome, placement_outcome.Placed)
    assert outcome.status["elastic"]["data"] == placed
    if direction is None:
        assert outcome.resized is None
        return
    assert outcome.resized is not None
    assert (outcome.resized.direction, outcome.resized.type, outcome.resized.reason) == (
        direction,
        event_type,
        reason,
    )
    assert outcome.resized.message.startswith(f"data-parallel degree {ran} -> {placed}: ")
    assert outcome.resized.detail == outcome.status["elastic"]["message"]


def test_a_grow_check_finds_room_only_for_a_larger_size_that_fits():
    declared = loading.parse_spec(raw((2, 4)))
    four = elastic.size_at(declared, 4)
    two = elastic.size_at(declared, 2)
    the_job = job(raw((2, 4)))
    assert placement_outcome.larger_size(sized(the_job, placed_on("a"), size=four), 2) == four
    assert placement_outcome.larger_size(sized(the_job, placed_on("a"), size=two), 2) is None
    assert placement_outcome.larger_size(sized(the_job, NO_ROOM, size=four), 2) is None
    assert placement_outcome.larger_size(sized(the_job, placed_on("a")), 2) is None


@pytest.mark.parametrize(
    "bounds, what_to_change",
    [
        (None, "; lower the parallelism degrees"),
        ((2, 4), "; narrow runPolicy.elastic [minData=2, maxData=4] (every degree in it"),
    ],
)
def test_a_plan_past_the_deadline_fails_the_job_naming_the_deadline_and_the_fix(
    bounds: tuple[int, int] | None, what_to_change: str
) -> None:
    refused = placement_outcome.planning_refused(job(raw(bounds)), 2.5, NOW)
    assert refused.reason == conditions.PLANNING_DEADLINE_EXCEEDED
    assert refused.status["phase"] == job_state.Phase.FAILED.value
    assert refused.status["observedGeneration"] == 2
    by_type = {c["type"]: c for c in refused.status["conditions"]}
    assert (by_type["Failed"]["status"], by_type["Placed"]["status"]) == ("True", "False")
    assert by_type["Failed"]["reason"] == by_type["Placed"]["reason"] == refused.reason
    assert conditions.WONT_FIT not in by_type
    for said in ("planning deadline of 2.5 s", "--planning-deadline-seconds", what_to_change):
        assert said in refused.message, refused.message
    assert by_type["Failed"]["message"] == refused.message
