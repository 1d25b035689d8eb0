"""Gradient compression on the data-parallel reduction (``parallelism.gradientCompression``).

:class:`Compressor` turns a flat gradient buffer into the approximate mean over the group (bf16
or fp16, int8, top-k, PowerSGD) and keeps the error feedback that int8, topk and powersgd need,
which checkpoints carry.  :class:`CompressedGradReducer` runs it per bucket in place of the
all-reduce, overlapped with backward (:mod:`.exchanges`); ZeRO-2's reduce-scatter uses it through
:mod:`.compression_sharded`.  For the first ``warmup_steps`` optimizer steps both reduce exactly
(the plain fp32 collective), as torch's PowerSGD hook does before ``start_powerSGD_iter``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.trainer.parallel import exchanges, reducer
from meshtrain.trainer.telemetry import clocks, recording

MODES = ("none", "bf16", "fp16", "int8", "topk", "powersgd")
CAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


INT8_LEVELS = 127


def quantise_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` on 127 levels of its own max magnitude, row by row: (int8 values, fp32 scales).

    A flat ``x`` has one scale of shape (1,); an (N, s) ``x`` one per row, shape (N, 1).
    """
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(x.float() / scale * INT8_LEVELS).clamp_(-INT8_LEVELS, INT8_LEVELS)
    return q.to(torch.int8), scale


def dequantise_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * (scale / INT8_LEVELS)


def mean_of_int8(payloads: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Mean over ranks of (ranks, n) int8 payloads with one scale each, summed in fp32.

    Rank by rank, so the temporaries stay one fp32 bucket whatever the group size.
    """
    steps = scales.reshape(-1).float() / (INT8_LEVELS * payloads.shape[0])
    out = torch.zeros(payloads.shape[1], dtype=torch.float32, device=payloads.device)
    for payload, step in zip(payloads, steps):
        out.add_(payload.float() * step)
    return out


def members(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Views of the tensors packed, in order, at the start of ``flat``."""
    views, offset = [], 0
    for shape in shapes:
        numel = shape.numel()
        views.append(flat.narrow(0, offset, numel).view(shape))
        offset += numel
    return views


@dataclasses.dataclass(frozen=True)
class Settings:
    """``parallelism.gradientCompression`` as the trainer uses it."""

    mode: str
    """bf16, fp16, int8, topk or powersgd."""
    rank: int = 4
    """powersgd: rank of each matrix's approximation."""
    topk_ratio: float = 0.01
    """topk: share of a buffer's elements a rank sends."""
    warm_start: bool = True
    """powersgd: start each power iteration from the previous Q."""
    warmup_steps: int = 0
    """Optimizer steps reduced exactly before compression starts."""

    def __post_init__(self) -> None:
        if self.mode not in MODES or self.mode == "none":
            raise ValueError(f"compression mode must be one of {MODES[1:]}, got {self.mode!r}")


class Compressor:
    """The compressed mean of flat gradient buffers over a data-parallel group, and its state.

    A buffer comes with its index (which state is its own) and the shapes of the tensors packed in
    it.  Error feedback adds what a rank's compression dropped to its next buffer of that index.
    Each buffer's exchange touches only its own state, so exchanges may run while backward fills
    the others.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        group: dist.ProcessGroup,
        group_size: int,
        recorder: recording.StepRecorder,
        clock: clocks.Clock,
    ) -> None:
        self.settings = settings
        self.group, self.group_size, self.recorder, self.clock = group, group_size, recorder, clock
        self.state: dict[str, torch.Tensor] = {}
        """Error feedback (``error/<bucket>/<member>``) and PowerSGD's Q (``q/<bucket>/<member>``)."""
        self.sending = 0
        """Payload bytes of the collectives since the caller last reset it (the exchange thread adds)."""

    def create_state(self, index: int, flat: torch.Tensor, shapes: list[torch.Size]) -> None:
        """Every state tensor of buffer ``index`` now, as its first exchange would, so a checkpoint can load into it."""
        if self.settings.mode in ("int8", "topk"):
            self.error(index, 0, flat)
        elif self.settings.mode == "powersgd":
            for member, view in enumerate(members(flat, shapes)):
                m = self.matrix(view)
                if m is not None:
                    self.error(index, member, m)
                    self.state[f"q/{index}/{member}"] = self.fresh_q(index, member, m)

    def matrix(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The (rows, columns) view PowerSGD compresses, or None for a tensor sent uncompressed."""
        m = grad.reshape(grad.shape[0], -1) if grad.dim() >= 2 else None
        # rank r saves bytes only below min(n, m)
        return m if m is not None and min(m.shape) > self.settings.rank else None

    def fresh_q(self, index: int, member: int, m: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(index * 1000 + member)
        return torch.randn(m.shape[1], self.settings.rank, generator=generator).to(m)

    def error(self, index: int, member: int, like: torch.Tensor) -> torch.Tensor:
        key = f"error/{index}/{member}"
        if key not in self.state:
            self.state[key] = torch.zeros_like(like)
        return self.state[key]

    def mean(self, index: int, flat: torch.Tensor, shapes: list[torch.Size]) -> None:
        """Replace ``flat`` (this rank's sum) by the compressed mean over the group."""
        getattr(self, f"_mean_{self.settings.mode}")(index, flat, shapes)

    def discard(self) -> None:
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

    def all_reduce(self, tensor: torch.Tensor, index: int) -> None:
        start = self.clock.now()
        dist.all_reduce(tensor, group=self.group)
        self.record("all_reduce", tensor, start, index)

    def all_gather(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        out = torch.empty(
            tensor.numel() * self.group_size, dtype=tensor.dtype, device=tensor.device
        )
        start = self.clock.now()
        dist.all_gather_into_tensor(out, tensor, group=self.group)
        self.record("all_gather", out, start, index)
        return out

    def record(self, op: str, tensor: torch.Tensor, start: clocks.Stamp, index: int) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.sending += nbytes
        end = self.clock.now()
        self.recorder.collective("dp", op, nbytes, start, end, bucket=index)  # type: ignore[arg-type]

    # --- the modes --------------------------------------------------------------------

    def _mean_bf16(self, index: int, flat: torch.Tensor, shapes: list[torch.Size]) -> None:
        """All-reduce in 16 bits (bf16 or fp16): 2 bytes per element."""
        low = flat.div(self.group_size).to(CAST[self.settings.mode])  # mean first: no fp16 overflow
        self.all_reduce(low, index)
        flat.copy_(low)

    _mean_fp16 = _mean_bf16

    def _mean_int8(self, index: int, flat: torch.Tensor, shapes: list[torch.Size]) -> None:
        """Each rank's values on 127 levels of its own scale; payloads and scales all-gathered.

        Every rank dequantises and sums them in fp32, so the precision does not shrink with the
        group size; the wire carries ``N x n`` bytes, gathered, against ``4 x n`` for an fp32
        all-reduce.
        """
        x = flat.add_(self.error(index, 0, flat))
        q, scale = quantise_int8(x)
        self.error(index, 0, x).copy_(x - dequantise_int8(q, scale))
        scales = self.all_gather(scale, index)
        payloads = self.all_gather(q, index).view(self.group_size, -1)
        flat.copy_(mean_of_int8(payloads, scales))

    def _mean_topk(self, index: int, flat: torch.Tensor, shapes: list[torch.Size]) -> None:
        """Each rank's ``ratio x n`` largest-magnitude elements, all-gathered and scatter-added.

        Values and int32 indices travel.
        """
        x = flat.add_(self.error(index, 0, flat))
        k = max(1, int(self.settings.topk_ratio * x.numel()))
        chosen = x.abs().topk(k, sorted=False).indices
        values = x[chosen]
        error = self.error(index, 0, x)
        error.copy_(x)
        error[chosen] = 0
        all_values = self.all_gather(values, index)
        all_index = self.all_gather(chosen.to(torch.int32), index)
        flat.zero_().index_add_(0, all_index.long(), all_values).div_(self.group_size)

    def _mean_powersgd(self, index: int, flat: torch.Tensor, shapes: list[torch.Size]) -> None:
        """PowerSGD (Vogels et al. 2019): every matrix ``M`` as ``P Q^T`` of rank r.

        One power iteration: ``P = M Q`` (all-reduced, orthonormalised), then ``Q = M^T P``
        (all-reduced); ``Q`` is kept for the next step (warm start).  Vectors and matrices too
        small to gain travel uncompressed in one all-reduce.
        """
        r = self.settings.rank
        matrices, rest = [], []
        for member, view in enumerate(members(flat, shapes)):
            m = self.matrix(view)
            if m is not None:
                matrices.append((member, m))
            else:
                rest.append(view)
        if rest:  # uncompressed, one collective
            joined = torch.cat([g.reshape(-1) for g in rest])
            self.all_reduce(joined, index)
            offset = 0
            for g in rest:
                g.copy_(joined[offset : offset + g.numel()].view_as(g) / self.group_size)
                offset += g.numel()
        if not matrices:
            return
        qs = []
        for member, m in matrices:
            m.add_(self.error(index, member, m))
            key = f"q/{index}/{member}"
            if not self.settings.warm_start:
                self.state[key].copy_(self.fresh_q(index, member, m))
            qs.append(self.state[key])
        ps = torch.cat([(m @ q).reshape(-1) for (_, m), q in zip(matrices, qs)])
        self.all_reduce(ps, index)
        offset, p_list = 0, []
        for _, m in matrices:
            p = ps[offset : offset + m.shape[0] * r].view(m.shape[0], r)
            p_list.append(torch.linalg.qr(p).Q)
            offset += m.shape[0] * r
        qs_new = torch.cat([(m.T @ p).reshape(-1) for (_, m), p in zip(matrices, p_list)])
        self.all_reduce(qs_new, index)
        qs_new.div_(self.group_size)
        offset = 0
        for (member, m), p in zip(matrices, p_list):
            q = qs_new[offset : offset + m.shape[1] * r].view(m.shape[1], r)
            offset += m.shape[1] * r
            approx = p @ q.T  # the mean gradient, rank r
            self.error(index, member, m).copy_(m - approx)
            # in place: checkpoint entries are views
            self.state[f"q/{index}/{member}"].copy_(q)
            m.copy_(approx)


class Compressing(reducer.GradReducer):
    """What a compressing reducer adds to its kind (all-reduce or ZeRO-2's reduce-scatter): the
    :class:`Compressor`, the exact warm-up and the payload it reports."""

    settings: Settings
    compressor: Compressor
    exact: bool
    """Whether this step reduces exactly (the warm-up; :meth:`start_step` sets it)."""
    sent_bytes: int = 0
    """Payload bytes of the last step's collectives."""
    dense_bytes: int = 0
    """Payload bytes the same step's plain fp32 exchange would have had."""

    def _start_compressing(self, settings: Settings) -> None:
        """Call at the end of ``__init__``, once the buckets exist."""
        self.settings = settings
        self.mode, self.rank, self.topk_ratio = settings.mode, settings.rank, settings.topk_ratio
        self.compressor = Compressor(
            settings,
            group=self.group,
            group_size=self.group_size,
            recorder=self.recorder,
            clock=self.clock,
        )
        self.exact = settings.warmup_steps > 0

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The compressor's state (error feedback, PowerSGD's Q), which checkpoints carry."""
        return self.compressor.state

    def start_step(self, step: int) -> None:
        """Optimizer step ``step`` (1-based, the restored count on resume) begins: exact while ``step <= warmupSteps``.

        The state is not touched at the switch: error feedback is still zero and Q its seeded
        start, as torch's PowerSGD hook creates them at its first compressed step; a job resumed
        past the warm-up loads both and compresses at once.
        """
        self.exact = step <= self.settings.warmup_steps

    @property
    def compression_ratio(self) -> float:
        """Uncompressed over compressed payload of the last step (1 before the first)."""
        return self.dense_bytes / self.sent_bytes if self.sent_bytes else 1.0

    def payload_bytes(self) -> tuple[int, int]:
        """(uncompressed, sent) payload bytes of the last step (the plain exchange's, the compressed collectives')."""
        return (self.dense_bytes, self.sent_bytes) if self.sent_bytes else super().payload_bytes()

    def discard_step(self) -> None:
        """A skipped update: error feedback forgets it (:meth:`Compressor.discard`)."""
        self.compressor.discard()


class CompressedGradReducer(Compressing, exchanges.QueuedGradReducer):
    """A gradient reducer whose per-bucket all-reduce is compressed (:class:`Compressor`), after an exact warm-up."""

    def __init__(
        self,
        params: list[torch.nn.Parameter] | list[list[torch.nn.Parameter]],
        *,
        mode: str,
        rank: int = 4,
        topk_ratio: float = 0.01,
        warm_start: bool = True,
        warmup_steps: int = 0,
        **reducer_args: Any,
    ) -> None:
        """The keywords are :class:`Settings`' fields; ``reducer_args`` :class:`~.reducer.GradReducer`'s
        (group, group_size, bucket_mb, recorder, clock)."""
        settings = Settings(mode, rank, topk_ratio, warm_start, warmup_steps)
        super().__init__(params, **reducer_args)
        self._start_compressing(settings)
        for bucket in self.buckets:
            self.compressor.create_state(bucket.index, bucket.buffer, shapes(bucket))

    def _exchange(self, bucket: reducer.Bucket) -> None:
        """Exchange the bucket (exactly in the warm-up), leaving the (approximate) mean gradient in it."""
        if self.exact:
            self.compressor.all_reduce(bucket.buffer, bucket.index)
            bucket.buffer.div_(self.group_size)
        else:
            self.compressor.mean(bucket.index, bucket.buffer, shapes(bucket))

    def _settled(self) -> None:
        self.sent_bytes, self.compressor.sending = self.compressor.sending, 0
        self.dense_bytes = sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)


def shapes(bucket: reducer.Bucket) -> list[torch.Size]:
    """The shapes of the bucket's members, in their flat order."""
    return [p.shape for p in bucket.params]
