"""What one rank of a pipeline stage does in one step, and its seconds at a machine's prices.

The work is counted here, machine-free: matmul and attention FLOPs, tensor operations, every
collective of :mod:`meshtrain.planner.comm` and the optimizer's bytes.  :func:`price` turns it
into a :class:`StageTime` at the :class:`Prices` a machine quotes (:mod:`.machine`): wall seconds
on a GPU, CPU seconds on a CPU host.
"""

from __future__ import annotations

import dataclasses

from meshtrain.api import spec as api_spec
from meshtrain.api.spec import model as api_model
from meshtrain.planner import comm, context, memory, parameters, precision
from meshtrain.planner.timing import network, tp_overlap

OPTIMIZER_BYTES_PER_PARAM = 32
"""AdamW reads weight, gradient and both moments and writes weight and moments (7 x 4 B), plus the norm pass (4 B)."""

BACKWARD_SHARE = 2.0 / 3.0
"""Backward's share of a block's matmul FLOPs (input and weight gradients: twice the forward)."""

BLOCK_OPS = (28, 53)
"""Tensor operations (forward, backward) of one block and micro-batch; tests count the trainer's Block."""

OUTSIDE_BLOCK_OPS = (11, 15)
"""Tensor operations (forward, backward) of the embeddings, final norm and head of one micro-batch, beside the loss's chunks."""

LOSS_OPS_PER_CHUNK = 44
"""Forward operations per token chunk of the trainer's fused loss (logits, softmax, both gradients); tests count them."""

OPTIMIZER_OPS_PER_TENSOR = 16
"""Per parameter tensor and step: AdamW's single-tensor update (~12 ops), the norm and zeroing."""


def attention_span(job: api_spec.TrainingJobSpec) -> int:
    """Tokens a token attends over, as model FLOPs (the MFU numerator) count them: the window, or
    under ``training.documentMask`` the documents' attention-weighted length
    (``training.documentLength``, ``sum(d^2) / sum(d)``) when given.

    Documents of lengths d_i cost ``12 l h sum(d_i^2)`` in attention, ``12 l h span`` per token
    with ``span = sum(d^2) / sum(d)`` (the trainer's MFU counts the batch's own lengths:
    :func:`meshtrain.trainer.models.gpt.training_flops`).  Only the numerator: the masked
    kernel does the whole window's T x T work, so step time counts the window.
    """
    seq, training = job.model.shape().seq_len, job.training
    if training.document_mask and training.document_length is not None:
        return min(training.document_length, seq)
    return seq


def rank_flops_per_microbatch(
    shape: api_model.ModelShape, pipeline: int, tensor: int, stage: int, micro_batch: int
) -> float:
    """Training FLOPs of one micro-batch on one rank of ``stage``: (6 N_rank + 12 l s h / t) x tokens.

    Kaplan et al. 2020; Narayanan et al. 2021.  The window's ``s`` also under
    ``training.documentMask``: the masked kernel computes every T x T score.

    ``N_rank`` counts the parameters the rank multiplies with (its blocks and,
    on the last stage, the final norm and head; embedding lookups are not
    matmuls), as :func:`meshtrain.trainer.models.gpt.flops_per_token` does for the
    whole model.
    """
    layers = shape.layers // pipeline
    n_rank = layers * parameters.layer_params(shape, tensor)
    if stage == pipeline - 1:
        n_rank += parameters.head_params(shape, tensor)
        n_rank += parameters.vocab_rows(shape, tensor) * shape.hidden if shape.tie_embeddings else 0
    attention = 12 * layers * shape.seq_len * shape.hidden / tensor
    return (6 * n_rank + attention) * micro_batch * shape.seq_len


def rank_forward_flops_per_microbatch(
    shape: api_model.ModelShape, pipeline: int, tensor: int, stage: int, micro_batch: int
) -> float:
    """The part of :func:`rank_flops_per_microbatch` that runs in forward.

    A third of the blocks' (backward computes the input and the weight
    gradients) and, on the last stage, all of the head's: the trainer's
    fused loss (``trainer/meshtrain/trainer/parallel/loss.py``) computes the head's gradients
    in forward, chunk by chunk, and backward only scales them.
    """
    layers = shape.layers // pipeline
    tokens = micro_batch * shape.seq_len
    blocks = (
        6 * layers * parameters.layer_params(shape, tensor)
        + 12 * layers * shape.seq_len * shape.hidden / tensor
    )
    head = rank_flops_per_microbatch(shape, pipeline, tensor, stage, micro_batch) - blocks * tokens
    return blocks * tokens * (1 - BACKWARD_SHARE) + head


def recompute_flops_per_microbatch(
    shape: api_model.ModelShape, pipeline: int, tensor: int, micro_batch: int
) -> float:
    """Extra FLOPs of activation checkpointing: one more forward of the stage's blocks, (2 N_blocks + 4 l s h / t) x tokens.

    Hardware work, not model work: MFU does not count it.
    """
    layers = shape.layers // pipeline
    forward = (
        2 * layers * parameters.layer_params(shape, tensor)
        + 4 * layers * shape.seq_len * shape.hidden / tensor
    )
    return forward * micro_batch * shape.seq_len


def rank_ops_per_microbatch(
    shape: api_model.ModelShape, pipeline: int, stage: int, recompute: bool, loss_chunks: int = 1
) -> tuple[int, int]:
    """Tensor operations (forward, backward) of one micro-batch on one rank of ``stage``.

    ``loss_chunks``: token chunks the last stage's fused loss walks
    (:func:`~.memory.loss_chunks`).
    """
    layers = shape.layers // pipeline
    forward = layers * BLOCK_OPS[0]
    backward = layers * (BLOCK_OPS[1] + (BLOCK_OPS[0] if recompute else 0))
    if stage in (0, pipeline - 1):  # embeddings on the first stage, norm and head on the last
        share = 0.5 if pipeline > 1 else 1.0
        forward += round(OUTSIDE_BLOCK_OPS[0] * share)
        backward += round(OUTSIDE_BLOCK_OPS[1] * share)
    if stage == pipeline - 1:
        forward += LOSS_OPS_PER_CHUNK * loss_chunks
    return forward, backward


@dataclasses.dataclass(frozen=True)
class StageTime:
    """Predicted seconds of one rank of one pipeline stage in one step."""

    stage: int
    """Pipeline stage (0-based)."""
    compute: float
    """Forward and backward matmul FLOPs of all micro-batches at the rank's FLOP/s."""
    tp: float
    """Tensor-parallel collectives, overlapped or not."""
    pp: float
    """Pipeline sends and the norm reduction over the pipeline group."""
    dp: float
    """Data-parallel gradient reduction (and ZeRO parameter gather), before overlap."""
    dp_exposed: float
    """Part of ``dp`` not hidden behind the last backward."""
    optimizer: float
    """The optimizer step (memory traffic and per-tensor operations)."""
    cp: float = 0.0
    """Context parallelism: the ring's K/V (and dK/dV) transfers not hidden behind the block attentions."""
    cp_ring: float = 0.0
    """Context parallelism: every ring transfer of the step, overlapped or not."""
    overhead: float = 0.0
    """Fixed cost of the forward and backward tensor operations of all micro-batches."""
    forward: float = 0.0
    """The forward part of ``compute + overhead`` (the rest is backward)."""
    tp_hidden: float = 0.0
    """Part of ``tp`` hidden behind the linears' matmuls (``parallelism.overlap.tensor``, :mod:`.tp_overlap`)."""

    @property
    def tp_exposed(self) -> float:
        """Tensor-parallel seconds on the critical path: ``tp`` less what the matmuls hide."""
        return self.tp - self.tp_hidden

    @property
    def busy(self) -> float:
        """Compute plus the communication that blocks it (exposed tp, pp, the ring's exposed part)."""
        return self.compute + self.overhead + self.tp_exposed + self.pp + self.cp

    @property
    def comm(self) -> float:
        """All communication seconds, overlapped or not."""
        return self.tp + self.pp + self.dp + self.cp_ring

    def scaled(self, factor: float) -> StageTime:
        """This stage with every duration multiplied by ``factor`` (CPU seconds to wall seconds)."""
        if factor == 1.0:
            return self
        return dataclasses.replace(
            self,
            compute=self.compute * factor,
            tp=self.tp * factor,
            pp=self.pp * factor,
            dp=self.dp * factor,
            dp_exposed=self.dp_exposed * factor,
            optimizer=self.optimizer * factor,
            cp=self.cp * factor,
            cp_ring=self.cp_ring * factor,
            overhead=self.overhead * factor,
            forward=self.forward * factor,
            tp_hidden=self.tp_hidden * factor,
        )


def model_flops_per_token(shape: api_model.ModelShape, *, span: int | None = None) -> float:
    """``6 N + 12 L s h`` with ``N`` the non-embedding parameters (the trainer's MFU numerator);
    ``span`` (:func:`attention_span`) in place of ``s``."""
    tied_head = shape.vocab * shape.hidden if shape.tie_embeddings else 0  # still a matmul
    n = parameters.total_params(shape) - parameters.embedding_params(shape) + tied_head
    return 6 * n + 12 * shape.layers * (span or shape.seq_len) * shape.hidden


@dataclasses.dataclass(frozen=True)
class Prices:
    """What one rank's work costs on a machine, in the seconds that machine counts (wall or CPU)."""

    rank_flops: float
    """Matmul FLOP/s of one rank."""
    op_seconds: float
    """Fixed seconds per tensor operation (dispatch, autograd, kernel launch)."""
    memory_bandwidth: float
    """Bytes/s a rank streams through its memory (the optimizer step)."""
    links: dict[str, network.Link]
    """The link each group axis uses (``dp``, ``tp``, ``pp``), with the fits that price its collectives."""
    domain_link: network.Link
    """The link inside one NVLink domain (one host): the node-local legs of a hierarchical all-reduce."""

    def collective(self, job: api_spec.TrainingJobSpec, collective: comm.Collective) -> float:
        """Seconds of ``collective`` on its group's link (a hierarchical leg on the link it runs over)."""
        leg, link = network.hierarchical_leg(
            job, collective, self.links[collective.group], self.domain_link
        )
        return network.collective_seconds(leg, link)


def price(job: api_spec.TrainingJobSpec, stage_comm: comm.StageComm, prices: Prices) -> StageTime:
    """One rank's seconds of ``stage_comm.stage`` in one step at ``prices``.

    Data-parallel bucket exchanges (each bucket's whole chain: flat,
    hierarchical or compressed) overlap the last micro-batch's backward; what
    does not fit behind it (at least the last bucket's exchange) is exposed, and
    so is everything after backward (ZeRO's gathers, the norm).
    """
    par = job.parallelism
    stage = stage_comm.stage
    per_mb, forward_mb = _flops_per_microbatch(job, stage)
    ops_forward, ops_backward = _ops_per_microbatch(job, stage)
    seconds, after_backward, dp_calls = _group_seconds(job, stage_comm, prices)
    forward_one = forward_mb / prices.rank_flops + ops_forward * prices.op_seconds
    hidden = _hidden_gathers(job, stage_comm, prices, forward_one)
    backward = (per_mb - forward_mb) / prices.rank_flops  # one micro-batch's backward
    if par.zero_stage == 2:  # each micro-batch reduce-scatters its buckets behind its own backward
        backward *= par.micro_batches
    exposed = _exposed_reduction(
        job, stage_comm, prices, seconds["dp"] - after_backward, dp_calls, backward
    )
    layers = job.model.shape().layers // par.pipeline  # the rank's blocks, over all its chunks
    tp_hidden = 0.0
    for whole, flops, chunks in zip(
        (False, True), tp_overlap.hiding_flops(job), (comm.tp_chunks(job), 1)
    ):
        hiding = flops * layers * par.micro_batches / prices.rank_flops
        overlapped = sum(
            prices.collective(job, c)
            for c in stage_comm.collectives
            if c.group == "tp" and c.overlapped and c.whole == whole
        )
        tp_hidden += overlapped - tp_overlap.exposed(overlapped, hiding, chunks)
    return StageTime(
        stage=stage,
        compute=per_mb * par.micro_batches / prices.rank_flops,
        tp=seconds["tp"],
        pp=seconds["pp"],
        dp=seconds["dp"],
        dp_exposed=exposed + after_backward - hidden,
        optimizer=_optimizer_seconds(job, stage, prices),
        cp=_ring_exposed(job, stage_comm, prices),
        cp_ring=seconds["cp"],
        overhead=(ops_forward + ops_backward) * par.micro_batches * prices.op_seconds,
        forward=(forward_mb / prices.rank_flops + ops_forward * prices.op_seconds)
        * par.micro_batches,
        tp_hidden=tp_hidden,
    )


def _hidden_gathers(
    job: api_spec.TrainingJobSpec, stage_comm: comm.StageComm, prices: Prices, forward: float
) -> float:
    """Seconds of ZeRO-1/2's weight gathers hidden behind the next step's first forward (``forward``).

    Under ``overlap.paramGather`` the gathers run one bucket ahead of the layers: the first
    bucket's is exposed whole and the rest hide behind the forward as far as it lasts; 0 for the
    serial path, whose gathers block inside the step.
    """
    par = job.parallelism
    if par.zero_stage not in (1, 2) or par.data == 1 or not par.overlap.param_gather:
        return 0.0
    for c in stage_comm.collectives:
        if c.group == "dp" and c.op == "all_gather" and c.after_backward:
            spent = prices.collective(job, c)
            return min(spent - spent / c.calls, forward)
    return 0.0


def _flops_per_microbatch(job: api_spec.TrainingJobSpec, stage: int) -> tuple[float, float]:
    """A rank's FLOPs of one micro-batch (activation checkpointing's replay included) and their forward part."""
    shape, par, micro_batch = job.model.shape(), job.parallelism, job.training.micro_batch
    per_mb = rank_flops_per_microbatch(shape, par.pipeline, par.tensor, stage, micro_batch)
    if job.training.activation_checkpointing:
        per_mb += recompute_flops_per_microbatch(shape, par.pipeline, par.tensor, micro_batch)
    forward = rank_forward_flops_per_microbatch(shape, par.pipeline, par.tensor, stage, micro_batch)
    # context ranks each hold seqLen / context tokens, attending over the whole sequence
    return per_mb / par.context, forward / par.context


def _ring_exposed(
    job: api_spec.TrainingJobSpec, stage_comm: comm.StageComm, prices: Prices
) -> float:
    """The context ring's seconds on the critical path (:func:`~meshtrain.planner.context.ring_exposed_seconds`)."""
    ring = [c for c in stage_comm.collectives if c.group == "cp"]
    if not ring:
        return 0.0
    steps = context.ring_steps(job)
    grad = context.kv_block_bytes(job, precision.FP32, grads=True)  # fp32 whatever the scheme
    kv = (ring[0].nbytes - steps.grad_blocks * grad) / steps.kv_blocks  # one K/V block
    link = prices.links["cp"].for_op("send", 2)
    sends = (network.send_seconds(kv, link), network.send_seconds(grad, link))
    return context.ring_exposed_seconds(job, sends, prices.rank_flops)


def _ops_per_microbatch(job: api_spec.TrainingJobSpec, stage: int) -> tuple[int, int]:
    """A rank's tensor operations (forward, backward) of one micro-batch, the fused loss's chunks included."""
    shape, par = job.model.shape(), job.parallelism
    chunks = memory.loss_chunks(shape, job.training.micro_batch, par.tensor)
    checkpointing = job.training.activation_checkpointing
    return rank_ops_per_microbatch(shape, par.pipeline, stage, checkpointing, chunks)


def _group_seconds(
    job: api_spec.TrainingJobSpec, stage_comm: comm.StageComm, prices: Prices
) -> tuple[dict[str, float], float, int]:
    """Seconds per group axis; of the dp seconds, those after backward; calls of the overlapped dp collectives."""
    seconds = {"dp": 0.0, "tp": 0.0, "pp": 0.0, "cp": 0.0}
    after_backward = 0.0
    dp_calls = 0
    for c in stage_comm.collectives:
        spent = prices.collective(job, c)
        seconds[c.group] += spent
        if c.group == "dp" and c.after_backward:
            after_backward += spent
        elif c.group == "dp":
            dp_calls += c.calls
    return seconds, after_backward, dp_calls


def _exposed_reduction(
    job: api_spec.TrainingJobSpec,
    stage_comm: comm.StageComm,
    prices: Prices,
    reduce: float,
    dp_calls: int,
    backward: float,
) -> float:
    """Seconds of the bucket exchanges (``reduce`` in all) that do not hide behind ``backward``.

    Each bucket's exchange is one chain; the last bucket's starts when
    backward ends, so it is exposed whole (ZeRO-3, whose last chain is not
    modelled: the average chain).
    """
    exchanges = stage_comm.dp_exchanges or dp_calls
    if not exchanges:
        return 0.0
    last_chain = sum(prices.collective(job, c) for c in stage_comm.dp_last_exchange)
    if not stage_comm.dp_last_exchange:
        last_chain = reduce / exchanges
    return max(reduce - backward, last_chain)


def _optimizer_seconds(job: api_spec.TrainingJobSpec, stage: int, prices: Prices) -> float:
    """The optimizer step: its bytes through memory and its operations per parameter tensor."""
    shape, par = job.model.shape(), job.parallelism
    params = parameters.rank_params(shape, par.pipeline, par.tensor, stage)
    updated = params / context.reducers(par) if par.zero_stage >= 1 else params
    tensors = len(
        comm.chunk_param_sizes(
            shape,
            par.tensor,
            shape.layers // par.pipeline,
            first=stage == 0,
            last=stage == par.pipeline - 1,
        )
    )
    return (
        updated * OPTIMIZER_BYTES_PER_PARAM / prices.memory_bandwidth
        + tensors * OPTIMIZER_OPS_PER_TENSOR * prices.op_seconds
    )
