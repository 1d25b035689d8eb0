"""A Hugging Face model directory's ``config.json``, written from a model.

``config.json`` is written from a :class:`~meshtrain.trainer.models.gpt.GPTConfig` (Llama as
transformers' ``LlamaForCausalLM``, GPT as ``GPT2LMHeadModel``).  Reading it and checking it
against the spec is torch-free and shared with ``meshtrain validate``
(:mod:`meshtrain.api.hf_config`); the names below are that module's, for the trainer's callers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshtrain.api import hf_config as shared
from meshtrain.trainer import storage
from meshtrain.trainer.data import special_tokens
from meshtrain.trainer.models import gpt

CONFIG = shared.CONFIG
GENERATION_CONFIG = shared.GENERATION_CONFIG
WEIGHTS = shared.WEIGHTS
WEIGHTS_INDEX = shared.WEIGHTS_INDEX
FIELD = shared.FIELD
HFError = shared.HFError
ShapeMismatch = shared.ShapeMismatch
check_config = shared.check_config
stated = shared.stated


def hf_config(
    config: gpt.GPTConfig,
    token_ids: special_tokens.TokenIds = special_tokens.UNKNOWN,
    max_positions: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The ``config.json`` transformers builds this model from.

    Token ids are written even when unknown (null): left out, transformers
    would assume its config class's defaults, which name arbitrary tokens.
    ``max_positions`` is the imported model's ``max_position_embeddings``:
    training at a shorter ``seqLen`` does not shrink the context it was made for.
    ``dtype`` is the weights' element type (transformers loads them as that).
    """
    architecture = {**_architecture(config), "torch_dtype": dtype}
    if config.family == "llama":
        architecture["max_position_embeddings"] = max(config.seq_len, max_positions or 0)
    return {**architecture, **token_ids.to_json()}


def max_positions(directory: str | Path) -> int | None:
    """``max_position_embeddings`` of a Hugging Face directory's ``config.json`` (None when it names none)."""
    value = shared.read_config(storage.local_path(directory, FIELD)).get("max_position_embeddings")
    return value if isinstance(value, int) else None


def generation_config(token_ids: special_tokens.TokenIds) -> dict[str, Any]:
    """``generation_config.json``: what ``generate`` stops at and pads with."""
    return token_ids.to_json()


def _architecture(config: gpt.GPTConfig) -> dict[str, Any]:
    if config.family == "llama":
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **{key: getattr(config, attr) for key, attr, _ in shared.LLAMA_FIELDS},
            "head_dim": config.head_dim,
            "max_position_embeddings": config.seq_len,
            "rope_theta": config.rope_theta,
            "rope_parameters": _rope_config(config),
            **({"rope_scaling": _rope_config(config)} if config.rope_scaling else {}),
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **{key: getattr(config, attr) for key, attr, _ in shared.GPT2_FIELDS},
        "n_ctx": config.seq_len,
        "activation_function": "gelu",  # exact (erf) GELU, as F.gelu; GPT-2's own is gelu_new
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }


def _rope_config(config: gpt.GPTConfig) -> dict[str, Any]:
    scaling = config.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    return {
        "rope_type": "llama3",
        "rope_theta": config.rope_theta,
        **{key: getattr(scaling, key) for key, _ in shared.LLAMA3_KEYS},
    }
