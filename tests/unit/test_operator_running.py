"""The running gang's rows, table-driven: Running once, rank 0's progress polled, room to grow looked for."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest

from meshtrain.api import elastic
from meshtrain.operator.policy import (
    identity,
    job_actions,
    job_state,
    lifecycle,
    pod_state,
    resizing,
    running,
    situation,
)
from tests.builders import JobBuilder

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


def job(
    builder: JobBuilder | None = None,
    running_at: int | None = None,
    seen_running: bool = False,
    **status: Any,
) -> job_state.JobState:
    """A placed gang of ``builder``'s job (dp2 on 1-GPU pods unless told), at data ``running_at``;
    ``seen_running``: a pass has already seen every pod run (Running written)."""
    raw = (builder or JobBuilder().layout(data=2, gpus_per_node=1)).raw()
    body: dict[str, Any] = {
        "metadata": {"name": "j", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": raw,
    }
    declared = job_state.read(body).declared
    assert declared is not None
    if running_at is not None:
        size = elastic.size_at(declared, running_at)
        placed = resizing.placed_fields(declared, size, {}, T0)["elastic"]
        status["elastic"] = {**placed, **status.pop("elastic", {})}
    pods = running_at or declared.pods
    body["status"] = {
        "phase": "Placing",
        "placement": [{"podIndex": i, "node": f"n{i}"} for i in range(pods)],
        **status,
    }
    spec = job_state.read(body).spec
    assert spec is not None
    body["status"]["specHash"] = identity.spec_hash(spec)
    state = job_state.read(body)
    return written(state, gang(pods)) if seen_running else state


def written(state: job_state.JobState, pods: list[pod_state.PodState]) -> job_state.JobState:
    """``state`` once a pass over ``pods`` wrote its status (the gang seen running before)."""
    status = dict(state.status)
    for action in lifecycle.decide(state, pods, T0).actions:
        if isinstance(action, job_actions.SetStatus):
            status.update(action.changes)
    return dataclasses.replace(state, status=status)


def gang(pods: int = 2, ip: str | None = "10.0.0.1") -> list[pod_state.PodState]:
    """Every pod of the gang Running on its node; rank 0 at ``ip``."""
    rank0 = pod_state.PodState("j-r0-0", 0, 0, "Running", False, False, T0, "n0", ip, bound=True)
    return [rank0] + [
        dataclasses.replace(rank0, name=f"j-r0-{i}", index=i, node=f"n{i}", ip=None)
        for i in range(1, pods)
    ]


ELASTIC = (
    JobBuilder()
    .layout(data=4, gpus_per_node=1)
    .parallelism(microBatches=3)
    .checkpoint(claimName="ckpt")
    .run_policy(elastic={"minData": 2, "maxData": 4})
)


def elastic_job(running_at: int, checkpointed: int) -> job_state.JobState:
    """The elastic job running at ``running_at`` from step 10, its last checkpoint at ``checkpointed``."""
    return job(
        ELASTIC,
        running_at=running_at,
        seen_running=True,
        lastCheckpointStep=checkpointed,
        elastic={"checkpointStep": 10},
    )


CUSTOM = JobBuilder().layout(data=2, gpus_per_node=1).trainer(type="custom", command=["train"])
"""A user's own program, which says nothing of a progress port."""


CASES = [
    # name, job, pods, the rule that decides, action kinds
    (
        "every pod runs: Running, rank 0's progress polled",
        job(),
        gang(),
        running.RUNNING,
        ["SetStatus", "PollProgress"],
    ),
    (
        "already Running: progress polled",
        job(seen_running=True),
        gang(),
        running.RUNNING,
        ["PollProgress"],
    ),
    (
        "rank 0 has no IP yet: nothing to poll",
        job(seen_running=True),
        gang(ip=None),
        running.RUNNING,
        [],
    ),
    (
        "a custom program declaring a progress port: polled there",
        job(CUSTOM.clone().trainer(progressPort=9500), seen_running=True),
        gang(),
        running.RUNNING,
        ["PollProgress"],
    ),
    (
        "a custom program declaring no progress port: never polled",
        job(CUSTOM, seen_running=True),
        gang(),
        running.RUNNING,
        [],
    ),
    (
        "below its largest size, checkpointed since placed: room to grow looked for",
        elastic_job(3, checkpointed=50),
        gang(3),
        running.GROW_CHECK,
        ["PollProgress", "Grow"],
    ),
    (
        "below its largest size, no checkpoint since placed: no grow yet",
        elastic_job(3, checkpointed=10),
        gang(3),
        running.RUNNING,
        ["PollProgress"],
    ),
    (
        "at its largest size: nothing to grow to",
        elastic_job(4, checkpointed=50),
        gang(4),
        running.RUNNING,
        ["PollProgress"],
    ),
]


@pytest.mark.parametrize(
    ("name", "state", "pods", "rule", "kinds"), CASES, ids=[c[0] for c in CASES]
)
def test_running_rows(name, state, pods, rule, kinds):
    seen = situation.Situation(state, tuple(pods), T0)
    assert situation.GANG_RUNNING.covers(seen)
    decides = next(r for r in lifecycle.RULES if isinstance(r, situation.Rule) and r.when(seen))
    assert decides is rule
    decision = lifecycle.decide(state, pods, T0)
    assert [type(a).__name__ for a in decision.actions] == kinds


def test_the_grow_check_names_the_running_size_and_the_larger_ones():
    state = elastic_job(2, checkpointed=50)
    [*_, grow] = lifecycle.decide(state, gang(2), T0).actions
    assert isinstance(grow, resizing.Grow)
    assert grow.running == 2 and [s.data for s in grow.sizes] == [4, 3]


@pytest.mark.parametrize(
    ("builder", "port"),
    [
        (JobBuilder().layout(data=2, gpus_per_node=1).metrics(port=9600), 9600),
        (CUSTOM.clone().trainer(progressPort=9500), 9500),
        (CUSTOM, None),
    ],
)
def test_rank_zero_is_polled_at_the_port_its_program_serves_progress_on(builder, port):
    polls = [
        a
        for a in lifecycle.decide(job(builder, seen_running=True), gang(), T0).actions
        if isinstance(a, job_actions.PollProgress)
    ]
    assert [(p.ip, p.port) for p in polls] == ([] if port is None else [("10.0.0.1", port)])


def test_a_gang_not_all_running_is_not_in_the_running_section():
    starting = gang()
    starting[1] = pod_state.PodState("j-r0-1", 1, 0, "Pending", False, False, T0, "n1")
    seen = situation.Situation(job(), tuple(starting), T0)
    assert situation.GANG_STARTING.covers(seen) and not situation.GANG_RUNNING.covers(seen)
    assert running.ENTERED.adds(seen) == () and running.PROGRESS_POLLED.adds(seen) == ()
