"""Peak memory from allocations: the bytes of live tensor storages, tracked on any device.

CUDA has ``torch.cuda.max_memory_allocated``; a CPU has nothing like it (the resident set counts
the allocator's cache, the corpus and the interpreter).  :class:`LiveBytes` is a dispatch mode that
counts each new storage until it is freed, and FSDP2's in-place storage resizes too.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of tensor storages created under the mode (plus those registered).

    Each new storage counts once, until it is freed (a weak reference's callback), so ``peak`` is
    the high-water mark of live tensor bytes as the CUDA caching allocator reports it, less the
    allocator's rounding.  Tensors that exist before the mode is entered (weights, gradient
    buckets, optimizer state) are registered with :meth:`track`.  FSDP2 (ZeRO-3) allocates and
    frees a unit's gathered parameters with ``UntypedStorage.resize_``, which no dispatch mode
    sees: while the mode is active that method is wrapped (as PyTorch's own ``MemTracker`` does),
    so a resize moves ``current`` by the difference; an ``aten.resize_``/``set_`` output is re-read
    after the op.  A DTensor counts as its local shard.

    Not seen: tensors made without an op (``torch.from_numpy``) and a collective's internal
    staging buffers.  It costs a Python call per op: for tests and benchmarks, not production
    steps.  Not ``torch.distributed._tools.mem_tracker.MemTracker``: a private module whose
    per-module attribution copies a snapshot at every new peak; this is its core (storage weak
    references) without the rest.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.current = 0
        """Bytes of storages alive now."""
        self.peak = 0
        """Highest ``current`` since the last :meth:`reset_peak`."""
        self._alive: dict[int, int] = {}  # id of a tracked storage -> its bytes
        # the bucket exchange thread counts too (exchanges.ExchangeQueue); reentrant: a storage's
        # finalizer (_free) can run inside _account on the same thread
        self._lock = threading.RLock()

    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count storages that already exist (each once; a DTensor by its local shard)."""
        for t in tensors:
            if t is not None:
                self._add(t)
        self.peak = max(self.peak, self.current)

    def reset_peak(self) -> None:
        """Start a new high-water mark from what is alive now."""
        self.peak = self.current

    def __enter__(self) -> LiveBytes:
        super().__enter__()  # type: ignore[no-untyped-call]
        self._original_resize = torch.UntypedStorage.resize_
        original, account = self._original_resize, self._account

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            account(storage)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def _add(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):
            # a DTensor's own storage is a placeholder of the global size: count its local shard
            names, _ = t.__tensor_flatten__()
            for inner in (getattr(t, name) for name in names):
                if isinstance(inner, torch.Tensor):
                    self._add(inner)
        elif t.device.type != "meta":
            self._account(t.untyped_storage())

    def _account(self, storage: torch.UntypedStorage) -> None:
        """Count a storage's bytes now: a new one whole, a known one by how much it changed."""
        key, nbytes = id(storage), storage.nbytes()
        with self._lock:
            known = self._alive.get(key)
            if known is None:
                weakref.finalize(storage, self._free, key)
                known = 0
            self._alive[key] = nbytes
            self.current += nbytes - known
            self.peak = max(self.peak, self.current)

    def _free(self, key: int) -> None:
        with self._lock:
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
        with self._lock:
            self.peak = max(self.peak, self.current)
        return out
