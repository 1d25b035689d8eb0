"""The fault benchmark's reading of a step log: next step after a fault, steps lost, goodput."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import fault_analysis as fa


def _run(*segments: tuple[int, int, float]) -> list[fa.StepRecord]:
    """Steps ``first..last`` one second apart each, the segment starting at ``begin``."""
    out = []
    for first, last, begin in segments:
        out += [
            fa.StepRecord(step, begin + (step - first + 1) * 1.0, 0.8)
            for step in range(first, last + 1)
        ]
    return out


def test_a_rebuild_that_resumes_from_an_older_checkpoint_recomputes_the_steps_since() -> None:
    # steps 1..18 end at t=1..18; fault at 18.5; resumed from step 15 at t=40: 16 ends at 41
    records = _run((1, 18, 0.0), (16, 30, 40.0))
    cost = fa.fault_cost(records, 18.5, fa.usual_gap(records))
    assert (cost.last_step_before, cost.resumed_after, cost.steps_lost) == (18, 15, 3)
    assert cost.seconds_to_next_step == pytest.approx(41.0 - 18.5)


def test_steps_the_old_run_finished_after_the_fault_are_not_the_recovery() -> None:
    # a graceful stop: the step in flight (19) ends after the fault, then a stall, then 20
    records = _run((1, 19, 0.0), (20, 30, 50.0))
    cost = fa.fault_cost(records, 18.5, fa.usual_gap(records))
    assert (cost.resumed_after, cost.steps_lost) == (19, 0)
    assert cost.next_step_at == pytest.approx(51.0)


def test_no_recovery_in_the_log_is_reported_as_none() -> None:
    records = _run((1, 18, 0.0))
    cost = fa.fault_cost(records, 18.5, fa.usual_gap(records))
    assert cost.next_step_at is None and cost.steps_lost is None


def test_goodput_counts_each_step_once_over_the_whole_wall_time() -> None:
    records = _run((1, 18, 0.0), (16, 30, 40.0))
    good = fa.goodput(records)
    assert good.recomputed_steps == 3
    assert good.productive_seconds == pytest.approx(30 * 0.8)
    assert good.wall_seconds == pytest.approx(55.0 - 0.2)
    assert good.ratio == pytest.approx(24.0 / 54.8)


def test_the_log_reader_skips_a_partial_last_line(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    log.write_text(json.dumps({"step": 1, "time": 5.0, "step_seconds": 0.5}) + '\n{"step": 2, "ti')
    assert fa.step_records(fa.read_jsonl(log)) == [fa.StepRecord(1, 5.0, 0.5)]
    assert fa.read_jsonl(tmp_path / "absent.jsonl") == []


def test_the_tail_parses_only_what_was_appended(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    tail = fa.Tail(log)
    assert tail.read() == []
    log.write_text(json.dumps({"step": 1, "time": 5.0, "step_seconds": 0.5}) + '\n{"step": 2,')
    assert [r.step for r in tail.read()] == [1]
    log.write_text(log.read_text() + ' "time": 6.0, "step_seconds": 0.5}\n')
    assert [r.step for r in tail.read()] == [1, 2]


def test_the_trainers_recovery_record_of_a_fault_is_the_one_detected_after_it() -> None:
    records = _run((1, 18, 0.0), (18, 30, 21.0))
    cost = fa.fault_cost(records, 18.5, fa.usual_gap(records))
    assert cost.resumed_after == 17 and cost.steps_lost == 1
    earlier = {"detectedAt": 10.0, "tier": "process"}
    this = {"detectedAt": 19.0, "tier": "process", "source": "memory"}
    assert fa.recovery_for([earlier, this], cost) == this
    assert fa.recovery_for([earlier], cost) is None


def test_slow_steps_are_no_stall_but_the_idle_time_of_a_recovery_is() -> None:
    # ten-second steps with 0.1 s between them; a fault at 35 and 6 s idle before step 5
    records = [fa.StepRecord(s, s * 10.1, 10.0) for s in range(1, 5)]
    records += [fa.StepRecord(s, 6.0 + s * 10.1, 10.0) for s in range(5, 9)]
    cost = fa.fault_cost(records, 35.0, fa.usual_gap(records))
    assert (cost.resumed_after, cost.steps_lost) == (4, 0)
    assert cost.next_step_at == pytest.approx(6.0 + 50.5)


def test_a_recovery_in_place_faster_than_the_stall_floor_is_still_the_recovery() -> None:
    """Measured in the sandbox: a worker killed after step 18 was restarted in place and its
    state restored from memory; step 19 began 1.4 s after step 18 ended, under the 2 s floor
    that keeps a slow step elsewhere from passing for a stall."""
    steps = [fa.StepRecord(s, 10.0 + s * 0.5, 0.49) for s in range(1, 19)]
    end_18 = steps[-1].end
    resumed = [fa.StepRecord(s, end_18 + 1.4 + (s - 18) * 0.5, 0.49) for s in range(19, 30)]
    records = steps + resumed
    cost = fa.fault_cost(records, end_18 + 0.2, fa.usual_gap(records))
    assert (cost.resumed_after, cost.steps_lost) == (18, 0)
    assert cost.next_step_at == pytest.approx(resumed[0].end)
    # the same idle time away from the fault is no stall
    later = fa.fault_cost(records, resumed[3].end + 0.001, fa.usual_gap(records))
    assert later.next_step_at is None
