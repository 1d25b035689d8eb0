"""fp8 linears (``training.float8``) in the planner: the blocks' share of a step and the bytes torchao keeps.

Rate: compiled (``training.compile``), torchao's float8 linears run the blocks' linear matmuls at
the device's float8 dense peak (``fp8_peak_flops``: twice bf16's on H100, H200 and L40S) times the
achievable fraction and :data:`LINEAR_EFFICIENCY`; the attention core, the head and the rest stay
at bf16's rate (:func:`blend`; :mod:`meshtrain.planner.device_rate` puts the rates together, and
prices eager float8, slower than bf16).  Memory: torchao saves the linear's bf16 input (as
autocast's matmul does) and the fp32 weight Parameter itself, so the blocks keep no bf16 copies of
their weights; the float8 casts (weight, input, grad_output) live only around each matmul.
docs/planner.md states both.
"""

from __future__ import annotations

from meshtrain.api import spec as api_spec
from meshtrain.api.spec import model as api_model
from meshtrain.planner import parameters, precision, profiles

TORCHTITAN_LLAMA3_8B = {"bf16+compile": 6667.0, "fp8+compile": 8532.0}
"""TorchTitan's published tokens/s per GPU for Llama 3.1 8B on 8 H100 at sequence 8192 (FSDP,
compiled; docs/performance.md of pytorch/torchtitan): what :data:`LINEAR_EFFICIENCY` is fitted to."""

LINEAR_EFFICIENCY = 0.72
"""Share of the float8 peak (over the profile's achievable fraction) the converted linears realise:
the casts (amax, scale, cast: memory-bound kernels beside every matmul) take the rest.  Fitted to TorchTitan's
1.28x (:data:`TORCHTITAN_LLAMA3_8B`): with 72% of llama3-8b's FLOPs in the blocks' linears, that
speedup needs the linears 1.43x faster, 0.72 of the 2x peak ratio.  One end-to-end figure (8 H100,
FSDP, compiled, tensorwise), applied to every recipe, shape and device; on the lent H200 it
predicted 1.27x where the trainer measured 1.245x (``benchmarks/results/issue35-h200/``)."""

CAST_BYTES = 1
"""Bytes of a float8 element (e4m3 or e5m2)."""


def linear_flops_per_token(shape: api_model.ModelShape) -> float:
    """Training FLOPs per token in the blocks' linears (forward and backward: 6 per weight)."""
    return 6.0 * shape.layers * sum(parameters.block_matrices(shape))


def total_flops_per_token(shape: api_model.ModelShape) -> float:
    """Training FLOPs per token of the step as priced: the blocks' linears, the head's matmul
    (tied or not) and attention over the whole window (the kernel's work)."""
    head = 6.0 * shape.vocab * shape.hidden
    attention = 12.0 * shape.layers * shape.seq_len * shape.hidden
    return linear_flops_per_token(shape) + head + attention


def blend(job: api_spec.TrainingJobSpec, *, linears: float, rest: float) -> float:
    """A rank's FLOP/s when the blocks' linears run at ``linears`` and the rest of the step
    (attention, the head) at ``rest``: the harmonic blend over the step's FLOPs per token."""
    shape = job.model.shape()
    share = min(1.0, linear_flops_per_token(shape) / total_flops_per_token(shape))
    return 1.0 / (share / linears + (1.0 - share) / rest)


def profile_problem(job: api_spec.TrainingJobSpec, profile: profiles.Profile) -> str | None:
    """Why ``training.float8`` cannot run on ``profile``'s device (None: it can, or it is off)."""
    if job.training.float8 is None:
        return None
    if profile.fp8_peak_flops <= 0:
        return (
            f"training.float8 on {profile.name}: no float8 tensor cores (the profile gives no "
            "fp8_peak_flops): the trainer refuses fp8 there; planned at bf16's rate"
        )
    if not job.training.compile:
        return (
            "training.float8 with training.compile false: eager float8 linears run their casts "
            "unfused and are slower than bf16 (1.56x bf16's step in the one run measured, an "
            "8B on an H200; planned from that run); set "
            "training.compile: true for fp8's speedup"
        )
    return None


def linear_cast_bytes(outputs: int, inputs: int, tokens: int) -> int:
    """The float8 copies alive at once around one float8 linear's backward (torchao's casts, read
    back from its emulation): the weight's, the input's, and grad_output's twice (once for the
    input gradient's matmul, once for the weight gradient's)."""
    return CAST_BYTES * (outputs * inputs + tokens * inputs + 2 * tokens * outputs)


def weight_cast_bytes(
    shape: api_model.ModelShape,
    tensor: int,
    *,
    tokens: int,
    last: bool,
    scheme: precision.StateScheme,
) -> float:
    """The transient copies a stage holds under ``training.float8`` (``tokens``: a micro-batch's
    tokens on the rank).

    torchao saves the fp32 weight Parameter for backward, not a cast, so the converted linears
    keep none across micro-batches; the largest linear's float8 casts (:func:`linear_cast_bytes`:
    at sequence 8192 grad_output's outweigh the weight's) live around its matmuls.  The head
    stays bf16 under autocast: on the last stage its copy lives for the loss's forward, as
    without fp8.  fp8 runs at tensor 1 (the spec refuses more): the blocks' linears are whole.
    """
    largest = max(linear_cast_bytes(o, i, tokens) for o, i in parameters.block_matrix_dims(shape))
    head = parameters.vocab_rows(shape, tensor) * shape.hidden * scheme.matmul_bytes if last else 0
    return float(largest + head)
