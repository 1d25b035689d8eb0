"""The GPT-style decoder that meshtrain trains, and its own accounting.

What it is: token + position embeddings, ``layers`` pre-norm blocks (causal
self-attention through ``F.scaled_dot_product_attention``, then a GELU MLP), a
final LayerNorm and an untied LM head.  It also counts its parameters and its
training FLOPs per token (see docs/trainer.md for the formula).

What it is not: distributed.  This module imports only torch.  Tensor,
pipeline and data parallelism are applied from outside by
:mod:`meshtrain.trainer.parallel`, which swaps the linear and embedding
modules for sharded ones and drops the parts a pipeline stage does not own
(an absent part is ``None`` and :meth:`GPT.forward` skips it).  The attention
module infers its number of (local) heads from the width of its QKV output so
that it runs unchanged on a tensor-parallel shard.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the decoder."""

    vocab: int
    """Vocabulary size (256 for byte-level tokens)."""
    seq_len: int
    """Maximum sequence length (size of the position table)."""
    layers: int
    """Transformer blocks."""
    hidden: int
    """Model width."""
    heads: int
    """Attention heads; ``hidden`` must be a multiple of it."""
    ffn_hidden: int
    """MLP inner width (usually 4 x hidden)."""
    init_std: float = 0.02
    """Standard deviation of the normal init (GPT-2's value)."""

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    @classmethod
    def from_shape(cls, shape) -> GPTConfig:  # noqa: ANN001 - any object with the ModelShape fields
        """Config from a resolved spec shape (``spec.model.shape()``)."""
        return cls(vocab=shape.vocab, seq_len=shape.seq_len, layers=shape.layers, hidden=shape.hidden,
                   heads=shape.heads, ffn_hidden=shape.ffn_hidden)


class Attention(nn.Module):
    """Causal multi-head self-attention with a fused QKV projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        # Output rows are laid out [q heads | k heads | v heads]; tensor
        # parallelism keeps that layout on every shard (its own heads of each).
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden, bias=False)
        self.proj = nn.Linear(config.hidden, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, 3 * local_heads * head_dim)
        batch, seq, width = qkv.shape
        local_heads = width // (3 * self.head_dim)
        qkv = qkv.view(batch, seq, 3, local_heads, self.head_dim)  # (B, T, 3, h, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, h, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h, T, hd)
        y = y.transpose(1, 2).reshape(batch, seq, local_heads * self.head_dim)  # (B, T, h * hd)
        return self.proj(y)


class MLP(nn.Module):
    """Two linear layers with a GELU between them."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden, config.ffn_hidden, bias=False)
        self.proj = nn.Linear(config.ffn_hidden, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The decoder.  ``forward`` maps tokens (or a hidden state) to logits (or a hidden state).

    A pipeline stage is a GPT whose absent parts are ``None``: without
    ``tok_emb`` the input is already a hidden state (B, T, H); without
    ``head`` the output is one.  Blocks live in a ModuleDict keyed by their
    global index so parameter names are the same on every layout.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb: nn.Module | None = nn.Embedding(config.vocab, config.hidden)
        self.pos_emb: nn.Module | None = nn.Embedding(config.seq_len, config.hidden)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.layers)})
        self.norm: nn.Module | None = nn.LayerNorm(config.hidden)
        self.head: nn.Module | None = nn.Linear(config.hidden, config.vocab, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: normal(0.02), residual projections scaled by 1/sqrt(2 * layers)."""
        std = self.config.init_std
        for name, param in self.named_parameters():
            if param.dim() == 1:  # LayerNorm: weight 1, bias 0
                nn.init.ones_(param) if name.endswith("weight") else nn.init.zeros_(param)
            elif name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=std / math.sqrt(2 * self.config.layers))
            else:
                nn.init.normal_(param, mean=0.0, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            positions = torch.arange(x.shape[1], device=x.device)  # (T,)
            x = self.tok_emb(x) + self.pos_emb(positions)  # (B, T, H)
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)  # (B, T, V) logits (or this rank's vocabulary shard)
        return x

    def num_params(self, *, include_embeddings: bool = True) -> int:
        """Parameters in this module (a shard or a stage counts only what it holds)."""
        total = sum(p.numel() for p in self.parameters())
        if not include_embeddings:
            for part in (self.tok_emb, self.pos_emb):
                if part is not None:
                    total -= sum(p.numel() for p in part.parameters())
        return total


def dense_param_count(config: GPTConfig, *, include_embeddings: bool = True) -> int:
    """Parameters of the full (unsharded) model, computed from the shape alone."""
    h, f = config.hidden, config.ffn_hidden
    per_block = 4 * h + 3 * h * h + h * h + 2 * h * f  # two LayerNorms, QKV, proj, MLP
    total = config.layers * per_block + 2 * h + h * config.vocab  # + final norm + LM head
    if include_embeddings:
        total += config.vocab * h + config.seq_len * h
    return total


def flops_per_token(config: GPTConfig, *, causal_half: bool = False) -> float:
    """Training FLOPs per token: 6 N + 12 L T H (forward + backward, matmuls only).

    ``N`` excludes the embedding tables (lookups are not matmuls) but includes
    the LM head.  The attention term counts QK^T and AV for the full T x T
    score matrix, as in the PaLM MFU definition; with ``causal_half`` it counts
    only the unmasked half (what a causal kernel can skip).  docs/trainer.md
    states which one the MFU metric uses.
    """
    n = dense_param_count(config, include_embeddings=False)
    attention = 12 * config.layers * config.seq_len * config.hidden
    if causal_half:
        attention /= 2
    return 6 * n + attention
