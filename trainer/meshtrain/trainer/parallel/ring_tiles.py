"""One ring tile of attention through torch's own fused SDPA kernels, with its log-sum-exp.

Ring attention (:mod:`.context`) merges tiles by their log-sum-exp and recomputes each tile in
backward from the whole attention's output and log-sum-exp.  Each tile runs on the aten SDPA
operator that returns the log-sum-exp and has a backward operator (what
``torch.distributed.tensor.experimental.context_parallel`` calls per ring step): on CPU
``_scaled_dot_product_flash_attention_for_cpu`` (it takes a mask and fp64, so the gloo tests run
this same path); on CUDA ``_scaled_dot_product_flash_attention`` for unmasked bf16/fp16 tiles and
``_scaled_dot_product_efficient_attention`` (an additive bias) for masked or fp32 ones.  Scores
stay fp32 inside the kernels; no (c x c) scores are materialised here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

aten: Any = torch.ops.aten
"""The aten operator namespace (untyped)."""

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""What CUDA's flash kernel takes."""

_LSE_BLOCK = 32
"""CUDA's memory-efficient kernel pads its log-sum-exp's sequence dimension to this multiple."""


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, kv, s, d) -> (B, heads, s, d): grouped-query keys or values, one per query head."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, h, s, d) -> (B, kv, s, d): per-query-head key/value gradients summed per group."""
    batch, heads, seq, dim = t.shape
    return t.view(batch, kv_heads, heads // kv_heads, seq, dim).sum(2)


def _cuda_kernel(q: torch.Tensor, bias: torch.Tensor | None) -> str:
    if q.dtype == torch.float64:
        raise ValueError(
            "ring attention on CUDA takes bf16, fp16 or fp32 (training.precision); fp64 runs on CPU only"
        )
    return "flash" if bias is None and q.dtype in _FLASH_DTYPES else "efficient"


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, h, t, d) to k, v (B, kv, s, d): output (B, h, t, d) in q's dtype and
    log-sum-exp (B, h, t) (fp32, or fp64 for fp64 inputs).  ``causal``: top-left causal (square
    diagonal tiles); ``bias`` (B, 1, t, s) additive in q's dtype.  Rows ``bias`` masks whole get
    output 0 and log-sum-exp -inf."""
    heads = q.shape[1]
    k, v = _expand(k, heads), _expand(v, heads)
    if q.device.type != "cuda":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias
        )
    elif _cuda_kernel(q, bias) == "flash":
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
    else:
        out, lse, *_ = aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, causal
        )
        lse = lse[..., : q.shape[2]]
    if bias is not None:  # the CPU kernel gives a masked-out row log-sum-exp 0
        dead = torch.isinf(bias).all(-1)  # (B, 1, t)
        lse = lse.masked_fill(dead, float("-inf"))
        out = out.masked_fill(dead.unsqueeze(-1), 0.0)
    return out, lse


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile's gradients, recomputed against the whole attention's ``out`` (B, h, t, d) and
    log-sum-exp ``lse`` (B, h, t) for these rows (exact: the softmax over every key):
    dq (B, h, t, d) and dk, dv (B, kv, s, d), in q's dtype."""
    heads, kv_heads = q.shape[1], k.shape[1]
    ek, ev = _expand(k, heads), _expand(v, heads)
    dout = dout.contiguous()
    if q.device.type != "cuda":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ek, ev, out, lse, 0.0, causal, attn_mask=bias
        )
    elif _cuda_kernel(q, bias) == "flash":
        no_rng = torch.empty((), dtype=torch.int64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            ek,
            ev,
            out,
            lse,
            None,
            None,
            q.shape[2],
            ek.shape[2],
            0.0,
            causal,
            no_rng,
            no_rng,
        )
    else:
        no_rng = torch.empty((), dtype=torch.int64, device=q.device)
        padded = F.pad(lse, (0, (-q.shape[2]) % _LSE_BLOCK)).contiguous()
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout,
            q,
            ek,
            ev,
            bias,
            out,
            padded,
            no_rng,
            no_rng,
            0.0,
            (True, True, True, False),
            causal,
        )
    return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)
