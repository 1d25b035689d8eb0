"""``training.float8``: the blocks' linears as torchao's float8 linears, and where they cannot run.

torchao's float8 training (``convert_to_float8_training``) swaps ``torch.nn.Linear`` for
``Float8Linear``: input, weight and output gradient are cast to float8 with dynamic scales (one
per tensor, or one per row) and multiplied by torch's scaled matmul.  The weight stays the same
fp32 Parameter under the same name, so checkpoints, the gradient reducers and ZeRO see nothing
new.  As TorchTitan does, the head (the loss is sensitive to it) and the embeddings stay bf16,
and so does every linear whose dimensions the scaled matmul cannot take (not multiples of 16).

torchao is imported only when a job asks for fp8: every other job runs without it, on any torch
the trainer supports (torchao 0.18 needs torch 2.11 or newer: the CUDA 12 image, on torch 2.10,
refuses fp8 with the fix named, before any process group).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from meshtrain.api.spec import training as api_training

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with float8 tensor cores (Ada L40S 8.9, Hopper 9.0)."""
ALIGNMENT = 16
"""torch's scaled matmul needs both dimensions of a weight divisible by this."""
MIN_TORCH = (2, 11)
"""The oldest torch torchao 0.18 (the version pyproject's trainer extra pins) builds its float8 for."""
KEPT_BF16 = ("head",)
"""Linears left in bf16 by name (TorchTitan leaves its ``output`` projection)."""


class Float8Unavailable(ValueError):
    """``training.float8`` on a device that cannot run float8 matmuls."""


def device_problem(device: torch.device) -> str | None:
    """Why float8 matmuls cannot run on ``device`` (None: they can)."""
    need = ".".join(map(str, MIN_CAPABILITY))
    if device.type != "cuda":
        return (
            f"training.float8 is set but this rank runs on {device.type}: float8 matmuls need a GPU of "
            f"compute capability {need} or newer (H100, H200, L40S); remove training.float8 or run on such a GPU"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"training.float8 is set but {name} has compute capability "
            f"{capability[0]}.{capability[1]}, below {need}: it has no float8 tensor cores; remove "
            "training.float8 (bf16 runs there) or run on an H100, H200 or L40S"
        )
    return None


def library_problem(torch_version: str) -> str | None:
    """Why torchao's float8 training cannot run beside torch ``torch_version`` (None: it can)."""
    found = re.match(r"(\d+)\.(\d+)", torch_version)
    need = ".".join(map(str, MIN_TORCH))
    if found is not None and (int(found[1]), int(found[2])) < MIN_TORCH:
        return (
            f"training.float8 is set but this rank has torch {torch_version}: torchao's float8 "
            f"training needs torch {need} or newer (the CUDA 12 image ships torch 2.10); remove "
            "training.float8 or use the CUDA 13 image (a torch 2.11+ build with torchao)"
        )
    try:
        importlib.import_module("torchao.float8")
    except ImportError as err:
        return (
            f"training.float8 is set but torchao's float8 training does not import ({err}): "
            "install meshtrain[trainer] (torchao>=0.18) beside torch "
            f"{need}+ or remove training.float8"
        )
    return None


def check_device(spec: api_training.Float8 | None, device: torch.device) -> None:
    """Raise :class:`Float8Unavailable` when ``spec`` asks for fp8 on a device without it, or
    where torch or torchao cannot run torchao's float8 training."""
    problem = (device_problem(device) or library_problem(torch.__version__)) if spec else None
    if problem is not None:
        raise Float8Unavailable(problem)


def converts(module: nn.Module, fqn: str) -> bool:
    """Whether the linear ``module`` at ``fqn`` becomes a float8 linear (torchao's filter)."""
    if not isinstance(module, nn.Linear) or fqn.rsplit(".", 1)[-1] in KEPT_BF16:
        return False
    return module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0


def config_for(spec: api_training.Float8) -> Any:
    """torchao's ``Float8LinearConfig`` of the spec's recipe (torchao's own recipe names)."""
    torchao_float8 = importlib.import_module("torchao.float8")
    return torchao_float8.Float8LinearConfig.from_recipe_name(spec.recipe)


def apply_float8(chunks: Sequence[nn.Module], config: Any) -> list[str]:
    """Swap every chunk's convertible linears (:func:`converts`) for float8 ones, in place.

    ``config`` is a torchao ``Float8LinearConfig`` (:func:`config_for`).  Returns the converted
    linears' names, chunk by chunk.  The swap keeps each weight Parameter, so it may run on a
    model already on its device and before anything hooks the parameters.
    """
    torchao_float8 = importlib.import_module("torchao.float8")
    converted: list[str] = []
    for chunk in chunks:
        names = [fqn for fqn, module in chunk.named_modules() if converts(module, fqn)]
        torchao_float8.convert_to_float8_training(chunk, config=config, module_filter_fn=converts)
        converted.extend(names)
    return converted
