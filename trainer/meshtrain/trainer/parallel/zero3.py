"""ZeRO stage 3: parameters, gradients and optimizer state sharded over data parallelism, by FSDP2.

:func:`apply_zero3` calls ``fully_shard`` on the embeddings and on every block (:func:`units`)
after tensor parallelism swapped the layers, so FSDP2 shards the tensor-parallel pieces along
dim 0 and meshtrain's own layers see whole pieces inside a unit.  The ordinary ``torch.optim.AdamW``
updates the ``DTensor`` shards, and every gather and reduce-scatter is recorded as a ``dp``
collective.  Why FSDP2: docs/architecture.md (ZeRO-3).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor

from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import tensor
from meshtrain.trainer.telemetry import clocks, recording


class _Recorded:
    """Allocates like FSDP2's default and reports each call to the recorder (synchronously)."""

    def __init__(self, recorder: recording.StepRecorder, clock: clocks.Clock) -> None:
        self.recorder = recorder
        self.clock = clock

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _RecordedAllGather(_Recorded, AllGather):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        start = self.clock.now()
        dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)
        nbytes = output_tensor.numel() * output_tensor.element_size()
        self.recorder.collective("dp", "all_gather", nbytes, start, self.clock.now())  # type: ignore[arg-type]
        return None  # done: FSDP2 waits only on a returned Work


class _RecordedReduceScatter(_Recorded, ReduceScatter):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        start = self.clock.now()
        dist.reduce_scatter_tensor(output_tensor, input_tensor, group=group, op=op)
        nbytes = input_tensor.numel() * input_tensor.element_size()
        self.recorder.collective("dp", "reduce_scatter", nbytes, start, self.clock.now())  # type: ignore[arg-type]
        return None


def apply_zero3(
    chunks: list[torch.nn.Module],
    dp_mesh: DeviceMesh,
    *,
    recorder: recording.StepRecorder,
    clock: clocks.Clock,
    param_dtype: torch.dtype | None = None,
    pipelined: bool = False,
    reduce_dtype: torch.dtype | None = None,
) -> None:
    """Shard every chunk's parameters over ``dp_mesh`` in the FSDP2 units of :func:`units`.

    Gradients are reduce-scattered after every micro-batch's backward (FSDP2's default), so
    only the gradient shard accumulates.  ``param_dtype`` (bf16 under bf16 training) is what
    the units gather and compute with; the shards, the optimizer and the reduce-scatter stay fp32
    (Megatron's and DeepSpeed's recipe: half the all-gather bytes).  ``reduce_dtype`` (bf16 or
    fp16 under ``gradientCompression``) makes the reduce-scatter 16-bit: FSDP2's own
    ``reduce_dtype``: the collective runs in 16 bits, the gradient shard stays fp32.
    """
    all_gather = _RecordedAllGather(recorder, clock)
    reduce_scatter = _RecordedReduceScatter(recorder, clock)
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype or torch.float32
    )
    for chunk in chunks:
        for modules, reshard in units(chunk, pipelined=pipelined):
            fully_shard(modules, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
            unit: Any = modules[0]  # the units' modules share one FSDP2 state
            unit.set_custom_all_gather(all_gather)
            unit.set_custom_reduce_scatter(reduce_scatter)


def units(
    chunk: torch.nn.Module, *, pipelined: bool = False
) -> list[tuple[list[torch.nn.Module], bool]]:
    """The FSDP2 units of one chunk, in wrapping order (the chunk itself last), each with its ``reshard_after_forward``.

    TorchTitan's layout: the embeddings are a unit of their own, resharded
    after forward (backward needs them last); every block is one, resharded
    after forward except the last block, whose backward comes first (FSDP2
    would gather it again at once); the chunk's own unit (the root: final
    norm and head) stays gathered from its forward through its backward, as
    FSDP2 keeps every root.  A tied head is the embedding matrix, which one
    unit must own: then the embeddings stay in the chunk's unit.

    Under pipelining (``pipelined``) the last block reshards too: TorchTitan
    then keeps every unit gathered between micro-batches, which would hold a
    whole stage's weights; meshtrain keeps the one-block working set the
    planner admits jobs by (a 1F1B schedule's interleaved forwards would make
    the last block's gathers depend on the schedule).  The tables then stay
    in the root: FSDP2 prefetches in backward along the order of the
    forwards, which 1F1B interleaves across micro-batches, and a separate
    tables unit made it gather a block once more per step (measured on
    dp2-pp2 interleaved).
    """
    blocks = list(chunk.blocks.values())  # type: ignore[operator]
    out: list[tuple[list[torch.nn.Module], bool]] = []
    tables = [m for m in (chunk.tok_emb, chunk.pos_emb) if isinstance(m, torch.nn.Module)]
    tied = bool(chunk.config.tie_embeddings)  # type: ignore[union-attr]
    if tables and not tied and not pipelined:
        out.append((tables, True))
    out += [([block], pipelined or i < len(blocks) - 1) for i, block in enumerate(blocks)]
    out.append(([chunk], True))  # FSDP2 never reshards a root after forward
    return out


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor this rank holds of a (possibly DTensor) parameter, gradient or moment."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_rows(param: torch.Tensor) -> tuple[int, int]:
    """The rows ``[start, stop)`` of the whole (TP-local) tensor that this rank's dim-0 shard of ``param`` holds."""
    rows = param.shape[0]
    if not isinstance(param, DTensor):
        return 0, rows
    size, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
    per_rank = -(-rows // size)  # torch.chunk's split: the last ranks may hold fewer rows (or none)
    return min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)


def flat_offset(param: torch.Tensor) -> int:
    """Where this rank's dim-0 shard of ``param`` starts in the flat order of the whole (TP-local) tensor."""
    return shard_rows(param)[0] * math.prod(param.shape[1:])


def shards_on_meta(chunks: list[torch.nn.Module]) -> bool:
    """Whether every parameter of ``chunks`` is still on ``meta``, so that tensor parallelism and
    FSDP2 can split the shapes and each rank then builds only its own rows
    (:func:`materialize_shards`)."""
    return all(p.is_meta for chunk in chunks for p in chunk.parameters())


def materialize_shards(
    chunks: list[gpt.GPT],
    device: torch.device,
    tp_plan: tensor.TPPlan | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> None:
    """Give each rank's dim-0 shard of every parameter sharded on ``meta`` its initial value, alone.

    After :func:`apply_zero3` on a model still on ``meta`` (and, with ``tp_plan``, tensor
    parallelism's pieces left there): FSDP2 allocates the shards on ``device`` (``to_empty``)
    and each is filled with its rows of the dense tensor, or of this tensor-parallel rank's piece
    of it (:func:`.tensor.shard_param`), so a start from a Hugging Face directory reads each
    tensor's elements once over the data-parallel (data x context) ranks of each tensor-parallel
    rank, and no rank builds an unsharded parameter; from the seed each tensor is made whole on
    the CPU, one at a time, and cut.  Equal, element for element, to sharding the materialised
    model.
    """
    split = tp_plan.shards if tp_plan is not None else {}
    for chunk in chunks:
        shapes = {name: param.shape for name, param in chunk.named_parameters()}
        chunk.to_empty(device=device)
        with torch.no_grad():
            for name, param in chunk.named_parameters():
                rows = shard_rows(param)
                spec = split.get(gpt.logical_name(chunk.config, name))
                if spec is None:
                    dense = torch.empty(shapes[name], device="meta")
                    value = gpt.dense_piece(chunk, name, dense, 0, [rows])
                else:
                    piece = torch.empty(shapes[name], device="meta")
                    dense = torch.empty(tensor.dense_shape(piece, spec, tp_size), device="meta")
                    value = tensor.shard_param(chunk, name, dense, spec, tp_rank, tp_size, rows)
                local(param).copy_(value)
