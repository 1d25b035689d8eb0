"""The planner's exposed tensor-parallel time against the trainer's chunk schedule, simulated."""

from __future__ import annotations

import pytest

from meshtrain.api import loading
from meshtrain.planner import comm, precision
from meshtrain.planner.timing import network, stage_work, tp_overlap
from tests.builders import JobBuilder


def _simulated_exposure(collective: float, matmul: float, chunks: int) -> float:
    """What the trainer's schedule leaves exposed, by simulation: with one chunk the collective
    runs beside an independent matmul (the column-parallel input gradient's all-reduce beside the
    weight gradient, tensor_overlap._CopyLinear); with k, chunk i's collective follows chunk i's
    matmul and chunk i-1's collective (the row-parallel forward, _LinearAllReduce)."""
    if chunks == 1:
        return max(collective, matmul) - matmul
    end = 0.0
    for i in range(1, chunks + 1):
        end = max(i * matmul / chunks, end) + collective / chunks
    return end - matmul


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize(("collective", "matmul"), [(1.0, 3.0), (3.0, 1.0), (2.0, 2.0), (0.5, 0.0)])
def test_exposure_matches_the_chunk_schedule(collective: float, matmul: float, chunks: int) -> None:
    assert tp_overlap.exposed(collective, matmul, chunks) == pytest.approx(
        _simulated_exposure(collective, matmul, chunks)
    )


LAYERS, HIDDEN, FFN, SEQ, MICRO_BATCHES, TP = 2, 64, 256, 64, 2, 2


def _stage(overlap: bool, rank_flops: float) -> tuple[stage_work.StageTime, int]:
    """tp2 without SP on one stage at made-up prices (a 1 GB/s link without latency,
    ``rank_flops`` matmuls), and the micro-batch size."""
    raw = (
        JobBuilder()
        .layout(tensor=TP)
        .model(layers=LAYERS, hidden=HIDDEN, heads=4, seqLen=SEQ, ffnHidden=FFN)
        .parallelism(microBatches=MICRO_BATCHES, overlap={"tensor": overlap})
        .raw()
    )
    job = loading.parse_spec(raw)
    link = network.Link("nvlink", 1e9, 0.0)
    prices = stage_work.Prices(rank_flops, 0.0, 1e12, {"dp": link, "tp": link, "pp": link}, link)
    time = stage_work.price(job, comm.stage_comm(job, 0, precision.FP32), prices)
    return time, job.training.micro_batch


@pytest.mark.parametrize("rank_flops", [1e6, 1e9, 1e15])
def test_the_column_input_gradient_all_reduce_is_one_chunk_beside_the_weight_gradient(
    rank_flops: float,
) -> None:
    """Without SP the exposed tp time of the linears is the row outputs' all-reduces in k chunks
    beside the row matmuls plus the column input gradients' all-reduce in one piece beside the
    column weight gradients (tensor_overlap._CopyLinear), each from the simulated schedule."""
    (serial, b), (overlapped, _) = _stage(False, rank_flops), _stage(True, rank_flops)
    tokens, k = b * SEQ, 2  # 64 tokens: layout.TP_OVERLAP_CHUNKS chunks
    sums = LAYERS * MICRO_BATCHES * 2  # per block and micro-batch: two linears of each kind
    # one (B, T, H) fp32 all-reduce over 2 ranks moves its bytes once: bytes / bandwidth
    rows = columns = sums * tokens * HIDDEN * 4 / 1e9
    # forward: attention and MLP output projections; backward: QKV and MLP-in weight gradients
    row_matmuls = 2 * tokens * (HIDDEN * HIDDEN + FFN * HIDDEN) / TP * LAYERS * MICRO_BATCHES
    column_matmuls = 2 * tokens * (3 * HIDDEN * HIDDEN + FFN * HIDDEN) / TP * LAYERS * MICRO_BATCHES
    expected = _simulated_exposure(rows, row_matmuls / rank_flops, k) + _simulated_exposure(
        columns, column_matmuls / rank_flops, 1
    )
    assert overlapped.tp == pytest.approx(serial.tp)  # the same bytes; the rest stays blocking
    assert overlapped.tp_exposed == pytest.approx(serial.tp - rows - columns + expected)
