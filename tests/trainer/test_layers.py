"""Parallel layers alone (2 TP ranks) equal their dense counterparts, forward and backward;
the gradient reducer makes one collective per bucket and none before the last micro-batch."""

from __future__ import annotations

import mt_harness
import mt_layer_workers
import pytest


@pytest.fixture(scope="module")
def checks():
    return mt_harness.run_distributed(mt_layer_workers.all_checks, 2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tp", "tp+sp", "tp+overlap", "tp+sp+overlap"])
def test_tensor_parallel_layers_equal_dense(mode, checks):
    for rank, result in enumerate(checks):
        diffs = result[mode]
        assert len(diffs) == 15
        for check, diff in diffs.items():
            assert diff < 1e-5, f"rank {rank}: {check} differs by {diff:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16 overlap", "bf16 sp overlap"])
def test_overlapped_layers_equal_the_serial_ones_under_bf16_autocast(mode, checks):
    """The same bf16 matmuls and bf16 sums over ranks: equal to the serial path, dtypes too."""
    for rank, result in enumerate(checks):
        for check, diff in result[mode].items():
            assert diff == 0.0, f"rank {rank}: {check} differs by {diff:.2e}"


@pytest.mark.slow
def test_reducer_one_collective_per_bucket_after_last_microbatch(checks):
    for result in (r["reducer"] for r in checks):
        assert result["counts"][0] == 0, "gradients were communicated before the last micro-batch"
        assert 1 < result["buckets"] < 120
        assert result["counts"][1] == result["buckets"]
        assert result["grad diff"] < 1e-6


@pytest.mark.slow
def test_gloo_reduce_scatter_and_all_gather_into_tensor_for_fp32_and_bf16(checks):
    """The collectives ZeRO, sequence parallelism and the hierarchical all-reduce call, on this
    torch's gloo (make test-torch-oldest runs it on the oldest supported torch)."""
    for rank, result in enumerate(checks):
        diffs = result["collectives"]
        assert len(diffs) == 4
        for check, diff in diffs.items():
            assert diff == 0.0, f"rank {rank}: {check} differs by {diff:.2e}"
