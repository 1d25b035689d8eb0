"""``training.float8``: its rules, the linears torchao converts, the device refusal, torchao's CPU
emulation against bf16, and the planner's rate and bytes.  fp8 matmuls themselves need a GPU of
compute capability 8.9+ (``benchmarks/gpu_check.sh`` runs them)."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain.api import exitcodes, loading
from meshtrain.api.spec import training as api_training
from meshtrain.cli import main as cli_main
from meshtrain.planner import estimate, float8, memory, parameters, profiles
from meshtrain.trainer.models import gpt, llama
from meshtrain.trainer.parallel import float8 as trainer_float8
from tests.builders import LLAMA_TINY, JobBuilder

float8_linear = pytest.importorskip("torchao.float8.float8_linear")


def fp8_job(**training: object) -> JobBuilder:
    return JobBuilder().model(preset="llama3-8b").training(float8={}, **training)


# --------------------------------------------------------------------------- the spec


def test_presence_enables_the_tensorwise_recipe_and_rowwise_is_torchaos_other_name() -> None:
    assert loading.parse_spec(fp8_job().raw()).training.float8 == api_training.Float8()
    assert api_training.Float8().recipe == "tensorwise"
    rowwise = fp8_job().training(float8={"recipe": "rowwise"})
    assert loading.parse_spec(rowwise.raw()).training.float8 is not None
    assert loading.parse_spec(JobBuilder().raw()).training.float8 is None
    with pytest.raises(loading.SpecError):
        loading.parse_spec(fp8_job().training(float8={"recipe": "delayed"}).raw())


@pytest.mark.parametrize(
    "builder,words",
    [
        (fp8_job(precision="fp32"), ["precision=fp32", "precision: bf16"]),
        (fp8_job().layout(tensor=2, gpus_per_node=2), ["tensor=2", "use tensor 1"]),
        (
            JobBuilder().model(LLAMA_TINY, hidden=72, heads=4).training(float8={}),
            ["hidden=72", "divisible by 16"],
        ),
        (
            JobBuilder().model(LLAMA_TINY, hidden=64, heads=16, kvHeads=1).training(float8={}),
            ["fused QKV", "72 outputs", "kvHeads"],
        ),
    ],
    ids=["fp32", "tensor-parallel", "dims", "qkv-dims"],
)
def test_fp8_is_refused_naming_the_field_and_the_fix(builder: JobBuilder, words: list[str]) -> None:
    with pytest.raises(loading.SpecError) as err:
        loading.parse_spec(builder.raw())
    [problem] = err.value.problems
    assert problem.path == "spec.training.float8"
    assert all(word in problem.message for word in words), problem.message


def test_auto_precision_data_pipeline_and_zero_compose_with_fp8() -> None:
    job = fp8_job().layout(data=2, pipeline=2, gpus_per_node=4).parallelism(zeroStage=1)
    assert loading.parse_spec(job.raw()).training.float8 is not None


def test_validate_accepts_fp8_and_says_it_cannot_see_the_device(tmp_path, capsys) -> None:
    assert cli_main.main(["validate", str(fp8_job().write(tmp_path))]) == 0
    err = capsys.readouterr().err
    assert "training.float8 needs GPUs of compute capability 8.9" in err
    assert "validate cannot see the nodes' GPUs" in err
    bad = fp8_job(precision="fp32").write(tmp_path, "fp32.yaml")
    assert cli_main.main(["validate", str(bad)]) == exitcodes.SPEC
    assert "spec.training.float8" in capsys.readouterr().err


# --------------------------------------------------------------------------- the trainer


def tiny_llama() -> gpt.GPT:
    shape = loading.parse_spec(JobBuilder().model(LLAMA_TINY).raw()).model.shape()
    model = llama.build(gpt.GPTConfig.from_shape(shape), seed=3)
    gpt.materialize(model)
    return model


def emulated(recipe: str) -> object:
    """torchao's config of the recipe with its emulation on (plain torch ops: a CPU runs them)."""
    config = trainer_float8.config_for(api_training.Float8(recipe=recipe))  # type: ignore[arg-type]
    return dataclasses.replace(config, emulate=True)


def test_every_block_linear_and_no_head_becomes_torchaos_float8_linear() -> None:
    model = tiny_llama()
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    names = trainer_float8.apply_float8([model], emulated("tensorwise"))
    # what torchao itself swapped, read back from the model
    swapped = {n for n, m in model.named_modules() if isinstance(m, float8_linear.Float8Linear)}
    assert swapped == set(names) == linears - {"head"}
    assert len(swapped) == 4 * LLAMA_TINY["layers"]  # qkv, proj, fc, proj of every block
    assert not isinstance(model.head, float8_linear.Float8Linear)


def test_the_swap_keeps_every_parameter_its_name_and_the_checkpoint_keys() -> None:
    model = tiny_llama()
    before, saved = dict(model.named_parameters()), model.state_dict().keys()
    trainer_float8.apply_float8([model], emulated("rowwise"))
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    assert model.state_dict().keys() == saved  # checkpoints read and write the same names


@pytest.mark.parametrize(
    "model",
    [dict(LLAMA_TINY), {**LLAMA_TINY, "hidden": 64, "heads": 16, "kvHeads": 1}],
    ids=["aligned", "qkv-misaligned"],
)
def test_the_spec_admits_fp8_exactly_where_every_block_linear_converts(model: dict) -> None:
    """The planner prices every block matrix in float8: the spec must refuse a shape where the
    converter (torchao's filter, :func:`converts`) would leave one in bf16."""
    shape = loading.parse_spec(JobBuilder().model(model).raw()).model.shape()
    built = llama.build(gpt.GPTConfig.from_shape(shape), seed=3)
    blocks = [
        (fqn, m)
        for fqn, m in built.named_modules()
        if isinstance(m, torch.nn.Linear) and fqn != "head"
    ]
    every = all(trainer_float8.converts(m, fqn) for fqn, m in blocks)
    admitted = True
    try:
        loading.parse_spec(JobBuilder().model(model).training(float8={}).raw())
    except loading.SpecError:
        admitted = False
    assert admitted == every


def test_a_linear_whose_dimensions_the_scaled_matmul_cannot_take_stays() -> None:
    assert trainer_float8.converts(torch.nn.Linear(64, 128), "blocks.0.mlp.fc")
    assert not trainer_float8.converts(torch.nn.Linear(64, 72), "blocks.0.mlp.fc")
    assert not trainer_float8.converts(torch.nn.Linear(64, 128), "head")


def lm_loss_and_grads(model: gpt.GPT, tokens: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_fp8_matches_bf16_within_fp8s_precision(recipe: str) -> None:
    """torchao's emulation on a CPU: the loss within 1% of bf16's, every gradient pointing the same
    way (fp8's e4m3 keeps 3 mantissa bits, bf16 7: a few percent per element, not a direction)."""
    bf16 = tiny_llama()
    fp8 = copy.deepcopy(bf16)
    trainer_float8.apply_float8([fp8], emulated(recipe))
    tokens = torch.randint(
        0,
        LLAMA_TINY["vocab"],
        (4, LLAMA_TINY["seqLen"] + 1),
        generator=torch.Generator().manual_seed(0),
    )
    loss_bf16, grads_bf16 = lm_loss_and_grads(bf16, tokens)
    loss_fp8, grads_fp8 = lm_loss_and_grads(fp8, tokens)
    assert loss_fp8 == pytest.approx(loss_bf16, rel=0.01)
    assert len(grads_fp8) == len(grads_bf16)
    for a, b in zip(grads_fp8, grads_bf16):
        assert F.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.98


def test_the_device_check_refuses_a_cpu_and_a_gpu_below_8_9(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = api_training.Float8()
    trainer_float8.check_device(None, torch.device("cpu"))  # fp8 off: any device
    with pytest.raises(trainer_float8.Float8Unavailable, match="runs on cpu"):
        trainer_float8.check_device(spec, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(
        trainer_float8.Float8Unavailable, match=r"A100.*capability 8\.0, below 8\.9"
    ):
        trainer_float8.check_device(spec, torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    trainer_float8.check_device(spec, torch.device("cuda", 0))


def test_fp8_is_refused_on_a_torch_older_than_torchaos_or_without_torchao(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA 12 image's torch 2.10 cannot run torchao 0.18's float8: refused naming the field
    and the fix, as the device check is (before any process group)."""
    said = trainer_float8.library_problem("2.10.0+cu128")
    assert said and "training.float8" in said and "torch 2.11" in said and "CUDA 13" in said
    assert trainer_float8.library_problem(torch.__version__) is None  # this venv's torch + torchao
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # torchao absent: import fails
    said = trainer_float8.library_problem("2.15.0")
    assert said and "training.float8" in said and "torchao>=0.18" in said
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(trainer_float8.Float8Unavailable, match="torchao"):
        trainer_float8.check_device(api_training.Float8(), torch.device("cuda", 0))


def test_the_trainer_entry_point_refuses_fp8_on_a_cpu_with_the_spec_exit_code(tmp_path) -> None:
    job = JobBuilder.cpu_run().model(LLAMA_TINY).training(float8={}, precision="bf16")
    path = job.write(tmp_path)
    env = {**os.environ, "MESHTRAIN_DEVICE": "cpu", "MESHTRAIN_LOG_DIR": str(tmp_path)}
    trainer = [sys.executable, "-m", "meshtrain.trainer", "--spec", str(path)]
    ran = subprocess.run(trainer, capture_output=True, text=True, env=env, timeout=120)
    assert ran.returncode == exitcodes.SPEC, ran.stderr[-2000:]
    assert "training.float8" in ran.stderr and "compute capability 8.9" in ran.stderr


# --------------------------------------------------------------------------- the planner


def plan(job: JobBuilder, profile: str) -> estimate.Plan:
    return estimate.make_plan(loading.parse_spec(job.raw()), profiles.get(profile))


def test_the_planners_step_for_torchtitans_llama3_8b_run_is_its_published_fp8_gain() -> None:
    """TorchTitan's Llama 3.1 8B on 8 H100 at seq 8192 (FSDP: ZeRO-3, local batch 2, compiled):
    bf16+compile / fp8+compile step time is 8532 / 6667 tokens/s.  LINEAR_EFFICIENCY is fitted to
    this one figure (an assumption elsewhere); the check is that the whole step, its
    communication and the unconverted FLOPs included, lands on it."""
    base = (
        JobBuilder()
        .model(preset="llama3-8b")
        .layout(data=8, gpus_per_node=8)
        .parallelism(zeroStage=3)
        .training(microBatch=2, compile=True)
    )
    bf16 = plan(base, "h100-sxm").time
    fp8 = plan(base.clone().training(float8={}), "h100-sxm").time
    published = float8.TORCHTITAN_LLAMA3_8B
    speedup = published["fp8+compile"] / published["bf16+compile"]
    assert bf16.step_seconds / fp8.step_seconds == pytest.approx(speedup, rel=0.03)
    assert fp8.model_flops == bf16.model_flops  # MFU's numerator and peak stay bf16's
    assert fp8.peak_flops == bf16.peak_flops == profiles.get("h100-sxm").peak_flops


def test_eager_fp8_is_planned_slower_than_bf16_and_warned() -> None:
    """torchao's float8 linears without compile run their casts unfused and are slower than bf16
    (pytorch/ao#685; 1.56x the step on the lent H200, ``test_planner_vs_h200``): the plan
    prices them below bf16 and says to compile."""
    base = JobBuilder().model(preset="llama3-8b").layout(data=8, gpus_per_node=8)
    bf16 = plan(base.clone().training(compile=False), "h100-sxm")
    eager = plan(base.clone().training(compile=False, float8={}), "h100-sxm")
    bf16_compiled = plan(base.clone().training(compile=True), "h100-sxm")
    compiled = plan(base.clone().training(compile=True, float8={}), "h100-sxm")
    assert eager.time.rank_flops < bf16.time.rank_flops
    assert compiled.time.rank_flops > bf16_compiled.time.rank_flops
    [warning] = [w for w in eager.warnings if "float8" in w]
    assert "training.compile" in warning and "bf16" in warning
    assert not any("float8" in w for w in compiled.warnings)


def test_a_device_without_float8_is_warned_and_planned_at_bf16() -> None:
    job = JobBuilder().model(preset="llama3.2-1b").training(float8={}, compile=True)
    on_a100 = plan(job, "a100-80g")
    assert any("no float8 tensor cores" in w for w in on_a100.warnings)
    without = JobBuilder().model(preset="llama3.2-1b").training(compile=True)
    assert on_a100.time.rank_flops == plan(without, "a100-80g").time.rank_flops
    assert not any("float8" in w for w in plan(job, "h200").warnings)


def saved_weight_copies(model: gpt.GPT, tokens: torch.Tensor) -> int:
    """Bytes of the weight-shaped tensors autograd saves that are not the Parameters themselves."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()} | {
        tuple(reversed(p.shape)) for p in model.parameters()
    }
    copies: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if tuple(t.shape) in shapes and ptr not in params:
            copies[ptr] = t.untyped_storage().nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast(tokens.device.type, dtype=torch.bfloat16, cache_enabled=False),
    ):
        model.features(tokens)  # the head is the last stage's (not counted here)
    return sum(copies.values())


def test_the_planners_weight_copies_are_what_autograd_saves_under_bf16_and_fp8() -> None:
    """bf16 autocast saves a bf16 copy of every block matrix per micro-batch; torchao saves the fp32
    Parameter itself, so fp8's blocks keep none (the planner keeps only the transient casts)."""
    job = loading.parse_spec(JobBuilder().model(LLAMA_TINY).training(float8={}).raw())
    shape, scheme = job.model.shape(), memory.precision.AUTOCAST
    layers = shape.layers
    bf16 = tiny_llama()
    fp8 = copy.deepcopy(bf16)
    trainer_float8.apply_float8([fp8], emulated("tensorwise"))
    tokens = torch.randint(0, shape.vocab, (1, 24))  # 24 rows: no weight has that dimension
    predicted_bf16 = memory.weight_cast_bytes(shape, 1, layers, 1.0, last=False, scheme=scheme)
    assert saved_weight_copies(bf16, tokens) == predicted_bf16
    assert saved_weight_copies(fp8, tokens) == 0
    measured = [
        live_float8_peak(torch.nn.Linear(inputs, outputs, bias=False), FLOAT8_TOKENS)
        for outputs, inputs in parameters.block_matrix_dims(shape)
    ]
    planned = float8.weight_cast_bytes(shape, 1, tokens=FLOAT8_TOKENS, last=False, scheme=scheme)
    assert planned == max(measured)


FLOAT8_TOKENS = 48
"""Rows of the float8 peak's input: more than the tiny llama's weight dimensions, so the
activations' casts decide, as they do at sequence 8192."""


class _LiveFloat8(TorchDispatchMode):
    """The most float8 bytes alive at once among the tensors torch's ops return."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.dtype in FLOAT8_DTYPES:
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live:
                    self.live[key] = storage.nbytes()
                    weakref.finalize(storage, self.live.pop, key, None)
                    self.peak = max(self.peak, sum(self.live.values()))
        return out


FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def live_float8_peak(linear: torch.nn.Linear, tokens: int, config: object = None) -> int:
    """torchao's float8 copies alive at once over one float8 linear's forward and backward, on
    the linear's device (``config`` None: emulated, the same casts with the matmul in plain
    torch ops, as a CPU needs)."""
    model = torch.nn.Sequential(linear)
    trainer_float8.apply_float8([model], config or emulated("tensorwise"))
    device = linear.weight.device
    x = torch.randn(tokens, linear.in_features, requires_grad=True, device=device)
    with _LiveFloat8() as seen:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = model(x)
        y.float().sum().backward()
    return seen.peak


@pytest.mark.parametrize("outputs,inputs,tokens", [(192, 64, 48), (64, 192, 512), (256, 256, 16)])
def test_the_planners_float8_casts_of_a_linear_are_torchaos_peak(
    outputs: int, inputs: int, tokens: int
) -> None:
    """Read back from torchao: the weight's, the input's and grad_output's two casts, at once."""
    measured = live_float8_peak(torch.nn.Linear(inputs, outputs, bias=False), tokens)
    assert float8.linear_cast_bytes(outputs, inputs, tokens) == measured
