"""Precision recipes: the bytes per parameter of the model state and per activation element.

What a job's precision (``training.precision``, ``auto`` taking the
device profile's) means for the bytes the memory and communication models
count: meshtrain's bf16 autocast recipe, the literature's mixed-precision
Adam, plain fp32.  Pure.
"""

from __future__ import annotations

import dataclasses

from meshtrain.api import spec as api_spec
from meshtrain.planner import profiles


@dataclasses.dataclass(frozen=True)
class StateScheme:
    """Bytes per parameter of the model state and per activation element for one precision recipe."""

    name: str
    """Short name: ``mixed``, ``autocast`` or ``fp32``."""
    weights: int
    """Bytes of the weights the forward pass reads."""
    grads: int
    """Bytes of a gradient (also the element size of the data-parallel gradient reduction)."""
    optimizer: int
    """Bytes of optimizer state (fp32 master copy where there is one, Adam first and second moments)."""
    stream_bytes: int
    """Bytes of a residual-stream element: block inputs, LayerNorm outputs, pipeline activations."""
    matmul_bytes: int
    """Bytes of a matmul output element (Q, K, V, attention output, MLP hidden, row-parallel outputs)."""
    wire_bytes: int
    """Bytes of an activation (or activation-gradient) element sent between pipeline stages or inside the TP group."""

    @property
    def total(self) -> int:
        """Bytes per parameter without sharding (16 for Adam in every recipe)."""
        return self.weights + self.grads + self.optimizer


MIXED = StateScheme(
    "mixed", weights=2, grads=2, optimizer=12, stream_bytes=2, matmul_bytes=2, wire_bytes=2
)
"""Mixed-precision Adam as in the ZeRO paper (Rajbhandari et al. 2020) and Megatron-LM:
16-bit weights and gradients, fp32 master weights and Adam moments (4 + 4 + 4), 16-bit activations."""

AUTOCAST = StateScheme(
    "autocast", weights=4, grads=4, optimizer=8, stream_bytes=4, matmul_bytes=2, wire_bytes=2
)
"""What meshtrain's trainer does for bf16: fp32 weights (the master copy), fp32 gradients and
Adam moments, bf16 autocast for matmuls while LayerNorms and the residual stream stay fp32;
activations cross pipeline stages and the TP group in bf16."""

FP32 = StateScheme(
    "fp32", weights=4, grads=4, optimizer=8, stream_bytes=4, matmul_bytes=4, wire_bytes=4
)
"""Plain fp32 Adam (CPU training): 4 + 4 + (4 m + 4 v), fp32 activations."""

RECIPES = ("meshtrain", "mixed")
"""How bf16 training is accounted: as meshtrain's trainer runs it, or the 2+2+12 literature recipe."""


def resolve_precision(job: api_spec.TrainingJobSpec, profile: profiles.Profile) -> str:
    """The precision a job trains in on a device: ``auto`` takes the profile's."""
    return profile.precision if job.training.precision == "auto" else job.training.precision


def scheme_for(precision: str, recipe: str = "meshtrain") -> StateScheme:
    """The state scheme of a precision: fp32 -> :data:`FP32`; bf16 -> :data:`AUTOCAST` or :data:`MIXED`."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
    if precision == "fp32":
        return FP32
    if precision == "bf16":
        return AUTOCAST if recipe == "meshtrain" else MIXED
    raise ValueError(f"unknown precision {precision!r}; known: bf16, fp32")
