"""Context parallelism in the planner: what splitting each sequence over ``context`` ranks costs.

A rank holds ``seqLen / context`` tokens of every sequence (two load-balanced chunks, so causal
attention does equal work on every rank): its activations are those of the shorter sequence
(:func:`local_shape`), its FLOPs ``1 / context`` of the sequence's (attention included: every
token still attends over the whole sequence).  Ring attention passes each block's K and V around
the context group, ``context - 1`` times forward and, with their gradients dK and dV, ``context -
1`` times backward; each transfer overlaps the attention of the block the rank already holds, so
only what does not fit behind it is exposed (:func:`ring_exposed_seconds`).  docs/planner.md,
"Context parallelism", states the model.
"""

from __future__ import annotations

import dataclasses

from meshtrain.api import spec as api_spec
from meshtrain.api.spec import model as api_model
from meshtrain.planner import parameters, precision

RING_BUFFERS = 2
"""K/V blocks a rank holds beside its own while the ring turns: the one it computes on and the one
arriving (double buffering)."""


def local_shape(job: api_spec.TrainingJobSpec) -> api_model.ModelShape:
    """The model shape as one rank's activations see it: ``seqLen / context`` tokens per sequence.

    For activations only: the parameters (GPT's position table included) are the whole model's.
    """
    shape, context = job.model.shape(), job.parallelism.context
    if context == 1:
        return shape
    return shape.model_copy(update={"seq_len": shape.seq_len // context})


def kv_block_bytes(job: api_spec.TrainingJobSpec, scheme: precision.StateScheme) -> float:
    """Bytes of one rank's K and V block of one layer and micro-batch: ``2 b (s / c) kv_width`` in the wire dtype.

    ``kv_width`` is this tensor rank's key/value heads times the head width (grouped-query
    attention: Llama's ``kvHeads``; GPT: ``hidden / tensor``).
    """
    shape, par = job.model.shape(), job.parallelism
    if shape.family == "llama":
        width: float = parameters.kv_heads_per_rank(shape, par.tensor) * shape.head_dim
    else:
        width = shape.hidden / par.tensor
    tokens = job.training.micro_batch * shape.seq_len / par.context
    return 2 * tokens * width * scheme.wire_bytes


def ring_buffer_bytes(job: api_spec.TrainingJobSpec, scheme: precision.StateScheme) -> float:
    """The ring's transient buffers of the one layer running, beside the activations: 0 without context.

    Backward's are the larger: :data:`RING_BUFFERS` K/V blocks and as many dK/dV blocks (the
    gradients travel with them), each the size of :func:`kv_block_bytes`.
    """
    if job.parallelism.context == 1:
        return 0.0
    return 2 * RING_BUFFERS * kv_block_bytes(job, scheme)


@dataclasses.dataclass(frozen=True)
class RingSteps:
    """The ring steps of one rank of one stage in one step (each sends one message to the next rank of the context group)."""

    forward: int
    """Forward steps, each one K/V block (the replayed forward under activation checkpointing included)."""
    backward: int
    """Backward steps, each a K/V block and its dK/dV: twice the bytes."""

    @property
    def calls(self) -> int:
        """Sends per step."""
        return self.forward + self.backward

    @property
    def blocks(self) -> int:
        """K/V blocks' worth of bytes those sends carry."""
        return self.forward + 2 * self.backward


def ring_steps(job: api_spec.TrainingJobSpec) -> RingSteps:
    """Per layer and micro-batch ``context - 1`` forward steps, as many backward, and again forward
    where activation checkpointing replays the forward."""
    shape, par = job.model.shape(), job.parallelism
    if par.context == 1:
        return RingSteps(0, 0)
    steps = (shape.layers // par.pipeline) * par.micro_batches * (par.context - 1)
    forwards = 2 if job.training.activation_checkpointing else 1
    return RingSteps(forward=forwards * steps, backward=steps)


def block_attention_flops(job: api_spec.TrainingJobSpec) -> float:
    """Forward FLOPs of one ring step's block attention on one rank: ``4 b (s / c)^2 h / t``.

    QK^T and the weighted sum of V over one K/V block, counted as the planner counts attention
    (``12 s h`` per token and layer for a whole training step, a third of it forward); backward
    does twice this per step.
    """
    shape, par = job.model.shape(), job.parallelism
    local = shape.seq_len / par.context
    return 4 * job.training.micro_batch * local * local * shape.hidden / par.tensor


def ring_exposed_seconds(
    job: api_spec.TrainingJobSpec, block_send: tuple[float, float], rank_flops: float
) -> float:
    """Seconds of the ring on the critical path of one step: per ring step ``max(0, transfer - block compute)``.

    ``block_send`` is the seconds of one forward step's send (a K/V block) and of one backward
    step's (K/V and dK/dV) on the context group's link; ``rank_flops`` the rank's FLOP/s.  A
    forward step hides behind one block's forward attention, a backward step behind twice that.
    """
    steps = ring_steps(job)
    block = block_attention_flops(job) / rank_flops
    forward = steps.forward * max(0.0, block_send[0] - block)
    return forward + steps.backward * max(0.0, block_send[1] - 2 * block)


def placement_bytes(job: api_spec.TrainingJobSpec, scheme: precision.StateScheme) -> float:
    """Bytes one rank sends to its context-ring successor per step, the figure placement weighs."""
    return ring_steps(job).blocks * kv_block_bytes(job, scheme)
