"""training.lrScaling: the learning rate follows the global batch (Goyal et al. 2017: linear
with warmup; the square-root rule for Adam-style optimizers), also after a layout change."""

from __future__ import annotations

import pytest

from meshtrain.api import layout as layout_mod
from meshtrain.api import loading
from meshtrain.trainer.telemetry.recorder import make_recorder
from tests.builders import JobBuilder
from tests.unit import telemetry_feed
from tests.unit.test_telemetry_exporter import families, free_base


def spec(data: int, rule: str = "linear", reference: int | None = 8, port: int = 0):
    scaling = {"rule": rule} | ({"referenceBatch": reference} if reference else {})
    builder = (
        JobBuilder()
        .layout(data=data)
        .parallelism(microBatches=4)
        .training(
            microBatch=2, learningRate=1e-3, minLearningRate=1e-4, warmupSteps=10, lrScaling=scaling
        )
    )
    if port:
        builder.metrics(port=port)
    return loading.parse_spec(builder.raw())


@pytest.mark.parametrize(
    "rule,data,factor",
    [
        ("none", 4, 1.0),
        ("linear", 1, 1.0),  # 2 x 4 x 1 = 8 sequences: the reference batch itself
        ("linear", 2, 2.0),
        ("linear", 4, 4.0),
        ("sqrt", 4, 2.0),
    ],
)
def test_peak_and_minimum_scale_with_the_global_batch(rule, data, factor):
    job = spec(data, rule)
    peak, minimum = job.training.learning_rates(job.parallelism)
    assert peak == pytest.approx(1e-3 * factor)
    assert minimum == pytest.approx(1e-4 * factor)


def test_a_layout_change_that_doubles_the_batch_doubles_the_rate():
    before, after = spec(2), spec(4)  # kubectl patch ... data: 4
    assert after.global_batch == 2 * before.global_batch
    ratio = (
        after.training.learning_rates(after.parallelism)[0]
        / before.training.learning_rates(before.parallelism)[0]
    )
    assert ratio == pytest.approx(2.0)


def test_linear_scaling_without_a_reference_batch_is_refused_naming_the_field():
    with pytest.raises(loading.SpecError) as err:
        spec(2, reference=None)
    [problem] = err.value.problems
    assert problem.path == "spec.training.lrScaling.referenceBatch"
    assert "referenceBatch is empty" in problem.message and "16" in problem.message


def test_the_exported_learning_rate_is_the_scaled_schedule(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_JOB_NAME", "lr")
    base = free_base(1)
    job = spec(4, port=base)
    layout = layout_mod.ParallelLayout(data=1, pipeline=1, tensor=1)
    recorder = make_recorder(job, layout, 0, tmp_path, local_rank=0)
    try:
        events, seconds = telemetry_feed.simulate_step(
            "1f1b", 1, 4, fwd=0.01, bwd=0.02, buckets=1, bucket_seconds=0.001
        )
        telemetry_feed.feed(recorder, 3, events[0], seconds, origin=1.0, tokens=1024)
        [sample] = families(base, 0)["meshtrain_learning_rate"].samples
        # Step 3 of a 10-step warmup to the linearly scaled peak: 4 x 1e-3 x 3/10.
        assert sample.value == pytest.approx(4e-3 * 3 / 10)
    finally:
        recorder.close()
