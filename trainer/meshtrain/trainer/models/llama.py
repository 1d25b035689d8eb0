"""The Llama-family decoder: RoPE, RMSNorm, SwiGLU and grouped-query attention.

It keeps :class:`~meshtrain.trainer.models.gpt.GPT`'s module names and structure (``pos_emb`` is
``None``), so parallelism, checkpoints and initialisation treat both families alike.  The fused
``attn.qkv`` (rows ``[q | k | v]``) and ``mlp.fc`` (``[gate | up]``) name their blocks
(``qkv_sizes``, ``fc_sizes``), so tensor parallelism splits each block on its own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.trainer.models import documents as documents_mod
from meshtrain.trainer.models import gpt


def rope_tables(
    seq: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    scaling: gpt.RopeScaling | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, rotary frequency), each (T, head_dim), fp32.

    ``positions`` (B, T): each token's own position (restarting per document); the tables are then (B, T, head_dim).
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    if scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, scaling)
    where = torch.arange(seq, device=device) if positions is None else positions  # (T,) or (B, T)
    angles = where.float()[..., None] * inv_freq  # (T, hd/2) or (B, T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hd): rotate-half layout
    return angles.cos(), angles.sin()


def llama3_frequencies(inv_freq: torch.Tensor, scaling: gpt.RopeScaling) -> torch.Tensor:
    """Llama 3.1's rewrite: long wavelengths slowed by ``factor``, short ones kept, the band between blended."""
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    long = wavelength > context / scaling.low_freq_factor
    short = wavelength < context / scaling.high_freq_factor
    blend = (context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    return torch.where(long, inv_freq / scaling.factor, torch.where(short, inv_freq, blended))


class _RMSNormFunction(torch.autograd.Function):
    """``rms_norm`` that keeps only its input and the per-token ``rstd`` for backward, on every device.

    That is what CUDA's fused kernel keeps; elsewhere ``F.rms_norm``
    decomposes into element-wise ops whose autograd also keeps the
    normalised input (one more hidden-wide fp32 tensor per norm).  Backward
    rebuilds it from the two.  The planner counts what this keeps.
    """

    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out: torch.Tensor
        out, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        fctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = fctx.saved_tensors  # rstd: (..., 1), fp32
        g, normed = grad.float(), x.float() * rstd
        grad_weight = (g * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        g = g * weight.float()
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` over the last dimension that keeps less for backward (:class:`_RMSNormFunction`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:  # the trainer's residual stream is fp32, as its weights
            return super().forward(x)
        out: torch.Tensor = _RMSNormFunction.apply(x, self.weight, self.eps)
        return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (..., T, hd) by its positions' angles, in fp32 (the reference of :class:`_RotaryQKV`)."""
    rotated: torch.Tensor = (x * cos + _rotate_half(x) * sin).to(x.dtype)
    return rotated


class _RotaryQKV(torch.autograd.Function):
    """The fused QKV output with its q and k heads rotated, as one new tensor; keeps only cos and sin.

    Rotating q and k apart from v would keep the projection's whole output
    alive (v is a view of it) beside the rotated copies, ``h + kv`` more
    elements per token.  Here the output holds rotated q, rotated k and v,
    the projection's output is freed, and backward rotates the gradient back
    (by the negative angles) from cos and sin alone.
    """

    @staticmethod
    def forward(
        fctx: Any,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotated: int,
        head_dim: int,
    ) -> torch.Tensor:
        batch, seq, _ = qkv.shape
        out = torch.empty_like(qkv)  # (B, T, (h + 2 kv) * hd)
        qk = qkv[..., :rotated].unflatten(-1, (-1, head_dim))  # (B, T, h + kv, hd)
        # cos, sin: (T, hd) or (B, T, hd), one head axis inserted before hd
        out[..., :rotated] = apply_rope(qk, cos.unsqueeze(-2), sin.unsqueeze(-2)).flatten(-2)
        out[..., rotated:] = qkv[..., rotated:]
        fctx.save_for_backward(cos, sin)
        fctx.rotated, fctx.head_dim = rotated, head_dim
        return out

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        cos, sin = fctx.saved_tensors
        rotated = fctx.rotated
        out = torch.empty_like(grad)
        g = grad[..., :rotated].unflatten(-1, (-1, fctx.head_dim))
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        back = (g * cos - _rotate_half(g) * sin).to(grad.dtype)
        out[..., :rotated] = back.flatten(-2)
        out[..., rotated:] = grad[..., rotated:]
        return out, None, None, None, None


class Attention(nn.Module):
    """Causal grouped-query attention with a fused QKV projection and rotary positions.

    Rotary embeddings use the rotate-half layout of Hugging Face's ``LlamaForCausalLM`` (so its
    weights load unchanged), in fp32, over the positions of the sequence the attention sees:
    under sequence parallelism the whole sequence, after the gather.
    """

    recompute_core = False
    """Selective recompute: rebuild the attention core in backward (:func:`.gpt.attend`)."""

    def __init__(self, config: gpt.GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.rope_scaling = config.rope_scaling
        self.group = config.heads // config.key_value_heads
        """Query heads per key/value head (fewer on a tensor rank whose key/value head is replicated)."""
        q_rows, kv_rows = config.heads * config.head_dim, config.key_value_heads * config.head_dim
        self.qkv = nn.Linear(config.hidden, q_rows + 2 * kv_rows, bias=False)
        self.qkv_sizes = (q_rows, kv_rows, kv_rows)
        """Dense rows of the fused output's blocks (q, k, v): tensor parallelism splits each alone."""
        self.proj = nn.Linear(q_rows, config.hidden, bias=False)
        self.core: gpt.AttentionCore = gpt.attend
        """The attention on q, k and v (replaced from outside, e.g. by ring attention)."""
        self.positions: gpt.TokenPositions = gpt.natural_positions
        """The positions of the tokens this attention sees (without documents): its rotations."""

    def forward(
        self, x: torch.Tensor, documents: documents_mod.Documents | None = None
    ) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, (h + 2 kv) * hd) on this rank
        batch, seq, width = qkv.shape
        kv_heads = width // ((self.group + 2) * self.head_dim)  # local key/value heads
        heads = kv_heads * self.group
        if documents is not None and documents.rope is not None:  # shared by every layer
            cos, sin = documents.rope
        else:
            positions = (
                documents.positions if documents is not None else self.positions(seq, x.device)
            )
            cos, sin = rope_tables(
                seq, self.head_dim, self.rope_theta, x.device, self.rope_scaling, positions
            )
        qkv = _RotaryQKV.apply(qkv, cos, sin, (heads + kv_heads) * self.head_dim, self.head_dim)
        q, k, v = qkv.split(
            [heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim], dim=-1
        )
        q = q.view(batch, seq, heads, self.head_dim).transpose(1, 2)  # (B, h, T, hd), rotated
        k = k.view(batch, seq, kv_heads, self.head_dim).transpose(1, 2)  # (B, kv, T, hd), rotated
        v = v.view(batch, seq, kv_heads, self.head_dim).transpose(1, 2)  # (B, kv, T, hd)
        mask = documents.mask if documents is not None else None
        if mask is not None and self.group > 1:
            # CUDA's memory-efficient kernel (the fused one that takes a mask) refuses
            # enable_gqa: k and v repeated to every query head, (B, h, T, hd) each
            k = k.repeat_interleave(self.group, dim=1)
            v = v.repeat_interleave(self.group, dim=1)
        y = self.core(
            q,
            k,
            v,
            recompute=self.recompute_core,
            enable_gqa=self.group > 1 and mask is None,
            mask=mask,
        )  # (B, h, T, hd)
        y = y.transpose(1, 2).reshape(batch, seq, heads * self.head_dim)  # (B, T, h * hd)
        out: torch.Tensor = self.proj(y)
        return out


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused in ``fc``."""

    def __init__(self, config: gpt.GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden, 2 * config.ffn_hidden, bias=False)
        self.fc_sizes = (config.ffn_hidden, config.ffn_hidden)
        """Dense rows of ``fc``'s output blocks (gate, up)."""
        self.proj = nn.Linear(config.ffn_hidden, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)  # each (B, T, f) on this rank
        out: torch.Tensor = self.proj(F.silu(gate) * up)
        return out


class Block(gpt.Block):
    """Pre-norm block: x + attn(rms(x)), then x + mlp(rms(x)) (GPT's forward, with its selective recompute)."""

    def __init__(self, config: gpt.GPTConfig) -> None:
        nn.Module.__init__(self)
        self.ln1 = RMSNorm(config.hidden, eps=config.norm_eps)
        self.attn = Attention(config)
        self.ln2 = RMSNorm(config.hidden, eps=config.norm_eps)
        self.mlp = SwiGLU(config)


class Llama(gpt.GPT):
    """The Llama decoder; a pipeline stage drops parts exactly as a GPT stage does."""

    def __init__(
        self, config: gpt.GPTConfig, *, seed: int = 0, recompute_blocks: bool = False
    ) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.seed = seed
        self.recompute_blocks = recompute_blocks
        self.positions: gpt.TokenPositions = gpt.natural_positions
        self.tok_emb: nn.Module | None = nn.Embedding(config.vocab, config.hidden)
        self.pos_emb: nn.Module | None = None  # positions are rotary, inside attention
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.layers)})
        self.norm: nn.Module | None = RMSNorm(config.hidden, eps=config.norm_eps)
        self.head: nn.Module | None = nn.Linear(config.hidden, config.vocab, bias=False)
        if config.tie_embeddings:  # one Parameter, registered (and named) as tok_emb.weight
            self.head.weight = self.tok_emb.weight
        if not self.head.weight.is_meta:
            self.reset_parameters()

    def embed(
        self, tokens: torch.Tensor, documents: documents_mod.Documents | None = None
    ) -> torch.Tensor:
        assert self.tok_emb is not None  # only the first stage embeds
        out: torch.Tensor = self.tok_emb(tokens)  # (B, T, H): positions are rotations in attention
        return out

    def features(
        self, x: torch.Tensor, documents: documents_mod.Documents | None = None
    ) -> torch.Tensor:
        """GPT's, with the documents' rotary tables computed once for all of this chunk's layers.

        Per-document positions make the tables (B, T, head_dim) fp32 each; built in every
        layer, autograd would keep one pair per layer (:class:`_RotaryQKV` saves them).
        """
        if documents is not None and documents.rope is None and self.blocks:
            c, positions = self.config, documents.positions  # (B, T)
            rope = rope_tables(
                positions.shape[1], c.head_dim, c.rope_theta, x.device, c.rope_scaling, positions
            )
            documents = dataclasses.replace(documents, rope=rope)
        return super().features(x, documents)


def build(config: gpt.GPTConfig, *, seed: int = 0, recompute_blocks: bool = False) -> gpt.GPT:
    """The decoder of ``config.family`` (under ``torch.device("meta")``: shapes only)."""
    cls = Llama if config.family == "llama" else gpt.GPT
    return cls(config, seed=seed, recompute_blocks=recompute_blocks)
