"""The planner's exposed tensor-parallel time against the trainer's chunk schedule, simulated."""

from __future__ import annotations

import pytest

from meshtrain.planner.timing import tp_overlap


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
