"""Memory accounting: the bytes of weights, gradients and optimizer state one rank really holds.

:func:`measure` adds up the storage of the tensors that exist on this rank (each storage once) and
:class:`MemoryReport` sets it beside the ZeRO paper's formula; :func:`meter` hands telemetry a
measurement for every step.  It lives with parallelism because what a rank holds is what the
sharding leaves it.  Measured, not computed: a lazily created tensor counts once it exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshtrain.trainer.parallel import zero, zero3


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-rank bytes of the training state, measured, with the formula beside it."""

    params: int
    """Elements of the parameters this rank holds (its TP shard of its PP stage)."""
    param_bytes: int
    """Bytes of parameter storage."""
    grad_bytes: int
    """Bytes of gradient storage (reducer buckets or shards, or ``.grad``)."""
    optimizer_bytes: int
    """Bytes of optimizer state (AdamW moments and step counters)."""
    zero_stage: int
    """ZeRO stage in effect."""
    dp: int
    """Data-parallel degree (ZeRO's divisor)."""

    @property
    def total_bytes(self) -> int:
        """Weights + gradients + optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def per_param(self) -> dict[str, float]:
        """Measured bytes per parameter element of each kind."""
        n = max(1, self.params)
        return {
            "params": self.param_bytes / n,
            "grads": self.grad_bytes / n,
            "optimizer": self.optimizer_bytes / n,
        }

    def expected(self) -> dict[str, float]:
        """The formula's bytes per parameter (fp32 weights and gradients, two fp32 AdamW moments)."""
        return zero.expected_bytes_per_param(stage=self.zero_stage, dp=self.dp)

    def as_dict(self) -> dict[str, Any]:
        """Everything, for logs and JSON."""
        return {
            **dataclasses.asdict(self),
            "total_bytes": self.total_bytes,
            "per_param": self.per_param(),
            "expected_per_param": self.expected(),
        }

    def as_metrics(self) -> dict[str, int]:
        """Bytes keyed by the ``component`` label of the exporter's ``meshtrain_memory_bytes`` gauge."""
        return {
            "parameters": self.param_bytes,
            "gradients": self.grad_bytes,
            "optimizer": self.optimizer_bytes,
        }

    def summary(self) -> str:
        """One log line."""
        per, exp = self.per_param(), self.expected()
        return (
            f"state memory (zero {self.zero_stage}, dp {self.dp}, {self.params} params): "
            f"weights {self.param_bytes / 2**20:.1f} MiB ({per['params']:.2f} B/param, formula {exp['params']:.2f}), "
            f"grads {self.grad_bytes / 2**20:.1f} MiB ({per['grads']:.2f}, {exp['grads']:.2f}), "
            f"optimizer {self.optimizer_bytes / 2**20:.1f} MiB ({per['optimizer']:.2f}, {exp['optimizer']:.2f})"
        )


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage, once).

    ``seen``: storages already counted elsewhere, left out (and added to).
    """
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    if isinstance(optimizer, zero.ZeroAdamW):
        return [t for b in optimizer.buckets for t in (b.exp_avg, b.exp_avg_sq)]
    found = []
    for state in optimizer.state.values():
        found += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return found


def _params_of(model: Any) -> list[torch.nn.Parameter]:
    if hasattr(model, "named_params"):  # meshtrain.trainer.parallel.parallelize.ParallelModel
        return [p for _, p in model.named_params]
    if isinstance(model, torch.nn.Module):
        return list(model.parameters())
    return list(model)


def state_tensors(model: Any, optimizer: Any, grad_reducer: Any) -> list[torch.Tensor]:
    """Every tensor of this rank's training state: weights, gradient storage, optimizer state, compression state.

    ZeRO-3's DTensors are given as the local shards that hold the bytes.
    """
    params = _params_of(model)
    grads = [b.buffer for b in grad_reducer.buckets] if grad_reducer is not None else []
    grads += [p.grad for p in params if p.grad is not None]
    compressed = list(getattr(grad_reducer, "state", {}).values())  # error feedback, PowerSGD's Q
    return [zero3.local(t) for t in (*params, *grads, *_optimizer_tensors(optimizer), *compressed)]


def measure(model: Any, optimizer: Any, grad_reducer: Any) -> MemoryReport:
    """Measure this rank's weights, gradients and optimizer state from the tensors themselves.

    ``model`` is the rank's ParallelModel (or a module, or a list of
    parameters); ``grad_reducer`` the data-parallel reducer (None without
    DP), whose bucket buffers are the gradients (full buckets, or shards under
    ZeRO-2).  The ZeRO stage is the optimizer's, the divisor the reducer's group;
    DTensor parameters are ZeRO-3's shards (FSDP2), over their mesh.
    """
    params = _params_of(model)
    seen: set[int] = set()
    param_bytes = storage_bytes(map(zero3.local, params), seen)
    grads = [b.buffer for b in grad_reducer.buckets] if grad_reducer is not None else []
    grads += [p.grad for p in params if p.grad is not None]
    grad_bytes = storage_bytes(map(zero3.local, grads), seen)
    optimizer_bytes = storage_bytes(map(zero3.local, _optimizer_tensors(optimizer)), seen)
    fsdp = next((p for p in params if isinstance(p, DTensor)), None)  # ZeRO-3 (FSDP2)
    return MemoryReport(
        params=sum(p.numel() for p in params),
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
        zero_stage=3 if fsdp is not None else getattr(optimizer, "stage", 0),
        dp=fsdp.device_mesh.size()
        if fsdp is not None
        else grad_reducer.group_size
        if grad_reducer is not None
        else 1,
    )


def meter(model: Any, optimizer: Any, grad_reducer: Any) -> Callable[[], dict[str, int]]:
    """A measurement of the state of :func:`measure`'s arguments, taken again at every call:
    bytes by the exporter's ``component`` (:meth:`MemoryReport.as_metrics`)."""
    return lambda: measure(model, optimizer, grad_reducer).as_metrics()
