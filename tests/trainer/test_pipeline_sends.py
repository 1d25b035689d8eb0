"""Pipeline sends free their tensors when done: a stage's peak memory does not grow with micro-batches.

Two gloo ranks run pp2 under 1F1B with micro-batches of one sequence, at 4 and at 16 micro-batches
per step, and measure the peak live bytes of the second step
(:class:`~meshtrain.trainer.telemetry.live_bytes.LiveBytes`, the training state registered first).
1F1B keeps at most ``p - stage`` micro-batches of activations alive, so what may still grow with
the micro-batch count is what the executor holds for its sends: before each sent tensor was freed
as soon as its send completed, the last stage kept every input gradient it sent until the step
ended, 12 more of them at 16 micro-batches than at 4 (one is ``seq x hidden`` fp32).  The peaks at
16 and at 4 must now differ by less than two such tensors on both stages (the token ids and targets
of 12 more micro-batches, which the step loads up front, are a few KiB).
"""

from __future__ import annotations

import mt_harness
import mt_workers
import pytest

from tests.builders import JobBuilder

SHAPE = {"layers": 4, "hidden": 128, "heads": 4, "vocab": 256, "seqLen": 32, "ffnHidden": 256}
MICRO_BATCHES = (4, 16)


def _raw(micro_batches: int) -> dict:
    return (
        JobBuilder.cpu_run()
        .model(SHAPE)
        .layout(pipeline=2)
        .parallelism(schedule="1f1b", microBatches=micro_batches)
        .training(steps=2, microBatch=1, globalBatch=micro_batches)
        .raw()
    )


def peaks() -> dict[int, int]:
    """On every rank: the peak live bytes of step 2 at each micro-batch count."""
    return {m: mt_workers.second_step_peak(_raw(m))[1] for m in MICRO_BATCHES}


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_micro_batches() -> None:
    boundary = SHAPE["seqLen"] * SHAPE["hidden"] * 4  # one sent activation or input gradient
    for stage, result in enumerate(mt_harness.run_distributed(peaks, 2)):
        few, many = (result[m] for m in MICRO_BATCHES)
        assert many - few < 2 * boundary, (
            f"stage {stage}: peak {many} B at {MICRO_BATCHES[1]} micro-batches, {few} B at "
            f"{MICRO_BATCHES[0]}: {(many - few) / boundary:.1f} sent tensors more"
        )
