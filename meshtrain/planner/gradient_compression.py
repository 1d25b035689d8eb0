"""Data-parallel collectives and memory under gradient compression (``parallelism.gradientCompression``).

Mirrors :mod:`meshtrain.trainer.parallel.compression` bucket by bucket, call for call, in the
recorder's payload convention (the buffer a collective works on; an all-gather counts its
gathered output).
"""

from __future__ import annotations

import math

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
    """(group, op, calls, payload bytes) of one step for buckets given as their members' shapes.

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
        mode = compression.mode
        if mode in ("bf16", "fp16"):
            out.append(("dp", "all_reduce", 1, n * CAST_BYTES))
        elif mode == "int8":
            out.append(("dp", "all_gather", 2, dp * (INT8_SCALE_BYTES + n)))
        elif mode == "topk":
            k = max(1, int(compression.topk_ratio * n))
            out.append(("dp", "all_gather", 2, dp * k * (grad_bytes + INDEX_BYTES)))
        elif mode == "powersgd":
            r = compression.rank
            matrices = [(s[0], math.prod(s) // s[0]) for s in shapes if len(s) >= 2]
            matrices = [(rows, cols) for rows, cols in matrices if min(rows, cols) > r]
            rest = n - sum(rows * cols for rows, cols in matrices)
            if rest:
                out.append(("dp", "all_reduce", 1, rest * grad_bytes))
            if matrices:
                out.append(
                    ("dp", "all_reduce", 1, sum(rows * r for rows, _ in matrices) * grad_bytes)
                )
                out.append(
                    ("dp", "all_reduce", 1, sum(cols * r for _, cols in matrices) * grad_bytes)
                )
        else:
            raise ValueError(f"unknown gradient compression mode {mode!r}")
    return out


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
