"""Step arithmetic of the telemetry: bubble, exposed communication, bus bandwidth, MFU."""

from __future__ import annotations

import math

import pytest

from meshtrain.planner.timing import pipeline_window
from meshtrain.trainer.telemetry import recording, stepstats
from tests.unit import telemetry_feed


def facts(p: int = 2, m: int = 4, v: int = 1, **kw) -> stepstats.JobFacts:
    base = dict(
        stages=p,
        micro_batches=m,
        virtual_stages=v,
        world_size=p,
        group_sizes={"dp": 2, "tp": 1, "pp": p},
        flops_per_token=1.0,
        peak_flops=1.0,
    )
    base.update(kw)
    return stepstats.JobFacts(**base)


@pytest.mark.parametrize(
    "intervals,expected",
    [
        ([], 0.0),
        ([(0, 1)], 1.0),
        ([(0, 1), (2, 3)], 2.0),
        ([(0, 2), (1, 3)], 3.0),
        ([(1, 3), (0, 4), (5, 6)], 5.0),
        ([(0, 1), (1, 2)], 2.0),
    ],
)
def test_union_seconds(intervals, expected):
    assert stepstats.union_seconds(intervals) == pytest.approx(expected)


@pytest.mark.parametrize(
    "op,n,factor",
    [
        ("all_reduce", 1, 0.0),
        ("all_reduce", 2, 1.0),
        ("all_reduce", 8, 1.75),
        ("reduce_scatter", 4, 0.75),
        ("all_gather", 2, 0.5),
        ("broadcast", 4, 1.0),
    ],
)
def test_bus_factor_follows_nccl_tests(op, n, factor):
    assert stepstats.bus_factor(op, n) == pytest.approx(factor)


def test_bus_bandwidth_is_algbw_times_factor():
    # 1 GiB all-reduce over 8 ranks in 0.5 s: algbw 2 GiB/s, busbw 3.5 GiB/s
    assert stepstats.bus_bandwidth("all_reduce", 2**30, 0.5, 8) == pytest.approx(3.5 * 2**30)
    assert stepstats.bus_bandwidth("all_reduce", 2**30, 0.0, 8) == 0.0


def _events(backward_end: float, bucket_ends: list[float]) -> list[recording.Event]:
    out = [
        recording.Event(
            "compute", "backward", backward_end - 1, backward_end, microbatch=0, chunk=0
        )
    ]
    out += [
        recording.Event(
            "collective", "all_reduce", end - 0.5, end, group="dp", nbytes=100, bucket=i
        )
        for i, end in enumerate(bucket_ends)
    ]
    return out


@pytest.mark.parametrize(
    "backward_end,bucket_ends,exposed",
    [
        (10.0, [], 0.0),
        (10.0, [9.0, 9.8], 0.0),
        (10.0, [9.5, 10.5, 12.0], 2.0),
    ],
)
def test_exposed_comm_runs_from_last_backward_to_last_bucket(backward_end, bucket_ends, exposed):
    assert stepstats.exposed_comm(_events(backward_end, bucket_ends)) == pytest.approx(exposed)


def test_tp_collectives_are_never_exposed_dp_time():
    events = _events(10.0, []) + [
        recording.Event("collective", "all_reduce", 10, 11, group="tp", nbytes=8)
    ]
    assert stepstats.exposed_comm(events) == 0.0


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_balanced_pipeline_bubble_equals_theory_on_every_stage(schedule, v, p, m):
    events, seconds = telemetry_feed.simulate_step(schedule, p, m, v, fwd=1.0, bwd=2.0)
    for stage_events in events:
        stats = stepstats.summarise(
            stage_events, facts(p, m, v), step=1, loss=1.0, tokens=10, seconds=seconds, start=0.0
        )
        assert stats.bubble_ratio == pytest.approx(pipeline_window.bubble_ratio(p, m, v))
        assert stats.bubble_ratio_theoretical == pytest.approx((p - 1) / (v * m + p - 1))


def test_exposed_communication_is_not_bubble():
    events, seconds = telemetry_feed.simulate_step(
        "1f1b", 2, 4, fwd=1.0, bwd=2.0, buckets=2, bucket_seconds=0.5
    )
    stage0 = stepstats.summarise(
        events[0], facts(), step=1, loss=1.0, tokens=10, seconds=seconds, start=0.0
    )
    # stage 0 finishes last: 12 compute + 1 exposed of a 16 s step
    assert seconds == pytest.approx(16.0)
    assert stage0.exposed_comm_seconds == pytest.approx(1.0)
    assert stage0.bubble_ratio == pytest.approx(1 - 13 / 16)
    dp = next(c for c in stage0.collectives if c.group == "dp")
    assert (dp.count, dp.nbytes, dp.seconds) == (2, 2 << 20, pytest.approx(1.0))
    assert dp.bus_bandwidth == pytest.approx((2 << 20) / 1.0 * 1.0)  # n = 2: factor 1


def test_the_update_after_the_pipeline_is_reported_apart_from_the_bubble():
    events, seconds = telemetry_feed.simulate_step("gpipe", 2, 4, tail=5.0)
    for stage_events in events:
        stats = stepstats.summarise(
            stage_events, facts(), step=1, loss=1.0, tokens=10, seconds=seconds, start=0.0
        )
        assert stats.bubble_ratio == pytest.approx(1 - 12 / 15)
        assert stats.update_seconds == pytest.approx(5.0)


def test_waiting_in_the_stage_synchronising_all_reduce_is_bubble():
    events, seconds = telemetry_feed.simulate_step("1f1b", 2, 4)
    last_stage = stepstats.summarise(
        events[1], facts(), step=1, loss=1.0, tokens=10, seconds=seconds, start=0.0
    )
    pp = next(c for c in last_stage.collectives if c.group == "pp")
    assert pp.seconds == pytest.approx(2.0)  # stage 1 finishes one backward before stage 0
    assert last_stage.bubble_ratio == pytest.approx(0.2)


def test_mfu_and_throughput():
    stats = stepstats.summarise(
        [],
        facts(world_size=4, flops_per_token=6e6, peak_flops=1e12),
        step=3,
        loss=2.0,
        tokens=8192,
        seconds=0.5,
        start=0.0,
    )
    assert stats.model_flops == pytest.approx(6e6 * 8192)
    assert stats.mfu == pytest.approx(6e6 * 8192 / (0.5 * 4 * 1e12))
    assert stats.tokens_per_second == pytest.approx(16384)


def test_without_a_peak_mfu_is_nan_and_left_out_of_the_log():
    """A GPU no profile names: peak 0 (meshtrain.trainer.telemetry.peak), no MFU rather than 0 or inf."""
    stats = stepstats.summarise(
        [], facts(peak_flops=0.0), step=1, loss=1.0, tokens=8, seconds=0.5, start=0.0
    )
    assert math.isnan(stats.mfu)
    assert "mfu" not in stats.log_record()


def test_log_record_has_the_documented_fields():
    events, seconds = telemetry_feed.simulate_step("1f1b", 2, 4, buckets=1, bucket_seconds=0.1)
    record = stepstats.summarise(
        events[0], facts(), step=1, loss=1.0, tokens=10, seconds=seconds, start=0.0
    ).log_record()
    assert {
        "step",
        "loss",
        "tokens",
        "step_seconds",
        "tokens_per_second",
        "allreduce_seconds",
        "exposed_comm_seconds",
        "bubble_ratio",
        "bubble_ratio_theoretical",
        "mfu",
    } <= set(record)
    assert record["allreduce_seconds"] == pytest.approx(0.1)


def test_theoretical_bubble_falls_with_micro_batches_and_virtual_stages():
    values = [pipeline_window.bubble_ratio(4, m, v) for v in (1, 2) for m in (4, 8, 16)]
    assert values[:3] == sorted(values[:3], reverse=True)
    assert all(values[3 + i] < values[i] for i in range(3))


def test_tp_waits_are_exposed_tp_time_not_pipeline_waits():
    """An overlapped tp collective's flight (launch to seen done) is tp time; only its wait is exposed."""
    events = [
        recording.Event("compute", "forward", 0.0, 10.0, microbatch=0, chunk=0),
        recording.Event("collective", "all_gather", 1.0, 3.0, group="tp", nbytes=8),
        recording.Event("wait", "tp", 2.5, 3.0),  # the matmul hid 1.5 s of the 2 s flight
        recording.Event("collective", "all_reduce", 4.0, 5.0, group="tp", nbytes=8),
        recording.Event("wait", "tp", 4.0, 5.0),  # a blocking one: held for all of it
        recording.Event("wait", "recv", 6.0, 6.25),
    ]
    stats = stepstats.summarise(
        events, facts(), step=1, loss=1.0, tokens=8, seconds=10.0, start=0.0
    )
    assert stats.tp_exposed_seconds == pytest.approx(1.5)
    assert stats.allreduce_seconds("tp") == pytest.approx(3.0)
    assert stats.wait_seconds == pytest.approx(0.25)
    record = stats.log_record()
    assert record["tp_exposed_seconds"] == pytest.approx(1.5)
    assert record["tp_allreduce_seconds"] == pytest.approx(3.0)
    assert record["pipeline_wait_seconds"] == pytest.approx(0.25)
