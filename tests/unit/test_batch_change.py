"""A run resumed at another global batch: the learning-rate multiplier and its ramp (trainer.batch_change)."""

from __future__ import annotations

import pytest

from meshtrain.api import loading
from meshtrain.trainer.optim import batch_change, lr_schedule
from meshtrain.trainer.telemetry import stepstats
from tests.builders import JobBuilder


def spec(data, micro_batches, scaling=None, warmup=10):
    training = {"microBatch": 2, "learningRate": 1e-3, "minLearningRate": 1e-4}
    training["warmupSteps"] = warmup
    if scaling:
        training["lrScaling"] = scaling
    return loading.parse_spec(
        JobBuilder()
        .layout(data=data, gpus_per_node=1)
        .parallelism(microBatches=micro_batches)
        .training(**training)
        .raw()
    )


def saved_at(job, step, plan=None):
    return batch_change.saved_record(
        job.training, job.parallelism, plan or batch_change.LrPlan(), step
    )


def test_the_same_batch_at_another_degree_changes_no_rate():
    before, after = spec(2, 2), spec(1, 4)  # 2 x 2 x 2 = 1 x 4 x 2 = 8
    resumed = batch_change.on_resume(after.training, after.parallelism, saved_at(before, 40), 40)
    assert resumed is not None and resumed.plan.multiplier(41) == 1.0
    assert resumed.record["global_batch"] == resumed.record["from_global_batch"] == 8
    assert "global batch kept at 8" in resumed.message


def test_an_unchanged_run_has_no_plan():
    job = spec(2, 2)
    assert batch_change.on_resume(job.training, job.parallelism, saved_at(job, 40), 40) is None
    assert (
        batch_change.on_resume(job.training, job.parallelism, None, 40) is None
    )  # older checkpoint


def test_a_smaller_batch_drops_the_rate_by_the_batch_ratio_at_once():
    before, after = spec(2, 2), spec(1, 2)  # batch 8 -> 4
    resumed = batch_change.on_resume(after.training, after.parallelism, saved_at(before, 40), 40)
    assert resumed is not None
    assert [resumed.plan.multiplier(s) for s in (41, 45, 90)] == [0.5, 0.5, 0.5]
    assert resumed.record["ramp_steps"] == 0 and "8 -> 4" in resumed.message


def test_a_larger_batch_ramps_up_at_the_warmups_slope():
    before, after = (
        spec(1, 2),
        spec(2, 2),
    )  # batch 4 -> 8: twice the rate, over 10 x (1 - 1/2) steps
    resumed = batch_change.on_resume(after.training, after.parallelism, saved_at(before, 40), 40)
    assert resumed is not None and resumed.record["ramp_steps"] == 5
    ramp = [resumed.plan.multiplier(s) for s in range(41, 47)]
    assert ramp == pytest.approx([2 * (0.5 + 0.5 * k / 5) for k in range(1, 6)] + [2.0])
    assert "ramped linearly over steps 41..45" in resumed.message


def test_a_restart_in_the_middle_of_a_ramp_goes_on_from_the_rate_it_had():
    small, large = spec(1, 2), spec(2, 2)
    first = batch_change.on_resume(large.training, large.parallelism, saved_at(small, 40), 40)
    assert first is not None
    saved = saved_at(large, 42, first.plan)  # saved after step 42 of the ramp: 0.8 of the target
    again = batch_change.on_resume(large.training, large.parallelism, saved, 42)
    assert again is not None and again.plan.scale == 2.0
    assert again.plan.multiplier(42) == pytest.approx(first.plan.multiplier(42))
    assert again.plan.multiplier(45) == 2.0


def test_a_batch_change_and_back_restores_the_declared_rate():
    large, small = spec(2, 2), spec(1, 2)
    down = batch_change.on_resume(small.training, small.parallelism, saved_at(large, 40), 40)
    assert down is not None
    back = batch_change.on_resume(
        large.training, large.parallelism, saved_at(small, 60, down.plan), 60
    )
    assert back is not None and back.plan.scale == pytest.approx(1.0)


@pytest.mark.parametrize("rule,factor", [("linear", 2.0), ("sqrt", 2**0.5)])
def test_a_scaling_rule_already_follows_the_batch_and_gets_only_the_ramp(rule, factor):
    scaling = {"rule": rule, "referenceBatch": 4}
    before, after = spec(1, 2, scaling), spec(2, 2, scaling)  # 4 -> 8
    resumed = batch_change.on_resume(after.training, after.parallelism, saved_at(before, 40), 40)
    assert resumed is not None and resumed.plan.scale == 1.0
    peak = after.training.learning_rates(after.parallelism)[0]
    assert peak == pytest.approx(1e-3 * factor)
    assert resumed.plan.multiplier(41) < 1.0 and resumed.plan.multiplier(60) == 1.0
    assert resumed.record["peak_learning_rate"] == pytest.approx(peak)


def test_without_warmup_a_larger_rate_applies_at_once():
    before, after = spec(1, 2, warmup=0), spec(2, 2, warmup=0)
    resumed = batch_change.on_resume(after.training, after.parallelism, saved_at(before, 40), 40)
    assert resumed is not None and resumed.plan.multiplier(41) == 2.0


def test_the_engine_rate_is_the_schedule_times_the_multiplier():
    """What the engine sets (optim.lr_at x multiplier) at a step after the resume."""
    before, after = spec(1, 2), spec(2, 2)
    resumed = batch_change.on_resume(after.training, after.parallelism, saved_at(before, 40), 40)
    assert resumed is not None
    t = after.training
    schedule = lr_schedule.lr_at(43, peak=1e-3, minimum=1e-4, warmup=t.warmup_steps, total=t.steps)
    assert schedule * resumed.plan.multiplier(43) == pytest.approx(schedule * 2 * 0.8)


def test_the_exported_rate_follows_the_plan():
    """meshtrain_learning_rate is JobFacts.learning_rate: the schedule times the resumed plan."""
    plan = batch_change.LrPlan(scale=2.0, ramp_from=0.5, start=40, steps=5)
    facts = stepstats.JobFacts(
        stages=1,
        micro_batches=1,
        virtual_stages=1,
        world_size=1,
        group_sizes={},
        flops_per_token=1.0,
        peak_flops=1.0,
        training_steps=100,
        peak_learning_rate=1e-3,
        min_learning_rate=1e-4,
        warmup_steps=10,
        lr_plan=plan,
    )
    expected = lr_schedule.lr_at(42, peak=1e-3, minimum=1e-4, warmup=10, total=100) * 2 * 0.7
    assert facts.learning_rate(42) == pytest.approx(expected)
