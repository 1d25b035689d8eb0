"""Workers of the context-parallel tests: ring attention on a cp group against torch's own SDPA.

Unique module name on purpose: child processes import it by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtrain.trainer.models import documents
from meshtrain.trainer.parallel import context
from meshtrain.trainer.telemetry import clocks, recording

EOS = 3
"""The end-of-text id of the random documents."""


def ring_vs_sdpa(
    heads: int,
    kv_heads: int,
    seq: int,
    masked: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> dict:
    """Ring attention of this rank's slices of random q, k, v, and the whole-sequence SDPA's output
    and gradients cut the same way (every rank builds the same tensors from ``seed``); ``masked``:
    random documents, the ring's mask from :func:`context.documents_of` and SDPA's from
    :func:`documents.of_tokens` (one device's).  ``dtype``: q, k, v, the output gradient and both
    attentions' (drawn in fp64, then cast)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, seq, 8, generator=generator, dtype=torch.float64)
    k = torch.randn(2, kv_heads, seq, 8, generator=generator, dtype=torch.float64)
    v = torch.randn(2, kv_heads, seq, 8, generator=generator, dtype=torch.float64)
    dout = torch.randn(2, heads, seq, 8, generator=generator, dtype=torch.float64)
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    tokens = torch.randint(0, 8, (2, seq), generator=generator)  # id 3 ends a document
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    if masked:
        mask = documents.of_tokens(tokens, EOS, dtype).mask
        ref_k, ref_v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in whole[1:])
        ref = F.scaled_dot_product_attention(whole[0], ref_k, ref_v, attn_mask=mask)
    else:
        ref = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=kv_heads < heads)
    ref.backward(dout)
    recorder = recording.MemoryRecorder()
    ctx = context.CPContext(
        group=dist.group.WORLD,
        # the gradient ring's own group of the same ranks, as build_mesh makes it
        grad_group=dist.new_group(list(range(world))),
        rank=rank,
        size=world,
        peers=tuple(range(world)),
        recorder=recorder,
        clock=clocks.for_device(torch.device("cpu")),
    )

    def mine(t: torch.Tensor) -> torch.Tensor:  # (B, h, T, d): this rank's two chunks of T
        return context.shard(t.transpose(1, 2), rank, world).transpose(1, 2)

    local = [mine(t).clone().requires_grad_() for t in (q, k, v)]
    ring_mask = context.documents_of(tokens, EOS, rank, world).mask if masked else None
    out = context._RingAttention.apply(*local, ctx, ring_mask)
    out.backward(mine(dout))
    return {
        "out": (out.detach(), mine(ref.detach())),
        "grads": [(t.grad, mine(w.grad)) for t, w in zip(local, whole)],
        "transfers": recorder.count("collective", "cp"),
    }
