"""Documents packed into one training window: who may attend to whom, and each token's position.

``training.documentMask`` trains a window that holds the end of one document and the start of the
next as if each document were alone: a token attends only to earlier tokens of its own document
and its position counts from its document's first token.  A document ends with its end-of-text
id (``meshtrain data prepare`` writes one after each); the id belongs to the document it ends.

The mask is an additive (B, 1, T, T) block-diagonal causal matrix (0 where attention is
allowed, -inf elsewhere) for ``scaled_dot_product_attention`` (docs/trainer.md says why not
FlexAttention), built once per micro-batch in the attention's dtype, so every layer passes the
same tensor and autograd keeps it once (a boolean mask would be turned into a new float bias by
every layer, each kept for backward).  A function of the token ids alone, so every pipeline stage
and tensor rank rebuilds the same one from the micro-batch it already reads, and nothing travels
between stages.
"""

from __future__ import annotations

import dataclasses

import torch

MASK_ALIGNMENT = 16
"""Keys a mask row's stride is a multiple of (what CUDA's memory-efficient SDPA kernel wants)."""


@dataclasses.dataclass(frozen=True)
class Documents:
    """The document structure of one micro-batch, on the device it is used on."""

    positions: torch.Tensor
    """(B, T) int64: each token's index inside its document (0 at a document's first token)."""
    mask: torch.Tensor
    """(B, 1, T, T) additive, in the attention's dtype: 0 where query t may attend key s (same
    document and s <= t), -inf elsewhere.  Under context parallelism the ring's document indices
    (B, T) instead (``parallel.context.documents_of``), from which it builds each tile's mask."""
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    """Llama's rotary cos and sin of ``positions`` (each (B, T, head_dim), fp32), computed once
    per micro-batch by the model and shared by its layers; None until then."""


def document_index(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """(B, T) int64: which document of its row each token belongs to (0 for the row's first)."""
    ends = (tokens == eos).long()  # (B, T)
    return torch.cumsum(ends, dim=1) - ends  # an end-of-text id closes its own document


def of_tokens(tokens: torch.Tensor, eos: int, dtype: torch.dtype = torch.float32) -> Documents:
    """The documents of ``tokens`` (B, T) whose documents end with ``eos``; the mask in ``dtype``
    (the dtype attention's queries have: bf16 under bf16 autocast)."""
    batch, seq = tokens.shape
    doc = document_index(tokens, eos)  # (B, T)
    same = doc[:, :, None] == doc[:, None, :]  # (B, T, T)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril()
    allowed = (same & causal).unsqueeze(1)  # (B, 1, T, T)
    # rows padded to a multiple of 16 keys: CUDA's memory-efficient kernel would otherwise
    # pad a copy of the mask at every call (and every layer would keep its own)
    padded = torch.zeros(
        batch, 1, seq, seq + (-seq) % MASK_ALIGNMENT, dtype=dtype, device=tokens.device
    )
    bias = padded[..., :seq]  # (B, 1, T, T) view
    return Documents(
        positions=positions_in_documents(tokens, eos),
        mask=bias.masked_fill_(~allowed, float("-inf")),
    )


def positions_in_documents(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """(B, T) int64: each token's index inside its document (0 at a document's first token)."""
    batch, seq = tokens.shape
    index = torch.arange(seq, device=tokens.device).expand(batch, seq)  # (B, T)
    starts = torch.ones_like(tokens, dtype=torch.bool)  # a token after an end-of-text starts one
    starts[:, 1:] = tokens[:, :-1] == eos
    first = torch.cummax(
        torch.where(starts, index, 0), dim=1
    ).values  # (B, T): its document's start
    return index - first


def squares(tokens: torch.Tensor, eos: int) -> int:
    """Sum over the documents of every row of their squared lengths (what attention FLOPs scale with)."""
    tokens = tokens.cpu()
    rows = tokens.shape[1] * torch.arange(len(tokens))[:, None]  # (B, 1): each row's own bins
    counts = torch.bincount((document_index(tokens, eos) + rows).flatten())
    return int((counts * counts).sum())
