"""Build a :class:`~model.PlacementRequest` from a TrainingJob spec.

What it is: the bridge from the typed spec (:mod:`meshtrain.api.spec`) to the
planner's plain request, including the bytes-per-step model of the job's DP
and PP traffic (formulas in :mod:`meshtrain.operator.placement.cost`).  What it
is not: it does not validate the spec (the spec rules do) and does not plan.

Assumptions, written down in docs/placement.md: gradients are all-reduced in
fp32 (4 bytes; the trainer keeps fp32 master weights under bf16 autocast),
activations cross stages in bf16 (2 bytes) unless the precision is fp32, and
every stage holds an equal share of the parameters.
"""

from __future__ import annotations

from meshtrain.api import spec as api_spec
from meshtrain.operator.placement import cost, model

GRADIENT_BYTES = 4
"""Bytes per gradient element in the DP all-reduce (fp32 gradients of fp32 master weights)."""


def request_from_spec(job: api_spec.TrainingJobSpec) -> model.PlacementRequest:
    """The placement request of a (validated) TrainingJob spec."""
    par = job.parallelism
    shape = job.model.shape()
    parameters = cost.gpt_parameters(shape.layers, shape.hidden, shape.vocab, shape.seq_len, shape.ffn_hidden)
    activation_bytes = 4 if job.training.precision == "fp32" else 2
    virtual = par.virtual_stages if par.schedule == "interleaved-1f1b" else 1
    return model.PlacementRequest(
        gpus_per_node=job.resources.gpus_per_node,
        data=par.data,
        pipeline=par.pipeline,
        tensor=par.tensor,
        dp_bytes_per_step=cost.dp_ring_bytes(parameters / par.pipeline, par.tensor, par.data, GRADIENT_BYTES),
        pp_bytes_per_step=(
            cost.pp_boundary_bytes(
                job.training.micro_batch, shape.seq_len, shape.hidden, par.micro_batches, activation_bytes, virtual
            )
            if par.pipeline > 1
            else 0.0
        ),
        nvlink_domain_label=job.topology.nvlink_domain_label,
        levels=tuple(
            model.FabricLevel(label=level.label, required=level.mode == "required") for level in job.topology.levels
        ),
        node_selector=dict(job.resources.node_selector),
    )
