"""The operator's elastic policy: what a placement tries, what it records, when a gang grows."""

from __future__ import annotations

import datetime

import pytest

from meshtrain.api import elastic, loading
from meshtrain.operator.policy import job_state, resizing
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
    job = job_state.read(body)
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
    assert max(s.data for s, _ in resizing.candidates(job_state.read(body).declared)) == 8
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    job = job_state.read(body)
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


def steady(stable=60, interval=300):
    """A dp4 job (minData 2) that grows only after room lasted ``stable`` s, ``interval`` s after a resize."""
    builder = JobBuilder().layout(data=4, gpus_per_node=1).parallelism(microBatches=3)
    builder.checkpoint(claimName="ckpt").run_policy(
        elastic={
            "minData": 2,
            "maxData": 4,
            "growStableSeconds": stable,
            "minResizeIntervalSeconds": interval,
        }
    )
    return loading.parse_spec(builder.raw())


def at(seconds):
    return NOW + datetime.timedelta(seconds=seconds)


def shrunk(spec, when=0):
    """The status of a gang that ran at dp4 and was placed again at dp3 at ``when``."""
    status = resizing.placed_fields(spec, elastic.size_at(spec, 4), {}, NOW)
    return status | resizing.placed_fields(spec, elastic.size_at(spec, 3), status, at(when))


def test_a_resize_is_stamped_and_a_placement_at_the_same_size_keeps_the_stamp():
    spec = steady()
    first = resizing.placed_fields(spec, elastic.size_at(spec, 4), {}, NOW)
    assert first["elastic"]["resizedAt"] is None  # the first placement is no resize
    status = shrunk(spec, when=5)
    assert status["elastic"]["resizedAt"] == "2026-01-01T00:00:05Z"
    status["elastic"]["roomSince"] = "2026-01-01T00:00:06Z"
    again = resizing.placed_fields(spec, elastic.size_at(spec, 3), status, at(50))  # a restart
    assert again["elastic"]["resizedAt"] == "2026-01-01T00:00:05Z"
    assert again["elastic"]["roomSince"] is None  # the new gang judges room afresh


@pytest.mark.parametrize(
    "checks,grows_at",
    [
        # (second of a check, room found?) after a shrink at 0; growStableSeconds 60, interval 300
        ([(10, True), (70, True), (290, True), (300, True)], 300),  # the interval binds
        (
            [(10, True), (250, False), (260, True), (310, True), (320, True)],
            320,
        ),  # room lost: 60 s again
        ([(290, True), (340, True), (350, True)], 350),  # room first seen late: stability binds
    ],
)
def test_a_gang_grows_once_room_lasted_and_the_resize_interval_passed(checks, grows_at):
    spec = steady()
    status = shrunk(spec)
    grown_at = None
    for second, room in checks:
        if not room:
            status |= resizing.no_room(status)
            assert status["elastic"]["roomSince"] is None
            assert resizing.largest_allowed(spec, status, at(second)) == 3
            continue
        checked = resizing.room_found(spec, status, 3, 4, at(second))
        status |= checked.fields
        assert resizing.largest_allowed(spec, status, at(second)) == (None if checked.grow else 3)
        if checked.grow:
            grown_at = second
            break
    assert grown_at == grows_at


def test_the_first_check_that_finds_room_says_when_the_gang_will_grow():
    spec = steady()
    status = shrunk(spec)
    first = resizing.room_found(spec, status, 3, 4, at(10))
    assert not first.grow and first.fields["elastic"]["roomSince"] == "2026-01-01T00:00:10Z"
    assert (
        "growStableSeconds=60" in first.message and "minResizeIntervalSeconds=300" in first.message
    )
    status |= first.fields
    later = resizing.room_found(spec, status, 3, 4, at(20))
    assert later == resizing.Checked(False, {}, None)


def test_without_waiting_periods_a_gang_grows_at_the_first_check_with_room():
    spec = steady(stable=0, interval=0)
    checked = resizing.room_found(spec, shrunk(spec), 3, 4, at(1))
    assert checked.grow


def test_a_gang_never_resized_waits_only_for_stable_room():
    spec = steady()
    status = resizing.placed_fields(spec, elastic.size_at(spec, 3), {}, NOW)  # first placed at dp3
    status |= resizing.room_found(spec, status, 3, 4, at(1)).fields
    assert not resizing.room_found(spec, status, 3, 4, at(60)).grow
    assert resizing.room_found(spec, status, 3, 4, at(61)).grow


def test_a_restarted_gang_is_not_placed_larger_than_it_ran_before_a_grow_is_allowed():
    spec = steady()
    status = shrunk(spec)
    cap = resizing.largest_allowed(spec, status, at(1))
    assert cap == 3
    assert [s.data for s, _ in resizing.no_larger_than(resizing.candidates(spec), cap)] == [3, 2]
    # a lower cap than any allowed size (minData raised by a spec change): nothing is left out
    assert len(resizing.no_larger_than(resizing.candidates(spec), 1)) == 3
    assert resizing.largest_allowed(declared(), {}, NOW) is None  # never placed


@pytest.mark.parametrize(
    ("data", "micro_batches", "bounds", "order"),
    [
        # G=24: dp7 runs G=21, so it comes after every degree that keeps 24 (dp5's G=25 breaks
        # the minData rule and is never tried).
        (8, 3, (3, 8), [8, 6, 4, 3, 7]),
        # G=12: every degree from 2 to 4 keeps it, so largest first.
        (4, 3, (2, 4), [4, 3, 2]),
    ],
)
def test_a_placement_tries_the_sizes_that_keep_the_global_batch_first(
    data, micro_batches, bounds, order
):
    spec = loading.parse_spec(
        JobBuilder()
        .layout(data=data, gpus_per_node=1)
        .parallelism(microBatches=micro_batches)
        .checkpoint(claimName="ckpt")
        .run_policy(elastic={"minData": bounds[0], "maxData": bounds[1]})
        .raw()
    )
    tried = [(s.data, s.keeps_global_batch) for s, _ in resizing.candidates(spec)]
    assert [d for d, _ in tried] == order
    keeping = [keeps for _, keeps in tried]
    assert keeping == sorted(keeping, reverse=True)  # no batch-changing size before a keeping one
