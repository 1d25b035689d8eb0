"""Exposed tensor-parallel time under ``parallelism.overlap.tensor``: what the linears' matmuls hide.

The trainer (``trainer/meshtrain/trainer/parallel/tensor_overlap.py``) splits each linear's
collective into ``k`` chunks along the sequence: chunk i's collective runs while chunk i+1's matmul
does, so of a linear's collective ``C`` beside a matmul ``M`` the first (or last) chunk is exposed
whole and each other chunk for what its matmul does not cover:
``C / k + (k - 1) / k * max(0, C - M)``.  Summed over a stage's linears (all alike) this is the same
expression of the totals.  The matmuls that can hide a collective, per block and micro-batch:

* sequence parallel: forward, all four linears (gather before the column-parallel ones,
  reduce-scatter after the row-parallel ones); backward, the column-parallel ones' input and weight
  gradients (their reduce-scatter) and the row-parallel ones' input gradients (their gather);
* without it: forward, the row-parallel ones (their all-reduce); backward, the column-parallel
  ones' weight gradients (their input gradient's all-reduce, one chunk).

One chunk (``k = 1``) is a collective that runs whole beside an independent matmul: without
sequence parallelism the column-parallel input gradient's all-reduce beside the weight-gradient
matmul, whatever ``k`` the other linears use (:attr:`meshtrain.planner.comm.Collective.whole`);
only what the matmul does not cover is exposed, ``max(0, C - M)``.  :func:`hiding_flops` gives
the matmuls of each kind apart, and the stage prices each kind's collectives beside its own.
"""

from __future__ import annotations

from meshtrain.api import spec as api_spec
from meshtrain.planner import parameters


def hiding_flops(job: api_spec.TrainingJobSpec) -> tuple[float, float]:
    """Matmul FLOPs of one rank's blocks per micro-batch and block that run beside the linears'
    collectives: (beside the chunked ones, beside the whole ones)."""
    shape, par = job.model.shape(), job.parallelism
    qkv, proj, fc, down = parameters.local_block_matrices(shape, par.tensor)
    tokens = job.training.micro_batch * shape.seq_len // par.context  # a context rank's share
    one = 2 * tokens  # FLOPs per matrix element for one matmul over the micro-batch's tokens
    if par.sequence_parallel:
        return one * ((qkv + proj + fc + down) + 2 * (qkv + fc) + (proj + down)), 0.0
    return one * (proj + down), one * (qkv + fc)


def exposed(collective: float, hiding: float, chunks: int) -> float:
    """Seconds of ``collective`` (in ``chunks`` chunks) left exposed beside ``hiding`` seconds of matmuls."""
    if chunks <= 1:  # one collective beside one matmul it does not depend on
        return max(0.0, collective - hiding)
    return collective / chunks + (chunks - 1) / chunks * max(0.0, collective - hiding)
