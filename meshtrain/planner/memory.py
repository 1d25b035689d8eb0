"""Memory model: bytes per GPU by component for a TrainingJob layout.

Model state from the parameters one rank holds (:mod:`.parameters`) at the precision's bytes per
parameter, divided as ZeRO divides it; activations per micro-batch and block (Korthikanti et al.
2022, adapted to this model) times the micro-batches a stage keeps in flight under its schedule;
the working buffers beside them.  docs/planner.md states every formula and its source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshtrain.api import spec as api_spec
from meshtrain.api.spec import model as api_model
from meshtrain.api.spec import parallelism as api_parallelism
from meshtrain.planner import (
    comm,
    context,
    float8,
    gradient_compression,
    parameters,
    precision,
    profiles,
)

# --------------------------------------------------------------------------- model state


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Model-state bytes on one rank."""

    weights: float
    """Bytes of weights."""
    grads: float
    """Bytes of gradients (kept for the whole step under gradient accumulation)."""
    optimizer: float
    """Bytes of optimizer state (master weights and Adam moments)."""

    @property
    def total(self) -> float:
        """Sum of the three."""
        return self.weights + self.grads + self.optimizer


def state_bytes(
    params: float, scheme: precision.StateScheme, zero_stage: int, data: int
) -> StateBytes:
    """Weights, gradients and optimizer state of ``params`` parameters on one rank.

    ZeRO (Rajbhandari et al. 2020) shards over the ``data`` ranks holding the
    same parameters: stage 1 the optimizer state, stage 2 also the gradients,
    stage 3 also the weights.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3, got {zero_stage}")
    if data < 1:
        raise ValueError(f"data-parallel degree must be >= 1, got {data}")
    shard = {0: (1, 1, 1), 1: (1, 1, data), 2: (1, data, data), 3: (data, data, data)}[zero_stage]
    return StateBytes(
        weights=params * scheme.weights / shard[0],
        grads=params * scheme.grads / shard[1],
        optimizer=params * scheme.optimizer / shard[2],
    )


# --------------------------------------------------------------------------- activations


NORM_STATISTICS = {"gpt": 2, "llama": 1}
"""fp32 statistics per token a norm keeps for backward: LayerNorm's mean and rstd, RMSNorm's rstd."""


def layer_activation_bytes(
    shape: api_model.ModelShape,
    micro_batch: int,
    tensor: int,
    scheme: precision.StateScheme,
    *,
    sequence_parallel: bool,
    fused_attention: bool = True,
    recompute: Sequence[str] = (),
    gathered_inputs: bool = True,
) -> float:
    """Activation bytes one block keeps for backward, per micro-batch, on one TP rank.

    Counting as Korthikanti et al. 2022 (sec. 4.1) do, for this model (no
    dropout, MLP width f), what the trainer's autograd graph holds, per token:

    * the two norms' inputs (``scheme.stream_bytes``) and their fp32
      statistics (:data:`NORM_STATISTICS`), sharded by sequence parallelism;
    * the two norms' outputs as the QKV and MLP-in matmuls keep them: the
      matmul-dtype copy (autocast's), or under sequence parallelism in the
      wire dtype: with ``gathered_inputs`` (the serial path,
      ``parallelism.overlap.tensor`` off) the gathered whole sequence, else
      (the overlapped linears) the rank's shard, gathered again in backward as
      Megatron-LM does;
    * matmul outputs (``scheme.matmul_bytes``) split over TP: Q, K, V (Llama:
      rotated q and k, and v, one tensor), the attention output, and the MLP's
      up-projection and GELU (gpt) or gate, up, SiLU and product (llama);
    * attention internals: fused attention (``scaled_dot_product_attention``'s
      flash kernels) keeps one fp32 log-sum-exp per head and token; unfused
      it keeps the scores and the softmax, 2 a s elements per token.

    Per micro-batch, whatever its tokens: Llama's rotary cos and sin (fp32,
    T x hd each).  The 16-bit copies of the weights autocast's matmuls keep
    are counted apart (:func:`weight_cast_bytes`).

    With 16-bit activations, f = 4h and no sequence parallelism this is
    ``s b h (8 + 24/t)`` bytes, the paper's ``10 + 24/t`` minus its two
    dropout masks, plus the norm statistics.

    ``recompute`` (``training.selectiveRecompute``) drops what a part rebuilds
    in backward: ``attention`` the attention internals (its q, k, v stay,
    they are the checkpoint's inputs); ``mlp`` the second norm's statistics and
    output and the MLP's outputs (the sub-layer's input stays: it is the
    norm's input).
    """
    s, b, h, f, a = shape.seq_len, micro_batch, shape.hidden, shape.ffn_hidden, shape.heads
    llama = shape.family == "llama"
    mlp_rebuilt = "mlp" in recompute
    kept_norms = 1 if mlp_rebuilt else 2  # norms whose statistics and output the block keeps
    norm_inputs: float = (
        2 * h * scheme.stream_bytes + kept_norms * NORM_STATISTICS[shape.family] * 4
    )
    if sequence_parallel:
        norm_inputs /= tensor
    norm_outputs: float = (
        kept_norms * h * (scheme.wire_bytes if sequence_parallel else scheme.matmul_bytes)
    )
    if sequence_parallel and not gathered_inputs:
        norm_outputs /= tensor
    if llama:  # rotated q, attention output; rotated k and v: this rank's key/value heads
        kv = parameters.kv_heads_per_rank(shape, tensor) * shape.head_dim
        matmul_outputs = 2 * h / tensor + 2 * kv
    else:  # q, k, v, attention output
        matmul_outputs = 4 * h / tensor
    if not mlp_rebuilt:  # gate, up, SiLU, product (llama); up, GELU (gpt)
        matmul_outputs += (4 * f if llama else 2 * f) / tensor
    per_token = norm_inputs + norm_outputs + matmul_outputs * scheme.matmul_bytes
    if "attention" not in recompute:  # the attention internals
        per_token += (4 * a if fused_attention else 2 * a * s * scheme.matmul_bytes) / tensor
    rope_tables = 2 * s * shape.head_dim * 4 if llama else 0
    return s * b * per_token + rope_tables


def document_bytes(
    shape: api_model.ModelShape, micro_batch: int, tensor: int, scheme: precision.StateScheme
) -> tuple[float, float]:
    """``training.documentMask``'s extra activation bytes on one rank: (per micro-batch, per block).

    Per micro-batch, shared by the stage's blocks: the additive (B, 1, T, T) mask in the
    matmul dtype and Llama's (B, T, hd) fp32 rotary cos and sin of per-document positions.  Per
    block (Llama with grouped-query attention): k and v repeated to every query head for the
    masked kernel, less the (T, hd) rotary tables a block no longer builds.
    """
    s, b, hd = shape.seq_len, micro_batch, shape.head_dim
    shared = b * s * s * scheme.matmul_bytes
    if shape.family != "llama":
        return shared, 0.0
    heads = max(shape.heads // tensor, 1)
    repeated = 2 * b * s * heads * hd * scheme.matmul_bytes
    if heads == parameters.kv_heads_per_rank(shape, tensor):
        repeated = 0  # no grouped-query attention: nothing repeated
    return shared + 2 * b * s * hd * 4, repeated - 2 * s * hd * 4


def checkpointed_layer_bytes(
    shape: api_model.ModelShape,
    micro_batch: int,
    tensor: int,
    scheme: precision.StateScheme,
    *,
    sequence_parallel: bool,
) -> float:
    """Activation bytes one block keeps per micro-batch under activation checkpointing: its input only.

    The (s, b, h) residual-stream input, replicated over the TP group unless
    sequence parallelism shards it; the rest is recomputed in backward.
    """
    stream = shape.seq_len * micro_batch * shape.hidden * scheme.stream_bytes
    return stream / tensor if sequence_parallel else stream


LOSS_CHUNK_BYTES = 256 * 2**20
"""fp32 logits of one chunk of the trainer's fused loss (``meshtrain.trainer.parallel.loss.CHUNK_BYTES``)."""


def loss_chunk_tokens(shape: api_model.ModelShape, micro_batch: int, tensor: int) -> int:
    """Tokens per chunk of the trainer's fused loss: one chunk's fp32 logits within :data:`LOSS_CHUNK_BYTES`."""
    return min(
        shape.seq_len * micro_batch,
        max(1, LOSS_CHUNK_BYTES // (4 * parameters.vocab_rows(shape, tensor))),
    )


def loss_chunks(shape: api_model.ModelShape, micro_batch: int, tensor: int) -> int:
    """Chunks the fused loss walks per micro-batch."""
    return -(-shape.seq_len * micro_batch // loss_chunk_tokens(shape, micro_batch, tensor))


def head_activation_bytes(
    shape: api_model.ModelShape, micro_batch: int, tensor: int, scheme: precision.StateScheme
) -> float:
    """Activation bytes of the last stage's final norm, head and loss per micro-batch.

    The trainer's loss fuses the head with the cross-entropy and walks the
    tokens in chunks (``trainer/meshtrain/trainer/parallel/loss.py``): it keeps the final
    norm's input and the gradient of the head's input (2 s b h stream
    elements) and the head weight's gradient in fp32 (V/t x h), and while it
    runs one chunk's logits exist in fp32 (and in the matmul dtype first,
    when that is narrower).
    """
    s, b, vocab = shape.seq_len, micro_batch, parameters.vocab_rows(shape, tensor)
    chunk = loss_chunk_tokens(shape, micro_batch, tensor)
    logit_bytes = 4 + (scheme.matmul_bytes if scheme.matmul_bytes < 4 else 0)
    return (
        2 * s * b * shape.hidden * scheme.stream_bytes
        + vocab * shape.hidden * 4
        + chunk * vocab * logit_bytes
    )


def weight_cast_bytes(
    shape: api_model.ModelShape,
    tensor: int,
    layers: int,
    flight: float,
    *,
    last: bool,
    scheme: precision.StateScheme,
    checkpointing: bool = False,
    recompute: Sequence[str] = (),
) -> float:
    """Autocast's matmul-dtype copies of a stage's weights that autograd keeps for backward.

    Under autocast a matmul casts its fp32 weight and saves the cast for its
    backward, and the engine's autocast keeps no cast cache, so a copy lives
    as long as a saved tensor holds it: every micro-batch in flight keeps
    one of the ``layers`` blocks' matrices.  Where backward rebuilds a part
    (activation checkpointing: whole blocks; ``selectiveRecompute: mlp``: the
    MLP) the forward keeps none of its copies, and the block being rebuilt
    holds one.  The fused loss casts the head once, for the length of its
    forward.  0 when matmuls run in the weights' dtype (fp32, or the
    ``mixed`` recipe's 16-bit weights).  On the lent H200 the planner fell
    about 3.1 GiB short of 1.3B's measured peaks without this term (2.44 GiB
    there; docs/planner.md, "Memory per GPU").
    """
    if scheme.matmul_bytes >= scheme.weights:
        return 0.0
    qkv, proj, mlp_in, mlp_out = parameters.local_block_matrices(shape, tensor)
    block = qkv + proj + mlp_in + mlp_out
    if checkpointing:
        matrices: float = block
    elif "mlp" in recompute:
        matrices = flight * layers * (qkv + proj) + mlp_in + mlp_out
    else:
        matrices = flight * layers * block
    if last:  # the head, tied to the token table or not
        matrices += parameters.vocab_rows(shape, tensor) * shape.hidden
    return float(matrices * scheme.matmul_bytes)


def in_flight_microbatches(
    schedule: str, pipeline: int, micro_batches: int, stage: int, virtual_stages: int = 1
) -> float:
    """Micro-batches whose activations a stage holds at its peak, in units of the whole stage's layers.

    * gpipe (Huang et al. 2019): every forward runs before any backward: ``m``.
    * 1f1b (PipeDream-Flush, Narayanan et al. 2021): stage i warms up with
      ``p - i`` forwards: ``min(p - i, m)``.
    * interleaved-1f1b (Megatron-LM, Narayanan et al. 2021): rank i runs
      ``2 (p - i - 1) + (v - 1) p + 1`` chunk-forwards before its first
      backward, each chunk holding 1/v of the stage's layers; for rank 0 that
      is Korthikanti's factor ``1 + (p - 1)/(p v)`` times 1F1B's ``p``.
    """
    if not 0 <= stage < pipeline:
        raise ValueError(f"stage {stage} outside 0..{pipeline - 1}")
    if schedule == "gpipe":
        return float(micro_batches)
    if schedule == "1f1b":
        return float(min(pipeline - stage, micro_batches))
    if schedule == "interleaved-1f1b":
        chunks = min(
            2 * (pipeline - stage - 1) + (virtual_stages - 1) * pipeline + 1,
            micro_batches * virtual_stages,
        )
        return chunks / virtual_stages
    raise ValueError(f"unknown schedule {schedule!r}; known: gpipe, 1f1b, interleaved-1f1b")


# --------------------------------------------------------------------------- working buffers

ZERO2_BUCKETS_IN_FLIGHT = 1
"""Reduce-scatters the trainer's ZeRO-2 reducer keeps in flight beside the bucket it packs
(``zero.IN_FLIGHT_BUCKETS``)."""

MOMENT_BYTES = 4
"""Adam moments are fp32 in every recipe."""


def largest_param(shape: api_model.ModelShape, tensor: int, *, first: bool, last: bool) -> int:
    """Elements of the largest parameter tensor of a stage (a bucket overshoots by at most one)."""
    sizes = parameters.local_block_matrices(shape, tensor)
    if first or last:
        sizes.append(parameters.vocab_rows(shape, tensor) * shape.hidden)
    return max(sizes)


def working_buffers(
    params: int, largest: int, par: api_parallelism.Parallelism, scheme: precision.StateScheme
) -> tuple[float, float]:
    """(backward's transient buffers, the optimizer step's temporaries) of one rank, in bytes.

    * ZeRO-2 copies each gradient into its bucket's packed, full-size buffer as
      it arrives (buckets up to :func:`.comm.zero2_bucket`'s cap, large
      tensors split): one bucket packing, ``ZERO2_BUCKETS_IN_FLIGHT`` reduce-scattering
      with their reduced shards, and autograd's gradient of the largest tensor
      before it is copied.
    * ``overlap.paramGather`` (ZeRO-1/2): one gathered bucket is alive during
      the forward, up to its end beside nearly all the activations (ZeRO-2's
      packing comes after it, in backward: the larger of the two counts).
    * The optimizer step without ZeRO is ``torch.optim.AdamW`` (foreach): it
      builds the square root of every second moment at once (one fp32 moment
      of temporaries).  ZeRO-1/2 update bucket by bucket: the owned weights and
      the denominator (a shard each) and the all-gathered bucket.  ZeRO-3 runs
      ``torch.optim.AdamW`` on the shards: one fp32 moment of this rank's shard.
    """
    bucket = min(params, par.bucket_mb * 2**20 / scheme.grads + largest)  # elements
    reducers = context.reducers(par)
    sharded_grads = par.zero_stage == 2 and reducers > 1
    backward = 0.0
    if sharded_grads:
        target, cap = comm.zero2_bucket(params, scheme.grads, par.bucket_mb)
        bucket = min(params, cap, target + largest)  # overshoots by at most one slice
        packed = (
            ZERO2_BUCKETS_IN_FLIGHT + 1
        ) * bucket + ZERO2_BUCKETS_IN_FLIGHT * bucket / reducers
        backward = (packed + largest) * scheme.grads
    if par.zero_stage in (1, 2) and reducers > 1 and par.overlap.param_gather:
        backward = max(backward, bucket * scheme.weights)
    if par.zero_stage == 3 and reducers > 1:
        step = params / reducers * MOMENT_BYTES
    elif par.zero_stage >= 1 and reducers > 1:
        step = bucket * scheme.weights + 2 * bucket / reducers * MOMENT_BYTES
    else:
        step = params * MOMENT_BYTES
    return backward, step


def zero3_gathered(
    block: int, root: int, tables: int, data: int, scheme: precision.StateScheme
) -> tuple[float, float]:
    """What FSDP2 holds beside the shards under ZeRO-3: (during backward, with the activations; at the end of a chunk's backward).

    Units as the trainer wraps them (:func:`meshtrain.trainer.parallel.zero3.units`): the
    embedding tables (``tables`` parameters; 0 when tied to the head or
    pipelined), one unit per block (``block`` parameters) and the
    chunk's root (``root``: final norm and head, plus the tables when tied
    or pipelined), which
    stays gathered from its forward until its own reduce at the end.

    * Backward, while activations are alive: the root's weights, and the
      larger of its all-gather output (copied into the weights as backward
      starts) and a block's working set: the block's gathered weights, the
      next block's all-gather (FSDP2 prefetches one unit in backward) and one
      block of gradients (the block's own unsharded gradients, or the
      previous block's reduce-scatter input, which FSDP2 keeps until the next
      reduce-scatter).  Forward holds less: one block's weights and two
      all-gather outputs.
    * The end of the backward, when the activations are gone: the root's
      weights and gradients beside the last reduce-scatter input (the first
      block's, or, after the embeddings' backward, the tables') and, while
      the tables' unit runs, its gathered weights and gradients; then the
      root's gradients, its reduce-scatter input and the shard that comes out.
    """
    w, g = scheme.wire_bytes, scheme.grads  # gathered in FSDP2's param_dtype: bf16 under bf16
    backward = root * w + max(root * w, block * (2 * w + g))
    tables_backward = tables * (w + g) + block * g
    end = max(root * (w + g) + max(block * g, tables_backward), root * g * (2 + 1 / data))
    return backward, end


# --------------------------------------------------------------------------- per rank


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """Predicted peak memory of one rank of one pipeline stage."""

    stage: int
    """Pipeline stage (0-based)."""
    params: int
    """Parameters this rank holds."""
    weights: float
    """Bytes of weights."""
    grads: float
    """Bytes of gradients."""
    optimizer: float
    """Bytes of optimizer state."""
    activations: float
    """Bytes of activations at the schedule's peak."""
    in_flight: float
    """Micro-batches in flight at the peak (stage-layer units)."""
    buffers: float = 0.0
    """Transient buffers beside the activations in backward (ZeRO-2's packed gradient buckets,
    ZeRO-3's gathered units and reduce-scatter input)."""
    step_buffers: float = 0.0
    """Temporaries of the optimizer step, when the activations are gone."""
    reduce_end: float = 0.0
    """ZeRO-3: the chunk's own unit reducing at the end of a micro-batch's backward."""
    other_activations: float = 0.0
    """Activations of the other micro-batches in flight while one finishes its backward."""
    weight_casts: float = 0.0
    """Autocast's matmul-dtype copies of the weights autograd keeps (:func:`weight_cast_bytes`)."""
    compression: float = 0.0
    """Gradient compression's state kept between steps (error feedback, PowerSGD's Q)."""
    exchange: float = 0.0
    """Temporaries of one bucket's compressed or hierarchical exchange: the chains overlap backward,
    so they coexist with its activations and buffers."""
    ring: float = 0.0
    """Context parallelism: the ring's K/V and dK/dV blocks of the layer running (:func:`.context.ring_buffer_bytes`)."""

    @property
    def total(self) -> float:
        """Peak bytes: the state plus the largest working set (backward, the end of a backward, the optimizer step)."""
        working = max(  # the copies are 0 where reduce_end is not (ZeRO-3 over data ranks)
            self.activations + self.weight_casts + self.buffers + self.exchange + self.ring,
            self.other_activations + self.reduce_end,
            self.step_buffers,
        )
        return self.weights + self.grads + self.optimizer + self.compression + working


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Memory of every pipeline stage's ranks and the worst one against the device."""

    total_params: int
    """Parameters of the whole model."""
    scheme: precision.StateScheme
    """Bytes-per-parameter scheme used."""
    stages: tuple[RankMemory, ...]
    """One entry per pipeline stage (ranks of a stage are alike)."""
    capacity: float
    """Device memory a rank's tensors can use, in bytes (the profile's memory less its reserve)."""
    reserved: float = 0.0
    """Device memory set aside for what is not a tensor (the profile's ``reserved_bytes``)."""

    def describe_capacity(self) -> str:
        """The capacity in GiB, and how it follows from the device's memory when some is reserved."""
        usable = f"{self.capacity / 2**30:.2f} GiB"
        if not self.reserved:
            return usable
        device = (self.capacity + self.reserved) / 2**30
        return (
            f"{usable} for tensors ({device:.2f} GiB less {self.reserved / 2**30:.2f} GiB "
            "for the driver, CUDA context, NCCL and libraries)"
        )

    @property
    def worst(self) -> RankMemory:
        """The stage whose ranks need the most memory."""
        return max(self.stages, key=lambda r: r.total)

    @property
    def headroom(self) -> float:
        """Device memory left on the worst rank (negative: it does not fit)."""
        return self.capacity - self.worst.total

    @property
    def fits(self) -> bool:
        """True when the worst rank fits in device memory."""
        return self.headroom >= 0


@dataclasses.dataclass(frozen=True)
class _LayerBytes:
    """Activation bytes of one block and micro-batch on one rank, as the job's recompute settings keep them."""

    kept: float
    """What a block keeps for backward, less what selective recompute drops."""
    rebuilt: float
    """What backward rebuilds of the one block it recomputes at a time (selective recompute)."""
    checkpointed: float
    """Under activation checkpointing: the block's input only."""

    @classmethod
    def of(cls, job: api_spec.TrainingJobSpec, scheme: precision.StateScheme) -> _LayerBytes:
        """The figures of ``job``'s blocks."""
        par, micro_batch = job.parallelism, job.training.micro_batch
        shape = context.local_shape(job)  # a rank's seqLen / context tokens
        sp, ring = par.sequence_parallel, context.ring_saved_bytes(job, scheme)
        gathered = not (par.overlap.tensor and par.tensor > 1)  # the serial path keeps it whole
        kept = ring + layer_activation_bytes(
            shape,
            micro_batch,
            par.tensor,
            scheme,
            sequence_parallel=sp,
            recompute=job.training.selective_recompute,
            gathered_inputs=gathered,
        )
        whole = ring + layer_activation_bytes(
            shape, micro_batch, par.tensor, scheme, sequence_parallel=sp, gathered_inputs=gathered
        )
        return cls(
            kept=kept,
            rebuilt=whole - kept,
            checkpointed=checkpointed_layer_bytes(
                shape, micro_batch, par.tensor, scheme, sequence_parallel=sp
            ),
        )


def plan_memory(
    job: api_spec.TrainingJobSpec, profile: profiles.Profile, recipe: str = "meshtrain"
) -> MemoryPlan:
    """Per-stage memory of a job on a device profile (``recipe``: see :data:`~.precision.RECIPES`)."""
    scheme = precision.scheme_for(precision.resolve_precision(job, profile), recipe)
    layer = _LayerBytes.of(job, scheme)
    return MemoryPlan(
        total_params=parameters.total_params(job.model.shape()),
        scheme=scheme,
        stages=tuple(
            _rank_memory(job, stage, scheme, layer) for stage in range(job.parallelism.pipeline)
        ),
        capacity=profile.tensor_memory_bytes,
        reserved=profile.reserved_bytes,
    )


def _rank_memory(
    job: api_spec.TrainingJobSpec, stage: int, scheme: precision.StateScheme, layer: _LayerBytes
) -> RankMemory:
    """The peak memory of one rank of ``stage``, by component."""
    shape, par = job.model.shape(), job.parallelism
    params = parameters.rank_params(shape, par.pipeline, par.tensor, stage)
    state = state_bytes(params, scheme, par.zero_stage, context.reducers(par))
    virtual = par.virtual_stages
    flight = in_flight_microbatches(_schedule(job), par.pipeline, par.micro_batches, stage, virtual)
    activations = _activations(job, stage, scheme, layer, flight)
    largest = largest_param(shape, par.tensor, first=stage == 0, last=stage == par.pipeline - 1)
    buffers, step_buffers = working_buffers(params, largest, par, scheme)
    reduce_end = 0.0
    # FSDP2's gathered units, not ZeRO-2's buckets
    if par.zero_stage == 3 and context.reducers(par) > 1:
        buffers, reduce_end = _zero3_units(job, stage, params, scheme)
    compression, exchange = exchange_bytes(job, stage, params, largest, scheme)
    return RankMemory(
        stage=stage,
        params=params,
        weights=state.weights,
        grads=state.grads,
        optimizer=state.optimizer,
        activations=activations,
        in_flight=flight,
        buffers=buffers,
        step_buffers=step_buffers,
        reduce_end=reduce_end,
        other_activations=activations * max(0.0, flight - 1) / flight,
        weight_casts=_weight_casts(job, stage, scheme, flight),
        compression=compression,
        exchange=exchange,
        ring=context.ring_buffer_bytes(job, scheme),
    )


def _schedule(job: api_spec.TrainingJobSpec) -> str:
    """The job's schedule; one stage is plain gradient accumulation, which the trainer runs as 1F1B."""
    par = job.parallelism
    return par.schedule if par.pipeline > 1 else "1f1b"


def _activations(
    job: api_spec.TrainingJobSpec,
    stage: int,
    scheme: precision.StateScheme,
    layer: _LayerBytes,
    flight: float,
) -> float:
    """Activations at the schedule's peak: ``flight`` micro-batches of the stage's blocks, and the head's."""
    shape, par = context.local_shape(job), job.parallelism
    layers = shape.layers // par.pipeline
    if job.training.activation_checkpointing:
        # block inputs kept; one block's working set rebuilt at a time
        activations = flight * layers * layer.checkpointed + layer.kept
    else:
        activations = flight * layers * layer.kept + layer.rebuilt
    if job.training.document_mask:
        shared, per_block = document_bytes(shape, job.training.micro_batch, par.tensor, scheme)
        blocks = 1 if job.training.activation_checkpointing else flight * layers
        activations += flight * shared + blocks * per_block
    if stage == par.pipeline - 1:
        head_flight = par.micro_batches if _schedule(job) == "gpipe" else 1
        activations += head_flight * head_activation_bytes(
            shape, job.training.micro_batch, par.tensor, scheme
        )
    return activations


def _weight_casts(
    job: api_spec.TrainingJobSpec, stage: int, scheme: precision.StateScheme, flight: float
) -> float:
    """Autocast's copies of the stage's weights (:func:`weight_cast_bytes`); none under FSDP2, which gathers bf16,
    and only the head's under ``parallelism.overlap.tensor``."""
    shape, par = job.model.shape(), job.parallelism
    if par.zero_stage == 3 and context.reducers(par) > 1:
        return 0.0
    if job.training.float8 is not None:  # torchao saves the fp32 Parameter, not a cast
        tokens = job.training.micro_batch * shape.seq_len // par.context
        return float8.weight_cast_bytes(
            shape, par.tensor, tokens=tokens, last=stage == par.pipeline - 1, scheme=scheme
        )
    if par.tensor > 1 and par.overlap.tensor:
        # the overlapped linears keep the weight itself and cast it again in backward: the head's only
        return weight_cast_bytes(
            shape, par.tensor, 0, 0.0, last=stage == par.pipeline - 1, scheme=scheme
        )
    return weight_cast_bytes(
        shape,
        par.tensor,
        shape.layers // par.pipeline,
        flight,
        last=stage == par.pipeline - 1,
        scheme=scheme,
        checkpointing=job.training.activation_checkpointing,
        recompute=job.training.selective_recompute,
    )


def _zero3_units(
    job: api_spec.TrainingJobSpec, stage: int, params: int, scheme: precision.StateScheme
) -> tuple[float, float]:
    """FSDP2's gathered units beside a rank's shards (:func:`zero3_gathered`)."""
    shape, par = job.model.shape(), job.parallelism
    block = parameters.layer_params(shape, par.tensor)
    # zero3.units: untied tables without pipelining are a unit of their own
    own_unit = stage == 0 and not shape.tie_embeddings and par.pipeline == 1
    tables = parameters.embedding_params(shape, par.tensor) if own_unit else 0
    root = params - shape.layers // par.pipeline * block - tables
    return zero3_gathered(block, root, tables, context.reducers(par), scheme)


def exchange_bytes(
    job: api_spec.TrainingJobSpec,
    stage: int,
    params: int,
    largest: int,
    scheme: precision.StateScheme,
) -> tuple[float, float]:
    """Gradient compression's state between steps and one bucket's exchange temporaries (none without dp)."""
    shape, par = job.model.shape(), job.parallelism
    if context.reducers(par) == 1:
        return 0.0, 0.0
    bucket = min(params, par.bucket_mb * 2**20 / scheme.grads + largest)
    compression, exchange = gradient_compression.memory_bytes(
        par.gradient_compression,
        params,
        parameters.rank_matrices(shape, par.pipeline, par.tensor, stage),
        bucket,
        context.reducers(par),
        scheme.grads,
    )
    if par.all_reduce == "hierarchical" and not exchange:
        # the bucket padded to the node's k ranks and the 1/k shard reduced across nodes
        exchange = bucket * scheme.grads * (1 + 1 / comm.dp_ranks_per_node(job))
    return compression, exchange
