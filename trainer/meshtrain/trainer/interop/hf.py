"""Hugging Face interop: meshtrain weights to and from ``config.json`` + safetensors.

Llama maps to transformers' ``LlamaForCausalLM`` and GPT to ``GPT2LMHeadModel``; the name maps
below are the whole translation.  Import is lazy and per parameter (:class:`HFWeights`), so each
rank reads only its own pieces, and :func:`check_directory` refuses a directory that disagrees
with the spec before training, naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from meshtrain.api import spec as api_spec
from meshtrain.trainer.data import special_tokens
from meshtrain.trainer.models import gpt, llama

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Element types an export can write, by the name ``config.json``'s ``torch_dtype`` gives them."""
"""A sharded model's map from tensor name to shard file (transformers' and huggingface_hub's name)."""
FIELD = "spec.model.init.fromHF"


LLAMA_DEFAULT_NORM_EPS = 1e-6
"""transformers' ``LlamaConfig`` rms_norm_eps when config.json has none."""
LLAMA_DEFAULT_ROPE_THETA = 10000.0
"""transformers' rope_theta when config.json names none."""


class HFError(ValueError):
    """A Hugging Face directory that does not fit the model; the message names file and field."""


# --- config.json --------------------------------------------------------------

# (config.json key, GPTConfig attribute, spec field) per family
_LLAMA_FIELDS = (
    ("hidden_size", "hidden", "hidden"),
    ("intermediate_size", "ffn_hidden", "ffnHidden"),
    ("num_hidden_layers", "layers", "layers"),
    ("num_attention_heads", "heads", "heads"),
    ("num_key_value_heads", "key_value_heads", "kvHeads"),
    ("vocab_size", "vocab", "vocab"),
    ("rms_norm_eps", "norm_eps", "normEps"),
    ("tie_word_embeddings", "tie_embeddings", "tieEmbeddings"),
)
_GPT2_FIELDS = (
    ("n_embd", "hidden", "hidden"),
    ("n_inner", "ffn_hidden", "ffnHidden"),
    ("n_layer", "layers", "layers"),
    ("n_head", "heads", "heads"),
    ("vocab_size", "vocab", "vocab"),
    ("n_positions", "seq_len", "seqLen"),
    ("tie_word_embeddings", "tie_embeddings", "tieEmbeddings"),
)


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
    value = _read_config(Path(directory)).get("max_position_embeddings")
    return value if isinstance(value, int) else None


def generation_config(token_ids: special_tokens.TokenIds) -> dict[str, Any]:
    """``generation_config.json``: what ``generate`` stops at and pads with."""
    return token_ids.to_json()


def _architecture(config: gpt.GPTConfig) -> dict[str, Any]:
    if config.family == "llama":
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **{key: getattr(config, attr) for key, attr, _ in _LLAMA_FIELDS},
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
        **{key: getattr(config, attr) for key, attr, _ in _GPT2_FIELDS},
        "n_ctx": config.seq_len,
        "activation_function": "gelu",  # exact (erf) GELU, as F.gelu; GPT-2's own is gelu_new
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }


MISTRAL_DEFAULT_SLIDING_WINDOW = 4096
"""``MistralConfig``'s ``sliding_window`` when config.json leaves it out."""


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG
    if not path.is_file():
        raise HFError(f"{FIELD}: {path} does not exist (expected a Hugging Face model directory)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise HFError(f"{FIELD}: {path} is not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise HFError(f"{FIELD}: {path} is not a JSON object")
    return raw


def check_config(directory: Path, config: gpt.GPTConfig) -> None:
    """Refuse a ``config.json`` whose family or shape differs from the spec's, naming both fields."""
    raw = _read_config(directory)
    path = directory / CONFIG
    family = {"llama": "llama", "mistral": "llama", "gpt2": "gpt"}.get(str(raw.get("model_type")))
    if family != config.family:
        raise HFError(
            f"{FIELD}: {path}: model_type={raw.get('model_type')!r} but spec.model.family={config.family}"
            " (llama loads LlamaForCausalLM directories and MistralForCausalLM ones without a sliding"
            " window, gpt GPT2LMHeadModel ones; Qwen2's q/k/v biases are not supported)"
        )
    if raw.get("model_type") == "mistral":
        window = raw.get("sliding_window", MISTRAL_DEFAULT_SLIDING_WINDOW)
        if window is not None and window < config.seq_len:
            raise HFError(
                f"{FIELD}: {path}: sliding_window={window} but spec.model.seqLen={config.seq_len}: "
                "meshtrain's attention is full causal, the same as Mistral's only while the window "
                f"covers the sequence (sliding_window null or >= seqLen): train at seqLen <= {window}"
            )
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim != config.head_dim:
        raise HFError(
            f"{FIELD}: {path}: head_dim={head_dim} but meshtrain's head dimension is "
            f"spec.model.hidden / heads = {config.head_dim}: a head_dim other than hidden / heads "
            "is not supported"
        )
    fields = _LLAMA_FIELDS if family == "llama" else _GPT2_FIELDS
    # what transformers assumes for a key the file leaves out (LlamaConfig / GPT2Config defaults)
    defaults = {
        "num_key_value_heads": raw.get("num_attention_heads"),
        "n_inner": None,
        "rms_norm_eps": LLAMA_DEFAULT_NORM_EPS,
    }
    for key, attr, spec_field in fields:
        value = raw.get(key, defaults.get(key))
        if key == "n_inner" and value is None:
            value = 4 * raw.get("n_embd", 0)
        if key == "tie_word_embeddings" and value is None:
            value = family == "gpt"  # transformers' default for GPT-2
        mine = getattr(config, attr)
        close = (
            isinstance(mine, float)
            and isinstance(value, int | float)
            and abs(value - mine) <= 1e-12
        )
        if value != mine and not close:
            raise HFError(
                f"{FIELD}: {path}: {key}={value!r} but spec.model.{spec_field}={mine!r}: "
                f"set spec.model.{spec_field}: {value!r} to train this model"
            )
    if family == "gpt" and raw.get("activation_function", "gelu_new") != "gelu":
        raise HFError(
            f"{FIELD}: {path}: activation_function={raw.get('activation_function', 'gelu_new')!r}; "
            "meshtrain's GPT uses the exact GELU ('gelu')"
        )
    if family == "llama":
        _check_llama_architecture(raw, path, config)
    theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))
    if theta is None:
        theta = LLAMA_DEFAULT_ROPE_THETA
    if family == "llama" and float(theta) != config.rope_theta:
        raise HFError(
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


_LLAMA3_KEYS = (
    ("factor", "factor"),
    ("low_freq_factor", "lowFreqFactor"),
    ("high_freq_factor", "highFreqFactor"),
    ("original_max_position_embeddings", "originalMaxPositionEmbeddings"),
)
"""(config.json key, spec.model.ropeScaling field) of transformers' ``rope_type: llama3``."""


def _rope_config(config: gpt.GPTConfig) -> dict[str, Any]:
    scaling = config.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    return {
        "rope_type": "llama3",
        "rope_theta": config.rope_theta,
        **{key: getattr(scaling, key) for key, _ in _LLAMA3_KEYS},
    }


def _check_llama3(rope: dict[str, Any], path: Path, config: gpt.GPTConfig) -> None:
    scaling = config.rope_scaling
    file_values = {key: rope.get(key) for key, _ in _LLAMA3_KEYS}
    spec_yaml = ", ".join(f"{field}: {rope.get(key)}" for key, field in _LLAMA3_KEYS)
    if scaling is None:
        raise HFError(
            f"{FIELD}: {path}: rope_type='llama3' {file_values} but spec.model.ropeScaling is empty: "
            f"set spec.model.ropeScaling: {{{spec_yaml}}}"
        )
    for key, field in _LLAMA3_KEYS:
        mine = getattr(scaling, key)
        if rope.get(key) is None or float(rope[key]) != float(mine):
            raise HFError(
                f"{FIELD}: {path}: rope_scaling {key}={rope.get(key)!r} but "
                f"spec.model.ropeScaling.{field}={mine!r}: set spec.model.ropeScaling: {{{spec_yaml}}}"
            )


def _check_llama_architecture(raw: dict[str, Any], path: Path, config: gpt.GPTConfig) -> None:
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


# --- name maps ----------------------------------------------------------------


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


# --- reading a directory --------------------------------------------------------


def _indexed_files(directory: Path) -> dict[str, Path]:
    """The ``weight_map`` of ``model.safetensors.index.json``, as transformers loads a sharded model."""
    index = directory / WEIGHTS_INDEX
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise HFError(
            f"{FIELD}: {index} is not a safetensors index with a weight_map ({err})"
        ) from None
    if not isinstance(weight_map, dict):
        raise HFError(f"{FIELD}: {index}: weight_map is not an object of tensor name -> file")
    where = {str(key): directory / str(name) for key, name in weight_map.items()}
    missing = sorted({str(p) for p in where.values() if not p.is_file()})
    if missing:
        raise HFError(f"{FIELD}: {index} names files that are not there: {', '.join(missing)}")
    return where


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it (one file or a sharded set).

    With ``model.safetensors.index.json`` its ``weight_map`` decides (other
    ``*.safetensors`` files, e.g. a consolidated copy, are not read); without
    one, every file is read and a tensor in two of them is refused.
    """
    if (directory / WEIGHTS_INDEX).is_file():
        return _indexed_files(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise HFError(f"{FIELD}: {directory} has no *.safetensors file")
    where: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key in where:
                    raise HFError(
                        f"{FIELD}: tensor {key} is in both {where[key]} and {path}: remove the "
                        f"stale file, or add the {WEIGHTS_INDEX} that says which to load"
                    )
                where[key] = path
    return where


class HFWeights:
    """Dense meshtrain parameters read on demand from a Hugging Face directory (``model.initial_weights``)."""

    def __init__(self, directory: str | Path, config: gpt.GPTConfig) -> None:
        self.directory = Path(directory)
        self.config = config
        self.files = {k: str(v) for k, v in _tensor_files(self.directory).items()}
        """Hugging Face tensor name -> safetensors file."""

    def _read(self, key: str) -> torch.Tensor:
        with safe_open(self.files[key], framework="pt") as handle:
            tensor: torch.Tensor = handle.get_tensor(key)
        return tensor

    def __call__(self, name: str, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        parts = hf_parts(self.config, name)
        pieces = [self._read(p.key).t() if p.transpose else self._read(p.key) for p in parts]
        return torch.cat(pieces, dim=0).float().contiguous().reshape(shape)


def _hf_shapes(
    directory: Path, files: dict[str, Path]
) -> Iterator[tuple[str, tuple[int, ...], Path]]:
    for key, path in files.items():
        with safe_open(str(path), framework="pt") as handle:
            yield key, tuple(handle.get_slice(key).get_shape()), path


def check_directory(directory: str | Path, config: gpt.GPTConfig) -> None:
    """Refuse, before any process starts, a directory whose config or tensors disagree with the spec."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise HFError(f"{FIELD}: {directory} is not a directory")
    check_config(directory, config)
    files = _tensor_files(directory)
    shapes = {key: (shape, path) for key, shape, path in _hf_shapes(directory, files)}
    with torch.device("meta"):
        expected = to_hf(config, dict(llama.build(config).named_parameters()))
    for key, tensor in expected.items():
        if key not in shapes:
            if key.endswith(".bias"):
                continue  # an absent GPT-2 bias is a zero one
            raise HFError(
                f"{FIELD}: {directory}: tensor {key} is missing from the safetensors files"
            )
        shape, path = shapes[key]
        if shape != tuple(tensor.shape):
            raise HFError(
                f"{FIELD}: {path}: tensor {key} has shape {list(shape)}, the spec's model needs "
                f"{list(tensor.shape)} (spec.model: {config.family}, hidden={config.hidden}, "
                f"heads={config.heads}, kvHeads={config.key_value_heads}, ffnHidden={config.ffn_hidden}, "
                f"vocab={config.vocab})"
            )
    for key in sorted(set(shapes) - set(expected)):
        if not _ignored_by_transformers(config, key):
            raise HFError(
                f"{FIELD}: {shapes[key][1]}: tensor {key} has no place in the spec's model "
                f"(spec.model: {config.family}, layers={config.layers}, "
                f"tieEmbeddings={config.tie_embeddings}); loading it would drop it, so this model's "
                "logits cannot be reproduced"
            )
    for key in zero_biases(config):
        if key in shapes:
            with safe_open(str(shapes[key][1]), framework="pt") as handle:
                if handle.get_tensor(key).abs().max() > 0:
                    raise HFError(
                        f"{FIELD}: {shapes[key][1]}: {key} is not zero; meshtrain's GPT has no "
                        "linear biases, so this model cannot be loaded exactly"
                    )


def _ignored_by_transformers(config: gpt.GPTConfig, key: str) -> bool:
    """Tensors transformers itself skips or overwrites on load: RoPE and causal-mask buffers, a tied head."""
    if key.endswith("rotary_emb.inv_freq"):
        return True
    if config.family == "gpt" and key.endswith((".attn.bias", ".attn.masked_bias")):
        return True
    return key == "lm_head.weight" and config.tie_embeddings


def check_spec(job: api_spec.TrainingJobSpec) -> None:
    """:func:`check_directory` for a job that starts from a Hugging Face directory (else nothing)."""
    if job.model.init.from_hf:
        check_directory(job.model.init.from_hf, gpt.GPTConfig.from_shape(job.model.shape()))


def shard_file_name(index: int, count: int) -> str:
    """File of shard ``index`` (0-based) of ``count``: transformers' ``model-00001-of-00003.safetensors``."""
    return WEIGHTS if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Consecutive items (name, bytes) grouped into shards of at most ``max_bytes``; an item larger than that is a shard alone."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, nbytes in sizes:
        if shards[-1] and filled + nbytes > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += nbytes
    return [s for s in shards if s]


def _clear_weights(directory: Path) -> None:
    """Remove the weights of an earlier export (a stale shard would be loaded beside the new ones)."""
    stale = [
        directory / WEIGHTS,
        directory / WEIGHTS_INDEX,
        *directory.glob("model-*-of-*.safetensors"),
    ]
    for path in stale:
        path.unlink(missing_ok=True)


Loader = Callable[[list[str]], dict[str, torch.Tensor]]
"""Dense meshtrain parameters by name, read when asked for."""


def write_sharded(
    directory: str | Path,
    config: gpt.GPTConfig,
    shapes: dict[str, tuple[int, ...]],
    load: Loader,
    *,
    max_shard_bytes: int,
    token_ids: special_tokens.TokenIds = special_tokens.UNKNOWN,
    max_positions: int | None = None,
    dtype: str = "float32",
) -> list[Path]:
    """Write the model as Hugging Face safetensors shards of at most ``max_shard_bytes``; returns the files.

    ``dtype`` (a :data:`WEIGHT_DTYPES` name) is what the weights are rounded
    to on the way out (``bfloat16``: round to nearest even, as ``Tensor.to``).

    ``shapes`` names every dense parameter; ``load`` is asked for one
    shard's parameters at a time, so no more than one shard (plus the
    largest parameter) is in memory.  More than one shard gets
    ``model.safetensors.index.json``; one is ``model.safetensors``.  All of a
    parameter's pieces (q, k, v of a fused QKV) go to one shard.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _clear_weights(directory)
    order = {name: i for i, (name, _) in enumerate(_model_order(config))}
    names = sorted(shapes, key=lambda n: order.get(n, len(order)))
    element = WEIGHT_DTYPES[dtype]
    itemsize = element.itemsize
    sizes = [(n, math.prod(shapes[n]) * itemsize) for n in names]
    biases = zero_biases(config)
    sizes += [(key, n * itemsize) for key, n in biases.items()]
    shards = plan_shards(sizes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    files = []
    for index, members in enumerate(shards):
        file = shard_file_name(index, len(shards))
        dense = load([n for n in members if n not in biases])
        tensors: dict[str, torch.Tensor] = {}
        for name in members:
            if name in biases:
                tensors[name] = torch.zeros(biases[name], dtype=element)
            else:
                whole = dense.pop(name).detach().float().cpu()
                pieces = hf_tensors(config, name, whole)
                tensors.update({key: t.to(element).contiguous() for key, t in pieces.items()})
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        files.append(directory / file)
        del dense, tensors
    if len(shards) > 1:
        index_doc = {
            "metadata": {"total_size": total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (directory / WEIGHTS_INDEX).write_text(json.dumps(index_doc, indent=2) + "\n")
        files.append(directory / WEIGHTS_INDEX)
    (directory / CONFIG).write_text(
        json.dumps(hf_config(config, token_ids, max_positions, dtype), indent=2) + "\n"
    )
    (directory / GENERATION_CONFIG).write_text(
        json.dumps(generation_config(token_ids), indent=2) + "\n"
    )
    return files


def _model_order(config: gpt.GPTConfig) -> list[tuple[str, torch.Tensor]]:
    with torch.device("meta"):
        return list(llama.build(config).named_parameters())


def write(
    directory: str | Path,
    config: gpt.GPTConfig,
    dense: dict[str, torch.Tensor],
    *,
    max_shard_bytes: int = 1 << 62,
    token_ids: special_tokens.TokenIds = special_tokens.UNKNOWN,
    max_positions: int | None = None,
    dtype: str = "float32",
) -> list[Path]:
    """:func:`write_sharded` for parameters already in memory (meshtrain names)."""
    return write_sharded(
        directory,
        config,
        {name: tuple(t.shape) for name, t in dense.items()},
        lambda names: {n: dense[n] for n in names},
        max_shard_bytes=max_shard_bytes,
        token_ids=token_ids,
        max_positions=max_positions,
        dtype=dtype,
    )
