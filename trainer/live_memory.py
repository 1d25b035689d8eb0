"""Peak memory from allocations: the bytes of live tensor storages, tracked on any device.

CUDA has ``torch.cuda.max_memory_allocated``; CPU has nothing like it (the
resident set counts the allocator's cache, the corpus and the interpreter).
:class:`LiveBytes` is a ``TorchDispatchMode`` that sees every tensor an op
creates, counts the bytes of each new storage once, and uncounts them when
the storage is freed (a weak reference's callback), so ``peak`` is the
high-water mark of live tensor bytes, as the CUDA caching allocator reports
it, minus the allocator's rounding.

Tensors that exist before the mode is entered (weights, gradient buckets,
optimizer state) are registered with :meth:`LiveBytes.track`.  Not seen:
tensors made without an op (``torch.from_numpy``) and a collective's
internal staging buffers.  Costs a Python call per op: for tests and
benchmarks, not for production steps.

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: it is a private
module whose per-module attribution copies a snapshot at every new peak; the
count needed here is its core (storage weak references) without the rest.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of tensor storages created under the mode (plus those registered)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.current = 0
        """Bytes of storages alive now."""
        self.peak = 0
        """Highest ``current`` since the last :meth:`reset_peak`."""
        self._alive: dict[int, int] = {}  # id of a tracked storage -> its bytes

    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count storages that already exist (each once)."""
        for t in tensors:
            if t is not None:
                self._add(t)
        self.peak = max(self.peak, self.current)

    def reset_peak(self) -> None:
        """Start a new high-water mark from what is alive now."""
        self.peak = self.current

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._alive:
            return
        nbytes = storage.nbytes()
        self._alive[key] = nbytes
        self.current += nbytes
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._alive.pop(key, 0)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.current)
        return out
