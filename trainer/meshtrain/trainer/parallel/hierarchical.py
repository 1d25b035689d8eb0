"""Hierarchical data-parallel all-reduce (``parallelism.allReduce: hierarchical``).

:class:`HierarchicalGradReducer` replaces a bucket's all-reduce by a reduce-scatter among the
``k`` ranks of its node, an all-reduce of that ``1/k`` shard across the nodes and an all-gather
on the node (:meth:`meshtrain.api.layout.ParallelLayout.dp_levels`), so only ``1/k`` of the bytes
cross the inter-node fabric.  The three run as one chain (:mod:`.exchanges`), overlapped with
backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshtrain.trainer.parallel import exchanges, reducer
from meshtrain.trainer.telemetry import recording


class HierarchicalGradReducer(exchanges.QueuedGradReducer):
    """A gradient reducer whose per-bucket all-reduce goes intra-node, inter-node, intra-node."""

    def __init__(
        self,
        params: list[torch.nn.Parameter] | list[list[torch.nn.Parameter]],
        *,
        intra: dist.ProcessGroup,
        inter: dist.ProcessGroup,
        **reducer_args: Any,
    ) -> None:
        """``reducer_args`` are :class:`~.reducer.GradReducer`'s (group, group_size, bucket_mb, recorder, clock)."""
        super().__init__(params, **reducer_args)
        self.intra, self.inter = intra, inter
        self.intra_size = dist.get_world_size(intra)

    def _exchange(self, bucket: reducer.Bucket) -> None:
        buffer, k = bucket.buffer, self.intra_size
        shard_numel = -(-buffer.numel() // k)
        full = torch.zeros(shard_numel * k, dtype=buffer.dtype, device=buffer.device)
        full.narrow(0, 0, buffer.numel()).copy_(buffer)
        shard = torch.empty(shard_numel, dtype=buffer.dtype, device=buffer.device)
        self._timed(
            "reduce_scatter",
            "intra",
            full,
            bucket,
            lambda: dist.reduce_scatter_tensor(shard, full, group=self.intra),
        )
        self._timed(
            "all_reduce", "inter", shard, bucket, lambda: dist.all_reduce(shard, group=self.inter)
        )
        self._timed(
            "all_gather",
            "intra",
            full,
            bucket,
            lambda: dist.all_gather_into_tensor(full, shard, group=self.intra),
        )
        buffer.copy_(full.narrow(0, 0, buffer.numel()))

    def _settled(self) -> None:
        for bucket in self.buckets:  # sums into means
            bucket.buffer.div_(self.group_size)

    def _timed(
        self,
        op: str,
        level: recording.Level,
        payload: torch.Tensor,
        bucket: reducer.Bucket,
        run: Any,
    ) -> None:
        start = self.clock.now()
        run()
        end, nbytes = self.clock.now(), payload.numel() * payload.element_size()
        # stamps are floats on the host clock, CUDA events for the DeferredRecorder (see clocks)
        record: Any = self.recorder.collective
        record("dp", op, nbytes, start, end, bucket=bucket.index, level=level)
