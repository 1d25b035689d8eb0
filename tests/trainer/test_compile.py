"""``training.compile``: the compiled blocks train like the eager ones (CPU, inductor), or fall back to eager.

Two steps of a tiny model with and without compiled blocks in one process:
the losses and gradient norms agree to fp32 rounding (inductor fuses and
reorders the elementwise work).  One compile of the tiny block costs tens of
seconds on two shared cores, so the comparison is marked slow; the fallback
test needs no compiler.
"""

from __future__ import annotations

import mt_harness
import pytest
import torch

from meshtrain import layout as layout_mod
from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import compilation
from meshtrain.trainer.parallel import mesh as mesh_mod

STEPS = 2


def compiled_and_eager(layout: dict) -> dict[str, list[tuple[float, float]] | bool]:
    """(loss, grad norm) per step, eager then compiled, on this rank."""
    out: dict[str, list[tuple[float, float]] | bool] = {}
    for name, flag in (("eager", False), ("compiled", True)):
        raw = mt_harness.make_spec(**layout, steps=STEPS, compile=flag)
        job = loading.parse_spec(raw)
        mesh = mesh_mod.build_mesh(layout_mod.from_spec(job.parallelism), torch.device("cpu"))
        eng = engine.Engine(job, mesh)
        out[name] = [(r.loss, r.grad_norm) for r in (eng.train_step() for _ in range(STEPS))]
        if flag:
            out["was_compiled"] = eng.compiled
    return out


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_ones():
    for rank, result in enumerate(
        mt_harness.run_distributed(compiled_and_eager, 2, {"tensor": 2, "sequence_parallel": True})
    ):
        assert result["was_compiled"], f"rank {rank}: the blocks were not compiled"
        for (loss, norm), (want_loss, want_norm) in zip(result["compiled"], result["eager"]):
            assert loss == pytest.approx(want_loss, rel=1e-5), rank
            assert norm == pytest.approx(want_norm, rel=1e-4), rank


def test_a_backend_that_cannot_compile_leaves_the_blocks_eager(monkeypatch, capsys):
    monkeypatch.setattr(compilation, "compile_problem", lambda device: "no C++ compiler")
    model = torch.nn.Module()
    assert compilation.apply_compile([model], torch.device("cpu")) is False
    assert "no C++ compiler" in capsys.readouterr().err
    assert compilation.apply_compile([model], torch.device("cpu"), zero_stage=3) is False
    assert "zeroStage 3" in capsys.readouterr().err
