"""Issue #35's features on one rank of the device, as ``benchmarks/gpu_check.sh --suite issue35``
runs them on a lent GPU (``MESHTRAIN_TEST_DEVICE=cuda``; ``cpu`` by default, as CI runs them).

* fp8 (``training.float8``): on a GPU, 200 compiled steps of the 350m preset in fp8 end within 1%
  of the same run in bf16 (the issue's bar); on the CPU, the engine refuses fp8, naming the field.
  What the planner's fp8 memory rests on, read back on the device's own float8 path (a CPU runs
  torchao's emulation): autograd saves no weight copy under float8 linears, and the float8
  bytes alive at once around each block linear are the planner's.
* the overlap toggle (``parallelism.overlap.tensor``) and the ``context=1`` path: on one rank
  there is no collective to overlap and no sequence to split, so each must give exactly the run
  of the default spec.

The suite runs the 200-step pair (marked slow) in its own step right after the compiled llama
pair, and the quick one-rank checks after it.  One GPU cannot run more than one NCCL rank: what
needs two (overlap itself, context > 1, compression and its warm-up, which the spec refuses below
data 2) is reported as not measurable by the suite's results file.
"""

from __future__ import annotations

import importlib
import os

import mt_harness
import pytest
import torch

from meshtrain.api import loading
from meshtrain.api.spec import parallelism as api_parallelism
from meshtrain.api.spec import training as api_training
from meshtrain.planner import float8 as planner_float8
from meshtrain.planner import parameters
from meshtrain.trainer import engine
from meshtrain.trainer.models import gpt, llama
from meshtrain.trainer.parallel import float8
from meshtrain.trainer.parallel import mesh as mesh_mod
from tests.builders import LLAMA_TINY, JobBuilder

FP8_STEPS = 200
"""The issue's bar: loss within 1% of bf16 over 200 steps of a 350m+ model, both compiled."""
FP8_LOSS_REL = 0.01
LAST = 20
FP8_PAIR_SECONDS = 140
"""The pair's limit: two compiled 200-step runs of 350m (the suite gives their step 160 s)."""
"""Steps at the end whose mean loss is compared (one step's loss is one batch's noise)."""


@pytest.fixture(scope="module")
def device_kind(record_testsuite_property) -> str:
    kind = os.environ.get("MESHTRAIN_TEST_DEVICE", "cpu")
    record_testsuite_property("device", kind)
    if kind not in ("cpu", "cuda"):
        pytest.fail(f"MESHTRAIN_TEST_DEVICE={kind!r}: use cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"MESHTRAIN_TEST_DEVICE=cuda but torch {torch.__version__} sees no GPU")
    return kind


def _engine(raw: dict, device_kind: str) -> engine.Engine:
    job = loading.parse_spec(raw)
    device = mesh_mod.device_for(0, use_cuda=device_kind == "cuda")  # a world of one
    return engine.Engine(job, mesh_mod.build_mesh(job.parallelism.layout, device))


def losses(device_kind: str, raws: list[dict], steps: int) -> list[list[float]]:
    """Each job's losses, one rank of ``device_kind``, one job after the other."""
    out = []
    for raw in raws:
        eng = _engine(raw, device_kind)
        out.append([eng.train_step().loss for _ in range(steps)])
        del eng
        if device_kind == "cuda":
            torch.cuda.empty_cache()
    return out


def refusal(device_kind: str, raw: dict) -> str:
    """The engine's refusal of ``raw`` on this device ('' when it builds)."""
    try:
        _engine(raw, device_kind)
    except float8.Float8Unavailable as err:
        return str(err)
    return ""


def _tiny(**parallelism: object) -> dict:
    return (
        JobBuilder.cpu_run()
        .model(LLAMA_TINY)
        .parallelism(microBatches=2, **parallelism)
        .training(steps=3, precision="bf16")
        .raw()
    )


def test_the_overlap_toggle_gives_the_default_run_on_one_rank(device_kind):
    assert api_parallelism.Overlap().tensor  # the default overlaps: off is the serial path
    runs = [_tiny(), _tiny(overlap={"tensor": False})]
    default, serial = mt_harness.run_distributed(
        losses, 1, device_kind, runs, 3, timeout_s=180, use_cuda=device_kind == "cuda"
    )[0]
    assert serial == default


def test_context_1_is_the_plain_path_on_one_rank(device_kind):
    runs = [_tiny(), _tiny(context=1)]
    default, context_1 = mt_harness.run_distributed(
        losses, 1, device_kind, runs, 3, timeout_s=180, use_cuda=device_kind == "cuda"
    )[0]
    assert context_1 == default


FP8_ROWS = 48
"""Tokens through the float8 linears: a multiple of 16 (the scaled matmul's), no weight's dimension."""


def fp8_memory(device_kind: str) -> tuple[int, list[tuple[int, int, int]]]:
    """Weight copies autograd saves in a float8 tiny llama's blocks, and the float8 bytes alive at
    once around each of its block linears: (bytes, [(outputs, inputs, bytes)])."""
    unit = importlib.import_module("tests.unit.test_float8")  # its readers of autograd and torchao
    device = torch.device(device_kind)
    config = float8.config_for(api_training.Float8())
    if device_kind == "cpu":
        config = unit.emulated("tensorwise")
    shape = loading.parse_spec(JobBuilder().model(LLAMA_TINY).raw()).model.shape()
    model = llama.build(gpt.GPTConfig.from_shape(shape), seed=3)
    gpt.materialize(model)
    model.to(device)
    float8.apply_float8([model], config)
    tokens = torch.randint(0, shape.vocab, (1, FP8_ROWS), device=device)
    copies = unit.saved_weight_copies(model, tokens)
    peaks = []
    for outputs, inputs in parameters.block_matrix_dims(shape):
        linear = torch.nn.Linear(inputs, outputs, bias=False, device=device)
        peaks.append((outputs, inputs, unit.live_float8_peak(linear, FP8_ROWS, config)))
    return copies, peaks


def test_fp8_keeps_no_weight_copy_and_its_casts_are_the_planners(device_kind):
    copies, peaks = mt_harness.run_distributed(
        fp8_memory, 1, device_kind, timeout_s=120, use_cuda=device_kind == "cuda"
    )[0]
    assert copies == 0  # torchao saves the fp32 Parameter, not a cast
    for outputs, inputs, measured in peaks:
        assert planner_float8.linear_cast_bytes(outputs, inputs, FP8_ROWS) == measured, (
            outputs,
            inputs,
        )


def fp8_350m(recipe: str | None) -> dict:
    training = {"float8": {"recipe": recipe}} if recipe else {}
    return (
        JobBuilder()
        .model(preset="350m")
        .training(
            microBatch=4,
            steps=FP8_STEPS,
            precision="bf16",
            compile=True,
            warmupSteps=20,
            **training,
        )
        .raw()
    )


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise"])
def test_fp8_follows_bf16_over_200_compiled_steps_of_350m(device_kind, recipe):
    cuda = device_kind == "cuda"
    if not cuda:  # the trainer's own refusal, as a job on a CPU meets it
        said = mt_harness.run_distributed(refusal, 1, device_kind, fp8_350m(recipe), timeout_s=120)
        assert "training.float8" in said[0] and "compute capability 8.9" in said[0], said
        return
    runs = [fp8_350m(None), fp8_350m(recipe)]
    bf16, fp8 = mt_harness.run_distributed(
        losses, 1, device_kind, runs, FP8_STEPS, timeout_s=FP8_PAIR_SECONDS, use_cuda=True
    )[0]
    tail_bf16, tail_fp8 = sum(bf16[-LAST:]) / LAST, sum(fp8[-LAST:]) / LAST
    assert tail_fp8 == pytest.approx(tail_bf16, rel=FP8_LOSS_REL), (tail_fp8, tail_bf16)
    assert bf16[-1] < bf16[0] and fp8[-1] < fp8[0]  # both trained
