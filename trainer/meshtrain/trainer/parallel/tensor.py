"""Tensor parallelism: Megatron-style sharded layers and the rules to apply them.

Four autograd functions move activations into and out of the tensor-parallel region (copy and
reduce, or sequence parallelism's gather and reduce-scatter); the column- and row-parallel linears
and the vocabulary-parallel embedding are built on them, and :func:`apply_tensor_parallel` swaps a
model's dense modules for them.  Every collective is timed and reported as group ``tp``: why these
are meshtrain's own layers, not ``torch.distributed.tensor.parallel`` (docs/trainer.md).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshtrain.api import layout
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import tensor_overlap
from meshtrain.trainer.telemetry import clocks, recording

_Fn = typing.TypeVar("_Fn", bound=Callable[..., torch.Tensor])


@dataclasses.dataclass
class TPContext:
    """The tensor-parallel group of this rank and how it runs."""

    group: dist.ProcessGroup
    """Process group of the ranks sharing this rank's layers."""
    rank: int
    """This rank's index inside the group (0..size-1)."""
    size: int
    """Tensor-parallel degree."""
    sequence_parallel: bool = False
    """Shard norm/residual activations along the sequence (Megatron SP)."""
    recorder: recording.StepRecorder = dataclasses.field(default_factory=recording.NullRecorder)
    """Where collective timings go."""
    clock: clocks.Clock = dataclasses.field(default_factory=clocks.HostClock)
    """What times them (the engine's)."""
    wire_dtype: torch.dtype | None = None
    """Element type activations and their gradients cross the group in (bf16 under autocast; None: as computed)."""
    overlap: bool = False
    """Run the linears' collectives beside their matmuls, chunk by chunk (:mod:`.tensor_overlap`,
    ``parallelism.overlap.tensor``); False: each collective blocks before or after its matmul."""

    def on_wire(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as it is sent: cast to :attr:`wire_dtype` when one is set."""
        return x if self.wire_dtype is None else x.to(self.wire_dtype)


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How a dense parameter is split over the tensor-parallel ranks."""

    dim: int
    """Dimension of the dense tensor that is split."""
    groups: int = 1
    """The dense ``dim`` is ``groups`` equal blocks, each split separately (fused QKV: 3)."""
    sizes: tuple[int, ...] = ()
    """Dense sizes of unequal blocks (grouped-query QKV: q, k, v rows); overrides ``groups``."""
    extent: int = 0
    """The dense extent along ``dim`` when the pieces end in zero padding (a vocabulary that
    does not split evenly, :func:`meshtrain.api.layout.padded_vocab`); 0: the pieces tile it exactly."""
    replicas: tuple[int, ...] = ()
    """Per block of ``sizes``: how many consecutive ranks hold the same piece of it (empty: 1 each).

    Fewer key/value heads than tensor ranks: each k and v head is held by
    ``tensor / kvHeads`` ranks, the ones whose query heads use it.
    """

    def block_sizes(self, dense: int) -> list[int]:
        """Dense extent of every block along ``dim`` of a dense tensor of extent ``dense``."""
        return list(self.sizes) if self.sizes else [dense // self.groups] * self.groups

    def block_replicas(self) -> list[int]:
        """Ranks sharing each block's piece."""
        return list(self.replicas) or [1] * (len(self.sizes) or self.groups)

    def dense_extent(self, local: int, size: int) -> int:
        """Extent of the dense ``dim`` of a rank's piece of extent ``local`` over ``size`` ranks."""
        return self.extent or (sum(self.sizes) if self.sizes else local * size)

    def local_blocks(self, dense: int, size: int) -> list[int]:
        """Extent of every block in one rank's piece."""
        reps = self.block_replicas()
        return [n // (size // r) for n, r in zip(self.block_sizes(dense), reps)]


def shard(full: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """This rank's piece of a dense tensor (zero rows past ``spec.extent`` on the last ranks)."""
    if spec.extent:
        padding = [0, 0] * (full.dim() - 1 - spec.dim)
        padding += [0, layout.padded_vocab(spec.extent, size) - full.shape[spec.dim]]
        full = F.pad(full, padding)
    blocks = full.split(spec.block_sizes(full.shape[spec.dim]), dim=spec.dim)
    pieces = [
        b.chunk(size // r, dim=spec.dim)[rank // r] for b, r in zip(blocks, spec.block_replicas())
    ]
    return torch.cat(pieces, dim=spec.dim).clone()


def shard_ranges(spec: ShardSpec, dense: int, rank: int, size: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` ranges along ``spec.dim`` of a dense tensor of extent ``dense`` (padded,
    under ``spec.extent``) that :func:`shard` cuts for ``rank``, in the order it concatenates them."""
    ranges, offset = [], 0
    for extent, replicas in zip(spec.block_sizes(dense), spec.block_replicas()):
        step = -(-extent // (size // replicas))  # torch.chunk's piece size
        index = rank // replicas
        ranges.append(
            (offset + min(extent, index * step), offset + min(extent, (index + 1) * step))
        )
        offset += extent
    return ranges


def shard_param(
    model: gpt.GPT,
    name: str,
    param: torch.Tensor,
    spec: ShardSpec,
    rank: int,
    size: int,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """:func:`shard` of parameter ``name``'s dense value, reading only this rank's ranges
    (:func:`meshtrain.trainer.models.gpt.dense_piece`): a Hugging Face import reads a rank's rows or
    columns, not the whole tensor.  Equal, element for element, to ``shard(dense_value(...))``;
    with ``rows`` ``[start, stop)``, to those rows of it (a ZeRO-3 shard of the piece)."""
    dense = param.shape[spec.dim]
    ranges = _piece_ranges(param, spec, rank, size)
    column_rows = rows if spec.dim == 1 else None
    if rows is not None and spec.dim == 0:
        ranges = [covered for _, covered in gpt.window(ranges, *rows)]
    inside = [(min(start, dense), min(stop, dense)) for start, stop in ranges]
    piece = gpt.dense_piece(model, name, param, spec.dim, inside, column_rows)
    missing = sum(stop - start for start, stop in ranges) - piece.shape[spec.dim]
    if missing:  # the last ranks' rows past the vocabulary: zeros, as shard pads them
        padding = [0, 0] * (piece.dim() - 1 - spec.dim) + [0, missing]
        piece = F.pad(piece, padding)
    return piece


def _piece_ranges(
    param: torch.Tensor, spec: ShardSpec, rank: int, size: int
) -> list[tuple[int, int]]:
    """:func:`shard_ranges` of ``param``'s dense extent, padded under ``spec.extent``."""
    dense = param.shape[spec.dim]
    padded = layout.padded_vocab(spec.extent, size) if spec.extent else dense
    return shard_ranges(spec, padded, rank, size)


def piece_shape(param: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> list[int]:
    """The shape of ``rank``'s piece of ``param`` (:func:`shard_param`'s, padding included)."""
    shape = list(param.shape)
    shape[spec.dim] = sum(stop - start for start, stop in _piece_ranges(param, spec, rank, size))
    return shape


def dense_shape(piece: torch.Tensor, spec: ShardSpec, size: int) -> list[int]:
    """The shape of the dense parameter whose piece over ``size`` ranks is ``piece``."""
    shape = list(piece.shape)
    shape[spec.dim] = spec.dense_extent(piece.shape[spec.dim], size)
    return shape


def unshard(pieces: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The dense tensor from every rank's piece (inverse of :func:`shard`; a replicated block from its first holder)."""
    size = len(pieces)
    dense = spec.dense_extent(pieces[0].shape[spec.dim], size)
    local = spec.local_blocks(pieces[0].shape[spec.dim] * size if spec.extent else dense, size)
    per_rank = [p.split(local, dim=spec.dim) for p in pieces]  # [rank][block]
    whole = torch.cat(
        [
            torch.cat([per_rank[k][g] for k in range(0, size, r)], dim=spec.dim)
            for g, r in enumerate(spec.block_replicas())
        ],
        dim=spec.dim,
    )
    return whole.narrow(spec.dim, 0, dense)


def kv_replicas(kv_heads: int, size: int) -> int:
    """Ranks that hold each key/value head: ``size / kv_heads`` when there are fewer heads than ranks, else 1."""
    return size // kv_heads if kv_heads < size else 1


# --- timed collectives --------------------------------------------------------


def _timed(ctx: TPContext, op: str, tensor: torch.Tensor, fn) -> None:  # noqa: ANN001 - a closure
    recording.blocking_collective(
        ctx.recorder, ctx.clock, "tp", op, tensor.numel() * tensor.element_size(), fn
    )


def all_reduce(
    x: torch.Tensor, ctx: TPContext, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.Tensor:
    """Sum (or ``op``) of ``x`` over the tensor-parallel group, timed and recorded."""
    x = x.contiguous()
    _timed(ctx, "all_reduce", x, lambda: dist.all_reduce(x, op=op, group=ctx.group))
    return x


def _gather_seq(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """(B, T/tp, H) on each rank -> (B, T, H) on each rank."""
    local = ctx.on_wire(x).transpose(0, 1).contiguous()  # (T/tp, B, H): the split dim first
    out = local.new_empty((local.shape[0] * ctx.size, *local.shape[1:]))  # (T, B, H)
    _timed(ctx, "all_gather", out, lambda: dist.all_gather_into_tensor(out, local, group=ctx.group))
    return out.transpose(0, 1)  # (B, T, H)


def _reduce_scatter_seq(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """(B, T, H) partial sums -> this rank's (B, T/tp, H) of the total."""
    full = ctx.on_wire(x).transpose(0, 1).contiguous()  # (T, B, H)
    out = full.new_empty((full.shape[0] // ctx.size, *full.shape[1:]))  # (T/tp, B, H)
    _timed(
        ctx, "reduce_scatter", full, lambda: dist.reduce_scatter_tensor(out, full, group=ctx.group)
    )
    return out.transpose(0, 1)  # (B, T/tp, H)


class _CopyToTP(torch.autograd.Function):
    """Enter the TP region: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(fctx, x, ctx):  # noqa: ANN001, ANN205
        fctx.tp = ctx
        return x

    @staticmethod
    def backward(fctx, grad):  # noqa: ANN001, ANN205
        return all_reduce(fctx.tp.on_wire(grad), fctx.tp).to(grad.dtype), None


class _ReduceFromTP(torch.autograd.Function):
    """Leave the TP region: all-reduce of partial sums forward, identity backward."""

    @staticmethod
    def forward(fctx, x, ctx):  # noqa: ANN001, ANN205
        return all_reduce(x, ctx)

    @staticmethod
    def backward(fctx, grad):  # noqa: ANN001, ANN205
        return grad, None


class _GatherSeq(torch.autograd.Function):
    """SP: enter the TP region by gathering the sequence; backward reduce-scatters."""

    @staticmethod
    def forward(fctx, x, ctx):  # noqa: ANN001, ANN205
        fctx.tp, fctx.dtype = ctx, x.dtype
        return _gather_seq(
            x, ctx
        )  # in the wire dtype: the column-parallel matmul casts to it anyway

    @staticmethod
    def backward(fctx, grad):  # noqa: ANN001, ANN205
        return _reduce_scatter_seq(grad, fctx.tp).to(fctx.dtype), None


class _ReduceScatterSeq(torch.autograd.Function):
    """SP: leave the TP region by reduce-scattering along the sequence; backward gathers."""

    @staticmethod
    def forward(fctx, x, ctx):  # noqa: ANN001, ANN205
        fctx.tp, fctx.dtype = ctx, x.dtype
        return _reduce_scatter_seq(x, ctx)

    @staticmethod
    def backward(fctx, grad):  # noqa: ANN001, ANN205
        return _gather_seq(grad, fctx.tp).to(fctx.dtype), None


def _graph_break(fn: _Fn) -> _Fn:
    """``torch.compile`` does not trace ``fn``: the collectives in it stay meshtrain's timed calls."""
    return typing.cast(_Fn, torch.compiler.disable(fn))


@_graph_break
def enter_region(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """Input of a column-parallel layer: replicated (B, T, H)."""
    return _GatherSeq.apply(x, ctx) if ctx.sequence_parallel else _CopyToTP.apply(x, ctx)


@_graph_break
def leave_region(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """Output of a row-parallel layer: summed, and sequence-split under SP."""
    return _ReduceScatterSeq.apply(x, ctx) if ctx.sequence_parallel else _ReduceFromTP.apply(x, ctx)


_overlapped_column = _graph_break(tensor_overlap.column_linear)


@_graph_break
def _overlapped_row(x: torch.Tensor, weight: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """The overlapped row-parallel linear; in an activation checkpoint's recompute its partial
    sums, reduced after the checkpoint saw its input (:func:`.tensor_overlap.replaying`)."""
    if tensor_overlap.replaying():
        return leave_region(tensor_overlap.row_linear(x, weight, ctx, reduce=False), ctx)
    return tensor_overlap.row_linear(x, weight, ctx)


# --- layers -------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows; output stays split (B, T, out/tp)."""

    def __init__(self, weight: torch.Tensor, ctx: TPContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (out/tp, in)
        self.tp = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.overlap:
            return _overlapped_column(x, self.weight, self.tp)
        return F.linear(enter_region(x, self.tp), self.weight)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns; partial outputs are summed over TP."""

    def __init__(self, weight: torch.Tensor, ctx: TPContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (out, in/tp)
        self.tp = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.overlap:
            return _overlapped_row(x, self.weight, self.tp)
        return leave_region(F.linear(x, self.weight), self.tp)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose table rows (the vocabulary) are split over TP ranks."""

    def __init__(self, weight: torch.Tensor, ctx: TPContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (V/tp, H)
        self.tp = ctx
        self.vocab_start = ctx.rank * weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        emb = F.embedding(
            local.masked_fill(outside, 0), self.weight
        )  # (B, T, H), rows of other ranks wrong
        emb = emb.masked_fill(
            outside.unsqueeze(-1), 0.0
        )  # ...so zero them; the sum over TP fills them in
        return leave_region(emb, self.tp)


class SequenceParallelPositionEmbedding(nn.Module):
    """Position table (replicated) that returns only this rank's sequence slice under SP."""

    def __init__(self, weight: torch.Tensor, ctx: TPContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (T_max, H), the full table
        self.tp = ctx

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        emb = F.embedding(positions, self.weight)  # (T, H), or (B, T, H) for per-document positions
        return emb.chunk(self.tp.size, dim=-2)[self.tp.rank]  # (T/tp, H) or (B, T/tp, H)


# --- applying TP to the model -------------------------------------------------


@dataclasses.dataclass
class TPPlan:
    """What :func:`apply_tensor_parallel` did, by parameter name."""

    shards: dict[str, ShardSpec]
    """Sharded parameters and how (their gradients are shards too)."""
    sequence_partial: list[str]
    """Replicated parameters whose gradients are partial per rank under SP (sum over TP)."""
    kv_replicas: int = 1
    """Ranks sharing each key/value head (:func:`kv_replicas`)."""
    replica_partial: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """Per fused QKV weight, the flat range of its k and v rows, whose gradients are partial
    per rank when key/value heads are replicated (each holder has its own query heads' share):
    summed over the ranks holding the same head."""

    def norm_counted(self, name: str, tp_rank: int) -> bool | tuple[int, int]:
        """What this rank counts of parameter ``name`` in the global gradient norm.

        True (all of it) or False (none), or the flat range it counts: a
        replicated key/value head counts on its first holder only.
        """
        if name in self.replica_partial and tp_rank % self.kv_replicas:
            return (0, self.replica_partial[name][0])  # only its own query rows
        return name in self.shards or tp_rank == 0


def apply_tensor_parallel(model: gpt.GPT, ctx: TPContext, *, on_meta: bool = False) -> TPPlan:
    """Swap ``model``'s dense modules for sharded ones, in place.

    Attention heads and the MLP are split column-then-row, so each block
    needs one reduction forward and one backward per sub-layer; embedding and
    LM head are split over the vocabulary.  Parts a pipeline stage dropped
    (``None``) are skipped.  Norms stay replicated.  ``on_meta``: a model on
    ``meta`` keeps its pieces there, shapes only (ZeRO-3 then reads each
    shard's rows of them: ``zero3.materialize_shards``).
    """
    shards: dict[str, ShardSpec] = {}
    vocab_rows = model.config.vocab
    row = ShardSpec(1)
    vocab = ShardSpec(0, extent=vocab_rows if vocab_rows % ctx.size else 0)

    def swap(
        owner: nn.Module, attr: str, prefix: str, cls: type[nn.Module], spec: ShardSpec
    ) -> None:
        name, dense = f"{prefix}{attr}.weight", getattr(owner, attr).weight
        if on_meta:
            piece = torch.empty(piece_shape(dense, spec, ctx.rank, ctx.size), device="meta")
        else:
            piece = shard_param(model, name, dense, spec, ctx.rank, ctx.size)
        setattr(owner, attr, cls(piece, ctx))
        shards[gpt.logical_name(model.config, name)] = spec

    replicas = kv_replicas(model.config.key_value_heads, ctx.size)
    replica_partial: dict[str, tuple[int, int]] = {}
    for index, block in model.blocks.items():
        base = f"blocks.{index}."
        # fused projections: every block (q, k, v; gate, up) split on its own
        qkv_sizes = block.attn.qkv_sizes
        qkv = ShardSpec(
            0, sizes=qkv_sizes, replicas=(1, replicas, replicas) if replicas > 1 else ()
        )
        fc = ShardSpec(0, sizes=block.mlp.fc_sizes)
        swap(block.attn, "qkv", base + "attn.", ColumnParallelLinear, qkv)
        swap(block.attn, "proj", base + "attn.", RowParallelLinear, row)
        swap(block.mlp, "fc", base + "mlp.", ColumnParallelLinear, fc)
        swap(block.mlp, "proj", base + "mlp.", RowParallelLinear, row)
        if replicas > 1:  # each rank: its query heads and the one key/value head they use
            q_rows, k_rows, v_rows = qkv.local_blocks(sum(qkv_sizes), ctx.size)
            block.attn.group = q_rows // k_rows
            replica_partial[base + "attn.qkv.weight"] = (
                q_rows * model.config.hidden,
                (q_rows + k_rows + v_rows) * model.config.hidden,
            )
    if model.tok_emb is not None:
        swap(model, "tok_emb", "", VocabParallelEmbedding, vocab)
        if model.pos_emb is not None and ctx.sequence_parallel:
            table = model.pos_emb.weight
            assert isinstance(table, torch.Tensor)
            table = table if on_meta else gpt.dense_value(model, "pos_emb.weight", table)
            model.pos_emb = SequenceParallelPositionEmbedding(table.detach().clone(), ctx)
    if (
        model.head is not None and model.config.tie_embeddings and model.tok_emb is not None
    ):  # one stage: the embedding's own shard
        embedding = model.tok_emb
        assert isinstance(embedding, VocabParallelEmbedding)  # swapped above
        head = ColumnParallelLinear(embedding.weight.detach(), ctx)
        head.weight = embedding.weight
        model.head = head
    elif model.head is not None:  # (tied across pipeline stages: the last stage's copy, same shard)
        swap(model, "head", "", ColumnParallelLinear, vocab)
    names = (gpt.logical_name(model.config, n) for n, _ in model.named_parameters())
    partial = [n for n in names if n not in shards] if ctx.sequence_parallel else []
    return TPPlan(
        shards=shards,
        sequence_partial=partial,
        kv_replicas=replicas,
        replica_partial=replica_partial,
    )
