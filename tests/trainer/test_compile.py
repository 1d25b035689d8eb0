"""``training.compile``: a backend that cannot compile leaves the blocks eager.

The comparison of compiled and eager training (:func:`compiled_and_eager`,
tp2+SP on CPU with inductor) costs over two minutes on two shared cores, more
than a test of the suite may: it is ``benchmarks/test_compile_equivalence.py``.
"""

from __future__ import annotations

import mt_harness
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


def test_a_backend_that_cannot_compile_leaves_the_blocks_eager(monkeypatch, capsys):
    monkeypatch.setattr(compilation, "compile_problem", lambda device: "no C++ compiler")
    model = torch.nn.Module()
    assert compilation.apply_compile([model], torch.device("cpu")) is False
    assert "no C++ compiler" in capsys.readouterr().err
    assert compilation.apply_compile([model], torch.device("cpu"), zero_stage=3) is False
    assert "zeroStage 3" in capsys.readouterr().err
