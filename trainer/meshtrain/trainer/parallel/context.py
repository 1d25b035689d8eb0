"""Context parallelism: every sequence split over the cp group, attention as a ring.

The sequence is cut into ``2 x context`` chunks and cp rank ``k`` holds chunks ``k`` and
``2C-1-k`` (Megatron's and TorchTitan's load balancing: under the causal mask every rank then
has the same work).  Tokens take their global positions (learned table, rotations).  Attention
(:class:`_RingAttention`) passes each rank's keys and values around the ring with async
send/recv while the block in hand is computed, merges the blocks with their log-sum-exp (online
softmax) and in backward recomputes every block from the saved q, k, v, output and log-sum-exp,
sending each block's key/value gradients back around the ring to their owner.  docs/trainer.md
says why this and not ``torch.distributed.tensor.experimental.context_parallel``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.trainer.models import documents as documents_mod
from meshtrain.trainer.models import gpt
from meshtrain.trainer.telemetry import clocks, recording

KV_TAG, GRAD_TAG = 0, 1
"""Message tags of the ring's two streams: keys and values forward, their gradients backward."""


@dataclasses.dataclass(frozen=True)
class CPContext:
    """This rank's place in its context-parallel ring."""

    group: dist.ProcessGroup
    """The cp group (same pp, dp, tp)."""
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


def documents_of(
    tokens: torch.Tensor, eos: int, dtype: torch.dtype, rank: int, size: int
) -> documents_mod.Documents:
    """The documents of cp rank ``rank``'s share of the whole rows ``tokens`` (B, T).

    Positions are the rank's slices of the per-document positions; the mask (B, 1, T / C, T) is
    the rank's queries against every rank's keys in ring order (rank j's two chunks at columns
    ``j T / C``...): 0 where the key is in the query's document and not after it, -inf elsewhere.
    Built from the token ids every cp rank already holds, so nothing travels; 1 / C of one
    device's (B, 1, T, T) mask.
    """
    local = tokens.shape[1] // size
    doc = documents_mod.document_index(tokens, eos)  # (B, T)
    rows = global_positions(rank, size, local, tokens.device)  # (T / C,)
    cols = torch.cat([global_positions(j, size, local, tokens.device) for j in range(size)])
    allowed = (doc[:, rows, None] == doc[:, None, cols]) & (rows[:, None] >= cols[None, :])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=tokens.device)
    positions = shard(documents_mod.positions_in_documents(tokens, eos), rank, size)
    return documents_mod.Documents(
        positions=positions, mask=mask.masked_fill_(~allowed, float("-inf")).unsqueeze(1)
    )


def apply_context_parallel(chunks: list[gpt.GPT], ctx: CPContext) -> None:
    """Give every chunk's embedding and attention this rank's global positions, and the ring as attention."""

    def positions(local: int, device: torch.device) -> torch.Tensor:
        return global_positions(ctx.rank, ctx.size, local, device)

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
        """:func:`.gpt.attend`'s call; ``recompute`` is moot (the ring keeps only q, k, v, output
        and log-sum-exp), grouped-query attention is read from the head counts, and ``mask`` is
        :func:`documents_of`'s (B, 1, T / C, T) in ring order."""
        out: torch.Tensor = _RingAttention.apply(q, k, v, ctx, options.get("mask"))
        return out

    for chunk in chunks:
        for module in chunk.modules():  # the models' attention modules and the chunk itself
            if hasattr(module, "core"):
                setattr(module, "core", core)  # noqa: B010 - an attribute the module class declares
            if hasattr(module, "positions"):
                setattr(module, "positions", positions)  # noqa: B010 - as above


# --- the ring ------------------------------------------------------------------


def _exchange(buffer: torch.Tensor, ctx: CPContext, tag: int) -> tuple[list[Any], torch.Tensor]:
    """Send ``buffer`` to the next rank and receive the previous rank's into a new tensor (async)."""
    received = torch.empty_like(buffer)
    ops = [
        dist.P2POp(dist.isend, buffer, ctx.next_peer, ctx.group, tag),
        dist.P2POp(dist.irecv, received, ctx.prev_peer, ctx.group, tag),
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


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, h, T, d) -> (B, kv, h / kv, T, d): query heads by the key/value head they read."""
    batch, heads, seq, dim = q.shape
    return q.view(batch, kv_heads, heads // kv_heads, seq, dim)


def _accumulation(t: torch.Tensor) -> torch.dtype:
    """Where softmax and the merged output live: fp32, or the inputs' dtype if wider (fp64 tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 scaled scores (B, kv, g, Tq, Tk) of grouped q against k (B, kv, Tk, d), plus the
    additive ``bias`` (Tq, Tk) or (B, 1, Tq, Tk) where the tile is masked."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2))
    s = s.to(_accumulation(q)) / math.sqrt(q.shape[-1])
    if bias is None:
        return s
    return s + (bias.unsqueeze(2) if bias.dim() == 4 else bias)


Tile = tuple[slice, slice, "torch.Tensor | None"]
"""(query rows, key rows, additive bias or None where every pair attends)."""


def _tiles(
    rank: int, step: int, size: int, local: int, mask: torch.Tensor | None, like: torch.Tensor
) -> list[Tile]:
    """The tiles, one chunk by one chunk, of the pair at ``step`` of the ring: rank ``rank``'s
    queries against the keys of rank ``(rank - step) mod size``; the rest of the pair is fully
    masked.  Chunk by chunk keeps the transient scores (B, h, c, c).  Biases: causal on the
    diagonal tiles, or with ``mask`` (:func:`documents_of`) its slice on every tile.  Own
    diagonal tiles come first, so every query row has a finite log-sum-exp before the rest."""
    c = local // 2
    first, second = slice(0, c), slice(c, local)
    source = (rank - step) % size
    if step == 0:  # own chunks: chunk order is position order
        tiles = [(first, first, True), (second, second, True), (second, first, False)]
    elif source < rank:  # its first chunk precedes both of ours, its second follows both
        tiles = [(first, first, False), (second, first, False)]
    else:  # only our second chunk follows both of its
        tiles = [(second, first, False), (second, second, False)]
    if mask is not None:
        offset = source * local
        return [
            (rows, cols, mask[..., rows, offset + cols.start : offset + cols.stop])
            for rows, cols, _ in tiles
        ]
    causal = torch.full((c, c), float("-inf"), dtype=_accumulation(like), device=like.device)
    causal = causal.triu(1)
    return [(rows, cols, causal if diagonal else None) for rows, cols, diagonal in tiles]


class _RingAttention(torch.autograd.Function):
    """Exact causal attention over the whole sequence from this rank's slices of q, k, v."""

    @staticmethod
    def forward(
        fctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: CPContext,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        kv_heads, local = k.shape[1], q.shape[2]
        gq = _grouped(q, kv_heads)  # (B, kv, g, T, d)
        acc = _accumulation(q)
        out = torch.zeros(gq.shape, dtype=acc, device=q.device)
        lse = torch.full(gq.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()  # what travels: (2, B, kv, T, d)
        for step in range(ctx.size):
            pending = None
            if step < ctx.size - 1:
                pending = (_exchange(kv, ctx, KV_TAG), ctx.clock.now())
            for rows, cols, bias in _tiles(ctx.rank, step, ctx.size, local, mask, q):
                _merge_tile(out, lse, gq, kv, rows, cols, bias)
            if pending is not None:
                (works, received), start = pending
                _finish(works, kv, ctx, start)
                kv = received
        result = out.to(q.dtype).view(q.shape)
        fctx.save_for_backward(q, k, v, result, lse)
        fctx.ctx, fctx.mask = ctx, mask
        return result

    @staticmethod
    def backward(
        fctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse = fctx.saved_tensors
        ctx: CPContext = fctx.ctx
        kv_heads, local = k.shape[1], q.shape[2]
        acc = _accumulation(q)
        gq, dout = _grouped(q, kv_heads), _grouped(grad, kv_heads).to(acc)
        delta = (dout * _grouped(out, kv_heads).to(acc)).sum(-1)  # (B, kv, g, T): rowsum(dO * O)
        dq = torch.zeros(gq.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv: torch.Tensor | None = None  # the travelling key/value gradient, once one arrived
        grads_in: tuple[tuple[list[Any], torch.Tensor], clocks.Stamp] | None = None
        for step in range(ctx.size):
            pending = None
            if step < ctx.size - 1:
                pending = (_exchange(kv, ctx, KV_TAG), ctx.clock.now())
            contribution = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            for rows, cols, bias in _tiles(ctx.rank, step, ctx.size, local, fctx.mask, q):
                tile_dq, tile_dkv = _tile_backward(
                    gq[..., rows, :],
                    kv[..., cols, :],
                    bias,
                    dout[..., rows, :],
                    lse[..., rows],
                    delta[..., rows],
                )
                dq[..., rows, :] += tile_dq
                contribution[..., cols, :] += tile_dkv
            if grads_in is not None:  # the sum so far of the ranks this key/value block visited
                (works, received), start = grads_in
                _finish(works, received, ctx, start)
                dkv = received
            dkv = contribution if dkv is None else dkv + contribution
            grads_in = (_exchange(dkv, ctx, GRAD_TAG), ctx.clock.now())
            if pending is not None:
                (works, received), start = pending
                _finish(works, kv, ctx, start)
                kv = received
        assert grads_in is not None
        (works, own), start = grads_in  # after the last step: this rank's own keys' gradient
        _finish(works, own, ctx, start)
        return dq.to(q.dtype).view(q.shape), own[0].to(k.dtype), own[1].to(v.dtype), None, None


def _merge_tile(
    out: torch.Tensor,
    lse: torch.Tensor,
    gq: torch.Tensor,
    kv: torch.Tensor,
    rows: slice,
    cols: slice,
    bias: torch.Tensor | None,
) -> None:
    """Attend ``rows`` of the grouped queries to ``cols`` of ``kv`` and merge the tile into the
    running output and log-sum-exp in place (online softmax).  A row the tile masks whole
    (another document) adds nothing: its -inf log-sum-exp is not subtracted."""
    s = _scores(gq[..., rows, :], kv[0][..., cols, :], bias)
    tile_lse = torch.logsumexp(s, dim=-1)  # (B, kv, g, t)
    finite = torch.where(torch.isinf(tile_lse), 0.0, tile_lse)
    tile_out = torch.matmul(
        torch.exp(s - finite.unsqueeze(-1)), kv[1][..., cols, :].unsqueeze(2).to(out.dtype)
    )
    merged = torch.logaddexp(lse[..., rows], tile_lse)
    out[..., rows, :] = out[..., rows, :] * torch.exp(lse[..., rows] - merged).unsqueeze(
        -1
    ) + tile_out * torch.exp(tile_lse - merged).unsqueeze(-1)
    lse[..., rows] = merged


def _tile_backward(
    q: torch.Tensor,
    kv: torch.Tensor,
    bias: torch.Tensor | None,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile's gradients, recomputed from the whole attention's log-sum-exp ``lse`` and
    ``delta`` = rowsum(dO * O): the grouped queries' (B, kv, g, t, d) and the key/value rows'
    (2, B, kv, s, d), both in ``dout``'s accumulation dtype."""
    k, v = kv[0], kv[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    p = torch.exp(_scores(q, k, bias) - lse.unsqueeze(-1))  # (B, kv, g, t, s): the softmax
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(2)  # (B, kv, s, d)
    acc = dout.dtype
    dp = torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2).to(acc))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2).to(acc)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)).sum(2) * scale  # (B, kv, s, d)
    return dq, torch.stack([dk, dv])
