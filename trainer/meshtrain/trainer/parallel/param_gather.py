"""ZeRO-1/2 parameter all-gathers prefetched into the next forward (``parallelism.overlap.paramGather``).

After the optimizer step each bucket's updated shard is queued for an asynchronous all-gather, in
forward order, with at most :data:`IN_FLIGHT` gathers running; a forward pre-hook on each layer
(a block, an embedding, the final norm) waits for the buckets holding that layer's parameters,
writes them into the parameters and launches the next queued gather, so the gather of layer
``i + 1`` runs beside layer ``i``'s compute (Megatron's distributed optimizer with
``overlap_param_gather``).  The values written are the gathered ones, as in the serial path.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from meshtrain.trainer.telemetry import clocks, recording

IN_FLIGHT = 1
"""Gathers running at once: while a layer computes on its bucket, the next bucket is gathered
(each holds a full-size bucket, as the serial path holds one at a time)."""


@dataclasses.dataclass
class Gather:
    """One bucket's all-gather: queued, then in flight, then written into its parameters."""

    index: int
    """The bucket's index."""
    shard: Callable[[], torch.Tensor]
    """Packs this rank's updated elements (shard-sized), from where the step left them."""
    write: Callable[[torch.Tensor], None]
    """Copies the gathered bucket into its parameters."""
    packed: torch.Tensor | None = None
    """The packed shard, kept alive while the collective reads it."""
    full: torch.Tensor | None = None
    """The gathered bucket (allocated at launch)."""
    launch: clocks.Launch | None = None
    """The collective in flight."""
    looked: clocks.Stamp | None = None
    """When the next step first waited for a gather, if this one was launched before that step:
    its recorded start, so that a step's events lie inside the step (the part before ran while
    the last step ended and this one began, hidden)."""


def _all_gather(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Start gathering every rank's ``shard`` into ``full``."""
    work = dist.all_gather_into_tensor(full, shard, group=group, async_op=True)
    assert work is not None  # async_op=True always returns a handle
    return work


class GatherQueue:
    """Bucket all-gathers launched in queue order, bounded in flight, settled on demand."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        size: int,
        recorder: recording.StepRecorder,
        clock: clocks.Clock,
    ) -> None:
        self.group, self.size = group, size
        self.recorder, self.clock = recorder, clock
        self._queued: list[Gather] = []  # not launched, in launch order
        self._flying: dict[int, Gather] = {}  # bucket index -> launched, not yet written
        self.waits: list[tuple[clocks.Stamp, clocks.Stamp]] = []
        """Intervals the training thread blocked on a gather (drained by :meth:`take_waits`)."""
        self._fresh = False  # gathers were queued by a step and no one has waited since

    def _look(self) -> None:
        """The first wait after a step's queueing: the gathers in flight are recorded from now."""
        if self._fresh:
            self._fresh = False
            now = self.clock.now()
            for gather in self._flying.values():
                gather.looked = now

    def __bool__(self) -> bool:
        return bool(self._queued or self._flying)

    def put(self, gather: Gather) -> None:
        """Queue ``gather``; it starts as soon as fewer than :data:`IN_FLIGHT` are running."""
        self._queued.append(gather)
        self._fresh = True
        self._fill()

    def _fill(self) -> None:
        while self._queued and len(self._flying) < IN_FLIGHT:
            gather = self._queued.pop(0)
            shard = gather.packed = gather.shard()
            gather.full = torch.empty(
                shard.numel() * self.size, dtype=shard.dtype, device=shard.device
            )
            gather.launch = self.clock.launch(
                functools.partial(_all_gather, gather.full, shard, self.group)
            )
            self._flying[gather.index] = gather

    def settle(self, indices: Iterable[int]) -> None:
        """Wait for the gathers of bucket ``indices`` (launching them first if still queued) and write them."""
        wanted = set(indices)
        self._look()
        while wanted & ({g.index for g in self._queued} | set(self._flying)):
            flying = [i for i in self._flying if i in wanted]
            if not flying:  # still queued: wait for the oldest in flight to make room
                flying = [next(iter(self._flying))]
            self._land(self._flying.pop(flying[0]))
            self._fill()

    def settle_all(self) -> None:
        """Wait for and write every queued and in-flight gather."""
        self._look()
        while self:
            if not self._flying:
                self._fill()
            self._land(self._flying.pop(next(iter(self._flying))))
            self._fill()

    def _land(self, gather: Gather) -> None:
        assert gather.launch is not None and gather.full is not None
        blocked = self.clock.now()
        gather.launch.wait()
        end = (
            self.clock.now()
        )  # on CUDA, where the compute stream passes the wait (after ``looked``)
        self.waits.append((blocked, end))
        full = gather.full
        # stamps are floats on the host clock, CUDA events for the DeferredRecorder (see clocks)
        record: Callable[..., None] = self.recorder.collective
        start = gather.launch.start if gather.looked is None else gather.looked
        record("dp", "all_gather", full.numel() * full.element_size(), start, end)
        gather.write(full)
        gather.packed = gather.full = None

    def take_waits(self) -> list[tuple[clocks.Stamp, clocks.Stamp]]:
        """The blocked intervals since the last call (cleared)."""
        waits, self.waits = self.waits, []
        return waits


def layer_waits(
    chunks: Iterable[torch.nn.Module], bucket_of: Callable[[torch.nn.Parameter], set[int]]
) -> list[tuple[torch.nn.Module, set[int]]]:
    """(module, buckets its forward needs) for every layer of the chunks, in forward order.

    A layer is a transformer block (a compiled block's hook stays outside its compiled
    forward) or a module with parameters of its own outside the blocks.  The head's weight
    is read by the loss without calling the module (chunked loss), so its buckets are
    awaited with the final norm's, or with the chunk's own when there is no norm.
    """
    found: list[tuple[torch.nn.Module, set[int]]] = []
    for chunk in chunks:
        blocks = list(getattr(chunk, "blocks", {}).values())
        inside = {id(m) for b in blocks for m in b.modules()}
        head = getattr(chunk, "head", None)
        head_buckets = (
            {i for p in head.parameters() for i in bucket_of(p)} if head is not None else set()
        )
        norm = getattr(chunk, "norm", None)
        own = {i for p in chunk.parameters(recurse=False) for i in bucket_of(p)}
        found.append((chunk, own if norm is not None else own | head_buckets))
        for module in chunk.modules():
            if module is chunk or module is head:
                continue
            is_block = any(module is b for b in blocks)
            if not is_block and (
                id(module) in inside or next(module.parameters(recurse=False), None) is None
            ):
                continue
            needs = {i for p in module.parameters() for i in bucket_of(p)}
            found.append((module, needs | head_buckets if module is norm else needs))
    return [(m, needs) for m, needs in found if needs]
