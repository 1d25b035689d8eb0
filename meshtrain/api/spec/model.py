"""``spec.model``: the decoder as a preset, explicit sizes or both, the shape it resolves to, and
the rules on the section alone (the model-shape rule first: the others read the resolved shape)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from meshtrain.api import limits, presets
from meshtrain.api.spec import base

Family = Literal["gpt", "llama"]


class RopeScaling(base.SpecModel):
    """Llama 3.1's RoPE frequency rewrite (transformers' ``rope_type: llama3``)."""

    factor: float = Field(gt=0, description="Divisor of the low (long-wavelength) frequencies.")
    low_freq_factor: float = Field(
        gt=0,
        description="Wavelengths above originalMaxPositionEmbeddings / lowFreqFactor are divided by factor.",
    )
    high_freq_factor: float = Field(
        gt=0,
        description="Wavelengths below originalMaxPositionEmbeddings / highFreqFactor are kept; between the two they are blended.",
    )
    original_max_position_embeddings: int = Field(
        ge=1,
        le=limits.MAX_SEQ_LEN,
        description="Context length the model was pretrained at (8192 for Llama 3.1).",
    )


class ModelShape(base.SpecModel):
    """A resolved decoder shape (no preset names left)."""

    layers: int = Field(ge=1, description="Transformer blocks.")
    hidden: int = Field(ge=1, description="Model width.")
    heads: int = Field(ge=1, description="Attention heads.")
    vocab: int = Field(ge=2, description="Vocabulary size.")
    seq_len: int = Field(ge=1, description="Sequence length in tokens.")
    ffn_hidden: int = Field(ge=1, description="MLP inner width.")
    family: Family = Field("gpt", description="Decoder family.")
    kv_heads: int = Field(0, ge=0, description="Key/value heads (llama); 0 means heads.")
    tie_embeddings: bool = Field(False, description="LM head shares the token embedding.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base (llama).")
    rope_scaling: RopeScaling | None = Field(
        None, description="Llama 3.1 RoPE frequency rewrite (llama); none: plain RoPE."
    )
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon (llama).")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    @property
    def key_value_heads(self) -> int:
        """Key/value heads: ``kv_heads``, or one per attention head (GPT's multi-head attention)."""
        return self.kv_heads or self.heads


class ModelInit(base.SpecModel):
    """Where the starting weights come from (default: the seed)."""

    from_hf: str | None = Field(
        None,
        alias="fromHF",
        max_length=limits.MAX_STRING_LENGTH,
        description="A Hugging Face model directory (config.json + *.safetensors, e.g. from meshtrain export) "
        "whose weights start the run on any layout; its config must agree with the model shape.",
    )


SHAPE_OVERRIDES = (
    "layers",
    "hidden",
    "heads",
    "vocab",
    "seq_len",
    "ffn_hidden",
    "family",
    "kv_heads",
    "tie_embeddings",
    "rope_theta",
    "rope_scaling",
    "norm_eps",
)
"""ModelSpec fields that override a preset's value in the resolved shape."""


class ModelSpec(base.SpecModel):
    """The model: a named preset, explicit sizes, or a preset with overrides."""

    preset: presets.PresetName | None = Field(
        None,
        description="Named shape: tiny (tests), 125m, 350m, 1.3b, 7b (GPT); llama-tiny, llama3.2-1b, llama3-8b, "
        "llama3-70b (Llama family). Explicit fields override it.",
    )
    family: Family | None = Field(
        None,
        description="Decoder family: gpt (learned positions, LayerNorm, GELU, multi-head attention) or llama "
        "(RoPE, RMSNorm, SwiGLU, grouped-query attention). Empty: the preset's, else gpt.",
    )
    kv_heads: int | None = Field(
        None,
        ge=1,
        le=limits.MAX_HEADS,
        description="Key/value heads of grouped-query attention (llama). Empty: the preset's, else heads.",
    )
    tie_embeddings: bool | None = Field(
        None,
        description="The LM head reuses the token embedding matrix. Empty: the preset's, else false.",
    )
    rope_theta: float | None = Field(
        None, gt=0, description="RoPE base frequency (llama). Empty: the preset's, else 10000."
    )
    norm_eps: float | None = Field(
        None, gt=0, description="RMSNorm epsilon (llama). Empty: the preset's, else 1e-5."
    )
    rope_scaling: RopeScaling | None = Field(
        None,
        description="Llama 3.1's RoPE frequency rewrite (llama; transformers' rope_type llama3). "
        "Empty: plain RoPE.",
    )
    init: ModelInit = Field(
        default_factory=ModelInit,
        description="Starting weights: the seed, or a Hugging Face directory.",
    )
    layers: int | None = Field(
        None, ge=1, le=limits.MAX_LAYERS, description="Transformer blocks (overrides the preset)."
    )
    hidden: int | None = Field(
        None, ge=1, le=limits.MAX_HIDDEN, description="Model width (overrides the preset)."
    )
    heads: int | None = Field(
        None, ge=1, le=limits.MAX_HEADS, description="Attention heads (overrides the preset)."
    )
    vocab: int | None = Field(
        None,
        ge=2,
        le=limits.MAX_VOCAB,
        description="Vocabulary size (overrides the preset); 256 for byte-level data.",
    )
    seq_len: int | None = Field(
        None,
        ge=1,
        le=limits.MAX_SEQ_LEN,
        description="Sequence length in tokens (overrides the preset).",
    )
    ffn_hidden: int | None = Field(
        None,
        ge=1,
        le=limits.MAX_FFN_HIDDEN,
        description="MLP inner width; defaults to 4 x hidden (gpt) or 8/3 x hidden rounded up to a multiple of 256 (llama).",
    )

    def missing_fields(self) -> list[str]:
        """Shape fields that neither the preset nor the spec gives."""
        preset = presets.PRESETS[self.preset] if self.preset else {}
        return [
            f
            for f in ("layers", "hidden", "heads", "vocab", "seq_len")
            if getattr(self, f) is None and f not in preset
        ]

    def shape(self) -> ModelShape:
        """The resolved shape: preset values overridden by explicit fields."""
        values: dict[str, Any] = dict(presets.PRESETS[self.preset]) if self.preset else {}
        for name in SHAPE_OVERRIDES:
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if "ffn_hidden" not in values:
            values["ffn_hidden"] = (
                -(-8 * values["hidden"] // 3 // 256) * 256  # Llama's SwiGLU width, multiple of 256
                if values.get("family") == "llama"
                else 4 * values["hidden"]
            )
        return ModelShape(**values)


def _model_shape_complete(model: ModelSpec) -> str | None:
    missing = model.missing_fields()
    if missing:
        return f"no preset and no value for {', '.join(missing)}: set model.preset or give every shape field"
    return None


SHAPE_RULE: base.Rule[ModelSpec] = base.Rule(
    "model-shape-complete",
    "spec.model",
    "has(self.preset) || (has(self.layers) && has(self.hidden) && has(self.heads) && has(self.vocab) && has(self.seqLen))",
    "model needs a preset or all of layers, hidden, heads, vocab, seqLen",
    _model_shape_complete,
)
"""Judged before every other rule, which read the resolved shape; its CEL sits on ``spec.model``."""


def _hidden_split_over_heads(model: ModelSpec) -> str | None:
    shape = model.shape()
    if shape.hidden % shape.heads:
        return f"hidden={shape.hidden} is not divisible by heads={shape.heads}"
    return None


def _rope_scaling_frequency_band(model: ModelSpec) -> str | None:
    scaling = model.shape().rope_scaling
    if scaling is not None and scaling.low_freq_factor >= scaling.high_freq_factor:
        return (
            f"lowFreqFactor={scaling.low_freq_factor} is not below highFreqFactor={scaling.high_freq_factor}; "
            "the blended band between them would be empty (Llama 3.1 uses 1 and 4)"
        )
    return None


def _rope_scaling_needs_llama(model: ModelSpec) -> str | None:
    shape = model.shape()
    if shape.rope_scaling is not None and shape.family != "llama":
        return f"ropeScaling is set but family={shape.family}; only the llama family has RoPE: remove it"
    return None


def _kv_heads_divide_heads(model: ModelSpec) -> str | None:
    shape = model.shape()
    if shape.family == "gpt" and shape.kv_heads not in (0, shape.heads):
        return f"kvHeads={shape.kv_heads} needs family llama (gpt uses multi-head attention: kvHeads = heads)"
    if shape.heads % shape.key_value_heads:
        return (
            f"heads={shape.heads} is not a multiple of kvHeads={shape.key_value_heads}; "
            "each key/value head serves an equal group of query heads"
        )
    return None


RULES: tuple[base.Rule[ModelSpec], ...] = (
    base.Rule(
        "hidden-split-over-heads",
        "spec.model.hidden",
        "!has(self.model.hidden) || !has(self.model.heads) || self.model.hidden % self.model.heads == 0",
        "model.hidden must be divisible by model.heads",
        _hidden_split_over_heads,
    ),
    base.Rule(
        "rope-scaling-frequency-band",
        "spec.model.ropeScaling.highFreqFactor",
        "!has(self.model.ropeScaling) || self.model.ropeScaling.lowFreqFactor < self.model.ropeScaling.highFreqFactor",
        "model.ropeScaling.lowFreqFactor must be below model.ropeScaling.highFreqFactor",
        _rope_scaling_frequency_band,
    ),
    base.Rule(
        "rope-scaling-needs-llama",
        "spec.model.ropeScaling",
        "!has(self.model.ropeScaling) || (has(self.model.family) ? self.model.family == 'llama' : (has(self.model.preset) && self.model.preset.startsWith('llama')))",
        "model.ropeScaling needs the llama family (GPT has no RoPE)",
        _rope_scaling_needs_llama,
    ),
    base.Rule(
        "kv-heads-divide-heads",
        "spec.model.kvHeads",
        "!has(self.model.kvHeads) || ((!has(self.model.family) || self.model.family == 'llama') && (!has(self.model.heads) || self.model.heads % self.model.kvHeads == 0))",
        "model.kvHeads needs family llama and must divide model.heads",
        _kv_heads_divide_heads,
    ),
)
"""Rules on the model section alone, judged once :data:`SHAPE_RULE` holds (the ones that read
the parallelism too are in :mod:`meshtrain.api.spec.cross_section`)."""
