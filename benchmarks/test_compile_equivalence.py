"""Compiled blocks (``training.compile``) train like eager ones: tp2+SP and dp2 ZeRO-3 on CPU, inductor's C++ backend.

Two steps with and without compiled blocks on the same two ranks: losses
agree to 1e-5 and gradient norms to 1e-4 relative (inductor fuses and
reorders the elementwise work).  Out of the test suite because one compile
costs over two minutes on a two-core machine (134 s measured under load):

    pytest benchmarks/test_compile_equivalence.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "trainer"))
import mt_harness
import test_compile


@pytest.mark.parametrize(
    "layout",
    [{"tensor": 2, "sequence_parallel": True}, {"data": 2, "zero_stage": 3}],
    ids=["tp2-sp", "dp2-zero3"],
)
def test_compiled_blocks_train_like_eager_ones(layout: dict) -> None:
    results = mt_harness.run_distributed(test_compile.compiled_and_eager, 2, layout)
    for rank, result in enumerate(results):
        assert result["was_compiled"], f"rank {rank}: the blocks were not compiled"
        for (loss, norm), (want_loss, want_norm) in zip(result["compiled"], result["eager"]):
            assert loss == pytest.approx(want_loss, rel=1e-5), rank
            assert norm == pytest.approx(want_norm, rel=1e-4), rank
