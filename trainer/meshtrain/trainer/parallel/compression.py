"""Gradient compression on the data-parallel reduction (``parallelism.gradientCompression``).

:class:`CompressedGradReducer` keeps the reducer's buckets and replaces a bucket's all-reduce by a
compressed exchange (bf16 or fp16, int8, top-k, PowerSGD) that leaves the approximate mean in it.
int8, topk and powersgd keep error feedback in :attr:`CompressedGradReducer.state`, which
checkpoints carry.  Exchanges run per bucket, overlapped with backward (:mod:`.exchanges`), and
report their real payload.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshtrain.trainer.parallel import exchanges, reducer
from meshtrain.trainer.telemetry import clocks

MODES = ("none", "bf16", "fp16", "int8", "topk", "powersgd")
CAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


INT8_LEVELS = 127


def quantise_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` on 127 levels of its own max magnitude: (int8 values, fp32 scale of shape (1,))."""
    scale = x.abs().max().reshape(1).float().clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(x.float() / scale * INT8_LEVELS).clamp_(-INT8_LEVELS, INT8_LEVELS)
    return q.to(torch.int8), scale


def dequantise_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * (scale / INT8_LEVELS)


def mean_of_int8(payloads: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Mean over ranks of (ranks, n) int8 payloads with one scale each, summed in fp32.

    Rank by rank, so the temporaries stay one fp32 bucket whatever the group size.
    """
    steps = scales.float() / (INT8_LEVELS * payloads.shape[0])
    out = torch.zeros(payloads.shape[1], dtype=torch.float32, device=payloads.device)
    for payload, step in zip(payloads, steps):
        out.add_(payload.float() * step)
    return out


class CompressedGradReducer(exchanges.QueuedGradReducer):
    """A gradient reducer whose per-bucket exchange is compressed (one ``_exchange_<mode>`` each).

    Error feedback adds what a rank's compression dropped this step to its gradient next step.
    Each bucket's exchange touches only its own state, so overlapping the exchanges with backward
    gives the arithmetic of exchanging them one by one after it.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter] | list[list[torch.nn.Parameter]],
        *,
        mode: str,
        rank: int = 4,
        topk_ratio: float = 0.01,
        warm_start: bool = True,
        **reducer_args: Any,
    ) -> None:
        """``reducer_args`` are :class:`~.reducer.GradReducer`'s (group, group_size, bucket_mb, recorder, clock)."""
        if mode not in MODES or mode == "none":
            raise ValueError(f"compression mode must be one of {MODES[1:]}, got {mode!r}")
        super().__init__(params, **reducer_args)
        self.mode, self.rank, self.topk_ratio, self.warm_start = mode, rank, topk_ratio, warm_start
        self.state: dict[str, torch.Tensor] = {}
        """Error feedback (``error/<bucket>/<member>``) and PowerSGD's Q (``q/<bucket>/<member>``)."""
        self.sent_bytes = 0
        """Payload bytes of the last step's compressed collectives."""
        self.dense_bytes = 0
        """Payload bytes the same step's plain all-reduce would have had."""
        self._sending = 0
        """Payload bytes of this step's compressed collectives so far (the exchange thread adds)."""
        self._create_state()

    def _create_state(self) -> None:
        """Every state tensor now, as the first step would create it, so a checkpoint can load into it."""
        for bucket in self.buckets:
            if self.mode in ("int8", "topk"):
                self._error(bucket, 0, bucket.buffer)
            elif self.mode == "powersgd":
                for member, param in enumerate(bucket.params):
                    m = self._matrix(param)
                    if m is not None:
                        self._error(bucket, member, m)
                        self.state[f"q/{bucket.index}/{member}"] = self._fresh_q(bucket, member, m)

    def _matrix(self, param: torch.Tensor) -> torch.Tensor | None:
        """The (rows, columns) view PowerSGD compresses, or None for a tensor sent uncompressed."""
        grad = param.grad if param.grad is not None else param.detach()
        m = grad.reshape(grad.shape[0], -1) if grad.dim() >= 2 else None
        return (
            m if m is not None and min(m.shape) > self.rank else None
        )  # rank r saves bytes only below min(n, m)

    def _fresh_q(self, bucket: reducer.Bucket, member: int, m: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(bucket.index * 1000 + member)
        return torch.randn(m.shape[1], self.rank, generator=generator).to(m)

    @property
    def compression_ratio(self) -> float:
        """Uncompressed over compressed payload of the last step (1 before the first)."""
        return self.dense_bytes / self.sent_bytes if self.sent_bytes else 1.0

    def payload_bytes(self) -> tuple[int, int]:
        """(uncompressed, sent) payload bytes of the last step (the plain all-reduce's, the compressed collectives')."""
        return (self.dense_bytes, self.sent_bytes) if self.sent_bytes else super().payload_bytes()

    def _exchange(self, bucket: reducer.Bucket) -> None:
        """Exchange the bucket compressed, leaving the (approximate) mean gradient in it."""
        getattr(self, f"_exchange_{self.mode}")(bucket)

    def _settled(self) -> None:
        self.sent_bytes, self._sending = self._sending, 0
        self.dense_bytes = sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def discard_step(self) -> None:
        """A skipped update's gradients are dropped, so is what error feedback kept of them.

        Without this a non-finite step would leave NaN in the error (and in
        PowerSGD's warm-start Q), and every later step would be NaN too.  The
        same on every rank: the guard's verdict and Q (all-reduced) agree.
        """
        for key, tensor in self.state.items():
            if key.startswith("error/"):
                tensor.zero_()
            elif not bool(torch.isfinite(tensor).all()):  # q/<bucket>/<member>: its fresh start
                bucket, member = (int(x) for x in key.split("/")[1:])
                generator = torch.Generator().manual_seed(bucket * 1000 + member)
                tensor.copy_(torch.randn(tensor.shape, generator=generator))

    # --- the collectives, recorded ---------------------------------------------------

    def _all_reduce(
        self,
        tensor: torch.Tensor,
        bucket: reducer.Bucket,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    ) -> None:
        start = self.clock.now()
        dist.all_reduce(tensor, op=op, group=self.group)
        self._record("all_reduce", tensor, start, bucket)

    def _all_gather(self, tensor: torch.Tensor, bucket: reducer.Bucket) -> torch.Tensor:
        out = torch.empty(
            tensor.numel() * self.group_size, dtype=tensor.dtype, device=tensor.device
        )
        start = self.clock.now()
        dist.all_gather_into_tensor(out, tensor, group=self.group)
        self._record("all_gather", out, start, bucket)
        return out

    def _record(
        self, op: str, tensor: torch.Tensor, start: clocks.Stamp, bucket: reducer.Bucket
    ) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self._sending += nbytes
        end = self.clock.now()
        self.recorder.collective("dp", op, nbytes, start, end, bucket=bucket.index)  # type: ignore[arg-type]

    def _error(self, bucket: reducer.Bucket, member: int, like: torch.Tensor) -> torch.Tensor:
        key = f"error/{bucket.index}/{member}"
        if key not in self.state:
            self.state[key] = torch.zeros_like(like)
        return self.state[key]

    # --- the modes --------------------------------------------------------------------

    def _exchange_bf16(self, bucket: reducer.Bucket) -> None:
        """All-reduce in 16 bits (bf16 or fp16): 2 bytes per element."""
        low = bucket.buffer.div(self.group_size).to(CAST[self.mode])  # mean first: no fp16 overflow
        self._all_reduce(low, bucket)
        bucket.buffer.copy_(low)

    _exchange_fp16 = _exchange_bf16

    def _exchange_int8(self, bucket: reducer.Bucket) -> None:
        """Each rank's values on 127 levels of its own scale; payloads and scales all-gathered.

        Every rank dequantises and sums them in fp32, so the precision does not shrink with the
        group size; the wire carries ``N x n`` bytes, gathered, against ``4 x n`` for an fp32
        all-reduce.
        """
        x = bucket.buffer.add_(self._error(bucket, 0, bucket.buffer))
        q, scale = quantise_int8(x)
        self._error(bucket, 0, x).copy_(x - dequantise_int8(q, scale))
        scales = self._all_gather(scale, bucket)
        payloads = self._all_gather(q, bucket).view(self.group_size, -1)
        bucket.buffer.copy_(mean_of_int8(payloads, scales))

    def _exchange_topk(self, bucket: reducer.Bucket) -> None:
        """Each rank's ``ratio x n`` largest-magnitude elements, all-gathered and scatter-added.

        Values and int32 indices travel.
        """
        x = bucket.buffer.add_(self._error(bucket, 0, bucket.buffer))
        k = max(1, int(self.topk_ratio * x.numel()))
        index = x.abs().topk(k, sorted=False).indices
        values = x[index]
        error = self._error(bucket, 0, x)
        error.copy_(x)
        error[index] = 0
        all_values = self._all_gather(values, bucket)
        all_index = self._all_gather(index.to(torch.int32), bucket)
        bucket.buffer.zero_().index_add_(0, all_index.long(), all_values).div_(self.group_size)

    def _exchange_powersgd(self, bucket: reducer.Bucket) -> None:
        """PowerSGD (Vogels et al. 2019): every matrix ``M`` as ``P Q^T`` of rank r.

        One power iteration: ``P = M Q`` (all-reduced, orthonormalised), then ``Q = M^T P``
        (all-reduced); ``Q`` is kept for the next step (warm start).  Vectors and matrices too
        small to gain travel uncompressed in one all-reduce.
        """
        r = self.rank
        matrices, rest = [], []
        for member, param in enumerate(bucket.params):
            assert param.grad is not None  # a view into the bucket, set by the reducer
            m = self._matrix(param)
            if m is not None:
                matrices.append((member, m))
            else:
                rest.append(param.grad)
        if rest:  # uncompressed, one collective
            flat = torch.cat([g.reshape(-1) for g in rest])
            self._all_reduce(flat, bucket)
            offset = 0
            for g in rest:
                g.copy_(flat[offset : offset + g.numel()].view_as(g) / self.group_size)
                offset += g.numel()
        if not matrices:
            return
        qs = []
        for member, m in matrices:
            m.add_(self._error(bucket, member, m))
            key = f"q/{bucket.index}/{member}"
            if not self.warm_start:
                self.state[key].copy_(self._fresh_q(bucket, member, m))
            qs.append(self.state[key])
        ps = torch.cat([(m @ q).reshape(-1) for (_, m), q in zip(matrices, qs)])
        self._all_reduce(ps, bucket)
        offset, p_list = 0, []
        for _, m in matrices:
            p = ps[offset : offset + m.shape[0] * r].view(m.shape[0], r)
            p_list.append(torch.linalg.qr(p).Q)
            offset += m.shape[0] * r
        qs_new = torch.cat([(m.T @ p).reshape(-1) for (_, m), p in zip(matrices, p_list)])
        self._all_reduce(qs_new, bucket)
        qs_new.div_(self.group_size)
        offset = 0
        for (member, m), p in zip(matrices, p_list):
            q = qs_new[offset : offset + m.shape[1] * r].view(m.shape[1], r)
            offset += m.shape[1] * r
            approx = p @ q.T  # the mean gradient, rank r
            self._error(bucket, member, m).copy_(m - approx)
            self.state[f"q/{bucket.index}/{member}"].copy_(
                q
            )  # in place: checkpoint entries are views
            m.copy_(approx)
