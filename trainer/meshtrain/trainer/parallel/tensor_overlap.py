"""Tensor-parallel linears whose collectives run beside their matmuls (``parallelism.overlap.tensor``).

Each function fuses one linear with the collective that feeds or drains it and splits the
activation along the sequence into :data:`meshtrain.api.layout.TP_OVERLAP_CHUNKS` chunks, so chunk
k's collective is in flight (``async_op``) while chunk k+1's matmul runs; a column-parallel
linear's input-gradient all-reduce runs beside its weight-gradient matmul (Megatron's trick).
Every row is computed by the same matmul as the serial path's, and every sum over ranks by the
same collective: equal to the serial path exactly on CPU/gloo at tp2, up to rounding elsewhere
(cuBLAS and NCCL pick kernels by shape and size).  On NCCL each chunk's input is held until the
compute stream waits for its collective, on the tp lane's own side stream.  Under sequence
parallelism a column-parallel linear keeps its input's local shard and gathers it again in
backward beside its input-gradient matmuls (Megatron's recipe).  In an activation checkpoint's
recompute a row-parallel linear returns its partial sums and its caller reduces them after the
checkpoint saw the matmul's input (:func:`replaying`).  Why chunks, not torch's micro-pipelined
``fused_all_gather_matmul``: docs/trainer.md, "Tensor-parallel overlap".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtrain.api import layout
from meshtrain.trainer.telemetry import clocks

if TYPE_CHECKING:  # tensor.py imports this module
    from meshtrain.trainer.parallel import tensor


@dataclasses.dataclass
class _InFlight:
    """A chunk's collective in flight and the buffer it fills."""

    launch: clocks.Launch
    """The timed asynchronous collective."""
    op: str
    """The collective, as recorded."""
    nbytes: int
    """Its payload per rank, as recorded."""
    out: torch.Tensor
    """Its output buffer."""
    payload: torch.Tensor | None
    """Its input, held until :func:`_land` has ordered the compute stream after the collective:
    on NCCL the input was allocated on the compute stream and ``work.wait()`` drops NCCL's own
    reference, so freeing it earlier would let the next chunk's matmul reuse memory NCCL still
    reads.  None once landed."""


def _launch(
    ctx: tensor.TPContext,
    op: str,
    recorded: torch.Tensor,
    sent: torch.Tensor,
    out: torch.Tensor,
    call: Callable[[], dist.Work | None],
) -> _InFlight:
    """Start ``call`` (an ``async_op`` collective sending ``sent`` and filling ``out``), recorded
    with ``recorded``'s bytes; ``sent`` stays referenced until the flight lands."""

    def started() -> dist.Work:
        work = call()
        assert work is not None  # async_op=True returns its handle
        return work

    launch = ctx.clock.launch(started, lane="tp")  # its own side stream: never behind a dp bucket
    return _InFlight(launch, op, recorded.numel() * recorded.element_size(), out, sent)


def _land(ctx: tensor.TPContext, flight: _InFlight) -> torch.Tensor:
    """Wait for ``flight`` and record it: its flight as a ``tp`` collective, the time the compute
    thread (on CUDA, the compute stream) was held as a ``tp`` wait, its exposed part.

    On the host the flight ends when the wait sees it done (gloo's collectives give no completion
    callback), so a collective that finished under the matmul reads until its wait: the flight may
    read long, the exposed part is exact.  On CUDA both are the GPU's.
    """
    held = ctx.clock.now()
    end = flight.launch.wait()
    released = ctx.clock.now()
    flight.payload = None  # the compute stream now runs after the collective: its input may go
    record: Callable[..., None] = ctx.recorder.collective  # stamps: floats, or CUDA events (clocks)
    record("tp", flight.op, flight.nbytes, flight.launch.start, end)
    wait: Callable[..., None] = ctx.recorder.wait
    wait("tp", held, released)
    return flight.out


def _all_gather(ctx: tensor.TPContext, local: torch.Tensor) -> _InFlight:
    """Start gathering ``local`` (rows first) from every rank: (n, ...) -> (size * n, ...)."""
    return _sharded(ctx, local, gather=True)


def _reduce_scatter(ctx: tensor.TPContext, full: torch.Tensor) -> _InFlight:
    """Start summing ``full`` over the ranks, this rank keeping its block of rows: (size * n, ...) -> (n, ...)."""
    return _sharded(ctx, full, gather=False)


def _sharded(ctx: tensor.TPContext, x: torch.Tensor, *, gather: bool) -> _InFlight:
    rows = x.shape[0] * ctx.size if gather else x.shape[0] // ctx.size
    out = x.new_empty((rows, *x.shape[1:]))
    if gather:  # recorded as the serial path records them: the gathered, the scattered bytes
        return _launch(
            ctx,
            "all_gather",
            out,
            x,
            out,
            lambda: dist.all_gather_into_tensor(out, x, group=ctx.group, async_op=True),
        )
    return _launch(
        ctx,
        "reduce_scatter",
        x,
        x,
        out,
        lambda: dist.reduce_scatter_tensor(out, x, group=ctx.group, async_op=True),
    )


def _all_reduce(ctx: tensor.TPContext, x: torch.Tensor) -> _InFlight:
    """Start summing ``x`` (contiguous) over the ranks, in place."""
    return _launch(
        ctx, "all_reduce", x, x, x, lambda: dist.all_reduce(x, group=ctx.group, async_op=True)
    )


def _spans(extent: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each chunk of ``extent`` rows, as ``tensor_split`` cuts them (fewer
    chunks than rows: one a row); plain integers, so nothing reads the device."""
    chunks = min(layout.TP_OVERLAP_CHUNKS, max(extent, 1))
    base, extra = divmod(extent, chunks)
    lengths = [base + 1 if i < extra else base for i in range(chunks)]
    return [(sum(lengths[:i]), n) for i, n in enumerate(lengths) if n]


def replaying() -> bool:
    """Whether this forward is an activation checkpoint's recompute, run inside backward.

    torch's non-reentrant checkpoint stops its recompute once the last tensor backward needs is
    saved: the serial path's last row-parallel collective of a block (its result saves nothing)
    is never replayed.  A fused row linear saves its input only when its collectives are done,
    so in a recompute it leaves them to its caller (:func:`row_linear`), after the save, where
    the early stop skips them as it does the serial path's.  The graph task id is what
    ``torch.utils.checkpoint`` itself keys recomputed tensors by; -1 outside backward.
    """
    return bool(torch._C._current_graph_task_id() != -1)


def _weight_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad^T x`` over every token, as ``F.linear``'s backward computes it, in ``weight``'s dtype."""
    g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    return g2.t().mm(x2.to(g2.dtype)).to(weight.dtype)


class _CopyLinear(torch.autograd.Function):
    """Column-parallel linear without SP: forward local; backward all-reduces the input gradient
    while the weight gradient is computed."""

    @staticmethod
    def forward(
        fctx: Any, x: torch.Tensor, weight: torch.Tensor, ctx: tensor.TPContext
    ) -> torch.Tensor:
        y = F.linear(x, weight)
        fctx.tp, fctx.x_dtype = ctx, x.dtype
        fctx.save_for_backward(x.to(y.dtype), weight)  # as autocast keeps it: in the matmul's dtype
        return y

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = fctx.saved_tensors
        ctx = fctx.tp
        grad_x = ctx.on_wire(grad.matmul(weight.to(grad.dtype))).contiguous()
        flight = _all_reduce(ctx, grad_x)
        grad_w = _weight_grad(grad, x, weight)  # beside the all-reduce
        return _land(ctx, flight).to(fctx.x_dtype), grad_w, None


class _LinearAllReduce(torch.autograd.Function):
    """Row-parallel linear without SP: chunk k's partial sums are all-reduced while chunk k+1's
    matmul runs; backward is local."""

    @staticmethod
    def forward(
        fctx: Any, x: torch.Tensor, weight: torch.Tensor, ctx: tensor.TPContext, reduce: bool
    ) -> torch.Tensor:
        pieces: list[torch.Tensor] = []
        flights = []
        for start, n in _spans(x.shape[1]):
            partial = F.linear(x.narrow(1, start, n), weight)
            if reduce:  # in flight while the next chunk's matmul runs
                flights.append(_all_reduce(ctx, partial))
            else:
                pieces.append(partial)
        pieces += [_land(ctx, f) for f in flights]
        y = torch.cat(pieces, dim=1)  # without ``reduce``: this rank's partial sums
        fctx.x_dtype = x.dtype
        fctx.save_for_backward(x.to(y.dtype), weight)
        return y

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, weight = fctx.saved_tensors
        grad_x = grad.matmul(weight.to(grad.dtype)).to(fctx.x_dtype)
        return grad_x, _weight_grad(grad, x, weight), None, None


class _GatherLinear(torch.autograd.Function):
    """Column-parallel linear under SP: (B, T/tp, H) in, (B, T, out/tp) out.  Chunk k's all-gather
    lands while chunk k-1's matmul runs.  It keeps the input's local shard, not the gathered
    sequence (SP's memory saving): backward gathers it again while the input gradients are
    computed, then reduce-scatters chunk k's input gradient while chunk k+1's (and last, the
    weight gradient) is computed."""

    @staticmethod
    def forward(
        fctx: Any, x: torch.Tensor, weight: torch.Tensor, ctx: tensor.TPContext
    ) -> torch.Tensor:
        shard = ctx.on_wire(x)  # (B, T/tp, H), as it is sent
        local = shard.transpose(0, 1)  # (T/tp, B, H): the gathered dim first
        spans = _spans(local.shape[0])
        # each (tp, n, B, out/tp)
        outs = [F.linear(piece, weight) for piece in _gathered(ctx, local, spans)]
        y = torch.cat(outs, dim=1).flatten(0, 1).transpose(0, 1)  # (B, T, out/tp)
        fctx.tp, fctx.x_dtype, fctx.spans = ctx, x.dtype, spans
        fctx.save_for_backward(shard, weight)
        return y

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shard, weight = fctx.saved_tensors
        ctx, spans = fctx.tp, fctx.spans
        local = shard.transpose(0, 1)  # (T/tp, B, H)
        gathers = _gathers(ctx, local, spans)  # in flight beside the input-gradient matmuls
        rows = local.shape[0]
        by_rank = grad.transpose(0, 1).unflatten(0, (ctx.size, rows))  # (tp, T/tp, B, out/tp)
        w = weight.to(grad.dtype)
        flights = []
        for start, n in spans:  # each beside the next chunk's matmul
            grad_x = by_rank.narrow(1, start, n).matmul(w)  # (tp, n, B, H)
            flights.append(_reduce_scatter(ctx, ctx.on_wire(grad_x).flatten(0, 1).contiguous()))
        pieces = [_piece(ctx, f, local) for f in gathers]  # each (tp, n, B, H)
        full = torch.cat(pieces, dim=1).flatten(0, 1).transpose(0, 1)  # (B, T, H)
        grad_w = _weight_grad(grad, full, weight)  # beside the last reduce-scatters
        grad_x = torch.cat([_land(ctx, f) for f in flights], dim=0)  # (T/tp, B, H)
        return grad_x.transpose(0, 1).to(fctx.x_dtype), grad_w, None


def _gathers(
    ctx: tensor.TPContext, local: torch.Tensor, spans: list[tuple[int, int]]
) -> list[_InFlight]:
    """Start gathering every rank's ``spans`` of ``local`` (T/tp, B, H), one flight a chunk."""
    return [_all_gather(ctx, local.narrow(0, s, n).contiguous()) for s, n in spans]


def _piece(ctx: tensor.TPContext, flight: _InFlight, local: torch.Tensor) -> torch.Tensor:
    """A gathered chunk of ``local``'s rows, landed: (tp, n, B, H)."""
    return _land(ctx, flight).view(ctx.size, -1, *local.shape[1:])


def _gathered(
    ctx: tensor.TPContext, local: torch.Tensor, spans: list[tuple[int, int]]
) -> Iterator[torch.Tensor]:
    """Every rank's ``spans`` of ``local`` (T/tp, B, H), each (tp, n, B, H): every chunk's gather
    is launched at the first step, and each lands when asked for, so the caller's work on chunk
    k runs while chunk k+1's gather is in flight."""
    for flight in _gathers(ctx, local, spans):
        yield _piece(ctx, flight, local)


class _LinearReduceScatter(torch.autograd.Function):
    """Row-parallel linear under SP: (B, T, in/tp) in, (B, T/tp, H) out.  Chunk k's partial sums
    are reduce-scattered while chunk k+1's matmul runs; backward gathers chunk k's output gradient
    while chunk k-1's input gradient is computed."""

    @staticmethod
    def forward(
        fctx: Any, x: torch.Tensor, weight: torch.Tensor, ctx: tensor.TPContext, reduce: bool
    ) -> torch.Tensor:
        rows = x.shape[1] // ctx.size
        by_rank = x.transpose(0, 1).unflatten(0, (ctx.size, rows))  # (tp, T/tp, B, in/tp)
        spans = _spans(rows)
        flights, partials, dtype = [], [], x.dtype
        for start, n in spans:
            partial = F.linear(by_rank.narrow(1, start, n), weight)  # (tp, n, B, H)
            dtype = partial.dtype
            if reduce:  # in flight while the next chunk's matmul runs
                flights.append(
                    _reduce_scatter(ctx, ctx.on_wire(partial).flatten(0, 1).contiguous())
                )
            else:
                partials.append(partial)
        fctx.tp, fctx.spans, fctx.x_dtype = ctx, spans, x.dtype
        fctx.save_for_backward(x.to(dtype), weight)  # as autocast keeps it: in the matmul's dtype
        if not reduce:  # this rank's partial sums of the whole sequence (B, T, H)
            return torch.cat(partials, dim=1).flatten(0, 1).transpose(0, 1)
        return torch.cat([_land(ctx, f) for f in flights], dim=0).transpose(0, 1)  # (B, T/tp, H)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, weight = fctx.saved_tensors
        ctx, spans = fctx.tp, fctx.spans
        local = ctx.on_wire(grad).transpose(0, 1)  # (T/tp, B, H)
        w = weight.to(local.dtype)
        pieces, grads_x = [], []
        for piece in _gathered(ctx, local, spans):  # (tp, n, B, H)
            pieces.append(piece)
            grads_x.append(piece.matmul(w))  # (tp, n, B, in/tp)
        grad_x = torch.cat(grads_x, dim=1).flatten(0, 1).transpose(0, 1)  # (B, T, in/tp)
        full = torch.cat(pieces, dim=1).flatten(0, 1).transpose(0, 1)  # (B, T, H)
        return grad_x.to(fctx.x_dtype), _weight_grad(full, x, weight), None, None


def column_linear(x: torch.Tensor, weight: torch.Tensor, ctx: tensor.TPContext) -> torch.Tensor:
    """A column-parallel linear with its collective overlapped (input replicated, or SP-split)."""
    if ctx.sequence_parallel:
        return _tensor(_GatherLinear.apply(x, weight, ctx))
    return _tensor(_CopyLinear.apply(x, weight, ctx))


def row_linear(
    x: torch.Tensor, weight: torch.Tensor, ctx: tensor.TPContext, *, reduce: bool = True
) -> torch.Tensor:
    """A row-parallel linear with its collective overlapped (output summed, and SP-split);
    without ``reduce`` its partial sums (B, T, H), for the caller to reduce (:func:`replaying`)."""
    if ctx.sequence_parallel:
        return _tensor(_LinearReduceScatter.apply(x, weight, ctx, reduce))
    return _tensor(_LinearAllReduce.apply(x, weight, ctx, reduce))


def _tensor(y: object) -> torch.Tensor:
    """``Function.apply``'s result, typed."""
    assert isinstance(y, torch.Tensor)
    return y
