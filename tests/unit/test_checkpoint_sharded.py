"""Pieces of dense tensors: TP boxes, flat ZeRO ranges as rectangles, and a DCP round trip across layouts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from meshtrain.trainer.checkpointing import sharded
from meshtrain.trainer.parallel import tensor as tp


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (5, 1, 3)])
def test_flat_range_boxes_tile_the_range_in_order(shape: tuple[int, ...]) -> None:
    numel = math.prod(shape)
    index = torch.arange(numel).view(shape)
    for start in range(numel):
        for stop in range(start + 1, numel + 1):
            boxes = sharded.flat_range_boxes(shape, start, stop)
            assert len(boxes) <= 2 * len(shape) - 1
            covered = []
            for flat, offsets, sizes in boxes:
                region = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
                assert region.tolist() == list(
                    range(flat, flat + region.numel())
                )  # contiguous, as claimed
                covered += region.tolist()
            assert covered == list(range(start, stop))


@pytest.mark.parametrize(
    ("spec", "shape", "size"),
    [
        (tp.ShardSpec(0), (8, 6), 2),
        (tp.ShardSpec(1), (6, 8), 2),
        (tp.ShardSpec(0, groups=3), (12, 4), 2),
        (tp.ShardSpec(0, sizes=(8, 4, 4)), (16, 4), 2),  # grouped-query QKV: q, k, v rows
        # 2 key/value heads of 2 rows over 4 ranks: each head held by 2 ranks
        (tp.ShardSpec(0, sizes=(8, 4, 4), replicas=(1, 2, 2)), (16, 4), 4),
    ],
)
def test_split_boxes_place_tp_shards_where_unshard_puts_them(
    spec: tp.ShardSpec, shape: tuple[int, int], size: int
) -> None:
    dense = torch.randn(shape)
    rebuilt = torch.full(shape, float("nan"))
    locals_ = []
    for rank in range(size):
        local = tp.shard(dense, spec, rank, size)
        locals_.append(local)
        full_shape, boxes = sharded.split_boxes(
            tuple(local.shape),
            dim=spec.dim,
            groups=spec.groups,
            rank=rank,
            size=size,
            blocks=spec.local_blocks(shape[spec.dim], size),
            replicas=spec.block_replicas(),
        )
        assert full_shape == shape
        for piece in sharded.pieces_of(local, boxes):
            region = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.data.shape))
            if not rebuilt[region].isnan().all():  # a replica writes exactly what its peer wrote
                assert torch.equal(rebuilt[region], piece.data)
            rebuilt[region] = piece.data
    assert torch.equal(rebuilt, dense)
    assert torch.equal(tp.unshard(locals_, spec), dense)


def _pieces_from_flat_shards(
    dense: torch.Tensor, spec: tp.ShardSpec, dp: int
) -> list[list[sharded.Piece]]:
    """Every (tp rank, dp rank) owner's pieces when the TP shard's flat order is split over dp ranks."""
    owners = []
    for tp_rank in range(2):
        local = tp.shard(dense, spec, tp_rank, 2)
        _, boxes = sharded.split_boxes(
            tuple(local.shape), dim=spec.dim, groups=spec.groups, rank=tp_rank, size=2
        )
        chunk = -(-local.numel() // dp)
        for d in range(dp):
            start, stop = min(d * chunk, local.numel()), min((d + 1) * chunk, local.numel())
            owners.append(
                sharded.pieces_of_flat(
                    local.reshape(-1)[start:stop], start, tuple(local.shape), boxes
                )
            )
    return owners


@pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled"
)  # one process, no group: intended
def test_dcp_round_trip_from_zero_flat_ranges_to_whole_tensor(tmp_path: Path) -> None:
    dense = torch.randn(12, 5)
    spec = tp.ShardSpec(0, groups=3)
    pieces = [p for owner in _pieces_from_flat_shards(dense, spec, dp=3) for p in owner]
    dcp.save(
        {"w": sharded.chunked(dense.shape, pieces, dense.dtype)},
        storage_writer=dcp.FileSystemWriter(str(tmp_path)),
    )
    # load at dp1·tp1 (one whole tensor), then as one rank's flat ZeRO range of it
    out = torch.zeros(12, 5)
    target = sharded.chunked(out.shape, sharded.pieces_of(out, sharded.whole(out.shape)), out.dtype)
    dcp.load({"w": target}, storage_reader=dcp.FileSystemReader(str(tmp_path)))
    assert torch.equal(out, dense)
    flat = torch.zeros(17)
    target = sharded.chunked(
        out.shape, sharded.pieces_of_flat(flat, 23, (12, 5), sharded.whole((12, 5))), out.dtype
    )
    dcp.load({"w": target}, storage_reader=dcp.FileSystemReader(str(tmp_path)))
    assert torch.equal(flat, dense.reshape(-1)[23:40])


def test_chunked_tensor_refuses_arithmetic() -> None:
    wrapped = sharded.chunked(
        (2, 2), sharded.pieces_of(torch.ones(2, 2), sharded.whole((2, 2))), torch.float32
    )
    with pytest.raises(RuntimeError, match="checkpoint descriptor"):
        wrapped + 1
