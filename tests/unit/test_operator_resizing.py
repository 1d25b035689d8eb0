"""The operator's elastic policy: what a placement tries, what it records, when a gang grows."""

from __future__ import annotations

import datetime

import pytest

from meshtrain.api import elastic, loading
from meshtrain.operator import lifecycle, resizing
from tests.builders import JobBuilder

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def declared(bounds=(2, 4)):
    builder = JobBuilder().layout(data=4, gpus_per_node=1).parallelism(microBatches=3)
    if bounds:
        builder.checkpoint(claimName="ckpt").run_policy(
            elastic={"minData": bounds[0], "maxData": bounds[1]}
        )
    return loading.parse_spec(builder.raw())


def test_a_placement_tries_every_allowed_size_largest_first():
    spec = declared()
    assert [s.parallelism.data for _, s in resizing.candidates(spec)] == [4, 3, 2]
    assert [s.global_batch for _, s in resizing.candidates(spec)] == [12, 12, 12]
    assert resizing.candidates(declared(bounds=None)) == [(None, declared(bounds=None))]


def test_the_job_state_runs_the_recorded_size_and_keeps_the_declared_spec():
    spec = declared()
    fields = resizing.placed_fields(spec, elastic.size_at(spec, 3), {}, NOW)
    body = {
        "metadata": {"name": "j", "namespace": "n", "uid": "u", "generation": 1},
        "spec": spec.model_dump(by_alias=True, exclude_none=True, mode="json"),
        "status": {"elastic": fields["elastic"], "placement": [{"podIndex": 0, "node": "a"}]},
    }
    job = lifecycle.job_state(body)
    assert job.declared == spec
    assert job.spec.parallelism.data == 3 and job.spec.pods == 3
    assert job.spec.parallelism.micro_batches == 4


@pytest.mark.parametrize(
    "data,reason,condition",
    [(3, "ElasticShrunk", "True"), (4, "DeclaredSize", "False")],
)
def test_placed_fields_state_the_size_and_the_condition(data, reason, condition):
    spec = declared()
    fields = resizing.placed_fields(
        spec, elastic.size_at(spec, data), {"lastCheckpointStep": 7}, NOW
    )
    # lastCheckpointStep 7 may predate the old gang's last checkpoint: unknown until the new gang reports
    assert fields["elastic"]["data"] == data and fields["elastic"]["checkpointStep"] is None
    [resized] = [c for c in fields["conditions"] if c["type"] == "Resized"]
    assert (resized["status"], resized["reason"]) == (condition, reason)


@pytest.mark.parametrize(
    "running,recorded_step,newest,due",
    [
        (3, 10, 10, False),  # no checkpoint since the shrink
        (3, 10, 20, True),
        (3, None, 5, False),  # the new gang has not reported the checkpoint it resumed from
        (3, None, None, False),
        (4, 10, 20, False),  # already at maxData
    ],
)
def test_a_smaller_gang_grows_only_at_a_newer_checkpoint(running, recorded_step, newest, due):
    spec = declared()
    record = resizing.placed_fields(spec, elastic.size_at(spec, running), {}, NOW)["elastic"]
    record["checkpointStep"] = recorded_step
    grow = resizing.grow_due(spec, {"elastic": record, "lastCheckpointStep": newest})
    assert (grow is not None) == due
    if grow is not None:
        assert grow.running == running and [s.data for s in grow.sizes] == [4]


def test_a_gang_grows_only_to_a_size_a_placement_would_try():
    """dp6 pp2 on 4-GPU nodes is runnable but breaks the hierarchical all-reduce rule (6 % 4)."""
    spec = loading.parse_spec(
        JobBuilder()
        .layout(data=8, pipeline=2, gpus_per_node=4)
        .parallelism(microBatches=4, allReduce="hierarchical")
        .checkpoint(claimName="ckpt")
        .run_policy(elastic={"minData": 2, "maxData": 8})
        .raw()
    )
    assert elastic.size_at(spec, 6) is not None
    placeable = [size.data for size, _ in resizing.candidates(spec)]
    assert 6 not in placeable and 8 in placeable
    record = resizing.placed_fields(spec, elastic.size_at(spec, 4), {}, NOW)["elastic"]
    record["checkpointStep"] = 0
    grow = resizing.grow_due(spec, {"elastic": record, "lastCheckpointStep": 50})
    assert grow is not None and [s.data for s in grow.sizes] == [8]


def test_the_baseline_is_the_checkpoint_the_new_gang_first_reports():
    """Placed when status said 100; the old gang's graceful stop saved 130, which the new gang restores."""
    spec = declared()
    status = {"lastCheckpointStep": 100}
    status |= resizing.placed_fields(spec, elastic.size_at(spec, 3), status, NOW)
    assert resizing.grow_due(spec, status) is None
    first = {"lastCheckpointStep": 130}
    status |= first | resizing.baseline(status, first)
    assert status["elastic"]["checkpointStep"] == 130
    assert resizing.grow_due(spec, status) is None  # not at once: 130 is where it resumed
    assert resizing.baseline(status, {"lastCheckpointStep": 180}) == {}
    status["lastCheckpointStep"] = 180
    assert resizing.grow_due(spec, status) is not None


def test_a_job_kueue_admits_never_grows_past_its_declared_size():
    """Kueue admitted the Workload of data=4: a dp8 gang would hold twice the quota."""
    spec = loading.parse_spec(
        JobBuilder()
        .layout(data=4, gpus_per_node=1)
        .parallelism(microBatches=6)
        .checkpoint(claimName="ckpt")
        .run_policy(elastic={"minData": 2, "maxData": 8})
        .raw()
    )
    body = {
        "metadata": {"name": "j", "namespace": "n", "uid": "u", "generation": 1},
        "spec": spec.model_dump(by_alias=True, exclude_none=True, mode="json"),
    }
    assert max(s.data for s, _ in resizing.candidates(lifecycle.job_state(body).declared)) == 8
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    job = lifecycle.job_state(body)
    assert [s.data for s, _ in resizing.candidates(job.declared)] == [4, 3, 2]
    record = resizing.placed_fields(job.declared, elastic.size_at(job.declared, 4), {}, NOW)
    assert resizing.grow_due(job.declared, {**record, "lastCheckpointStep": 9}) is None


def test_grow_checks_that_find_no_room_back_off_to_a_ceiling():
    waits, previous = [], None
    for _ in range(8):
        previous = resizing.next_grow_check(previous)
        waits.append(previous)
    assert waits[0] == resizing.GROW_CHECK_SECONDS
    assert all(b == min(2 * a, resizing.GROW_CHECK_MAX_SECONDS) for a, b in zip(waits, waits[1:]))
    assert waits[-1] == resizing.GROW_CHECK_MAX_SECONDS


def test_direction_of_a_change():
    spec = declared()
    assert resizing.change(4, elastic.size_at(spec, 3)) == "shrink"
    assert resizing.change(2, elastic.size_at(spec, 3)) == "grow"
    assert resizing.change(3, elastic.size_at(spec, 3)) is None
    assert resizing.change(None, elastic.size_at(spec, 3)) is None
