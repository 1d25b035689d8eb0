"""A Hugging Face model directory's ``config.json``, read and checked against the spec without torch.

``meshtrain validate`` and ``meshtrain run`` (the trainer's :mod:`meshtrain.trainer.interop.from_hf`)
call the same checks, so the two cannot drift: the file is read bounded, its ``model_type`` must be
one meshtrain loads, and every shape, RoPE and architecture key must agree with ``spec.model``;
:class:`HFError` names the file, the key and the spec field to set.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from meshtrain.api import limits


class Shape(Protocol):
    """What the checks read of a model: :class:`~meshtrain.api.spec.model.ModelShape`, or the trainer's ``GPTConfig``."""

    @property
    def family(self) -> str: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def key_value_heads(self) -> int: ...
    @property
    def ffn_hidden(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    @property
    def norm_eps(self) -> float: ...
    @property
    def tie_embeddings(self) -> bool: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rope_scaling(self) -> Any: ...


CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
WEIGHTS = "model.safetensors"
"""The weights of a model in one file."""
WEIGHTS_INDEX = "model.safetensors.index.json"
"""A sharded model's map from tensor name to shard file (transformers' and huggingface_hub's name)."""
FIELD = "spec.model.init.fromHF"


LLAMA_DEFAULT_NORM_EPS = 1e-6
"""transformers' ``LlamaConfig`` rms_norm_eps when config.json has none."""
LLAMA_DEFAULT_ROPE_THETA = 10000.0
"""transformers' rope_theta when config.json names none."""


class HFError(ValueError):
    """A Hugging Face directory that does not fit the model; the message names file and field."""


class ShapeMismatch(HFError):
    """The directory's model disagrees with a ``spec.model`` value (a preset may be what states it)."""


# (config.json key, GPTConfig attribute, spec field) per family
LLAMA_FIELDS = (
    ("hidden_size", "hidden", "hidden"),
    ("intermediate_size", "ffn_hidden", "ffnHidden"),
    ("num_hidden_layers", "layers", "layers"),
    ("num_attention_heads", "heads", "heads"),
    ("num_key_value_heads", "key_value_heads", "kvHeads"),
    ("vocab_size", "vocab", "vocab"),
    ("rms_norm_eps", "norm_eps", "normEps"),
    ("tie_word_embeddings", "tie_embeddings", "tieEmbeddings"),
)
GPT2_FIELDS = (
    ("n_embd", "hidden", "hidden"),
    ("n_inner", "ffn_hidden", "ffnHidden"),
    ("n_layer", "layers", "layers"),
    ("n_head", "heads", "heads"),
    ("vocab_size", "vocab", "vocab"),
    ("n_positions", "seq_len", "seqLen"),
    ("tie_word_embeddings", "tie_embeddings", "tieEmbeddings"),
)


MISTRAL_DEFAULT_SLIDING_WINDOW = 4096
"""``MistralConfig``'s ``sliding_window`` when config.json leaves it out."""


def read_json(path: Path) -> Any:
    """A small JSON file of the directory, at most :data:`~meshtrain.api.limits.MAX_HF_JSON_BYTES`."""
    try:
        with path.open("rb") as file:
            data = file.read(limits.MAX_HF_JSON_BYTES + 1)
    except OSError as err:
        raise HFError(f"{FIELD}: {path} cannot be read ({err.strerror})") from None
    if len(data) > limits.MAX_HF_JSON_BYTES:
        raise HFError(f"{FIELD}: {path} is larger than {limits.MAX_HF_JSON_BYTES} bytes")
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise HFError(f"{FIELD}: {path} is not valid JSON ({err})") from None


def read_config(directory: Path) -> dict[str, Any]:
    """``config.json`` of a Hugging Face directory as a JSON object."""
    path = directory / CONFIG
    if not path.is_file():
        raise HFError(f"{FIELD}: {path} does not exist (expected a Hugging Face model directory)")
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise HFError(f"{FIELD}: {path} is not a JSON object")
    return raw


def _family(raw: dict[str, Any]) -> str | None:
    """meshtrain's family of a ``model_type`` (None: none that meshtrain loads)."""
    return {"llama": "llama", "mistral": "llama", "gpt2": "gpt"}.get(str(raw.get("model_type")))


def _effective(raw: dict[str, Any], key: str, family: str) -> Any:
    """The value of ``key`` transformers runs the model with: the file's, else its config class's default."""
    # what transformers assumes for a key the file leaves out (LlamaConfig / GPT2Config defaults)
    defaults = {
        "num_key_value_heads": raw.get("num_attention_heads"),
        "n_inner": None,
        "rms_norm_eps": LLAMA_DEFAULT_NORM_EPS,
    }
    value = raw.get(key, defaults.get(key))
    if key == "n_inner" and value is None:
        value = 4 * raw.get("n_embd", 0)
    if key == "tie_word_embeddings" and value is None:
        value = family == "gpt"  # transformers' default for GPT-2
    return value


def _rope_theta(raw: dict[str, Any]) -> float:
    theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))
    return LLAMA_DEFAULT_ROPE_THETA if theta is None else float(theta)


def stated(directory: Path) -> dict[str, Any]:
    """``spec.model`` fields (camelCase) with the values the model of ``config.json`` runs with.

    Shape, tied embeddings, norm epsilon and RoPE (base and Llama 3.1
    scaling): what transformers makes of the file, its config class's
    defaults for keys it leaves out.  ``seqLen`` is not among them
    (``max_position_embeddings`` is the context the model was made for; a
    job may train shorter).  Empty for a ``model_type`` meshtrain does not
    load (:func:`check_config` refuses it).
    """
    raw = read_config(directory)
    family = _family(raw)
    if family is None:
        return {}
    fields = LLAMA_FIELDS if family == "llama" else GPT2_FIELDS
    values: dict[str, Any] = {"family": family}
    for key, _, spec_field in fields:
        value = _effective(raw, key, family)
        if spec_field != "seqLen" and value is not None:
            values[spec_field] = value
    if family == "llama":
        values["ropeTheta"] = _rope_theta(raw)
        for _, rope in _rope_settings(raw):
            if (rope.get("rope_type") or rope.get("type")) == "llama3":
                values["ropeScaling"] = {field: rope.get(key) for key, field in LLAMA3_KEYS}
    return values


def check_config(directory: Path, config: Shape) -> None:
    """Refuse a ``config.json`` whose family or shape differs from the spec's, naming both fields."""
    raw = read_config(directory)
    path = directory / CONFIG
    family = _family(raw)
    if family != config.family:
        raise ShapeMismatch(
            f"{FIELD}: {path}: model_type={raw.get('model_type')!r} but spec.model.family={config.family}"
            " (llama loads LlamaForCausalLM directories and MistralForCausalLM ones without a sliding"
            " window, gpt GPT2LMHeadModel ones; Qwen2's q/k/v biases are not supported)"
        )
    if raw.get("model_type") == "mistral":
        window = raw.get("sliding_window", MISTRAL_DEFAULT_SLIDING_WINDOW)
        if window is not None and window < config.seq_len:
            raise ShapeMismatch(
                f"{FIELD}: {path}: sliding_window={window} but spec.model.seqLen={config.seq_len}: "
                "meshtrain's attention is full causal, the same as Mistral's only while the window "
                f"covers the sequence (sliding_window null or >= seqLen): train at seqLen <= {window}"
            )
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim != config.head_dim:
        raise ShapeMismatch(
            f"{FIELD}: {path}: head_dim={head_dim} but meshtrain's head dimension is "
            f"spec.model.hidden / heads = {config.head_dim}: a head_dim other than hidden / heads "
            "is not supported"
        )
    fields = LLAMA_FIELDS if family == "llama" else GPT2_FIELDS
    for key, attr, spec_field in fields:
        value = _effective(raw, key, family)
        mine = getattr(config, attr)
        close = (
            isinstance(mine, float)
            and isinstance(value, int | float)
            and abs(value - mine) <= 1e-12
        )
        if value != mine and not close:
            raise ShapeMismatch(
                f"{FIELD}: {path}: {key}={value!r} but spec.model.{spec_field}={mine!r}: "
                f"set spec.model.{spec_field}: {value!r} to train this model, or leave it out "
                "to take config.json's"
            )
    if family == "gpt" and raw.get("activation_function", "gelu_new") != "gelu":
        raise HFError(
            f"{FIELD}: {path}: activation_function={raw.get('activation_function', 'gelu_new')!r}; "
            "meshtrain's GPT uses the exact GELU ('gelu')"
        )
    if family == "llama":
        _check_llama_architecture(raw, path, config)
    theta = _rope_theta(raw)
    if family == "llama" and theta != config.rope_theta:
        raise ShapeMismatch(
            f"{FIELD}: {path}: rope_theta={theta} but spec.model.ropeTheta={config.rope_theta}"
        )


_LLAMA_FIXED = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
"""config.json keys whose transformers default is the only architecture meshtrain's Llama has.

``pretraining_tp`` is not among them: it only slices the same matmuls (and
transformers 5 ignores it), so the logits do not depend on it.
"""


def _rope_settings(raw: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """RoPE settings of a Llama ``config.json``: transformers 5's ``rope_parameters``, the older ``rope_scaling``."""
    for key in ("rope_parameters", "rope_scaling"):
        value = raw.get(key)
        if value is not None and not isinstance(value, dict):
            raise HFError(f"{FIELD}: {key}={value!r} is not a JSON object")
        if value:
            yield key, value


LLAMA3_KEYS = (
    ("factor", "factor"),
    ("low_freq_factor", "lowFreqFactor"),
    ("high_freq_factor", "highFreqFactor"),
    ("original_max_position_embeddings", "originalMaxPositionEmbeddings"),
)
"""(config.json key, spec.model.ropeScaling field) of transformers' ``rope_type: llama3``."""


def _check_llama3(rope: dict[str, Any], path: Path, config: Shape) -> None:
    scaling = config.rope_scaling
    file_values = {key: rope.get(key) for key, _ in LLAMA3_KEYS}
    spec_yaml = ", ".join(f"{field}: {rope.get(key)}" for key, field in LLAMA3_KEYS)
    if scaling is None:
        raise HFError(
            f"{FIELD}: {path}: rope_type='llama3' {file_values} but spec.model.ropeScaling is empty: "
            f"set spec.model.ropeScaling: {{{spec_yaml}}}"
        )
    for key, field in LLAMA3_KEYS:
        mine = getattr(scaling, key)
        if rope.get(key) is None or float(rope[key]) != float(mine):
            raise ShapeMismatch(
                f"{FIELD}: {path}: rope_scaling {key}={rope.get(key)!r} but "
                f"spec.model.ropeScaling.{field}={mine!r}: set spec.model.ropeScaling: {{{spec_yaml}}}"
            )


def _check_llama_architecture(raw: dict[str, Any], path: Path, config: Shape) -> None:
    for key, fixed in _LLAMA_FIXED.items():
        value = raw.get(key, fixed)
        if value != fixed:
            raise HFError(
                f"{FIELD}: {path}: {key}={value!r}; meshtrain's Llama has only {key}={fixed!r}, "
                "so this model's logits cannot be reproduced"
            )
    llama3 = False
    for key, rope in _rope_settings(raw):
        rope_type = rope.get("rope_type") or rope.get("type")  # "type": transformers < 4.45
        if rope_type == "llama3":
            _check_llama3(rope, path, config)
            llama3 = True
            continue
        scaled = {k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type", "type")}
        if rope_type not in (None, "default") or (rope_type is None and scaled):
            raise HFError(
                f"{FIELD}: {path}: rope_type={rope_type!r} ({key} {rope}); meshtrain's Llama has "
                "plain RoPE and Llama 3.1's (llama3) only, so this model's logits cannot be reproduced"
            )
    if config.rope_scaling is not None and not llama3:
        raise HFError(
            f"{FIELD}: {path}: no rope_type='llama3' in rope_scaling / rope_parameters but "
            "spec.model.ropeScaling is set: leave spec.model.ropeScaling empty for this model"
        )
