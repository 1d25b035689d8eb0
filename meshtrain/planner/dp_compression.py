"""Data-parallel collectives per step under gradient compression (``parallelism.gradientCompression``).

Mirrors :mod:`meshtrain.trainer.parallel.compression`, bucket by bucket,
call for call, in the recorder's payload convention (the buffer a
collective works on; an all-gather counts its gathered output):

* bf16 / fp16: one all-reduce of the bucket in 2-byte elements;
* int8: two all-gathers: each rank's 4-byte scale and its bucket in 1-byte
  elements (``dp x (4 + n)`` bytes gathered: summed in fp32 by the receivers);
* topk: two all-gathers of ``k = max(1, int(ratio x n))`` elements per rank
  (4-byte values, 4-byte indices);
* powersgd: matrices with ``min(rows, cols) > r`` send ``P`` (rows x r) and
  ``Q`` (cols x r) in one all-reduce each; everything else of the bucket one
  uncompressed all-reduce.

Pure: no torch, no I/O.
"""

from __future__ import annotations

import math

from meshtrain.api import spec as api_spec

CAST_BYTES = 2
INT8_SCALE_BYTES = 4
INDEX_BYTES = 4


def dp_collectives(
    compression: api_spec.GradientCompression,
    buckets: list[list[tuple[int, ...]]],
    dp: int,
    grad_bytes: int,
) -> list[tuple[str, str, int, int]]:
    """(group, op, calls, payload bytes) of one step for buckets given as their members' shapes."""
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
