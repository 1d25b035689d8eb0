"""``training.compile``: a backend that cannot compile leaves the blocks eager.

The comparison of compiled and eager training (:func:`compiled_and_eager`,
tp2+SP on CPU with inductor) costs over two minutes on two shared cores, more
than a test of the suite may: it is ``benchmarks/test_compile_equivalence.py``.
"""

from __future__ import annotations

import operator
import os

import mt_harness
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.compile_worker.subproc_pool import SubprocPool

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import compilation
from meshtrain.trainer.parallel import mesh as mesh_mod
from tests.builders import JobBuilder

STEPS = 2


def compiled_and_eager(run: JobBuilder) -> dict[str, list[tuple[float, float]] | bool]:
    """(loss, grad norm) per step, eager then compiled, on this rank."""
    out: dict[str, list[tuple[float, float]] | bool] = {}
    for name, flag in (("eager", False), ("compiled", True)):
        raw = run.clone().training(steps=STEPS, compile=flag).raw()
        job = loading.parse_spec(raw)
        mesh = mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
        eng = engine.Engine(job, mesh)
        with mt_harness.no_silent_eager():
            out[name] = [(r.loss, r.grad_norm) for r in (eng.train_step() for _ in range(STEPS))]
        if flag:
            out["was_compiled"] = eng.compiled and eng.compile_fallbacks == 0
    return out


def test_inductor_compile_workers_start_in_a_test_process():
    """They take this process's ``sys.path`` as PYTHONPATH, the checkout's root included (pytest's
    pythonpath): before the namespace layout the root's ``operator/`` package killed them at start."""
    pool = SubprocPool(2)
    try:
        assert pool.submit(os.getpid).result(timeout=120) != os.getpid()
    finally:
        pool.shutdown()


def test_dynamo_traces_the_standard_librarys_operator():
    """Dynamo's polyfill re-imports ``operator`` from ``sys.path`` when it is first imported: a
    package named ``operator`` at the checkout's root (the old layout) broke its functions."""
    traced = torch.compile(
        lambda x: x * operator.indexOf([3, 5, 7], 5), backend="eager", fullgraph=True
    )
    assert traced(torch.ones(2)).tolist() == [1.0, 1.0]


def test_a_graph_the_backend_rejects_is_counted_and_said_once(capsys):
    def rejecting(graph: torch.fx.GraphModule, inputs: list) -> object:
        raise RuntimeError("rejected")

    watch = compilation.FallbackWatch()
    function = torch.compile(lambda x: x.sin() + 1, backend=rejecting)
    with torch._dynamo.config.patch(suppress_errors=True):
        assert function(torch.zeros(3)).tolist() == [1.0, 1.0, 1.0]  # ran eagerly
    assert watch.count() == 1
    watch.say_once()
    watch.say_once()
    assert capsys.readouterr().err.count("ran eagerly") == 1


def test_a_backend_that_cannot_compile_leaves_the_blocks_eager(monkeypatch, capsys):
    monkeypatch.setattr(compilation, "compile_problem", lambda device: "no C++ compiler")
    untouched = None  # the probe's failure returns before the model is looked at
    assert compilation.apply_compile(untouched, torch.device("cpu")) is False
    assert "no C++ compiler" in capsys.readouterr().err


def _traced_and_eager(run: JobBuilder) -> dict:
    """:func:`compiled_and_eager` with a backend that runs dynamo's and AOTAutograd's graphs as
    traced (no inductor code generation, which costs minutes on this machine), counting them."""
    traced = {"forward": 0, "backward": 0}

    def counted(kind: str):
        def compiler(graph: torch.fx.GraphModule, inputs: list) -> object:
            traced[kind] += 1
            return make_boxed_func(graph.forward)

        return compiler

    compilation.BACKEND = aot_autograd(
        fw_compiler=counted("forward"), bw_compiler=counted("backward")
    )
    return {**compiled_and_eager(run), "traced": traced}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "loss_graphs", "tolerance"),
    [
        (JobBuilder.cpu_run().layout(data=2).parallelism(zeroStage=3), 0, 1e-6),
        (
            JobBuilder.cpu_run()
            .model({"preset": "llama-tiny"})
            .layout(data=2)
            .parallelism(zeroStage=3),
            0,
            1e-6,
        ),
        (
            JobBuilder.cpu_run().layout(data=2).parallelism(zeroStage=3).training(precision="bf16"),
            3,
            1e-3,
        ),
    ],
    ids=["gpt", "llama", "gpt-bf16"],
)
def test_zero3_blocks_compile_around_fsdp2s_hooks_and_train_like_eager_ones(
    run, loss_graphs, tolerance
):
    """Under ZeRO-3 the compiled graph is the block's compute on the gathered weights: one forward
    and one backward graph serve every block and step (FSDP2's gathers and reduce-scatters stay
    outside it), and the losses and gradient norms are eager's.  In bf16 the loss's three chunk
    functions add a forward graph each (they run inside the loss's own autograd function, which
    has no traced backward) and agree with the eager arithmetic to bf16's precision."""
    for rank, result in enumerate(mt_harness.run_distributed(_traced_and_eager, 2, run)):
        assert result["was_compiled"], rank
        assert result["traced"] == {"forward": 1 + loss_graphs, "backward": 1}, rank
        for (loss, norm), (want_loss, want_norm) in zip(result["compiled"], result["eager"]):
            assert loss == pytest.approx(want_loss, rel=tolerance), rank
            assert norm == pytest.approx(want_norm, rel=tolerance), rank
