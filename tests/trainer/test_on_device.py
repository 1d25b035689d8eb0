"""The trainer on the device it trains on: what runs on CPU ranks cannot show about a GPU.

Everything else in the suite runs on CPU ranks over gloo.  These tests take
their device from ``MESHTRAIN_TEST_DEVICE`` (``cpu`` by default, as CI runs
them; ``cuda`` on a GPU machine, as ``benchmarks/gpu_check.sh`` does) and
check, each against a reference that does not share the code under test:

* the loss's chunk arithmetic compiled for the device (Triton kernels on a
  GPU) against ``F.cross_entropy`` of the whole logits under the same autocast;
* the engine training on the device in fp32 against the same job on the
  CPU, and in bf16 compiled against bf16 eager on the device, and bf16 against
  fp32 to bf16's precision;
* ``training.documentMask``'s attention on the device's pinned kernels against each
  document run alone with plain causal attention;
* the peak memory of a step on the device (``torch.cuda.max_memory_allocated``
  on a GPU, :class:`~meshtrain.trainer.telemetry.live_bytes.LiveBytes` on the CPU)
  against the planner's figure.
* in-place recovery's abort and regroup on the device's backend (NCCL on a GPU),
  one rank, against the values each round's all-reduce must give.

On the CPU the first engine comparison is the CPU against itself: it is the
GPU run that can disagree.
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import mt_harness
import pytest
import test_chunked_loss
import test_document_mask
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from meshtrain.api import loading
from meshtrain.api.spec import model as api_model
from meshtrain.planner import memory, profiles
from meshtrain.trainer import engine
from meshtrain.trainer.models import documents, gpt, llama
from meshtrain.trainer.parallel import compilation, loss, state_bytes
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.recovery import gpu_probe
from meshtrain.trainer.telemetry import live_bytes
from tests.builders import JobBuilder

SHAPE = {"layers": 4, "hidden": 128, "heads": 4, "vocab": 1024, "seqLen": 128, "ffnHidden": 512}
"""Big enough that the CUDA allocator's 512-byte rounding is far below the tolerances."""
STEPS = 4
RUNS = (("fp32", False), ("bf16", False), ("bf16", True))
"""(precision, training.compile) of the engine runs on the device."""


@pytest.fixture(scope="module")
def device_kind(record_testsuite_property) -> str:
    kind = os.environ.get("MESHTRAIN_TEST_DEVICE", "cpu")
    record_testsuite_property("device", kind)  # the JUnit report says where the tests ran
    if kind not in ("cpu", "cuda"):
        pytest.fail(f"MESHTRAIN_TEST_DEVICE={kind!r}: use cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        pytest.fail(
            "MESHTRAIN_TEST_DEVICE=cuda but torch sees no GPU "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda}): run on a GPU machine"
        )
    return kind


def _job(precision: str = "fp32", compiled: bool = False):
    raw = (
        JobBuilder.cpu_run()
        .model(SHAPE)
        .parallelism(microBatches=2)
        .training(globalBatch=8, steps=STEPS, precision=precision, compile=compiled)
        .raw()
    )
    return loading.parse_spec(raw)


def _engine(job, device_kind: str) -> engine.Engine:
    device = mesh_mod.device_for(0, use_cuda=device_kind == "cuda")  # a world of one
    return engine.Engine(job, mesh_mod.build_mesh(job.parallelism.layout, device))


def train(device_kind: str, runs: tuple[tuple[str, bool], ...]) -> dict:
    """Per (precision, compile): each step's loss and gradient norm on one rank of ``device_kind``.

    Compiled runs count the graphs the backend compiled and let a failing
    one raise: the engine would otherwise run it eagerly (``suppress_errors``),
    and the comparison would be eager against eager.
    """
    if device_kind == "cuda":  # the fp32 comparison with the CPU wants fp32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    counter = CompileCounterWithBackend(compilation.BACKEND)
    compilation.BACKEND = counter
    out = {}
    for precision, compiled in runs:
        eng = _engine(_job(precision, compiled), device_kind)
        assert eng.compiled == compiled and eng.precision == precision
        with mt_harness.no_silent_eager():
            steps = [eng.train_step() for _ in range(STEPS)]
        assert eng.compile_fallbacks == 0
        out[(precision, compiled)] = [(s.loss, s.grad_norm) for s in steps]
    out["graphs"] = counter.frame_count
    out["graph_breaks"] = dict(torch._dynamo.utils.counters["graph_break"])
    return out


def _close(got: list, want: list, loss_rel: float, norm_rel: float, what: str) -> None:
    for step, ((loss_a, norm_a), (loss_b, norm_b)) in enumerate(zip(got, want, strict=True)):
        assert loss_a == pytest.approx(loss_b, rel=loss_rel), f"{what}: loss of step {step + 1}"
        assert norm_a == pytest.approx(norm_b, rel=norm_rel), f"{what}: norm of step {step + 1}"


@pytest.mark.slow
def test_training_on_the_device_follows_the_cpu_and_bf16_follows_fp32(device_kind):
    cuda = device_kind == "cuda"
    reference = mt_harness.run_distributed(train, 1, "cpu", (("fp32", False),), timeout_s=150)[0]
    runs = mt_harness.run_distributed(train, 1, device_kind, RUNS, timeout_s=240, use_cuda=cuda)[0]
    assert runs["graphs"] >= 4, f"{runs['graphs']} graphs compiled: blocks and the loss's three"
    assert not runs["graph_breaks"], runs["graph_breaks"]  # one rank: no TP region boundary
    _close(runs[("fp32", False)], reference[("fp32", False)], 1e-4, 1e-3, "fp32 device vs CPU")
    # compile's fused kernels round bf16 differently (benchmarks/test_compile_equivalence.py)
    _close(runs[("bf16", True)], runs[("bf16", False)], 1e-3, 1e-2, "bf16 compiled vs eager")
    # bf16 matmuls with fp32 accumulation and an fp32 softmax: on a CPU they agreed to 1e-5 and 0.3%
    _close(runs[("bf16", False)], runs[("fp32", False)], 2e-3, 2e-2, "bf16 vs fp32")


@pytest.mark.parametrize("chunk", [96, 512])
def test_compiled_loss_arithmetic_on_the_device_equals_the_plain_loss(device_kind, chunk):
    """Under bf16 autocast, as the engine runs it; 96 gives chunks of two lengths (a recompile)."""
    h, w, t = (x.to(device_kind) for x in test_chunked_loss._inputs(512, 64, 1000, seed=4))
    torch._dynamo.reset()  # the three functions' caches and recompile budget are this test's
    counter = CompileCounterWithBackend(compilation.BACKEND)
    fused = loss.FusedChunkMath.compiled(counter)
    watch = compilation.FallbackWatch()
    with mt_harness.no_silent_eager(), torch.autocast(device_kind, dtype=torch.bfloat16):
        want = test_chunked_loss._plain(h, w, t, 1.0)
        got = test_chunked_loss._chunked(h, w, t, 1.0, chunk, fused)
    assert counter.frame_count >= 3 and watch.count() == 0, "the three functions not all compiled"
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(got[1:], want[1:]):  # bf16 matmuls: agreement to bf16 precision
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


def peak_of_a_step(device_kind: str, precision: str) -> int:
    """Bytes at the high-water mark of the second step (the first creates AdamW's moments).

    What the device holds that is not the job's (on a GPU the cuBLAS
    workspaces, one per thread and stream, the backward's thread included)
    is what is allocated after the first step beyond the training state;
    the first step leaves nothing else behind (on the CPU, where every
    allocation is seen, it left 0 bytes).
    """
    eng = _engine(_job(precision), device_kind)

    def state_now() -> int:
        tensors = state_bytes.state_tensors(eng.model, eng.optimizer, eng.model.reducer)
        return state_bytes.storage_bytes(tensors)

    if device_kind == "cuda":
        eng.train_step()
        torch.cuda.synchronize()
        not_the_jobs = torch.cuda.memory_allocated() - state_now()
        torch.cuda.reset_peak_memory_stats()
        eng.train_step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - not_the_jobs
    tracker = live_bytes.LiveBytes()
    tracker.track(state_bytes.state_tensors(eng.model, eng.optimizer, eng.model.reducer))
    with tracker:
        eng.train_step()
        assert tracker.current == state_now(), "the first step left more than the state"
        tracker.reset_peak()
        eng.train_step()
    return tracker.peak


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_planner_predicts_the_peak_memory_on_the_device(device_kind, precision):
    """Within 5% on the CPU (bf16 with autocast's copies of the weights,
    planner.memory.weight_cast_bytes, without which it was 10% short there); 10% on a GPU until
    one has measured this shape."""
    measured = mt_harness.run_distributed(
        peak_of_a_step, 1, device_kind, precision, timeout_s=150, use_cuda=device_kind == "cuda"
    )[0]
    # the job names its precision, so the profile's default plays no part
    planned = memory.plan_memory(_job(precision), profiles.get("cpu")).stages[0].total
    assert planned == pytest.approx(measured, rel=0.05 if device_kind == "cpu" else 0.10), (
        f"{device_kind} {precision}: planner {planned:.0f} B, measured peak {measured} B"
    )


MASKED_SHAPE = {**SHAPE, "family": "llama", "kvHeads": 2}
"""Grouped-query attention: on a GPU the masked path repeats k and v for the pinned kernels."""


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_masked_attention_on_the_device_equals_each_document_run_alone(device_kind, precision):
    """``training.documentMask``'s attention on the device's pinned kernels (``gpt.MASKED_KERNELS``:
    memory-efficient or cuDNN on a GPU) against the same model running each document alone with
    plain causal attention (test_document_mask.py's reference), forward and backward."""
    torch.manual_seed(0)
    device = torch.device("cuda" if device_kind == "cuda" else "cpu")
    config = gpt.GPTConfig.from_shape(api_model.ModelSpec.model_validate(MASKED_SHAPE).shape())
    model = llama.build(config, seed=3).to(device)
    tokens = torch.randint(1, config.vocab, (2, config.seq_len), device=device)
    ends = torch.rand(tokens.shape, device=device) < 0.05  # documents of about 20 tokens
    tokens = tokens.masked_fill(ends, test_document_mask.EOS)
    assert all(len(test_document_mask.split_documents(r)) > 2 for r in tokens.tolist())
    half = precision == "bf16"
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
        dtype = torch.bfloat16 if half else torch.float32
        packed = model(tokens, documents=documents.of_tokens(tokens, test_document_mask.EOS, dtype))
        alone = test_document_mask.per_document_logits(model, tokens)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if half else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(packed.float(), alone.float(), **tolerance)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
        unmasked = model(tokens).float()
    assert not torch.allclose(unmasked, alone.float(), **tolerance)  # the mask changes something
    packed.float().square().mean().backward()  # the pinned kernels' backward runs too
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


ABORT_AND_REJOIN = """
import datetime, sys
import torch, torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from meshtrain.trainer.recovery import abort, generations

kind, rounds = sys.argv[1], int(sys.argv[2])
backend = "nccl" if kind == "cuda" else "gloo"
device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
store = c10d.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
sockets = abort.GlooSockets(store.port)
abort.install(sockets)
left = []
for generation in range(rounds):
    with abort.GROUPS:  # as generations.run_generations creates a round's group
        dist.init_process_group(
            backend=backend, store=c10d.PrefixStore(f"g{generation}/", store),
            rank=0, world_size=1, timeout=datetime.timedelta(seconds=30),
        )
    value = torch.full((4,), float(generation + 1), device=device)
    dist.all_reduce(value)  # tolist() below waits for it
    print("generation", generation, dist.get_backend(), value.tolist(), flush=True)
    abort.abort_groups(sockets, backend, leave=left.append)
    generations._teardown(sockets)
print("left", left)
"""


def test_a_rank_aborts_its_groups_and_rejoins_new_rounds_on_the_device(device_kind):
    """The in-place recovery's abort and regroup (``abort.abort_groups``, then
    ``generations._teardown`` and a new round's group on the same store) on the device's own
    backend: NCCL's ``_abort_process_group`` on a GPU, gloo's sockets on the CPU.  One rank: NCCL
    refuses two ranks on one GPU, so a collective blocked by a lost peer is not shown here
    (tests/trainer/test_supervise.py shows it on gloo)."""
    rounds = 3
    result = subprocess.run(
        [sys.executable, "-c", ABORT_AND_REJOIN, device_kind, str(rounds)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    backend = "nccl" if device_kind == "cuda" else "gloo"
    for generation in range(rounds):
        want = f"generation {generation} {backend} {[float(generation + 1)] * 4}"
        assert want in lines, result.stdout
    assert "left []" in lines, result.stdout  # no abort outlasted its deadline


def test_the_gpu_probe_asks_the_real_driver_and_finds_its_gpu_there(device_kind):
    """``gpu_probe.lost_gpus`` through the device's own NVML: on a lent GPU the driver answers for
    every GPU and calls none lost (a false alarm would send healthy pods away); on the CPU there
    is no driver library and no verdict (a GPU host run on its CPU has one: it answers).  (A lost GPU is shown against ``fake_nvml.c``,
    tests/trainer/test_gpu_probe.py: no lent machine has one.)"""
    found = gpu_probe.probe()
    driver = device_kind == "cuda" or ctypes.util.find_library("nvidia-ml") is not None
    assert found == ([] if driver else None), found
