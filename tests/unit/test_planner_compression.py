"""The planner's gradient-compression model: the exact warm-up, ZeRO-2's compressed reduce-scatter, ZeRO-3's casts.

The trainer's side of each prediction (collectives call for call) is checked on real runs in
tests/trainer/test_compression_zero.py and test_planner_vs_trainer.py; here, what the planner
derives from it: a warm-up step is the uncompressed job's step, a run's bytes count the warm-up at
the exact price, ZeRO-2's int8/topk/powersgd exchange, which runs inline in backward after every
micro-batch, is all exposed, and its 16-bit casts overlap backward as its plain reduce-scatter does.
"""

from __future__ import annotations

import pytest

from meshtrain.api import loading
from meshtrain.planner import comm, estimate, gradient_compression, precision, profiles
from tests.builders import JobBuilder


def _job(stage: int, mode: dict, micro: int = 1, **extra: object):
    raw = (
        JobBuilder()
        .layout(16, 1, 1, gpus_per_node=8)
        .model(preset="1.3b")
        .parallelism(zeroStage=stage, gradientCompression=mode, microBatches=micro, **extra)
        .training(microBatch=64)
        .raw()
    )
    return loading.parse_spec(raw)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_warmup_step_is_the_uncompressed_jobs_step(stage: int) -> None:
    compressed = _job(stage, {"mode": "powersgd", "rank": 8, "warmupSteps": 10})
    plain = _job(stage, {"mode": "none"})
    warm = comm.stage_comm(compressed, 0, precision.FP32, warmup=True)
    exact = comm.stage_comm(plain, 0, precision.FP32)
    if stage < 2:
        assert warm == exact
    else:  # the compressing reducer buckets whole tensors (PowerSGD needs whole matrices), the
        # plain ZeRO-2 one cuts large tensors: the same exact collectives and bytes, other calls
        assert {k: c.nbytes for k, c in warm.by_key().items()} == {
            k: c.nbytes for k, c in exact.by_key().items()
        }
    after = comm.stage_comm(compressed, 0, precision.FP32)
    assert sum(c.nbytes for c in after.collectives if c.group == "dp") < sum(
        c.nbytes for c in warm.collectives if c.group == "dp"
    )


def test_a_runs_bytes_count_the_warmup_at_the_exact_price() -> None:
    job = _job(0, {"mode": "powersgd", "rank": 8, "warmupSteps": 10})
    compression = job.parallelism.gradient_compression
    assert [gradient_compression.in_warmup(compression, s) for s in (1, 10, 11)] == [
        True,
        True,
        False,
    ]
    assert gradient_compression.run_bytes(compression, 4.0, 1.0, 100) == 10 * 4.0 + 90 * 1.0
    assert gradient_compression.run_bytes(compression, 4.0, 1.0, 5) == 5 * 4.0


@pytest.mark.parametrize("mode", ["int8", "powersgd"])
def test_zero2s_compressed_reduce_scatter_is_priced_exposed_and_smaller(mode: str) -> None:
    h100 = profiles.get("h100-sxm")
    # the weights' all-gathers serial (overlap.paramGather off), so what is hidden is the reduction's
    serial = {"overlap": {"paramGather": False}}
    compressed = estimate.make_plan(_job(2, {"mode": mode}, **serial), h100).time.stages[0]
    plain = estimate.make_plan(_job(2, {"mode": "none"}, **serial), h100).time.stages[0]
    assert compressed.dp_exposed == pytest.approx(compressed.dp, rel=1e-12)  # inline in backward
    assert compressed.dp < plain.dp


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
@pytest.mark.parametrize("micro", [1, 4])
def test_zero2s_cast_is_its_overlapped_reduce_scatter_at_half_the_bytes(
    mode: str, micro: int
) -> None:
    """The casts ride ZeRO-2's asynchronous launch: the plain job's collectives in 2-byte elements,
    overlapped with backward as the plain reduce-scatters are (not all exposed)."""
    cast_job, plain_job = _job(2, {"mode": mode}, micro), _job(2, {"mode": "none"}, micro)
    cast = comm.stage_comm(cast_job, 0, precision.FP32).by_key()
    plain = comm.stage_comm(plain_job, 0, precision.FP32).by_key()
    rs = cast["dp", "reduce_scatter"]
    assert 2 * rs.nbytes == plain["dp", "reduce_scatter"].nbytes
    assert not rs.after_backward  # calls differ: the compressing reducer keeps whole tensors
    h100 = profiles.get("h100-sxm")
    timed = estimate.make_plan(cast_job, h100).time.stages[0]
    assert timed.dp_exposed < timed.dp


def test_zero2s_inline_compressed_traffic_is_counted_per_micro_batch() -> None:
    one = comm.stage_comm(_job(2, {"mode": "int8"}), 0, precision.FP32).by_key()
    four = comm.stage_comm(_job(2, {"mode": "int8"}, 4), 0, precision.FP32).by_key()
    assert four["dp", "all_to_all"].nbytes == 4 * one["dp", "all_to_all"].nbytes
    assert four["dp", "all_to_all"].calls == 4 * one["dp", "all_to_all"].calls


def test_zero3s_cast_halves_the_reduce_scatter() -> None:
    cast = comm.stage_comm(_job(3, {"mode": "bf16"}), 0, precision.FP32).by_key()
    plain = comm.stage_comm(_job(3, {"mode": "none"}), 0, precision.FP32).by_key()
    assert 2 * cast["dp", "reduce_scatter"].nbytes == plain["dp", "reduce_scatter"].nbytes
    assert cast["dp", "all_gather"] == plain["dp", "all_gather"]
