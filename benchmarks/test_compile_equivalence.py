"""Compiled blocks (``training.compile``) train like eager ones: tp2+SP and dp2 ZeRO-3 on CPU, inductor's C++ backend;
the loss's compiled chunk arithmetic equals the eager one in bf16.

Two steps with and without compiled blocks on the same two ranks: losses
agree to 1e-5 and gradient norms to 1e-4 relative in fp32, 1e-3 and 1e-2 in
bf16 (inductor fuses and reorders the elementwise work).  Out of the test suite because one compile
costs over two minutes on a two-core machine (134 s measured under load):

    pytest benchmarks/test_compile_equivalence.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from meshtrain.trainer.parallel import loss
from tests.builders import JobBuilder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "trainer"))
import mt_harness
import test_chunked_loss
import test_compile


@pytest.mark.parametrize(
    ("run", "loss_tolerance", "norm_tolerance"),
    [
        (JobBuilder.cpu_run().layout(tensor=2).parallelism(sequenceParallel=True), 1e-5, 1e-4),
        (JobBuilder.cpu_run().layout(data=2).parallelism(zeroStage=3), 1e-5, 1e-4),
        # bf16: the loss's compiled arithmetic over a vocabulary-parallel head too; inductor's
        # fusions round bf16 differently from eager's separate kernels
        (
            JobBuilder.cpu_run()
            .layout(tensor=2)
            .parallelism(sequenceParallel=True)
            .training(precision="bf16"),
            1e-3,
            1e-2,
        ),
    ],
    ids=["tp2-sp", "dp2-zero3", "tp2-sp-bf16"],
)
def test_compiled_blocks_train_like_eager_ones(
    run: JobBuilder, loss_tolerance: float, norm_tolerance: float
) -> None:
    results = mt_harness.run_distributed(test_compile.compiled_and_eager, 2, run)
    for rank, result in enumerate(results):
        assert result["was_compiled"], f"rank {rank}: the blocks were not compiled"
        for (value, norm), (want_value, want_norm) in zip(result["compiled"], result["eager"]):
            assert value == pytest.approx(want_value, rel=loss_tolerance), rank
            assert norm == pytest.approx(want_norm, rel=norm_tolerance), rank


def test_the_compiled_loss_arithmetic_equals_the_eager_one_in_bf16() -> None:
    """Inductor's kernels for :class:`FusedChunkMath` (bf16 logits, a padded vocabulary) give the
    eager arithmetic's loss and gradients to bf16's precision."""
    generator = torch.Generator().manual_seed(0)
    tokens, width, vocab, real = 300, 32, 1000, 997
    hidden = torch.randn(tokens, width, generator=generator)
    weight = torch.randn(vocab, width, generator=generator) * width**-0.5
    targets = torch.randint(0, real, (tokens,), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_h, want_w = test_chunked_loss._chunked(
            hidden, weight, targets, 1.0, 128, None, vocab=real
        )
        got, got_h, got_w = test_chunked_loss._chunked(
            hidden, weight, targets, 1.0, 128, loss.FusedChunkMath.compiled("inductor"), vocab=real
        )
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    for a, b in ((got_h, want_h), (got_w, want_w)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
    assert torch.count_nonzero(got_w[real:]) == 0
