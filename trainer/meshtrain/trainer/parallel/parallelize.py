"""``parallelize``: turn a dense model into this rank's share of a dp x pp x cp x tp job.

The one function that composes the parallelisms, in the order its comments explain: pipeline
split, tensor parallel, context parallel, float8 linears, data parallel (or ZeRO-3), then the
executor.  The model may be on the ``meta`` device, so a rank never holds more than its share plus
one dense matrix.  Precision is not a module transform: weights stay fp32, and bf16 is an autocast
the executor enters (torchao's float8 linears, ``training.float8``, swap modules but keep the weights).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.api import layout as layout_mod
from meshtrain.api.spec import parallelism as api_parallelism
from meshtrain.api.spec import training as api_training
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import (
    clipping,
    compression_sharded,
    context,
    float8,
    hierarchical,
    loss,
    pipeline,
    reducer,
    tensor,
    zero,
    zero3,
)
from meshtrain.trainer.parallel import compression as compression_mod
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import clocks, recording


@dataclasses.dataclass
class ParallelModel:
    """This rank's share of the model and the machinery to train it."""

    chunks: list[gpt.GPT]
    """Model chunks of this pipeline stage (one per virtual stage)."""
    named: list[tuple[str, torch.nn.Parameter]]
    """Every parameter of this rank, by its dense-model name (read through :attr:`named_params`)."""
    tp_plan: tensor.TPPlan | None
    """How parameters are sharded over TP (None without TP)."""
    executor: pipeline.PipelineExecutor
    """Runs the pipeline schedule (or plain gradient accumulation with one stage)."""
    reducer: reducer.GradReducer | None
    """Data-parallel gradient reducer (None without DP)."""
    tp: tensor.TPContext | None
    """Tensor-parallel context (None without TP)."""
    kv_group: dist.ProcessGroup | None = None
    """The ranks holding this rank's key/value heads (None unless they are replicated over TP)."""
    tied_group: dist.ProcessGroup | None = None
    """Tied embeddings over pipeline stages: this rank's first- and last-stage peers (Megatron's
    embedding group), which sum the matrix's gradients; None where this rank holds no copy."""
    tied_copy: bool = False
    """This rank holds the last stage's copy of the tied matrix (its gradient is counted on the first stage)."""
    before_read: Callable[[], None] | None = None
    """Makes the parameters current before they are read outside a forward (ZeRO's prefetched
    all-gathers, written by the layers' pre-hooks otherwise); None: always current."""

    @property
    def named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Every parameter of this rank, by its dense-model name, with its current values."""
        if self.before_read is not None:
            self.before_read()
        return self.named

    def norm_counted(self, tp_rank: int) -> list[clipping.Counted]:
        """Per parameter: what this rank counts of it in the global gradient norm (see ``TPPlan.norm_counted``)."""
        counted: list[clipping.Counted] = [
            self.tp_plan.norm_counted(name, tp_rank) if self.tp_plan is not None else True
            for name, _ in self.named_params
        ]
        return [
            False if self.tied_copy and name == gpt.TIED_NAME else c
            for (name, _), c in zip(self.named_params, counted)
        ]


def tied_embedding_group(layout: layout_mod.ParallelLayout) -> dist.ProcessGroup | None:
    """This rank's pair (first stage, last stage) with its (dp, cp, tp) (collective: every rank creates every pair)."""
    last = layout.pipeline - 1
    pairs = [
        [layout.rank_of(0, dp, tp, cp), layout.rank_of(last, dp, tp, cp)]
        for dp in range(layout.data)
        for cp in range(layout.context)
        for tp in range(layout.tensor)
    ]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group if isinstance(group, dist.ProcessGroup) else None  # a middle stage holds no copy


def kv_replica_group(layout: layout_mod.ParallelLayout, replicas: int) -> dist.ProcessGroup:
    """This rank's group of ``replicas`` consecutive tensor ranks sharing key/value heads (collective: every rank creates every group)."""
    groups = [
        members[start : start + replicas]
        for members in layout.all_groups("tp")
        for start in range(0, len(members), replicas)
    ]
    group, _ = dist.new_subgroups_by_enumeration(groups)
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"rank {dist.get_rank()} is in none of the key/value groups {groups}")
    return group


def parallelize(
    model: gpt.GPT,
    mesh: mesh_mod.Mesh,
    *,
    schedule: str,
    virtual_stages: int,
    micro_batches: int,
    micro_batch: int,
    sequence_parallel: bool,
    bucket_mb: float,
    recorder: recording.StepRecorder,
    clock: clocks.Clock,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    wire_dtype: torch.dtype | None = None,
    zero_stage: int = 0,
    compression: api_parallelism.GradientCompression | None = None,
    all_reduce: str = "flat",
    gpus_per_node: int = 1,
    float8_spec: api_training.Float8 | None = None,
    overlap_tensor: bool = False,
) -> ParallelModel:
    """Apply pipeline, tensor and data parallelism to ``model`` (consumed) for this rank.

    Every part that reports to ``recorder`` times its work with ``clock``;
    ``wire_dtype`` (bf16 under autocast) is what activations and their
    gradients travel in between pipeline stages and inside the
    tensor-parallel group; ``overlap_tensor`` runs its collectives beside the matmuls
    (``parallelism.overlap.tensor``).  ``float8_spec`` (``training.float8``) turns the
    blocks' linears into torchao's float8 linears.
    """
    layout, coords = mesh.layout, mesh.coords
    config = model.config
    float8.check_device(float8_spec, mesh.device)  # before building anything: a clear refusal

    # 1. Pipeline first: this stage's chunks (the rest of the model is dropped), so nothing
    # later spends time or memory on layers another stage owns.
    chunks = pipeline.split_model(
        model, stage=coords.pp, stages=layout.pipeline, virtual_stages=virtual_stages
    )

    # Under ZeRO-3 a model still wholly on meta stays there through tensor parallelism: FSDP2
    # shards the shapes and each rank then builds only its rows (zero3.materialize_shards), never
    # the whole stage nor its whole tensor-parallel pieces.
    sharded_on_meta = zero_stage == 3 and mesh.grad_group[1] > 1 and zero3.shards_on_meta(chunks)

    # 2. Tensor parallel: shard what this stage kept.  It swaps parameters, so it comes before
    # anything that holds on to them; then a model built on meta gets the weights TP did not
    # already build (norms, biases, ...).
    tp_ctx, tp_plan, kv_group = apply_tensor_parallel(
        chunks,
        mesh,
        sequence_parallel=sequence_parallel,
        recorder=recorder,
        clock=clock,
        wire_dtype=wire_dtype,
        overlap=overlap_tensor,
        on_meta=sharded_on_meta,
    )
    for chunk in chunks if not sharded_on_meta else ():
        gpt.materialize(chunk)
        chunk.to(mesh.device)
    # 2b. fp8: the blocks' linears become torchao's float8 linears, on their device (or on meta,
    # shapes only, for ZeRO-3 to materialise after sharding).  After TP
    # (the spec's rules keep fp8 to tensor 1: torchao swaps torch.nn.Linear, which TP's layers are
    # not), before data parallelism, which hooks (or FSDP2 shards) the Parameters the swap keeps.
    if float8_spec is not None:
        float8.apply_float8(chunks, float8.config_for(float8_spec))
    tied_across = config.tie_embeddings and layout.pipeline > 1
    tied_group = tied_embedding_group(layout) if tied_across else None

    # 3. Context parallel: global positions and the ring as every attention's core (no parameters
    # change: the cp ranks hold the same ones, and join the data-parallel gradient reduction).
    if layout.context > 1:
        assert mesh.cp_backward_group is not None  # build_mesh makes it with context parallelism
        context.apply_context_parallel(
            chunks,
            context.CPContext(
                group=mesh.group("cp"),
                grad_group=mesh.cp_backward_group,
                rank=coords.cp,
                size=layout.context,
                peers=tuple(layout.cp_group(mesh.rank)),
                recorder=recorder,
                clock=clock,
            ),
        )

    # 4. Data parallel: hook the final parameters, or (ZeRO-3) shard them with FSDP2, which then
    # owns the gradient reduction.
    grad_reducer = apply_data_parallel(
        chunks,
        mesh,
        zero_stage=zero_stage,
        compression=compression,
        all_reduce=all_reduce,
        gpus_per_node=gpus_per_node,
        bucket_mb=bucket_mb,
        recorder=recorder,
        clock=clock,
        wire_dtype=wire_dtype,
    )
    if sharded_on_meta:
        zero3.materialize_shards(chunks, mesh.device, tp_plan, mesh.coords.tp, mesh.layout.tensor)
    # the parameters every later step holds (ZeRO-3's DTensors): a tied head on the last stage is
    # the embedding matrix, by name too (initial value, checkpoint)
    named = [
        (gpt.logical_name(config, n), p) for chunk in chunks for n, p in chunk.named_parameters()
    ]

    # 5. The schedule executor around it all.
    seq = config.seq_len // layout.context  # this rank's slices of the sequence
    seq = seq // layout.tensor if (tp_ctx and sequence_parallel) else seq
    executor = build_executor(
        chunks,
        mesh,
        schedule=schedule,
        micro_batches=micro_batches,
        activation_shape=(micro_batch, seq, config.hidden),
        activation_dtype=named[0][1].dtype,
        wire_dtype=wire_dtype,
        recorder=recorder,
        clock=clock,
        grad_sync=grad_reducer.set_sync if grad_reducer else None,
        autocast=autocast,
    )
    holds_tied = tied_across and coords.pp in (0, layout.pipeline - 1)
    return ParallelModel(
        chunks=chunks,
        named=named,
        tp_plan=tp_plan,
        executor=executor,
        reducer=grad_reducer,
        tp=tp_ctx,
        kv_group=kv_group,
        tied_group=tied_group if holds_tied else None,
        tied_copy=tied_across and coords.pp == layout.pipeline - 1,
    )


def apply_tensor_parallel(
    chunks: list[gpt.GPT],
    mesh: mesh_mod.Mesh,
    *,
    sequence_parallel: bool,
    recorder: recording.StepRecorder,
    clock: clocks.Clock,
    wire_dtype: torch.dtype | None,
    overlap: bool = False,
    on_meta: bool = False,
) -> tuple[tensor.TPContext | None, tensor.TPPlan | None, dist.ProcessGroup | None]:
    """Swap every chunk's linears and embeddings for tensor-parallel ones (``on_meta``: pieces
    left on ``meta``, see :func:`.tensor.apply_tensor_parallel`).

    Returns the context, the plan and the group of ranks sharing this rank's
    key/value heads (None unless they are replicated); all None without TP.
    """
    if mesh.layout.tensor == 1:
        return None, None, None
    tp_ctx = tensor.TPContext(
        group=mesh.group("tp"),
        rank=mesh.coords.tp,
        size=mesh.layout.tensor,
        sequence_parallel=sequence_parallel,
        recorder=recorder,
        clock=clock,
        wire_dtype=wire_dtype,
        overlap=overlap,
    )
    plans = [tensor.apply_tensor_parallel(chunk, tp_ctx, on_meta=on_meta) for chunk in chunks]
    tp_plan = tensor.TPPlan(
        shards={k: v for p in plans for k, v in p.shards.items()},
        sequence_partial=[n for p in plans for n in p.sequence_partial],
        kv_replicas=plans[0].kv_replicas,
        replica_partial={k: v for p in plans for k, v in p.replica_partial.items()},
    )
    replicas = tp_plan.kv_replicas
    kv_group = kv_replica_group(mesh.layout, replicas) if replicas > 1 else None
    return tp_ctx, tp_plan, kv_group


def apply_data_parallel(
    chunks: list[gpt.GPT],
    mesh: mesh_mod.Mesh,
    *,
    zero_stage: int,
    compression: api_parallelism.GradientCompression | None,
    all_reduce: str,
    gpus_per_node: int,
    bucket_mb: float,
    recorder: recording.StepRecorder,
    clock: clocks.Clock,
    wire_dtype: torch.dtype | None,
) -> reducer.GradReducer | None:
    """Reduce gradients over the data-parallel group (data x context ranks with context
    parallelism): the gradient reducer of ``zero_stage``, or None without data parallelism or
    under ZeRO-3 (FSDP2 shards the chunks over the same ranks and reduces)."""
    layout = mesh.layout
    group, group_size = mesh.grad_group
    if group_size == 1:
        return None
    compressed = compression is not None and compression.mode != "none"
    if zero_stage == 3:  # the spec's rules keep ZeRO-3's compression to the 16-bit casts
        zero3.apply_zero3(
            chunks,
            mesh.grad_mesh(),
            recorder=recorder,
            clock=clock,
            param_dtype=wire_dtype,
            pipelined=layout.pipeline > 1,
            reduce_dtype=compression_mod.CAST.get(compression.mode) if compression else None,
        )
        return None
    # ZeRO-2 keeps only this rank's gradient shard (reduce-scatter); stages 0/1 all-reduce;
    # either compressed when asked.
    reducer_cls: Callable[..., reducer.GradReducer] = (
        zero.ShardedGradReducer if zero_stage == 2 else reducer.GradReducer
    )
    if all_reduce == "hierarchical":  # the spec's rules keep it to ZeRO 0/1 without compression
        intra, inter = mesh.dp_level_groups(gpus_per_node)
        reducer_cls = functools.partial(
            hierarchical.HierarchicalGradReducer, intra=intra, inter=inter
        )
    if compressed:
        assert compression is not None
        settings = compression_mod.Settings(
            mode=compression.mode,
            rank=compression.rank,
            topk_ratio=compression.topk_ratio,
            warm_start=compression.warm_start,
            warmup_steps=compression.exact_steps,
        )
        reducer_cls = (
            functools.partial(compression_sharded.CompressedShardedGradReducer, settings=settings)
            if zero_stage == 2
            else functools.partial(
                compression_mod.CompressedGradReducer, **dataclasses.asdict(settings)
            )
        )
    return reducer_cls(
        [list(chunk.parameters()) for chunk in chunks],
        group=group,
        group_size=group_size,
        bucket_mb=bucket_mb,
        recorder=recorder,
        clock=clock,
    )


def build_executor(
    chunks: list[gpt.GPT],
    mesh: mesh_mod.Mesh,
    *,
    schedule: str,
    **executor_args: Any,
) -> pipeline.PipelineExecutor:
    """The executor of this stage's ``schedule`` (plain gradient accumulation with one stage).

    ``executor_args`` are :class:`~.pipeline.PipelineExecutor`'s (micro-batches,
    activation shape and dtypes, recorder, clock, gradient sync, autocast).
    """
    layout, coords = mesh.layout, mesh.coords
    many = layout.pipeline > 1
    ctx = pipeline.PipelineContext(
        stage=coords.pp,
        stages=layout.pipeline,
        ranks=layout.pp_group(mesh.rank),
        forward_group=mesh.group("pp") if many else None,
        backward_group=mesh.pp_backward_group if many else None,
    )
    return pipeline.PipelineExecutor(
        chunks,
        ctx,
        schedule=schedule if many else "1f1b",
        device=mesh.device,
        loss_fn=loss.lm_loss,
        **executor_args,
    )
