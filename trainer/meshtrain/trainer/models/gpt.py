"""The GPT-style decoder that meshtrain trains, and its own accounting (parameters, FLOPs per token).

Initial weights are a function of (seed, parameter name) alone (:func:`initial_value`), so a model
built on the ``meta`` device is materialised piece by piece and every layout starts from one
device's weights.  Parallelism is applied from outside: :mod:`meshtrain.trainer.parallel` swaps
modules for sharded ones and drops what a pipeline stage does not own (an absent part is ``None``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from meshtrain.trainer.models import documents as documents_mod


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency rewrite (transformers' ``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @classmethod
    def from_spec(cls, spec) -> RopeScaling | None:  # noqa: ANN001 - api.spec.RopeScaling or None
        if spec is None:
            return None
        return cls(
            spec.factor,
            spec.low_freq_factor,
            spec.high_freq_factor,
            spec.original_max_position_embeddings,
        )


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
    family: str = "gpt"
    """``gpt`` (this module) or ``llama`` (:mod:`.llama`)."""
    kv_heads: int = 0
    """Key/value heads of grouped-query attention (llama); 0: one per head."""
    tie_embeddings: bool = False
    """The LM head is the token embedding matrix."""
    rope_theta: float = 10000.0
    """RoPE base frequency (llama)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (llama)."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1's RoPE frequency rewrite (llama); None: plain RoPE."""

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    @property
    def key_value_heads(self) -> int:
        """Key/value heads (``heads`` for multi-head attention)."""
        return self.kv_heads or self.heads

    @classmethod
    def from_shape(cls, shape) -> GPTConfig:  # noqa: ANN001 - any object with the ModelShape fields
        """Config from a resolved spec shape (``spec.model.shape()``)."""
        return cls(
            vocab=shape.vocab,
            seq_len=shape.seq_len,
            layers=shape.layers,
            hidden=shape.hidden,
            heads=shape.heads,
            ffn_hidden=shape.ffn_hidden,
            family=shape.family,
            kv_heads=shape.kv_heads,
            tie_embeddings=shape.tie_embeddings,
            rope_theta=shape.rope_theta,
            norm_eps=shape.norm_eps,
            rope_scaling=RopeScaling.from_spec(getattr(shape, "rope_scaling", None)),
        )


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def initial_value(
    config: GPTConfig, seed: int, name: str, shape: torch.Size | tuple[int, ...]
) -> torch.Tensor:
    """The dense model's initial value of parameter ``name`` (CPU, fp32).

    GPT-2 init: LayerNorm weight 1 and biases 0; matrices normal(0, 0.02),
    residual projections (``*proj.weight``) scaled by 1/sqrt(2 x layers).
    """
    if len(shape) == 1:
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    std = (
        config.init_std / math.sqrt(2 * config.layers)
        if name.endswith("proj.weight")
        else config.init_std
    )
    generator = torch.Generator().manual_seed(_name_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


RECOMPUTABLE = ("attention", "mlp")
"""Parts of a block that selective recompute (``training.selectiveRecompute``) can rebuild in backward."""


MASKED_KERNELS = {
    "cuda": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
    "cpu": [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH],
}
"""The only SDPA kernels a masked attention may run on, per device type.  On CUDA the flash
kernel refuses any mask and the math one builds (B, h, T, T) scores and probabilities per layer
(gigabytes at T = 8,192): pinned, a call no fused kernel takes fails loudly instead of running
out of memory.  The CPU's fused kernel takes a mask and its math kernel is its fallback."""


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    recompute: bool,
    enable_gqa: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal ``scaled_dot_product_attention``; with ``recompute`` its internals are rebuilt in backward.

    ``mask`` (B, 1, T, T) additive (:mod:`.documents`: causal inside each document, -inf across
    documents) replaces the causal mask; the same on every head, so on every tensor rank.  It
    runs only on :data:`MASKED_KERNELS` (no ``enable_gqa`` with a mask: CUDA's memory-efficient
    kernel refuses it, so callers pass k and v of every head).

    The checkpoint keeps q, k and v (which the QKV projection's output holds
    anyway) and drops what the kernel saves for backward: the scores and
    softmax of an unfused kernel, the output and log-sum-exp of a flash one.
    """
    if mask is None:
        core = functools.partial(
            F.scaled_dot_product_attention, is_causal=True, enable_gqa=enable_gqa
        )
    else:
        core = functools.partial(_masked, mask=mask.to(q.dtype))  # a no-op in q's dtype
    if recompute and torch.is_grad_enabled():
        out: torch.Tensor = checkpoint(core, q, k, v, use_reentrant=False)
        return out
    return core(q, k, v)


AttentionCore = Callable[..., torch.Tensor]
"""What an attention module calls on its q, k and v: :func:`attend`'s signature (context
parallelism swaps in its ring, :mod:`meshtrain.trainer.parallel.context`)."""

TokenPositions = Callable[[int, torch.device], torch.Tensor]
"""Positions (T,) of the ``T`` tokens a module sees (context parallelism: the global positions of
this rank's slices of the sequence)."""


def natural_positions(seq: int, device: torch.device) -> torch.Tensor:
    """Positions 0 .. seq-1: a module that sees the whole sequence."""
    return torch.arange(seq, device=device)


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA with an additive mask, on the device's :data:`MASKED_KERNELS` only."""
    with sdpa_kernel(MASKED_KERNELS.get(q.device.type, MASKED_KERNELS["cpu"])):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    """Causal multi-head self-attention with a fused QKV projection.

    Its (local) heads come from the width of the QKV output, so it runs unchanged on a
    tensor-parallel shard.
    """

    recompute_core = False
    """Selective recompute: rebuild the attention core in backward (:func:`attend`)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        # Output rows are laid out [q heads | k heads | v heads]; tensor
        # parallelism keeps that layout on every shard (its own heads of each).
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden, bias=False)
        self.qkv_sizes = (config.hidden,) * 3
        """Dense rows of the fused output's blocks (q, k, v): tensor parallelism splits each alone."""
        self.proj = nn.Linear(config.hidden, config.hidden, bias=False)
        self.core: AttentionCore = attend
        """The attention on q, k and v (replaced from outside, e.g. by ring attention)."""

    def forward(
        self, x: torch.Tensor, documents: documents_mod.Documents | None = None
    ) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, 3 * local_heads * head_dim)
        batch, seq, width = qkv.shape
        local_heads = width // (3 * self.head_dim)
        qkv = qkv.view(batch, seq, 3, local_heads, self.head_dim)  # (B, T, 3, h, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, h, T, hd)
        mask = documents.mask if documents is not None else None
        y = self.core(q, k, v, recompute=self.recompute_core, mask=mask)  # (B, h, T, hd)
        y = y.transpose(1, 2).reshape(batch, seq, local_heads * self.head_dim)  # (B, T, h * hd)
        return self.proj(y)


class MLP(nn.Module):
    """Two linear layers with a GELU between them."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden, config.ffn_hidden, bias=False)
        self.fc_sizes = (config.ffn_hidden,)
        """Dense rows of ``fc``'s output blocks (one: no fused projections)."""
        self.proj = nn.Linear(config.ffn_hidden, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    recompute_mlp = False
    """Selective recompute: keep only the MLP sub-layer's input and rebuild norm, up-projection and activation in backward."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1: nn.Module = nn.LayerNorm(config.hidden)
        self.attn: nn.Module = Attention(config)
        self.ln2: nn.Module = nn.LayerNorm(config.hidden)
        self.mlp: nn.Module = MLP(config)

    def forward(
        self, x: torch.Tensor, documents: documents_mod.Documents | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), documents)
        if self.recompute_mlp and torch.is_grad_enabled():
            return x + checkpoint(self._mlp_sublayer, x, use_reentrant=False)
        return x + self._mlp_sublayer(x)

    def _mlp_sublayer(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(self.ln2(x))
        return out


def set_selective_recompute(model: nn.Module, parts: list[str] | tuple[str, ...]) -> None:
    """Recompute ``parts`` (of :data:`RECOMPUTABLE`) of every block of ``model`` in backward."""
    unknown = set(parts) - set(RECOMPUTABLE)
    if unknown:
        raise ValueError(f"unknown recompute parts {sorted(unknown)}; known: {RECOMPUTABLE}")
    for module in model.modules():
        if hasattr(module, "recompute_mlp"):
            module.recompute_mlp = "mlp" in parts
        if hasattr(module, "recompute_core"):
            module.recompute_core = "attention" in parts


Ranges = Sequence[tuple[int, int]]
"""``[start, stop)`` ranges along one dimension of a dense tensor."""


def window(ranges: Ranges, start: int, stop: int) -> list[tuple[int, tuple[int, int]]]:
    """Where rows ``[start, stop)`` of the ranges laid end to end fall: each overlapped range's
    index and the sub-range of it they cover (in the ranges' own coordinates), in order."""
    out, offset = [], 0
    for index, (low, high) in enumerate(ranges):
        a, b = max(low, low + start - offset), min(high, low + stop - offset)
        if a < b:
            out.append((index, (a, b)))
        offset += high - low
    return out


class InitialWeights(Protocol):
    """A source of the dense initial values of parameters (a Hugging Face directory), by name and shape."""

    def __call__(self, name: str, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """The dense value of parameter ``name``."""
        ...

    def piece(
        self,
        name: str,
        shape: torch.Size | tuple[int, ...],
        dim: int,
        ranges: Ranges,
        rows: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """The ``ranges`` along ``dim`` of the dense value, concatenated along ``dim`` (of a column
        cut only ``rows``, when given); reads only those."""
        ...


class GPT(nn.Module):
    """The decoder.  ``forward`` maps tokens (or a hidden state) to logits (or a hidden state).

    A pipeline stage is a GPT whose absent parts are ``None``: without
    ``tok_emb`` the input is already a hidden state (B, T, H); without
    ``head`` the output is one.  Blocks live in a ModuleDict keyed by their
    global index so parameter names are the same on every layout.
    """

    initial_weights: InitialWeights | None = None
    """Where parameters still on ``meta`` get their values (None: the seed); see :func:`dense_value`."""

    def __init__(self, config: GPTConfig, *, seed: int = 0, recompute_blocks: bool = False) -> None:
        """Built under ``torch.device("meta")`` the parameters stay shapes only (see :func:`materialize`)."""
        super().__init__()
        self.config = config
        self.seed = seed
        """Seed of the initial weights."""
        self.recompute_blocks = recompute_blocks
        """Activation checkpointing: keep only each block's input and recompute the block in backward."""
        self.positions: TokenPositions = natural_positions
        """The positions of the tokens this model sees (without documents)."""
        self.tok_emb: nn.Module | None = nn.Embedding(config.vocab, config.hidden)
        self.pos_emb: nn.Module | None = nn.Embedding(config.seq_len, config.hidden)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.layers)})
        self.norm: nn.Module | None = nn.LayerNorm(config.hidden)
        self.head: nn.Module | None = nn.Linear(config.hidden, config.vocab, bias=False)
        if config.tie_embeddings:  # one Parameter, registered (and named) as tok_emb.weight
            self.head.weight = self.tok_emb.weight
        if not self.head.weight.is_meta:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every parameter to its :func:`initial_value`."""
        for name, param in self.named_parameters():
            param.copy_(initial_value(self.config, self.seed, name, param.shape))

    def embed(
        self, tokens: torch.Tensor, documents: documents_mod.Documents | None = None
    ) -> torch.Tensor:
        """Token ids (B, T) -> the first block's input (B, T, H); positions restart per document if given."""
        positions = (
            documents.positions  # (B, T)
            if documents is not None
            else self.positions(tokens.shape[1], tokens.device)  # (T,)
        )
        return self.tok_emb(tokens) + self.pos_emb(positions)  # (B, T, H)

    def forward(
        self,
        x: torch.Tensor,
        *,
        apply_head: Callable[[torch.Tensor, nn.Module], torch.Tensor] | None = None,
        documents: documents_mod.Documents | None = None,
    ) -> torch.Tensor:
        """Logits (or a hidden state).

        ``documents``: mask attention at document boundaries and restart positions per document.

        ``apply_head(hidden, head)`` replaces the head's own call (the fused
        loss); it runs inside this forward, where a sharding wrapper has the
        head's weight gathered.
        """
        x = self.features(x, documents)
        if self.head is not None:
            # (B, T, V) logits (or this rank's vocabulary shard), or what apply_head makes of them
            x = self.head(x) if apply_head is None else apply_head(x, self.head)
        return x

    def features(
        self, x: torch.Tensor, documents: documents_mod.Documents | None = None
    ) -> torch.Tensor:
        """Everything but the LM head: tokens (or a hidden state) to the head's input (or a hidden state)."""
        if self.tok_emb is not None:
            x = self.embed(x, documents)  # (B, T, H)
        recompute = self.recompute_blocks and torch.is_grad_enabled()
        for block in self.blocks.values():
            x = (
                checkpoint(block, x, documents, use_reentrant=False)
                if recompute
                else block(x, documents)
            )
        if self.norm is not None:
            x = self.norm(x)
        return x

    def num_params(self, *, include_embeddings: bool = True) -> int:
        """Parameters in this module (a shard or a stage counts only what it holds)."""
        total = sum(p.numel() for p in self.parameters())
        if not include_embeddings:
            # a tied token table is also the head (a matmul): it stays counted
            tables = [self.pos_emb] + ([] if self.config.tie_embeddings else [self.tok_emb])
            for part in tables:
                if part is not None:
                    total -= sum(p.numel() for p in part.parameters())
        return total


def dense_param_count(config: GPTConfig, *, include_embeddings: bool = True) -> int:
    """Parameters of the full (unsharded) model, computed from the shape alone.

    A tied LM head counts (it is a matmul); the embedding table it shares is
    then the part left out without embeddings.
    """
    h, f, kv = config.hidden, config.ffn_hidden, config.key_value_heads * config.head_dim
    if config.family == "llama":  # two RMSNorms, QKV (GQA), proj, SwiGLU; final RMSNorm
        per_block, final_norm, positions = 2 * h + (h + 2 * kv) * h + h * h + 3 * h * f, h, 0
    else:  # two LayerNorms, QKV, proj, MLP; final LayerNorm
        per_block, final_norm, positions = (
            4 * h + 3 * h * h + h * h + 2 * h * f,
            2 * h,
            config.seq_len,
        )
    total = config.layers * per_block + final_norm + h * config.vocab  # + LM head
    if include_embeddings:
        total += positions * h + (0 if config.tie_embeddings else config.vocab * h)
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


def training_flops(config: GPTConfig, tokens: int, document_squares: int) -> float:
    """Training FLOPs of ``tokens`` tokens packed in documents whose squared lengths sum to ``document_squares``.

    :func:`flops_per_token`'s ``6 N`` per token, and its attention term over
    each document's own square instead of the window's: ``12 L H sum(d^2)``
    in place of ``12 L H T^2`` per sequence (what a document mask leaves,
    counted as the full squares the PaLM definition counts; one document per
    window gives :func:`flops_per_token` times ``tokens`` back).
    """
    n = dense_param_count(config, include_embeddings=False)
    return 6 * n * tokens + 12 * config.layers * config.hidden * document_squares


TIED_NAME = "tok_emb.weight"
"""The one name of a tied embedding matrix, also where a pipeline's last stage holds it as the head."""


def logical_name(config: GPTConfig, name: str) -> str:
    """The checkpoint and initialisation name of parameter ``name``: a tied head is the embedding."""
    return TIED_NAME if config.tie_embeddings and name == "head.weight" else name


def dense_value(model: GPT, name: str, param: torch.Tensor) -> torch.Tensor:
    """The dense tensor of parameter ``name``: ``param`` itself, or its initial value while it is on ``meta``.

    The initial value comes from ``model.initial_weights`` when it is set
    (a Hugging Face directory, :class:`meshtrain.trainer.interop.from_hf.HFWeights`), else
    from the seed.
    """
    if not param.is_meta:
        return param.detach()
    name = logical_name(model.config, name)
    if model.initial_weights is not None:
        return model.initial_weights(name, param.shape)
    return initial_value(model.config, model.seed, name, param.shape)


def dense_piece(
    model: GPT,
    name: str,
    param: torch.Tensor,
    dim: int,
    ranges: Ranges,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The ``ranges`` along ``dim`` of parameter ``name``'s dense tensor, concatenated (a new tensor);
    of a column cut (``dim`` 1) only ``rows`` ``[start, stop)`` when given.

    From a Hugging Face directory only those ranges are read (a tensor-parallel
    rank's rows or columns, a data-parallel shard's rows of them); otherwise they
    are cut from :func:`dense_value`.
    """
    assert rows is None or dim == 1, "rows narrow a column cut"
    if not ranges:  # a data-parallel shard left no rows of a piece
        empty = list(param.shape)
        empty[dim] = 0
        return torch.empty(empty)
    if param.is_meta and model.initial_weights is not None:
        return model.initial_weights.piece(
            logical_name(model.config, name), param.shape, dim, ranges, rows
        )
    full = dense_value(model, name, param)
    if rows is not None:
        full = full[rows[0] : rows[1]]
    return torch.cat([full.narrow(dim, start, stop - start) for start, stop in ranges], dim=dim)


def materialize(model: GPT) -> None:
    """Give every parameter of ``model`` still on the ``meta`` device its initial value (CPU).

    A parameter shared by two modules (tied embeddings) stays shared.  Values drawn from the seed
    are drawn on as many threads as torch's intra-op pool has (each parameter has its own
    generator, so the values do not depend on the order): CPU ``normal_`` is serial, and on one
    thread the lent H200's eager 8B runs spent their 45 s limit inside it
    (``benchmarks/results/issue35-h200/gpu-check-log.txt``).  A Hugging Face directory is read
    one tensor at a time.  The workers see no thread-local torch mode (the values are CPU tensors).
    """
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    names: dict[int, tuple[str, torch.Tensor]] = {}
    for module_name, module in model.named_modules():
        for key, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                names.setdefault(id(param), (f"{module_name}.{key}" if module_name else key, param))
                slots.setdefault(id(param), []).append((module, key))

    def made(name: str, param: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(dense_value(model, name, param), requires_grad=param.requires_grad)

    workers = 1 if model.initial_weights is not None else max(1, torch.get_num_threads())
    if workers == 1:
        values = {identity: made(*item) for identity, item in names.items()}
    else:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            values = dict(zip(names, pool.map(lambda item: made(*item), names.values())))
    for identity, places in slots.items():
        for module, key in places:
            setattr(module, key, values[identity])
