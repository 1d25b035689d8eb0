"""Data parallelism: bucketed gradient reduction overlapped with backward.

:class:`GradReducer` packs the parameters, in reverse registration order, into buckets whose flat
buffers the ``.grad`` are views of, and launches a bucket's collective as soon as its last
gradient is final, while backward goes on.  Nothing is sent before the last micro-batch, so a step
makes one collective per bucket.  The collective is one method (:meth:`GradReducer._launch`), which
ZeRO-2 and the chained exchanges replace.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from meshtrain.trainer.telemetry import clocks, recording


@dataclasses.dataclass
class Bucket:
    """A group of parameters whose gradients are reduced together."""

    index: int
    """Position in launch order."""
    params: list[torch.nn.Parameter]
    """Members (their ``.grad`` are views into ``buffer``)."""
    buffer: torch.Tensor
    """Flat gradient storage of the members."""
    ready: int = 0
    """Members whose final gradient arrived this step."""
    work: clocks.Launch | None = None
    """The in-flight collective (launched through the clock), if launched."""
    spans: list[tuple[int, int]] | None = None
    """(first element, elements) of each member's flat slice in this bucket, when a member is
    split over buckets (ZeRO-2); None: every member whole."""

    def members(self) -> list[tuple[torch.nn.Parameter, int, int]]:
        """(parameter, first element, elements) of each member's slice, in flat order."""
        if self.spans is None:
            return [(p, 0, p.numel()) for p in self.params]
        return [(p, first, n) for p, (first, n) in zip(self.params, self.spans)]


def plan_buckets(sizes: list[int], element_size: int, bucket_bytes: int) -> list[list[int]]:
    """Group consecutive tensors (given by numel) into buckets of at least ``bucket_bytes`` (the last may be smaller)."""
    buckets: list[list[int]] = [[]]
    filled = 0
    for index, numel in enumerate(sizes):
        if buckets[-1] and filled >= bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += numel * element_size
    return [b for b in buckets if b]


class GradReducer:
    """Averages gradients over a data-parallel group, bucket by bucket, during backward.

    ``params`` is a list of parameters, or one list per model chunk (interleaved
    pipeline): a bucket then never spans two chunks, so its gradients are all
    final after the same chunk's backward.  A bucket is launched once every member's
    post-accumulate-grad hook has fired in the last micro-batch's backward: each parameter's
    gradient must be accumulated once per backward.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter] | list[list[torch.nn.Parameter]],
        *,
        group: dist.ProcessGroup,
        group_size: int,
        bucket_mb: float,
        recorder: recording.StepRecorder,
        clock: clocks.Clock | None = None,
    ) -> None:
        self.group = group
        self.group_size = group_size
        self.recorder = recorder
        self.clock = clock or clocks.HostClock()
        """Starts and times the collectives (the engine's)."""
        self.sync = True
        """Whether gradients arriving now are final (set per backward by the pipeline executor)."""
        chunks: list[list[torch.nn.Parameter]] = (
            params if params and isinstance(params[0], list) else [params]  # type: ignore[list-item]
        )
        ordered = [p for chunk in reversed(chunks) for p in reversed(chunk) if p.requires_grad]
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        for chunk in reversed(chunks):  # a bucket never spans two model chunks
            by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
            for p in reversed(chunk):
                if p.requires_grad:
                    by_dtype.setdefault(p.dtype, []).append(p)
            for dtype, members in by_dtype.items():
                element = torch.empty((), dtype=dtype).element_size()
                self._add_buckets(members, element, int(bucket_mb * 2**20))
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in ordered]
        self._measured: set[int] | None = None
        self.local_square: torch.Tensor | None = None
        """Squared norm of this replica's own gradient (the measured parameters), summed before the reduction."""

    def measure_local_norm(self, params: list[torch.nn.Parameter]) -> None:
        """Sum, each step, the squared norm of ``params``' gradients as this replica computed them.

        Taken from each bucket just before its reduction is launched (the gradient noise scale's
        small-batch norm); :meth:`take_local_square` reads and resets it.
        """
        self._measured = {id(p) for p in params}

    def _add_buckets(
        self, members: list[torch.nn.Parameter], element_size: int, bucket_bytes: int
    ) -> None:
        """Bucket consecutive ``members`` (one chunk, one dtype) by :func:`plan_buckets`."""
        for indices in plan_buckets([p.numel() for p in members], element_size, bucket_bytes):
            self._add_bucket([members[i] for i in indices])

    def _add_bucket(self, members: list[torch.nn.Parameter]) -> None:
        buffer = torch.zeros(
            sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device
        )
        offset = 0
        for p in members:
            p.grad = buffer[offset : offset + p.numel()].view_as(
                p
            )  # autograd accumulates into it in place
            offset += p.numel()
        bucket = Bucket(index=len(self.buckets), params=members, buffer=buffer)
        for p in members:
            self._bucket_of[id(p)] = bucket
        self.buckets.append(bucket)

    def start_step(self, step: int) -> None:
        """Optimizer step ``step`` (1-based; the restored count on resume) begins (compression's warm-up reads it)."""

    def set_sync(self, final: bool) -> None:
        """Say whether the coming backward produces final gradients (last micro-batch)."""
        self.sync = final

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self.sync:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._note_local(bucket)
            self._launch(bucket)

    def _note_local(self, bucket: Bucket) -> None:
        if self._measured is None:
            return
        grads = [p.grad for p in bucket.params if id(p) in self._measured and p.grad is not None]
        if not grads:
            return
        norms = torch._foreach_norm([g.detach() for g in grads], 2, dtype=torch.float32)
        square = torch.stack(norms).double().square().sum()
        self.local_square = square if self.local_square is None else self.local_square + square

    def take_local_square(self) -> torch.Tensor | None:
        """This step's local squared norm (None when not measured), reset for the next step."""
        square, self.local_square = self.local_square, None
        return square

    def _launch(self, bucket: Bucket) -> None:
        """Start the bucket's collective (all-reduce of the sum); ZeRO-2 would reduce-scatter here."""
        nbytes = bucket.buffer.numel() * bucket.buffer.element_size()
        bucket.work = self.clock.launch(
            lambda: dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        )
        bucket.work.report_when_done(  # host: on completion, from the communication thread; CUDA: now, as events
            lambda start, end: self.recorder.collective(
                "dp", "all_reduce", nbytes, start, end, bucket=bucket.index
            )
        )

    def finish(self) -> None:
        """Wait for every bucket (launching any still pending) and divide by the group size."""
        for bucket in self.buckets:
            if bucket.work is None:
                self._note_local(bucket)
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.buffer.div_(self.group_size)
            bucket.work = None
            bucket.ready = 0
        self.sync = True

    def zero_grad(self) -> None:
        """Zero the gradient buffers in place (the ``.grad`` views must survive)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def payload_bytes(self) -> tuple[int, int]:
        """(uncompressed, sent) payload bytes of a step's gradient reduction: equal without compression."""
        dense = sum(n * p.element_size() for b in self.buckets for p, _, n in b.members())
        return dense, dense

    def discard_step(self) -> None:
        """The step's update was skipped (the loss guard): carry nothing of it into the next step."""

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
