"""Pipeline schedules as pure action lists: complete, ordered, deadlock-free, with the textbook bubble."""

from __future__ import annotations

import itertools

import pytest

from meshtrain.planner.timing import pipeline_window
from meshtrain.trainer.parallel import schedules

CASES = (
    [("gpipe", p, m, 1) for p, m in [(1, 1), (2, 4), (4, 4), (4, 8), (3, 5)]]
    + [("1f1b", p, m, 1) for p, m in [(1, 3), (2, 4), (4, 4), (4, 8), (3, 5), (4, 2)]]
    + [
        ("interleaved-1f1b", p, m, v)
        for p, m, v in [(2, 4, 2), (4, 4, 2), (4, 8, 2), (2, 4, 3), (3, 6, 2)]
    ]
)


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_every_microbatch_and_chunk_once_forward_before_backward(schedule, p, m, v):
    for stage in range(p):
        acts = schedules.actions(schedule, p, m, stage, v)
        expected = {
            (k, mb, c) for k in ("forward", "backward") for mb in range(m) for c in range(v)
        }
        assert sorted((a.kind, a.microbatch, a.chunk) for a in acts) == sorted(expected)
        seen = set()
        for a in acts:
            if a.kind == "backward":
                assert (a.microbatch, a.chunk) in seen, f"stage {stage}: {a} before its forward"
            seen.add((a.microbatch, a.chunk))


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_simulated_bubble_equals_theory(schedule, p, m, v):
    timeline = schedules.simulate(schedule, p, m, v)
    span = max(t for stage in timeline for t, _ in stage) + 1
    busy = 2 * m * v  # unit-time actions per stage
    assert 1 - busy / span == pytest.approx(pipeline_window.bubble_ratio(p, m, v))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (3, 7)])
def test_1f1b_bounds_activations_in_flight(p, m):
    for stage in range(p):
        live, peak = 0, 0
        for a in schedules.actions("1f1b", p, m, stage):
            live += 1 if a.kind == "forward" else -1
            peak = max(peak, live)
        assert peak == min(p - stage, m)
    gpipe_peak = max(
        itertools.accumulate(
            1 if a.kind == "forward" else -1 for a in schedules.actions("gpipe", p, m, 0)
        )
    )
    assert gpipe_peak == m


def test_1f1b_first_stage_order():
    names = [str(a) for a in schedules.actions("1f1b", 4, 6, 0)]
    assert names == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]


def test_interleaved_chunks_are_megatron_virtual_stages():
    assert schedules.virtual_stage(stage=1, chunk=1, stages=4) == 5
    first = [str(a) for a in schedules.actions("interleaved-1f1b", 2, 4, 0, 2)[:4]]
    assert first == ["F0", "F1", "F0.1", "F1.1"]


def test_last_backward_per_chunk():
    acts = schedules.actions("interleaved-1f1b", 2, 4, 1, 2)
    last = schedules.last_backward(acts)
    assert {c: a.microbatch for c, a in last.items()} == {0: 3, 1: 3}


def test_bubble_formula_values():
    assert pipeline_window.bubble_ratio(4, 8) == pytest.approx(3 / 11)
    assert pipeline_window.bubble_ratio(4, 8, 2) == pytest.approx(3 / 19)
    assert pipeline_window.bubble_ratio(1, 8) == 0


@pytest.mark.parametrize(
    "bad",
    [
        dict(schedule="zigzag"),
        dict(schedule="interleaved-1f1b", v=1),
        dict(schedule="interleaved-1f1b", v=2, m=3),
        dict(schedule="1f1b", stage=5),
    ],
)
def test_bad_arguments_refused(bad):
    with pytest.raises(ValueError):
        schedules.actions(bad["schedule"], 2, bad.get("m", 4), bad.get("stage", 0), bad.get("v", 1))
