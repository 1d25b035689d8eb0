"""Context parallelism in the planner: what splitting each sequence over ``context`` ranks costs.

A rank holds ``seqLen / context`` tokens of every sequence (two load-balanced chunks, so causal
attention does equal work on every rank): its activations are those of the shorter sequence
(:func:`local_shape`), its FLOPs ``1 / context`` of the sequence's (attention included: every
token still attends over the whole sequence).  The ring is the trainer's own
(``trainer/parallel/context.py``): K and V go ``context - 1`` hops forward; backward recomputes,
so they go ``context - 1`` hops again, beside their fp32 gradients dK/dV, which take ``context``
hops to come home; each transfer overlaps the attention of the block the rank already holds, so
only what does not fit behind it is exposed (:func:`ring_exposed_seconds`).  docs/planner.md,
"Context parallelism", states the model.
"""

from __future__ import annotations

import dataclasses

from meshtrain.api import spec as api_spec
from meshtrain.api.spec import model as api_model
from meshtrain.api.spec import parallelism as api_parallelism
from meshtrain.planner import parameters, precision

RING_BUFFERS = 2
"""K/V blocks a rank holds while the ring turns: its own stacked for sending (or the one in hand)
and the one arriving (``trainer/parallel/context.py``'s ``kv`` and ``received``)."""

GRAD_BUFFERS = 3
"""dK/dV blocks in backward: this step's contribution, the travelling sum being sent and the one
arriving, each in the accumulation dtype (:data:`GRAD_BLOCK_BYTES` per element)."""

GRAD_BLOCK_BYTES = 4
"""Bytes per element of the travelling dK/dV: the trainer accumulates them in fp32
(``torch.promote_types(dtype, float32)``) and sends them so."""


def reducers(par: api_parallelism.Parallelism) -> int:
    """Ranks that sum (and under ZeRO shard) each replicated parameter's gradient: ``data x context``.

    Context ranks hold the same parameters as their data-parallel peers and other tokens, so the
    trainer reduces over its ``Mesh.grad_group`` (Megatron-Core's dp-cp group): ZeRO-1/2 shard the
    optimizer state and gradients, FSDP2 the parameters, and compression runs over these ranks.
    """
    return par.data * par.context


def local_shape(job: api_spec.TrainingJobSpec) -> api_model.ModelShape:
    """The model shape as one rank's activations see it: ``seqLen / context`` tokens per sequence.

    For activations only: the parameters (GPT's position table included) are the whole model's.
    """
    shape, context = job.model.shape(), job.parallelism.context
    if context == 1:
        return shape
    return shape.model_copy(update={"seq_len": shape.seq_len // context})


def kv_block_bytes(
    job: api_spec.TrainingJobSpec, scheme: precision.StateScheme, *, grads: bool = False
) -> float:
    """Bytes of one rank's K and V block of one layer and micro-batch: ``2 b (s / c) kv_width`` in the
    wire dtype, or with ``grads`` their gradients dK/dV in fp32 (:data:`GRAD_BLOCK_BYTES`).

    ``kv_width`` is this tensor rank's key/value heads times the head width (grouped-query
    attention: Llama's ``kvHeads``; GPT: ``hidden / tensor``).
    """
    shape, par = job.model.shape(), job.parallelism
    if shape.family == "llama":
        width: float = parameters.kv_heads_per_rank(shape, par.tensor) * shape.head_dim
    else:
        width = shape.hidden / par.tensor
    tokens = job.training.micro_batch * shape.seq_len / par.context
    return 2 * tokens * width * (GRAD_BLOCK_BYTES if grads else scheme.wire_bytes)


def ring_buffer_bytes(job: api_spec.TrainingJobSpec, scheme: precision.StateScheme) -> float:
    """The ring's transient buffers of the one layer running, beside the activations: 0 without context.

    Backward's are the larger: :data:`RING_BUFFERS` K/V blocks and :data:`GRAD_BUFFERS` fp32
    dK/dV blocks.
    """
    if job.parallelism.context == 1:
        return 0.0
    return RING_BUFFERS * kv_block_bytes(job, scheme) + GRAD_BUFFERS * kv_block_bytes(
        job, scheme, grads=True
    )


def ring_saved_bytes(job: api_spec.TrainingJobSpec, scheme: precision.StateScheme) -> float:
    """What the ring's attention keeps for backward per block and micro-batch beyond fused
    attention's: its output (B, h / t, s / c, d) in the queries' dtype, a storage of its own (the
    merged fp32 output cast, or itself in fp32).  0 without context; measured by
    ``tests/trainer/test_peak_memory.py`` (case ``cp2``)."""
    shape, par = job.model.shape(), job.parallelism
    if par.context == 1:
        return 0.0
    tokens = job.training.micro_batch * shape.seq_len / par.context
    return tokens * shape.hidden / par.tensor * scheme.matmul_bytes


@dataclasses.dataclass(frozen=True)
class RingSteps:
    """The ring exchanges of one rank of one stage in one step, as ``trainer/parallel/context.py``
    runs them: each sends one message to the next rank of the context group and receives one."""

    forward: int
    """Forward K/V exchanges, ``c - 1`` per layer and micro-batch (the replayed forward under
    activation checkpointing again)."""
    backward: int
    """Backward ring steps that send both a K/V block and a dK/dV sum, ``c - 1`` per layer and
    micro-batch: the K/V travel again, since backward recomputes every block."""
    returns: int
    """The last dK/dV hop per layer and micro-batch, bringing each rank's own gradient home after
    it visited every rank: behind no block, exposed whole."""

    @property
    def calls(self) -> int:
        """Exchanges per step: K/V forward and backward, dK/dV ``c`` times per layer and micro-batch."""
        return self.forward + 2 * self.backward + self.returns

    @property
    def kv_blocks(self) -> int:
        """K/V blocks sent (wire dtype)."""
        return self.forward + self.backward

    @property
    def grad_blocks(self) -> int:
        """dK/dV blocks sent (fp32)."""
        return self.backward + self.returns


def ring_steps(job: api_spec.TrainingJobSpec) -> RingSteps:
    """Per layer and micro-batch ``context - 1`` forward steps (twice under activation
    checkpointing), ``context - 1`` backward steps and one return hop."""
    shape, par = job.model.shape(), job.parallelism
    if par.context == 1:
        return RingSteps(0, 0, 0)
    visits = (shape.layers // par.pipeline) * par.micro_batches
    steps = visits * (par.context - 1)
    forwards = 2 if job.training.activation_checkpointing else 1
    return RingSteps(forward=forwards * steps, backward=steps, returns=visits)


BACKWARD_BLOCK_RATIO = 2.5
"""A ring step's backward matmuls per forward one: the trainer recomputes the scores (QK^T) and
computes dV, dP, dQ and dK, five matmuls against forward's two."""


def block_attention_flops(job: api_spec.TrainingJobSpec) -> float:
    """Forward FLOPs of one ring step's block attention on one rank: ``2 b (s / c)^2 h / t``.

    With the sequence cut in ``2c`` chunks (``L = s / c`` tokens a rank, two chunks of ``L / 2``),
    every ring step after the rank's own computes two chunk-by-chunk tiles, ``L^2 / 2`` query-key
    pairs; QK^T and the weighted sum of V cost ``4 h / t`` FLOPs a pair.  (The own step's three
    tiles are a quarter more; not counted: the window is the smaller one.)
    """
    shape, par = job.model.shape(), job.parallelism
    local = shape.seq_len / par.context
    return 2 * job.training.micro_batch * local * local * shape.hidden / par.tensor


def ring_exposed_seconds(
    job: api_spec.TrainingJobSpec, sends: tuple[float, float], rank_flops: float
) -> float:
    """Seconds of the ring on the critical path of one step.

    ``sends`` is the seconds of one K/V block's exchange and of one dK/dV block's on the context
    group's link; ``rank_flops`` the rank's FLOP/s.  A forward step's exchange hides behind one
    block's forward attention; a backward step's two (K/V and the previous dK/dV, concurrent)
    behind :data:`BACKWARD_BLOCK_RATIO` times that; the return hop behind nothing.
    """
    steps = ring_steps(job)
    block = block_attention_flops(job) / rank_flops
    kv, grad = sends
    forward = steps.forward * max(0.0, kv - block)
    backward = steps.backward * max(0.0, kv + grad - BACKWARD_BLOCK_RATIO * block)
    return forward + backward + steps.returns * grad


def placement_bytes(job: api_spec.TrainingJobSpec, scheme: precision.StateScheme) -> float:
    """Bytes one rank sends to its context-ring successor per step, the figure placement weighs."""
    steps = ring_steps(job)
    return steps.kv_blocks * kv_block_bytes(job, scheme) + steps.grad_blocks * kv_block_bytes(
        job, scheme, grads=True
    )
