"""ZeRO-1/2 with the weights' gathers prefetched and ZeRO-2's split buckets, in the planner and the reducer.

* ZeRO-2's buckets as the planner counts them (:func:`meshtrain.planner.comm.zero2_bucket_numels`)
  are the trainer's own (:class:`meshtrain.trainer.parallel.zero.ShardedGradReducer` built on the
  model), and every bucket holds exactly its size, large tensors split over several.
* ``overlap.paramGather`` hides the gathers behind the next forward: the exposed dp time falls, by
  no more than the gathers take and no more than one micro-batch's forward lasts, and the memory
  gains at most one gathered bucket.
"""

from __future__ import annotations

import pytest

from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.planner import comm, estimate, memory, profiles
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import zero
from meshtrain.trainer.telemetry import recording
from tests.builders import JobBuilder


def test_plan_spans_splits_large_tensors_and_keeps_buckets_within_twice_the_size() -> None:
    sizes = [5, 40, 3, 17]
    buckets = zero.plan_spans(sizes, 8, 16)
    held = [sum(n for _, _, n in b) for b in buckets]
    assert all(8 <= h <= 16 for h in held[:-1]) and sum(held) == sum(sizes)
    assert max(held) == 16 and len(buckets) < len(sizes) + 40 // 16  # the 40 split, not shredded
    covered: dict[int, list[tuple[int, int]]] = {}
    for bucket in buckets:
        for index, first, numel in bucket:
            covered.setdefault(index, []).append((first, numel))
    for index, size in enumerate(sizes):  # each tensor once, in order, without gaps
        ends = [first + numel for first, numel in covered[index]]
        assert [first for first, _ in covered[index]] == [0, *ends[:-1]] and ends[-1] == size


@pytest.mark.parametrize("bucket_mb", [25.0, 0.05])
def test_planner_counts_the_zero2_buckets_the_reducer_builds(bucket_mb: float) -> None:
    job = loading.parse_spec(
        JobBuilder.cpu_run().layout(data=2).parallelism(zeroStage=2, bucketMb=bucket_mb).raw()
    )
    model = gpt.GPT(gpt.GPTConfig.from_shape(job.model.shape()))
    reducer = zero.ShardedGradReducer(
        [list(model.parameters())],
        group=None,
        group_size=2,
        bucket_mb=bucket_mb,
        recorder=recording.NullRecorder(),
    )
    built = [sum(n for _, _, n in b.members()) for b in reducer.buckets]
    sizes = [p.numel() for p in model.parameters()]
    assert comm.zero2_bucket_numels([sizes], 4, bucket_mb) == built
    target, cap = comm.zero2_bucket(sum(sizes), 4, bucket_mb)
    assert len(built) > 1 and all(target <= n <= cap for n in built[:-1])
    reducer.remove()


def _plan(stage: int, prefetch: bool) -> tuple[api_spec.TrainingJobSpec, estimate.Plan]:
    """llama3-8b at dp8·tp8 on H100s (the issue's example: most of ZeRO-1's dp time exposed)."""
    raw = (
        JobBuilder()
        .layout(8, 1, 8)
        .model(preset="llama3-8b")
        .training(precision="bf16", microBatch=1, globalBatch=64)
        .parallelism(zeroStage=stage, microBatches=8, overlap={"paramGather": prefetch})
        .raw()
    )
    raw["resources"] = {"gpusPerNode": 8}
    job = loading.parse_spec(raw)
    return job, estimate.make_plan(job, profiles.get("h100-sxm"))


@pytest.mark.parametrize("stage", [1, 2])
def test_prefetched_gathers_hide_behind_the_first_forward(stage: int) -> None:
    (_, off), (job, on) = _plan(stage, False), _plan(stage, True)
    before, after = off.time.stages[0], on.time.stages[0]
    hidden = before.dp_exposed - after.dp_exposed
    assert hidden > 0
    assert after.dp == before.dp  # the same bytes move, later
    assert hidden <= after.forward / 8 * (1 + 1e-9)  # behind one micro-batch's forward at most
    assert hidden < before.dp_exposed
    # memory: at most one gathered bucket (bucketMb and the largest tensor, fp32 weights) more
    shape, scheme = job.model.shape(), on.memory.scheme
    largest = memory.largest_param(shape, 8, first=True, last=True)
    bucket = 25 * 2**20 / scheme.grads + largest
    grown = on.memory.worst.total - off.memory.worst.total
    assert 0 <= grown <= bucket * scheme.weights
