"""Meshtrain parameter names to Hugging Face tensor names, and the tensors that go with them.

A fused meshtrain parameter is several Hugging Face tensors concatenated along dim 0 (Llama's
q/k/v and gate/up projections); GPT-2's ``Conv1D`` weights are stored transposed, and its linear
biases, which meshtrain's GPT has not, are zeros.
"""

from __future__ import annotations

import dataclasses

import torch

from meshtrain.trainer.models import gpt


@dataclasses.dataclass(frozen=True)
class Part:
    """One Hugging Face tensor that is (part of) a meshtrain parameter."""

    key: str
    """Hugging Face tensor name."""
    transpose: bool = False
    """GPT-2 ``Conv1D`` stores (in, out)."""


def hf_parts(config: gpt.GPTConfig, name: str) -> list[Part]:
    """The Hugging Face tensors of meshtrain parameter ``name``, in the order they are concatenated (dim 0)."""
    llama = config.family == "llama"
    top = {
        "tok_emb.weight": "model.embed_tokens.weight" if llama else "transformer.wte.weight",
        "pos_emb.weight": "transformer.wpe.weight",
        "norm.weight": "model.norm.weight" if llama else "transformer.ln_f.weight",
        "norm.bias": "transformer.ln_f.bias",
        "head.weight": "lm_head.weight",
    }
    if name in top:
        return [Part(top[name])]
    _, index, rest = name.split(".", 2)
    if llama:
        base = f"model.layers.{index}."
        attn, mlp = base + "self_attn.", base + "mlp."
        table = {
            "ln1.weight": [Part(base + "input_layernorm.weight")],
            "ln2.weight": [Part(base + "post_attention_layernorm.weight")],
            "attn.qkv.weight": [Part(attn + f"{p}_proj.weight") for p in "qkv"],
            "attn.proj.weight": [Part(attn + "o_proj.weight")],
            "mlp.fc.weight": [Part(mlp + "gate_proj.weight"), Part(mlp + "up_proj.weight")],
            "mlp.proj.weight": [Part(mlp + "down_proj.weight")],
        }
    else:
        base = f"transformer.h.{index}."
        table = {
            "ln1.weight": [Part(base + "ln_1.weight")],
            "ln1.bias": [Part(base + "ln_1.bias")],
            "ln2.weight": [Part(base + "ln_2.weight")],
            "ln2.bias": [Part(base + "ln_2.bias")],
            "attn.qkv.weight": [Part(base + "attn.c_attn.weight", transpose=True)],
            "attn.proj.weight": [Part(base + "attn.c_proj.weight", transpose=True)],
            "mlp.fc.weight": [Part(base + "mlp.c_fc.weight", transpose=True)],
            "mlp.proj.weight": [Part(base + "mlp.c_proj.weight", transpose=True)],
        }
    return table[rest]


def zero_biases(config: gpt.GPTConfig) -> dict[str, int]:
    """GPT-2's linear biases (meshtrain's GPT has none): name -> length."""
    if config.family == "llama":
        return {}
    h, f = config.hidden, config.ffn_hidden
    sizes = {
        "attn.c_attn.bias": 3 * h,
        "attn.c_proj.bias": h,
        "mlp.c_fc.bias": f,
        "mlp.c_proj.bias": h,
    }
    return {f"transformer.h.{i}.{key}": n for i in range(config.layers) for key, n in sizes.items()}


def hf_tensors(config: gpt.GPTConfig, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of one dense meshtrain parameter."""
    parts = hf_parts(config, name)
    sizes = _part_rows(config, name, tensor.shape[0], len(parts))
    return {
        part.key: (piece.t() if part.transpose else piece).contiguous()
        for part, piece in zip(parts, tensor.split(sizes))
    }


def to_hf(config: gpt.GPTConfig, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face tensors from meshtrain's dense parameters (and GPT-2's zero biases)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in dense.items():
        out.update(hf_tensors(config, name, tensor))
    for key, n in zero_biases(config).items():
        out[key] = torch.zeros(n)
    return out


def _part_rows(config: gpt.GPTConfig, name: str, rows: int, parts: int) -> list[int]:
    if name.endswith("attn.qkv.weight") and parts == 3:
        q, kv = config.heads * config.head_dim, config.key_value_heads * config.head_dim
        return [q, kv, kv]
    return [rows // parts] * parts
