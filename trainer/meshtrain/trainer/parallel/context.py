"""Context parallelism: every sequence split over the cp group, attention as a ring.

The sequence is cut into ``2 x context`` chunks and cp rank ``k`` holds chunks ``k`` and
``2C-1-k`` (Megatron's and TorchTitan's load balancing: under the causal mask every rank then
has the same work).  Tokens take their global positions (learned table, rotations).  Attention
(:class:`_RingAttention`) passes each rank's keys and values around the ring with async
send/recv while the block in hand is computed, merges the blocks with their log-sum-exp (online
softmax) and in backward recomputes every block from the saved q, k, v, output and log-sum-exp,
sending each block's key/value gradients back around the ring to their owner.  The two rings run
on two process groups: NCCL ignores point-to-point tags, so on one group a rank's gradient send
could match its peer's key/value receive.  docs/trainer.md says why this and not
``torch.distributed.tensor.experimental.context_parallel``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.trainer.models import documents as documents_mod
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import ring_tiles
from meshtrain.trainer.telemetry import clocks, recording


@dataclasses.dataclass(frozen=True)
class CPContext:
    """This rank's place in its context-parallel ring."""

    group: dist.ProcessGroup
    """The cp group (same pp, dp, tp): the key/value ring."""
    grad_group: dist.ProcessGroup
    """A second group of the same ranks: the key/value gradients' ring in backward.  Apart
    because NCCL matches point-to-point messages by peer and order only (it ignores tags): on one
    group both rings' messages would have to be issued in the same order on every rank."""
    rank: int
    """Index in the group: which two chunks of each sequence this rank holds."""
    size: int
    """Context degree C."""
    peers: tuple[int, ...]
    """Global ranks of the group, cp index order."""
    recorder: recording.StepRecorder
    """Receives each ring transfer's time (group ``cp``)."""
    clock: clocks.Clock
    """Times the transfers."""

    @property
    def next_peer(self) -> int:
        """Global rank keys and values are sent to."""
        return self.peers[(self.rank + 1) % self.size]

    @property
    def prev_peer(self) -> int:
        """Global rank keys and values arrive from."""
        return self.peers[(self.rank - 1) % self.size]


def chunks_of(rank: int, size: int) -> tuple[int, int]:
    """The two chunks (of ``2 x size``) cp rank ``rank`` holds: ``rank`` and ``2 size - 1 - rank``."""
    return rank, 2 * size - 1 - rank


def shard(tokens: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's tokens of (B, T) sequences: its two chunks along T, concatenated (B, T / size)."""
    pieces = tokens.chunk(2 * size, dim=1)
    first, second = chunks_of(rank, size)
    return torch.cat([pieces[first], pieces[second]], dim=1)


def global_positions(rank: int, size: int, local: int, device: torch.device) -> torch.Tensor:
    """Positions (local,) of the tokens cp rank ``rank`` holds, ``local`` of them (two chunks)."""
    c = local // 2
    first, second = chunks_of(rank, size)
    return torch.cat(
        [
            torch.arange(first * c, (first + 1) * c, device=device),
            torch.arange(second * c, (second + 1) * c, device=device),
        ]
    )


def documents_of(tokens: torch.Tensor, eos: int, rank: int, size: int) -> documents_mod.Documents:
    """The documents of cp rank ``rank``'s share of the whole rows ``tokens`` (B, T).

    Positions are the rank's slices of the per-document positions.  ``mask`` is not a dense mask
    here but every token's document index (B, T) int64 in ring order (rank j's two chunks at
    columns ``j T / C``...): the ring builds each tile's (t x s) mask from it inside its tile
    loop (:func:`_document_bias`), so no (B, 1, T / C, T) mask exists.  Built from the token ids
    every cp rank already holds, so nothing travels.
    """
    doc = documents_mod.document_index(tokens, eos)  # (B, T)
    ids = torch.cat([shard(doc, j, size) for j in range(size)], dim=1)
    positions = shard(documents_mod.positions_in_documents(tokens, eos), rank, size)
    return documents_mod.Documents(positions=positions, mask=ids)


def apply_context_parallel(chunks: list[gpt.GPT], ctx: CPContext) -> None:
    """Give every chunk's embedding and attention this rank's global positions, and the ring as attention."""

    def positions(local: int, device: torch.device) -> torch.Tensor:
        return global_positions(ctx.rank, ctx.size, local, device)

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
        """:func:`.gpt.attend`'s call; ``recompute`` is moot (the ring keeps only q, k, v, output
        and log-sum-exp), grouped-query attention is read from the head counts, and ``mask`` is
        :func:`documents_of`'s document indices (B, T) in ring order."""
        out: torch.Tensor = _RingAttention.apply(q, k, v, ctx, options.get("mask"))
        return out

    for chunk in chunks:
        for module in chunk.modules():  # the models' attention modules and the chunk itself
            if hasattr(module, "core"):
                setattr(module, "core", core)  # noqa: B010 - an attribute the module class declares
            if hasattr(module, "positions"):
                setattr(module, "positions", positions)  # noqa: B010 - as above


# --- the ring ------------------------------------------------------------------


def _exchange(
    buffer: torch.Tensor, ctx: CPContext, group: dist.ProcessGroup
) -> tuple[list[Any], torch.Tensor]:
    """Send ``buffer`` to the next rank and receive the previous rank's into a new tensor (async),
    on ``group`` (the ring's: :attr:`CPContext.group` or :attr:`CPContext.grad_group`)."""
    received = torch.empty_like(buffer)
    ops = [
        dist.P2POp(dist.isend, buffer, ctx.next_peer, group),
        dist.P2POp(dist.irecv, received, ctx.prev_peer, group),
    ]
    return dist.batch_isend_irecv(ops), received


def _finish(works: list[Any], buffer: torch.Tensor, ctx: CPContext, start: clocks.Stamp) -> None:
    """Wait for one exchange and report it: its flight (launch to the wait's return, the attention
    beside it included) as a ``cp`` collective, the time the wait held compute as a ``cp`` wait."""
    held = ctx.clock.now()
    for work in works:
        work.wait()
    released = ctx.clock.now()
    nbytes = buffer.numel() * buffer.element_size()
    # stamps are floats on the host clock, CUDA events for the DeferredRecorder (see clocks)
    record: Callable[..., None] = ctx.recorder.collective
    record("cp", recording.RING_OP, nbytes, start, released)
    wait: Callable[..., None] = ctx.recorder.wait
    wait("cp", held, released)


def _accumulation(t: torch.Tensor) -> torch.dtype:
    """Where the merged output and log-sum-exp live: fp32, or the inputs' dtype if wider (fp64 tests)."""
    return torch.promote_types(t.dtype, torch.float32)


Tile = tuple[slice, slice, bool, "torch.Tensor | None"]
"""(query rows, key rows, causal (a diagonal tile), additive document bias or None)."""


def _document_bias(
    ids: torch.Tensor, rank: int, source: int, rows: slice, cols: slice, like: torch.Tensor
) -> torch.Tensor:
    """The tile's additive mask (B, 1, t, s) in ``like``'s dtype from the document indices
    ``ids`` (B, T) in ring order (:func:`documents_of`): 0 where the key is in the query's
    document and not after it, -inf elsewhere.  Rows padded to a multiple of 16 keys, as
    :func:`.documents.of_tokens` does (what CUDA's memory-efficient kernel wants)."""
    size = ids.shape[1] // like.shape[2]
    local = like.shape[2]
    doc_q = ids[:, rank * local : (rank + 1) * local][:, rows]
    doc_k = ids[:, source * local : (source + 1) * local][:, cols]
    pos_q = global_positions(rank, size, local, ids.device)[rows]
    pos_k = global_positions(source, size, local, ids.device)[cols]
    allowed = (doc_q[:, :, None] == doc_k[:, None, :]) & (pos_q[:, None] >= pos_k[None, :])
    batch, t, s = allowed.shape
    padded = torch.zeros(
        batch, 1, t, s + (-s) % documents_mod.MASK_ALIGNMENT, dtype=like.dtype, device=like.device
    )
    return padded[..., :s].masked_fill_(~allowed.unsqueeze(1), float("-inf"))


def _tiles(
    rank: int, step: int, size: int, ids: torch.Tensor | None, like: torch.Tensor
) -> list[Tile]:
    """The tiles, one chunk by one chunk, of the pair at ``step`` of the ring: rank ``rank``'s
    queries ``like`` (B, h, T / C, d) against the keys of rank ``(rank - step) mod size``; the
    rest of the pair is fully masked.  Causal on the diagonal tiles, or with document indices
    ``ids`` (:func:`documents_of`) each tile's own mask, built here per tile.  Own diagonal tiles
    come first, so every query row has a finite log-sum-exp before the rest."""
    local = like.shape[2]
    c = local // 2
    first, second = slice(0, c), slice(c, local)
    source = (rank - step) % size
    if step == 0:  # own chunks: chunk order is position order
        tiles = [(first, first, True), (second, second, True), (second, first, False)]
    elif source < rank:  # its first chunk precedes both of ours, its second follows both
        tiles = [(first, first, False), (second, first, False)]
    else:  # only our second chunk follows both of its
        tiles = [(second, first, False), (second, second, False)]
    if ids is None:
        return [(rows, cols, diagonal, None) for rows, cols, diagonal in tiles]
    return [
        (rows, cols, False, _document_bias(ids, rank, source, rows, cols, like))
        for rows, cols, _ in tiles
    ]


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows (dim 2, the sequence) of a (B, h, T, ...) or (B, h, T) tensor, contiguous for the kernels."""
    return t[:, :, rows].contiguous()


class _RingAttention(torch.autograd.Function):
    """Exact causal attention over the whole sequence from this rank's slices of q, k, v."""

    @staticmethod
    def forward(
        fctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: CPContext,
        ids: torch.Tensor | None,
    ) -> torch.Tensor:
        acc = _accumulation(q)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()  # what travels: (2, B, kv, T, d)
        for step in range(ctx.size):
            pending = None
            if step < ctx.size - 1:
                pending = (_exchange(kv, ctx, ctx.group), ctx.clock.now())
            for rows, cols, causal, bias in _tiles(ctx.rank, step, ctx.size, ids, q):
                tile_out, tile_lse = ring_tiles.forward(
                    _rows(q, rows), _rows(kv[0], cols), _rows(kv[1], cols), causal, bias
                )
                _merge(out, lse, rows, tile_out, tile_lse)
            if pending is not None:
                (works, received), start = pending
                _finish(works, kv, ctx, start)
                kv = received
        result = out.to(q.dtype)
        fctx.save_for_backward(q, k, v, result, lse)
        fctx.ctx, fctx.ids = ctx, ids
        return result

    @staticmethod
    def backward(
        fctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse = fctx.saved_tensors
        ctx: CPContext = fctx.ctx
        acc = _accumulation(q)
        dout = grad.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv: torch.Tensor | None = None  # the travelling key/value gradient, once one arrived
        grads_in: tuple[tuple[list[Any], torch.Tensor], clocks.Stamp] | None = None
        for step in range(ctx.size):
            pending = None
            if step < ctx.size - 1:
                pending = (_exchange(kv, ctx, ctx.group), ctx.clock.now())
            contribution = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            for rows, cols, causal, bias in _tiles(ctx.rank, step, ctx.size, fctx.ids, q):
                tile_dq, tile_dk, tile_dv = ring_tiles.backward(
                    _rows(dout, rows),
                    _rows(q, rows),
                    _rows(kv[0], cols),
                    _rows(kv[1], cols),
                    _rows(out, rows),
                    _rows(lse, rows),
                    causal,
                    bias,
                )
                dq[:, :, rows] += tile_dq
                contribution[0][:, :, cols] += tile_dk
                contribution[1][:, :, cols] += tile_dv
            if grads_in is not None:  # the sum so far of the ranks this key/value block visited
                (works, received), start = grads_in
                _finish(works, received, ctx, start)
                dkv = received
            dkv = contribution if dkv is None else dkv + contribution
            grads_in = (_exchange(dkv, ctx, ctx.grad_group), ctx.clock.now())
            if pending is not None:
                (works, received), start = pending
                _finish(works, kv, ctx, start)
                kv = received
        assert grads_in is not None
        (works, own), start = grads_in  # after the last step: this rank's own keys' gradient
        _finish(works, own, ctx, start)
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None


def _merge(
    out: torch.Tensor,
    lse: torch.Tensor,
    rows: slice,
    tile_out: torch.Tensor,
    tile_lse: torch.Tensor,
) -> None:
    """Merge one tile's output (B, h, t, d) and log-sum-exp (B, h, t) into the running output
    and log-sum-exp of ``rows`` in place (online softmax).  A row the tile masks whole (another
    document: log-sum-exp -inf) adds nothing."""
    merged = torch.logaddexp(lse[:, :, rows], tile_lse)
    out[:, :, rows] = out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).unsqueeze(
        -1
    ) + tile_out.to(out.dtype) * torch.exp(tile_lse - merged).unsqueeze(-1)
    lse[:, :, rows] = merged
