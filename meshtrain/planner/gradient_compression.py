"""Data-parallel collectives and memory under gradient compression (``parallelism.gradientCompression``).

Mirrors :mod:`meshtrain.trainer.parallel.compression` bucket by bucket, call for call, in the
recorder's payload convention (the buffer a collective works on; an all-gather counts its
gathered output).
"""

from __future__ import annotations

import math

from meshtrain.api import spec as api_spec
from meshtrain.api.spec import parallelism as api_parallelism

CAST_BYTES = 2
INT8_SCALE_BYTES = 4
INDEX_BYTES = 4


def dp_collectives(
    compression: api_parallelism.GradientCompression,
    buckets: list[list[tuple[int, ...]]],
    dp: int,
    grad_bytes: int,
) -> list[tuple[str, str, int, int]]:
    """(group, op, calls, payload bytes) of one compressed step (after the warm-up) for buckets
    given as their members' shapes.

    Per bucket of ``n`` elements:

    * bf16 / fp16: one all-reduce of the bucket in 2-byte elements;
    * int8: two all-gathers: each rank's 4-byte scale and its bucket in 1-byte
      elements (``dp x (4 + n)`` bytes gathered: summed in fp32 by the receivers);
    * topk: two all-gathers of ``k = max(1, int(ratio x n))`` elements per rank
      (4-byte values, 4-byte indices);
    * powersgd: matrices with ``min(rows, cols) > r`` send ``P`` (rows x r) and
      ``Q`` (cols x r) in one all-reduce each; everything else of the bucket one
      uncompressed all-reduce.
    """
    out: list[tuple[str, str, int, int]] = []
    for shapes in buckets:
        n = sum(math.prod(s) for s in shapes)
        if compression.mode in ("bf16", "fp16"):
            out.append(("dp", "all_reduce", 1, n * CAST_BYTES))
        elif compression.mode == "int8":
            out.append(("dp", "all_gather", 2, dp * (INT8_SCALE_BYTES + n)))
        else:
            out += _sparse_or_low_rank(compression, shapes, n, dp, grad_bytes)
    return out


def sharded_collectives(
    compression: api_parallelism.GradientCompression,
    buckets: list[list[tuple[int, ...]]],
    dp: int,
    grad_bytes: int,
    micro_batches: int,
) -> list[tuple[str, str, int, int]]:
    """As :func:`dp_collectives` on ZeRO-2's reduce-scatter, which runs after every micro-batch.

    Per micro-batch and bucket, padded to ``p = dp x ceil(n / dp)`` elements
    (:mod:`meshtrain.trainer.parallel.compression_sharded`):

    * bf16 / fp16: one reduce-scatter of the padded bucket in 2-byte elements;
    * int8: two all-to-alls: ``dp`` 4-byte scales (one per shard) and ``p`` 1-byte elements;
    * topk: as on ZeRO 0/1 over the padded bucket; powersgd: as on ZeRO 0/1 (whole matrices).
    """
    out: list[tuple[str, str, int, int]] = []
    for shapes in buckets:
        p = -(-sum(math.prod(s) for s in shapes) // dp) * dp
        if compression.mode in ("bf16", "fp16"):
            out.append(("dp", "reduce_scatter", 1, p * CAST_BYTES))
        elif compression.mode == "int8":
            out.append(("dp", "all_to_all", 2, dp * INT8_SCALE_BYTES + p))
        else:
            out += _sparse_or_low_rank(compression, shapes, p, dp, grad_bytes)
    return [(g, op, calls * micro_batches, nbytes * micro_batches) for g, op, calls, nbytes in out]


def _sparse_or_low_rank(
    compression: api_parallelism.GradientCompression,
    shapes: list[tuple[int, ...]],
    n: int,
    dp: int,
    grad_bytes: int,
) -> list[tuple[str, str, int, int]]:
    """topk's or powersgd's collectives of one bucket whose exchange works on ``n`` elements."""
    if compression.mode == "topk":
        k = max(1, int(compression.topk_ratio * n))
        return [("dp", "all_gather", 2, dp * k * (grad_bytes + INDEX_BYTES))]
    if compression.mode != "powersgd":
        raise ValueError(f"unknown gradient compression mode {compression.mode!r}")
    out = []
    r = compression.rank
    matrices = [(s[0], math.prod(s) // s[0]) for s in shapes if len(s) >= 2]
    matrices = [(rows, cols) for rows, cols in matrices if min(rows, cols) > r]
    rest = sum(math.prod(s) for s in shapes) - sum(rows * cols for rows, cols in matrices)
    if rest:
        out.append(("dp", "all_reduce", 1, rest * grad_bytes))
    if matrices:
        out.append(("dp", "all_reduce", 1, sum(rows * r for rows, _ in matrices) * grad_bytes))
        out.append(("dp", "all_reduce", 1, sum(cols * r for _, cols in matrices) * grad_bytes))
    return out


def in_warmup(compression: api_parallelism.GradientCompression, step: int) -> bool:
    """Whether optimizer step ``step`` (1-based) reduces exactly: the trainer's warm-up rule."""
    return step <= compression.exact_steps


def exact_job(job: api_spec.TrainingJobSpec) -> api_spec.TrainingJobSpec:
    """``job`` as its warm-up steps run it: gradient compression off."""
    par = job.parallelism
    exact = par.model_copy(update={"gradient_compression": api_parallelism.GradientCompression()})
    return job.model_copy(update={"parallelism": exact})


def run_bytes(
    compression: api_parallelism.GradientCompression, exact: float, compressed: float, steps: int
) -> float:
    """Data-parallel payload of a whole run of ``steps``: the warm-up's steps at ``exact`` bytes, the rest at ``compressed``."""
    warm = min(steps, compression.exact_steps) if compression.mode != "none" else 0
    return warm * exact + (steps - warm) * compressed


FP32_BYTES = 4
INT64_BYTES = 8


def memory_bytes(
    compression: api_parallelism.GradientCompression,
    params: int,
    matrices: list[tuple[int, int]],
    bucket: float,
    dp: int,
    grad_bytes: int,
) -> tuple[float, float]:
    """(state kept between steps, peak temporaries of one bucket's exchange) in bytes, for one rank.

    ``params``: this rank's gradient elements; ``matrices``: its 2-D gradients
    as (rows, columns) the way PowerSGD views them; ``bucket``: elements of its
    largest bucket.  Follows :mod:`meshtrain.trainer.parallel.compression`:

    * int8 and topk keep a full-size error buffer (``params`` gradients);
      int8's exchange holds its int8 payload, the ``dp`` gathered payloads and
      up to three fp32 buckets (quantising, dequantising, the fp32 sum);
      topk's the magnitudes (one bucket) and the gathered values and indices;
    * PowerSGD keeps an error buffer and Q (columns x r) per compressed matrix,
      and forms ``P Q^T`` and the new error (two of its largest matrix);
    * bf16 / fp16 keep nothing; their exchange holds the mean and its cast.
    """
    mode = compression.mode
    if mode == "none":
        return 0.0, 0.0
    if mode in ("bf16", "fp16"):
        return 0.0, bucket * (grad_bytes + CAST_BYTES)
    if mode == "int8":
        return params * grad_bytes, bucket * (1 + dp + 3 * FP32_BYTES)
    if mode == "topk":
        k = max(1, int(compression.topk_ratio * bucket))
        gathered = dp * k * (grad_bytes + INDEX_BYTES + INT64_BYTES)
        return params * grad_bytes, bucket * grad_bytes + k * (grad_bytes + INT64_BYTES) + gathered
    if mode == "powersgd":
        r = compression.rank
        kept = [(rows, cols) for rows, cols in matrices if min(rows, cols) > r]
        state = sum(rows * cols + cols * r for rows, cols in kept) * grad_bytes
        largest = max((rows * cols for rows, cols in kept), default=0)
        return state, 2 * min(largest, bucket) * grad_bytes
    raise ValueError(f"unknown gradient compression mode {mode!r}")
