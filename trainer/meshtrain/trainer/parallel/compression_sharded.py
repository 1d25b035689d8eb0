"""Gradient compression on ZeRO-2's reduce-scatter (``parallelism.gradientCompression`` with ``zeroStage: 2``).

ZeRO-2 reduce-scatters every bucket after every micro-batch's backward (:class:`~.zero.ShardedGradReducer`);
here that exchange is compressed, per mode:

* bf16 / fp16: the reduce-scatter itself in 16 bits (the mean taken first: no fp16 overflow), on
  ZeRO-2's own asynchronous launch, overlapped with backward as the plain reduce-scatter is;
* int8: each rank quantises each destination's shard on its own scale (one per shard, not one
  per bucket) and an all-to-all sends each rank only its shard: ``n`` int8 bytes and ``N`` scales
  per rank, where ZeRO 0/1's int8 gathers ``N x n``; the owner sums in fp32;
* topk and powersgd: the compressed all-reduce of ZeRO 0/1 (top-k values and indices gathered;
  PowerSGD's P and Q all-reduced), after which each rank keeps its shard of the decompressed mean.
  Their payload does not shrink with the shard, but it is what makes them sound: PowerSGD's
  factors describe whole matrices, and a matrix straddles the shard boundaries.

Error feedback is kept for the whole (padded) bucket, as under ZeRO 0/1: it is what this rank's
compression dropped, which no other rank knows.  int8, topk and powersgd run inline in backward's
hook (not overlapped), once per micro-batch as ZeRO-2 reduces after every backward: ``M`` times
ZeRO 0/1's payload per step with ``M`` micro-batches; the warm-up's exact steps and the casts keep
ZeRO-2's own asynchronous reduce-scatter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshtrain.trainer.parallel import compression, reducer, zero


class CompressedShardedGradReducer(compression.Compressing, zero.ShardedGradReducer):
    """ZeRO-2's gradient reduction with a compressed reduce-scatter, after an exact warm-up."""

    split_tensors = False

    def __init__(
        self,
        params: list[torch.nn.Parameter] | list[list[torch.nn.Parameter]],
        *,
        settings: compression.Settings,
        **reducer_args: Any,
    ) -> None:
        """``reducer_args`` are :class:`~.reducer.GradReducer`'s (group, group_size, bucket_mb, recorder, clock)."""
        super().__init__(params, **reducer_args)
        self._start_compressing(settings)
        self._dense = 0
        """This step's plain exchanges' payload so far (every micro-batch's reduce-scatters)."""
        for bucket in self.buckets:
            full = self._padded(bucket)
            if sum(p.numel() for p in bucket.params) > full.numel():  # whole members only
                raise ValueError(
                    f"bucket {bucket.index} holds part of a parameter: compression on ZeRO-2 needs "
                    "whole parameters per bucket (PowerSGD compresses whole matrices)"
                )
            self.compressor.create_state(bucket.index, full, compression.shapes(bucket))

    def _padded(self, bucket: reducer.Bucket) -> torch.Tensor:
        shard = bucket.buffer
        return torch.empty(shard.numel() * self.group_size, dtype=shard.dtype, device=shard.device)

    def _launch(self, bucket: reducer.Bucket) -> None:
        """Warm-up and the 16-bit casts: ZeRO-2's asynchronous reduce-scatter (:meth:`_on_wire` casts);
        int8, topk and powersgd: pack, compress and add the mean shard inline."""
        if self.exact or self.settings.mode in compression.CAST:
            super()._launch(bucket)
            return
        full = self._pack(bucket)
        self._dense += full.numel() * full.element_size()
        shard = self._scatter_mean(bucket.index, full, compression.shapes(bucket))
        bucket.buffer.add_(shard, alpha=self.group_size)  # finish() divides the sums
        bucket.ready = 0

    def _on_wire(self, full: torch.Tensor) -> tuple[torch.Tensor, float]:
        """After the warm-up a 16-bit cast sends the mean (no fp16 overflow); the shard takes it times N."""
        if self.exact or self.settings.mode not in compression.CAST:
            return super()._on_wire(full)
        self._dense += full.numel() * full.element_size()
        low = full.div_(self.group_size).to(compression.CAST[self.settings.mode])
        self.compressor.sending += low.numel() * low.element_size()
        return low, float(self.group_size)

    def _scatter_mean(
        self, index: int, full: torch.Tensor, shapes: list[torch.Size]
    ) -> torch.Tensor:
        """This rank's shard of the int8, topk or powersgd mean of ``full`` (every rank's packed bucket)."""
        mode, size = self.settings.mode, self.group_size
        s = full.numel() // size
        if mode == "int8":
            return self._scatter_int8(index, full.view(size, s))
        self.compressor.mean(index, full, shapes)  # topk, powersgd: the whole mean ...
        me = dist.get_rank(self.group)
        return full.narrow(0, me * s, s)  # ... of which this rank keeps its shard

    def _scatter_int8(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        """Row ``j`` (rank ``j``'s shard) on 127 levels of its own scale; an all-to-all delivers each row to its owner."""
        flat = rows.view(-1)
        error = self.compressor.error(index, 0, flat)
        x = rows.add_(error.view_as(rows))
        q, scales = compression.quantise_int8(x)
        error.copy_((x - compression.dequantise_int8(q, scales)).view(-1))
        got, got_scales = torch.empty_like(q), torch.empty_like(scales)
        for sent, received in ((scales, got_scales), (q, got)):
            start = self.clock.now()
            dist.all_to_all_single(received, sent, group=self.group)
            self.compressor.record("all_to_all", sent, start, index)
        return compression.mean_of_int8(got, got_scales).to(rows.dtype)

    def finish(self) -> None:
        """As ZeRO-2's; then the step's payload is settled."""
        super().finish()
        self.sent_bytes, self.compressor.sending = self.compressor.sending, 0
        self.dense_bytes, self._dense = self._dense, 0
