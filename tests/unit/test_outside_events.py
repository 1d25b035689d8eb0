"""loop_trace.outside_events and step_loop_run.between_share: the step loop's seconds between a rank's recorded events."""

from __future__ import annotations

import dataclasses

import pytest

from meshtrain.api import loading
from meshtrain.planner import profiles
from meshtrain.trainer.calibration import step_loop
from meshtrain.trainer.telemetry import loop_trace
from tests.builders import JobBuilder


def test_outside_events_counts_the_uncovered_seconds_up_to_the_last_event() -> None:
    events = [
        {"what": "compute", "kind": "forward", "start": 0.5, "end": 2.0},
        {"what": "wait", "kind": "recv", "start": 1.5, "end": 3.0},  # overlaps the forward
        {"what": "compute", "kind": "backward", "start": 4.0, "end": 6.0},
        {"what": "collective", "kind": "all_reduce", "start": 6.5, "end": 7.0},
    ]
    # uncovered: [0, 0.5], [3, 4], [6, 6.5] -> 0.5 + 1 + 0.5
    assert loop_trace.outside_events(events) == pytest.approx(2.0)
    assert loop_trace.outside_events([]) == 0.0


def test_between_share_converts_the_median_rank_wall_seconds_at_the_shared_rate() -> None:
    # Two single-thread ranks receiving 1 core together: each runs at 0.5 CPU s/s
    # while both are runnable.  Median rank outside events 0.004 s wall -> 0.002 CPU s,
    # a quarter of a 0.008 CPU s loop; with no loop measured, all of it is between.
    job = loading.parse_spec(
        JobBuilder().layout(2, 1, 1).model(preset="tiny", layers=2, hidden=32, heads=2).raw(),
        "share",
    )
    profile = dataclasses.replace(profiles.get("cpu"), cores=2, available_cores=1.0)
    run = {"outside_events_seconds": {"0": 0.002, "1": 0.004, "2": 0.006}}
    assert step_loop.between_share(run, job, profile, 0.008) == pytest.approx(0.25)
    assert step_loop.between_share(run, job, profile, 0.001) == 1.0  # capped
    assert step_loop.between_share({}, job, profile, 0.008) == 1.0
