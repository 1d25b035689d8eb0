"""A GPU rank's achievable FLOP/s: the profile's eager rate, compile's fusion and fp8's linears.

A datasheet GPU profile's ``achievable_fraction`` prices an eager step.  Compiled
(``training.compile``), the step runs :data:`COMPILE_SPEEDUP` faster: Inductor fuses the
elementwise and normalisation kernels around the matmuls.  A calibrated profile's fraction was
measured on one block's matmuls with the per-operation cost apart, and a CPU profile's is no
GPU's, so neither gets the factor.  fp8 (``training.float8``) changes the blocks' linears only
(:mod:`meshtrain.planner.float8`): compiled they run at the float8 rate, eager they run slower
than bf16, since their casts are separate kernels.  docs/planner.md shows each factor's source.
"""

from __future__ import annotations

from meshtrain.api import spec as api_spec
from meshtrain.planner import float8, profiles

COMPILE_SPEEDUP = 6667.0 / 5762.0
"""Compiled over eager tokens/s of a whole training step, ≈1.157: TorchTitan's Llama 3.1 8B on 8 H100
at sequence 8192 (bf16: 5,762 eager, 6,667 compiled; TorchTitan's H100 benchmark of December 2024,
Table 1).  The lent H200 measured the same, 1.157, on the 8B's blocks at 27 layers
(``benchmarks/results/issue35-h200/``: 1.863 s eager, 1.610 s compiled).  An assumption for
other shapes: fusion saves memory-bound time, so small models may gain more."""

EAGER_FLOAT8_LINEAR_RATE = 0.557
"""Eager float8 linears' FLOP/s over bf16's: the value at which the planned step of the one
measurement there is equals the measured one (to 0.1%; ``benchmarks/results/issue35-h200/``: the
27-layer 8B's eager fp8 step took 2.901 s, bf16's 1.863 s, with 72% of the step's FLOPs in the
converted linears, tensorwise, micro-batch 1 at sequence 8192, MLP recompute).  Each linear's
casts (amax, scale, cast) run as separate memory-bound kernels (pytorch/ao#685); their cost
follows bytes rather than FLOPs, so shorter micro-batches likely fare worse than this one point."""


def compile_speedup(job: api_spec.TrainingJobSpec, profile: profiles.Profile) -> float:
    """:data:`COMPILE_SPEEDUP` for a compiled job on a datasheet GPU profile, else 1."""
    datasheet_gpu = profile.precision == "bf16" and not profile.calibrated
    return COMPILE_SPEEDUP if job.training.compile and datasheet_gpu else 1.0


def rank_flops(job: api_spec.TrainingJobSpec, profile: profiles.Profile) -> float:
    """A rank's achievable FLOP/s on ``profile``'s device for ``job``'s step (never above a peak)."""
    speedup = compile_speedup(job, profile)
    bf16 = min(profile.peak_flops, profile.achievable_flops * speedup)
    if job.training.float8 is None or profile.fp8_peak_flops <= 0:
        return bf16
    if not job.training.compile:
        return float8.blend(job, linears=bf16 * EAGER_FLOAT8_LINEAR_RATE, rest=bf16)
    fp8 = profile.fp8_peak_flops * profile.achievable_fraction * float8.LINEAR_EFFICIENCY
    return float8.blend(
        job, linears=min(profile.fp8_peak_flops, max(bf16, fp8 * speedup)), rest=bf16
    )
