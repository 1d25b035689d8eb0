"""runPolicy.elastic: which data-parallel degrees a job may run at, and the accumulation that keeps
its global batch (the batch is recomputed from the resized spec, not restated here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshtrain.api import elastic, loading
from tests.builders import JobBuilder


def job(data=4, micro_batches=2, micro_batch=1, bounds=(1, 4), per_node=1, **parallelism):
    builder = (
        JobBuilder()
        .layout(data=data, gpus_per_node=per_node)
        .parallelism(microBatches=micro_batches, **parallelism)
        .training(microBatch=micro_batch)
    )
    if bounds is not None:
        builder.checkpoint(claimName="ckpt").run_policy(
            elastic={"minData": bounds[0], "maxData": bounds[1]}
        )
    return loading.parse_spec(builder.raw())


def test_degrees_run_largest_first_within_the_bounds():
    spec = job(data=4, micro_batches=6, bounds=(2, 6))
    assert [s.data for s in elastic.sizes(spec)] == [6, 5, 4, 3, 2]


def test_without_elastic_only_the_declared_degree():
    spec = job(data=4, bounds=None)
    assert [s.data for s in elastic.sizes(spec)] == [4]


@pytest.mark.parametrize("data", [1, 2, 3, 4, 6, 8])
def test_resized_spec_keeps_the_global_batch_where_it_divides(data):
    spec = job(data=4, micro_batches=6, micro_batch=2, bounds=(1, 8))  # global batch 48
    size = elastic.size_at(spec, data)
    assert size is not None and size.keeps_global_batch
    running = elastic.resized(spec, size)
    assert running.parallelism.data == data
    assert running.global_batch == spec.global_batch == 48
    assert loading.parse_spec(running.model_dump(by_alias=True, exclude_none=True)) == running


def test_a_degree_that_does_not_divide_states_the_new_batch_and_rate():
    spec = loading.parse_spec(
        JobBuilder()
        .layout(data=4, gpus_per_node=1)
        .parallelism(microBatches=2)
        .training(
            microBatch=1, learningRate=1e-3, lrScaling={"rule": "linear", "referenceBatch": 8}
        )
        .checkpoint(claimName="ckpt")
        .run_policy(elastic={"minData": 2, "maxData": 4})
        .raw()
    )
    size = elastic.size_at(spec, 3)
    assert size is not None and not size.keeps_global_batch
    running = elastic.resized(spec, size)
    assert (
        running.global_batch == size.global_batch == 9
    )  # 3 x round(8 / 3): the nearest whole accumulation
    status = elastic.status_of(spec, size, checkpoint_step=40)
    assert status is not None
    # training.lrScaling is applied to the batch the resized gang runs: linear, 9 / 8.
    assert status.learning_rate == pytest.approx(
        running.training.learning_rates(running.parallelism)[0]
    )
    assert status.learning_rate == pytest.approx(1e-3 * 9 / 8)
    assert (
        "global batch 8 -> 9" in status.message
        and "learning rate 0.001 -> 0.00113" in status.message
    )


def test_degrees_that_leave_a_partial_pod_are_skipped():
    spec = job(data=4, micro_batches=2, per_node=2, bounds=(2, 4))
    assert [s.data for s in elastic.sizes(spec)] == [4, 2]


def test_interleaved_accumulation_stays_a_multiple_of_the_pipeline():
    spec = loading.parse_spec(
        JobBuilder()
        .layout(data=4, pipeline=2, gpus_per_node=1)
        .parallelism(microBatches=4, schedule="interleaved-1f1b", virtualStages=2)
        .checkpoint(claimName="ckpt")
        .run_policy(elastic={"minData": 1, "maxData": 4})
        .raw()
    )
    for size in elastic.sizes(spec):
        assert size.micro_batches % 2 == 0
        running = elastic.resized(spec, size)
        assert loading.parse_spec(running.model_dump(by_alias=True, exclude_none=True))


def test_the_running_spec_follows_the_status_and_the_declared_one_without_it():
    spec = job(data=4, micro_batches=2, bounds=(2, 4))
    size = elastic.size_at(spec, 2)
    status = elastic.status_of(spec, size, None)
    assert elastic.running_spec(spec, status).parallelism.micro_batches == 4
    assert elastic.running_spec(spec, None) is spec
    assert elastic.status_of(spec, elastic.size_at(spec, 4), None) is None


@pytest.mark.parametrize(
    "bounds,path,words",
    [
        ((5, 3), "spec.runPolicy.elastic.minData", "minData=5 is above elastic.maxData=3"),
        ((1, 3), "spec.runPolicy.elastic", "parallelism.data=4 is outside"),
        ((3, 4), "spec.runPolicy.elastic.minData", "minData=3 cannot keep the global batch 4"),
    ],
)
def test_bad_bounds_are_refused_naming_the_field(bounds, path, words):
    with pytest.raises(loading.SpecError) as err:
        job(data=4, micro_batches=1, bounds=bounds)  # global batch 4: 3 does not divide it
    assert any(p.path == path and words in p.message for p in err.value.problems), (
        err.value.problems
    )


def test_resizing_without_a_checkpoint_claim_is_refused_naming_the_field():
    raw = JobBuilder().layout(data=4, gpus_per_node=1).parallelism(microBatches=2)
    with pytest.raises(loading.SpecError) as err:
        loading.parse_spec(raw.run_policy(elastic={"minData": 2, "maxData": 4}).raw())
    assert any(
        p.path == "spec.checkpoint.claimName" and "give checkpoint.claimName" in p.message
        for p in err.value.problems
    ), err.value.problems
    loading.parse_spec(raw.run_policy(elastic={"minData": 4, "maxData": 4}).raw())  # never resizes


def test_the_elastic_example_runs_at_dp8_or_dp4_with_its_batch():
    example = Path(__file__).parents[2] / "manifests" / "examples" / "gpt-1.3b-dp8-tp2.yaml"
    _, spec = loading.load_manifest(example)
    # dp5-7 would leave part of an 8-GPU node (tp2): only whole-node degrees remain.
    assert [(s.data, s.micro_batches, s.global_batch) for s in elastic.sizes(spec)] == [
        (8, 8, spec.global_batch),
        (4, 16, spec.global_batch),
    ]


def test_under_lr_scaling_none_a_changed_batch_scales_the_stated_rate_by_the_batch_ratio():
    """What the trainer will do (trainer.batch_change) is what status.elastic says."""
    spec = loading.parse_spec(
        JobBuilder()
        .layout(data=4, gpus_per_node=1)
        .parallelism(microBatches=2)
        .training(microBatch=1, learningRate=1e-3)
        .checkpoint(claimName="ckpt")
        .run_policy(elastic={"minData": 2, "maxData": 4})
        .raw()
    )
    size = elastic.size_at(spec, 3)
    status = elastic.status_of(spec, size, checkpoint_step=40)
    assert status is not None and size.global_batch == 9
    assert status.learning_rate == pytest.approx(1e-3 * 9 / 8)
    assert "the batch ratio, training.lrScaling is none" in status.message
    assert "ramped up" in status.message  # 9 > 8: the trainer ramps the larger rate in
