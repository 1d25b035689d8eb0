"""Layout-independent tensors for DCP: each rank's pieces of a logical (dense) tensor.

What a rank holds (a tensor-parallel shard, or a ZeRO flat range of one) is described as
:class:`Piece` s: dense offsets and a view of the rank's memory.  :class:`ChunkedTensor` carries
them into DCP as DTensor does, but with any number of rectangles per rank, which a flat range of a
2-D shard needs; on load DCP reads each requested piece from whatever pieces were stored, so a
checkpoint written at one (dp, pp, tp, zero) layout loads at any other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


@dataclasses.dataclass(frozen=True)
class Box:
    """A rectangle of a rank's local tensor and where it sits in the dense tensor."""

    local: tuple[int, ...]
    """Offsets in the local tensor."""
    offsets: tuple[int, ...]
    """Offsets in the dense tensor."""
    sizes: tuple[int, ...]
    """Extent along every dimension."""


@dataclasses.dataclass
class Piece:
    """A rank's data for one rectangle of a dense tensor."""

    offsets: tuple[int, ...]
    """Offsets in the dense tensor."""
    data: torch.Tensor
    """A view of the rank's memory whose shape is the rectangle's size."""


def whole(shape: Sequence[int]) -> list[Box]:
    """The boxes of a tensor that is not sharded: itself, at the origin."""
    zeros = (0,) * len(shape)
    return [Box(local=zeros, offsets=zeros, sizes=tuple(shape))]


def split_boxes(
    local_shape: Sequence[int],
    *,
    dim: int,
    groups: int,
    rank: int,
    size: int,
    blocks: Sequence[int] = (),
    replicas: Sequence[int] = (),
) -> tuple[tuple[int, ...], list[Box]]:
    """Dense shape and boxes of a tensor-parallel shard.

    The dense ``dim`` is ``groups`` equal blocks (or blocks of the local
    sizes ``blocks``: grouped-query QKV); each block is split into ``size``
    equal parts and the rank holds part ``rank`` of every block,
    concatenated (meshtrain.trainer.parallel.tensor.shard).  A block with
    ``replicas`` r > 1 is split into ``size / r`` parts, part ``rank // r``
    held by r consecutive ranks (replicated key/value heads): they write the
    same box, which DCP stores once, as it does for data-parallel replicas.
    """
    parts = list(blocks) or [local_shape[dim] // groups] * groups
    reps = list(replicas) or [1] * len(parts)
    if sum(parts) != local_shape[dim] or len(reps) != len(parts):
        raise ValueError(f"local dim {dim} of {tuple(local_shape)} is not the blocks {parts}")
    dense = list(local_shape)
    dense[dim] = sum(part * (size // rep) for part, rep in zip(parts, reps))
    boxes = []
    start = dense_start = 0
    for part, rep in zip(parts, reps):
        local = [0] * len(local_shape)
        offsets = [0] * len(local_shape)
        sizes = list(local_shape)
        local[dim] = start
        offsets[dim] = dense_start + (rank // rep) * part
        sizes[dim] = part
        boxes.append(Box(local=tuple(local), offsets=tuple(offsets), sizes=tuple(sizes)))
        start += part
        dense_start += part * (size // rep)
    return tuple(dense), boxes


def clip_boxes(
    shape: Sequence[int], boxes: list[Box], *, dim: int, extent: int
) -> tuple[tuple[int, ...], list[Box]]:
    """Dense shape and boxes cut at ``extent`` along ``dim``: a padded vocabulary's zero rows are not stored."""
    clipped = []
    for box in boxes:
        rows = min(box.sizes[dim], extent - box.offsets[dim])
        if rows > 0:
            sizes = list(box.sizes)
            sizes[dim] = rows
            clipped.append(dataclasses.replace(box, sizes=tuple(sizes)))
    dense = list(shape)
    dense[dim] = extent
    return tuple(dense), clipped


def flat_range_boxes(
    shape: Sequence[int], start: int, stop: int
) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Cut the row-major flat range [start, stop) of ``shape`` into rectangles contiguous in that order.

    Returns (flat start, offsets, sizes) per rectangle: at most 2*ndim - 1 of
    them (a partial innermost row, partial planes, whole outer slabs, then the
    same on the way down).
    """
    if start >= stop:
        return []
    if not shape:
        return [(0, (), ())]
    if len(shape) == 1:
        return [(start, (start,), (stop - start,))]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner

    def within(row: int, lo: int, hi: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        # the flat range [lo, hi) of the outer slice ``row``
        return [
            (f + row * inner, (row, *o), (1, *s)) for f, o, s in flat_range_boxes(shape[1:], lo, hi)
        ]

    if first == last:
        return within(first, start - first * inner, stop - first * inner)
    out = []
    if start % inner:
        out += within(first, start % inner, inner)
        first += 1
    end = last if stop % inner else last + 1  # outer slices [first, end) are whole
    if end > first:
        out.append((first * inner, (first, *([0] * (len(shape) - 1))), (end - first, *shape[1:])))
    if stop % inner:
        out += within(last, 0, stop % inner)
    return out


def _intersect(
    a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int], b_size: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + s, y + t) for x, s, y, t in zip(a_off, a_size, b_off, b_size)]
    if any(high <= low for low, high in zip(lo, hi)):
        return None
    return tuple(lo), tuple(high - low for low, high in zip(lo, hi))


def _view(
    data: torch.Tensor, origin: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]
) -> torch.Tensor:
    """The sub-rectangle (offsets, sizes) of ``data``, which itself starts at ``origin``."""
    for dim, (o, start, size) in enumerate(zip(origin, offsets, sizes)):
        data = data.narrow(dim, start - o, size)
    return data


def pieces_of(local: torch.Tensor, boxes: list[Box]) -> list[Piece]:
    """The pieces of a whole local tensor."""
    return [
        Piece(offsets=b.offsets, data=_view(local, (0,) * local.dim(), b.local, b.sizes))
        for b in boxes
        if math.prod(b.sizes)
    ]


def pieces_of_flat(
    flat: torch.Tensor, start: int, local_shape: Sequence[int], boxes: list[Box]
) -> list[Piece]:
    """The pieces of a flat range: ``flat`` holds elements [start, start + len) of a local tensor of ``local_shape``."""
    out = []
    for flat_start, off, sizes in flat_range_boxes(local_shape, start, start + flat.numel()):
        data = flat.narrow(0, flat_start - start, math.prod(sizes)).view(sizes)
        for box in boxes:
            hit = _intersect(off, sizes, box.local, box.sizes)
            if hit is None:
                continue
            lo, extent = hit
            dense = tuple(g + low - b for g, low, b in zip(box.offsets, lo, box.local))
            out.append(Piece(offsets=dense, data=_view(data, off, lo, extent)))
    return out


class ChunkedTensor(torch.Tensor):
    """One logical tensor as DCP sees it: its dense shape and this rank's pieces of it.

    It implements DCP's checkpointable protocol (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``); it is not a tensor to compute with:
    every op on it raises.
    """

    _pieces: list[Piece]

    @staticmethod
    def __new__(
        cls: type[ChunkedTensor], shape: Sequence[int], pieces: list[Piece], dtype: torch.dtype
    ) -> ChunkedTensor:
        device = pieces[0].data.device if pieces else torch.device("cpu")
        made = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        made._pieces = pieces
        return made

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        raise RuntimeError(
            f"ChunkedTensor is a checkpoint descriptor; {func} is not supported on it"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ChunkedTensor(shape={tuple(self.shape)}, pieces={len(self._pieces)})"

    def _chunk(self, piece: Piece) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.data.shape)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(p.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._chunk(p),
                    properties=TensorProperties.create_from_tensor(p.data),
                    size=self.shape,
                ),
            )
            for p in self._pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk(p) for p in self._pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if (
            index.index is not None
            and index.index < len(self._pieces)
            and torch.Size(self._pieces[index.index].offsets) == index.offset
        ):
            return self._pieces[index.index].data
        for piece in self._pieces:
            if torch.Size(piece.offsets) == index.offset:
                return piece.data
        raise ValueError(
            f"{index.fqn}: no piece at offsets {tuple(index.offset or ())} on this rank"
        )


def chunked(shape: Sequence[int], pieces: list[Piece], dtype: torch.dtype) -> ChunkedTensor:
    """A :class:`ChunkedTensor` of ``pieces`` (empty pieces dropped)."""
    return ChunkedTensor(shape, [p for p in pieces if p.data.numel()], dtype)


def pieces_in(tensor: ChunkedTensor) -> list[Piece]:
    """The pieces a :class:`ChunkedTensor` carries (views of the rank's memory)."""
    return tensor._pieces


def host_copy(entries: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of a DCP state dict in host memory: every piece and tensor copied, the rest as is.

    What a background save writes, so training may change the live tensors meanwhile.
    """
    copied: dict[str, Any] = {}
    for key, value in entries.items():
        if isinstance(value, ChunkedTensor):
            pieces = [Piece(p.offsets, p.data.to("cpu", copy=True)) for p in value._pieces]
            copied[key] = ChunkedTensor(value.shape, pieces, value.dtype)
        elif isinstance(value, torch.Tensor):
            copied[key] = value.to("cpu", copy=True)
        else:
            copied[key] = value
    return copied
