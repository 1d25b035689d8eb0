"""``spec.parallelism``: how a job is split (data x pipeline x context x tensor), how each axis runs, and the
rules on the section alone.  The rank arithmetic is :class:`~meshtrain.api.layout.ParallelLayout`,
which :attr:`Parallelism.layout` hands to placement, the planner and the trainer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshtrain.api import layout as layout_mod
from meshtrain.api import limits
from meshtrain.api.spec import base

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]


POWERSGD_RANK = 8
"""PowerSGD's default rank: the smallest whose final loss stayed within 0.25% of uncompressed on both
model sizes and all three seeds of the committed sweep (with the default warm-up); rank 4 ended
0.22-1.25% above it on the larger model (1.81-2.37% without the warm-up)."""
POWERSGD_WARMUP_STEPS = 10
"""PowerSGD's default exact warm-up (same sweep): it took rank 8 from +0.83-2.63% to +0.11-0.14% of
uncompressed on the larger model.  A small-run value (a quarter of the sweep's 40 steps): on a
real run set ``warmupSteps`` to about 10% of the steps and no fewer than the learning-rate
warm-up's (torch's PowerSGD hook: ``start_powerSGD_iter=1000``), docs/trainer.md."""


class GradientCompression(base.SpecModel):
    """How data-parallel gradients are compressed on the wire (error feedback for int8, topk, powersgd)."""

    mode: Literal["none", "bf16", "fp16", "int8", "topk", "powersgd"] = Field(
        "none",
        description="none (fp32 all-reduce), bf16/fp16 (16-bit all-reduce), int8 (per-rank scale, all-gathered, "
        "summed in fp32), topk (largest elements with error feedback), powersgd (rank-r approximation of each gradient matrix with error feedback).",
    )
    rank: int = Field(
        POWERSGD_RANK,
        ge=1,
        le=limits.MAX_HIDDEN,
        description="powersgd: rank of each matrix's approximation (default from the measured sweep in docs/trainer.md).",
    )
    topk_ratio: float = Field(
        0.01, gt=0, le=1, description="topk: share of each bucket's elements a rank sends per step."
    )
    warm_start: bool = Field(
        True, description="powersgd: start each step's power iteration from the previous step's Q."
    )
    warmup_steps: int | None = Field(
        None,
        ge=0,
        le=limits.MAX_STEPS,
        description="Optimizer steps reduced exactly (the plain fp32 exchange) before compression starts; "
        "counted from the restored step on resume, so a job resumed past it compresses at once. "
        f"Empty: {POWERSGD_WARMUP_STEPS} for powersgd (a small-run value from the measured sweep in docs/trainer.md; "
        "on a real run about 10% of the steps, no fewer than training.warmupSteps), 0 for the other modes.",
    )

    @property
    def exact_steps(self) -> int:
        """The warm-up's length: ``warmupSteps``, or when empty its mode's default."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return POWERSGD_WARMUP_STEPS if self.mode == "powersgd" else 0


class Overlap(base.SpecModel):
    """Which communication runs beside compute instead of before or after it (each switch off gives the serial path)."""

    tensor: bool = Field(
        True,
        description="Tensor-parallel collectives split into chunks along the sequence, each chunk's all-gather, "
        "reduce-scatter or all-reduce in flight while the next chunk's matmul runs (and a column-parallel "
        "input gradient's all-reduce beside the weight-gradient matmul); false: each collective blocks.",
    )

    param_gather: bool = Field(
        True,
        description="ZeRO-1/2: all-gather the updated weights asynchronously after the optimizer step and "
        "wait for each layer's bucket just before that layer's next forward (false: every bucket is "
        "gathered, blocking, inside the step).",
    )


class Parallelism(base.SpecModel):
    """How the job is split: data x pipeline x context x tensor, and how each axis runs.

    A spec read through :mod:`meshtrain.api.loading` keeps every rule, so its consumers
    do not check them again: ``virtual_stages`` is the model chunks per pipeline rank
    under any schedule (1 unless interleaved-1f1b), and ``micro_batches`` a multiple of
    :attr:`micro_batch_round`.
    """

    data: int = Field(
        1,
        ge=1,
        le=limits.MAX_DATA,
        description="Data-parallel degree: model replicas that split the global batch.",
    )
    pipeline: int = Field(
        1,
        ge=1,
        le=limits.MAX_PIPELINE,
        description="Pipeline-parallel degree: number of pipeline stages (layers split across them).",
    )
    tensor: int = Field(
        1,
        ge=1,
        le=limits.MAX_TENSOR,
        description="Tensor-parallel degree: GPUs that split every layer.",
    )
    context: int = Field(
        1,
        ge=1,
        le=limits.MAX_CONTEXT,
        description="Context-parallel degree: GPUs that split every sequence (ring attention, load-balanced "
        "for the causal mask); seqLen must be divisible by 2 x context.",
    )
    schedule: Schedule = Field(
        "1f1b",
        description="Pipeline schedule: gpipe (all forwards, then all backwards), 1f1b (one forward one backward, bounded activation memory), interleaved-1f1b (virtual stages, smaller bubble).",
    )
    virtual_stages: int = Field(
        1,
        ge=1,
        le=limits.MAX_VIRTUAL_STAGES,
        description="Model chunks per pipeline rank for interleaved-1f1b.",
    )
    micro_batches: int = Field(
        1,
        ge=1,
        le=limits.MAX_MICRO_BATCHES,
        description="Micro-batches per optimizer step per data-parallel replica (gradient accumulation and pipeline depth).",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        0,
        description="ZeRO sharding across the data-parallel group: 0 none, 1 optimizer state and master weights, "
        "2 also gradients, 3 also parameters (FSDP2, gathered one block at a time).",
    )
    sequence_parallel: bool = Field(
        False,
        description="Shard layer-norm and dropout activations along the sequence inside the tensor-parallel group.",
    )
    bucket_mb: float = Field(
        25.0,
        gt=0,
        le=limits.MAX_BUCKET_MB,
        description="Gradient all-reduce bucket size in MiB; a bucket is reduced as soon as all its gradients are ready.",
    )
    all_reduce: Literal["flat", "hierarchical"] = Field(
        "flat",
        description="Data-parallel gradient all-reduce: flat (one all-reduce over the group) or hierarchical "
        "(reduce-scatter inside each node, all-reduce of the shard across nodes, all-gather inside the node).",
    )
    gradient_compression: GradientCompression = Field(
        default_factory=GradientCompression,
        description="Compression of the data-parallel gradient reduction.",
    )
    overlap: Overlap = Field(
        default_factory=Overlap,
        description="Communication overlapped with compute (each switch off gives the serial path).",
    )

    @property
    def layout(self) -> layout_mod.ParallelLayout:
        """The rank arithmetic of these degrees, the one layout placement, planner and trainer use.

        Built on each read (three integers): a cached value would survive
        ``model_copy(update=...)``, which copies the instance dict, and go stale.
        """
        return layout_mod.ParallelLayout(
            data=self.data, pipeline=self.pipeline, tensor=self.tensor, context=self.context
        )

    @property
    def world_size(self) -> int:
        """Processes in the job: data x pipeline x context x tensor."""
        return self.layout.world_size

    @property
    def layout_string(self) -> str:
        """Human layout such as ``dp2·pp4·tp8`` (printer column, logs)."""
        return str(self.layout)

    @property
    def compression_has_peers(self) -> bool:
        """Whether gradient compression has a data-parallel reduction to compress: mode none, or data >= 2."""
        return self.gradient_compression.mode == "none" or self.data >= 2

    @property
    def micro_batch_round(self) -> int:
        """``microBatches`` is a multiple of this: interleaved-1f1b runs micro-batches in rounds of
        ``pipeline``; the other schedules take any number."""
        return self.pipeline if self.schedule == "interleaved-1f1b" else 1


def _virtual_stages_need_interleaving(p: Parallelism) -> str | None:
    if p.schedule == "interleaved-1f1b" and (p.virtual_stages < 2 or p.pipeline < 2):
        return (
            f"interleaved-1f1b needs pipeline >= 2 and virtualStages >= 2 (got pipeline={p.pipeline}, "
            f"virtualStages={p.virtual_stages}); use 1f1b otherwise"
        )
    if p.schedule != "interleaved-1f1b" and p.virtual_stages != 1:
        return f"virtualStages={p.virtual_stages} only applies to schedule interleaved-1f1b (schedule is {p.schedule})"
    return None


def _interleaved_micro_batches(p: Parallelism) -> str | None:
    if p.micro_batches % p.micro_batch_round:
        return (
            f"interleaved-1f1b runs micro-batches in rounds of pipeline={p.pipeline}: microBatches={p.micro_batches} "
            f"must be a multiple of it"
        )
    return None


ZERO3_MODES = ("none", "bf16", "fp16")
"""Compression modes ZeRO-3's reduce-scatter (FSDP2's) takes: the casts, which keep no state."""


def _compression_needs_data_parallel(p: Parallelism) -> str | None:
    mode = p.gradient_compression.mode
    if not p.compression_has_peers:
        return (
            f"gradientCompression.mode={mode} with data={p.data}: there is no data-parallel reduction "
            "to compress: set data >= 2 or mode none"
        )
    if mode not in ZERO3_MODES and p.zero_stage == 3:
        return (
            f"gradientCompression.mode={mode} with zeroStage=3: ZeRO-3's reduce-scatter is FSDP2's, "
            f"which compresses only by casting; {mode}'s error feedback would keep a full-size "
            "gradient on every rank, the memory ZeRO-3 exists to shard: use mode bf16 or fp16 "
            "with ZeRO-3, or zeroStage 2 (or zeroStage 0 or 1) for this mode"
        )
    return None


def _zero3_casts_have_no_warmup(p: Parallelism) -> str | None:
    compression = p.gradient_compression
    if p.zero_stage == 3 and compression.mode in ZERO3_MODES[1:] and compression.exact_steps > 0:
        return (
            f"gradientCompression.warmupSteps={compression.exact_steps} with mode={compression.mode} and "
            "zeroStage=3: ZeRO-3's reduce-scatter is FSDP2's, whose reduce dtype is fixed when the "
            f"model is sharded (torch offers no way to change it later), so it would reduce in "
            f"{compression.mode} from step 1: set warmupSteps 0 (or leave it empty) with ZeRO-3, "
            "or use zeroStage 2 for an exact warm-up before the 16-bit exchange"
        )
    return None


def _zero2_whole_bucket_modes_once_per_step(p: Parallelism) -> str | None:
    mode, m = p.gradient_compression.mode, p.micro_batches
    if p.zero_stage == 2 and mode in ("topk", "powersgd") and m > 1:
        return (
            f"gradientCompression.mode={mode} with zeroStage=2 and microBatches={m}: ZeRO-2 reduces after "
            f"every micro-batch, so {mode} would exchange {m}x its payload per step inline in backward, "
            "while its error feedback keeps the full-size gradient ZeRO-2 exists to shard: use zeroStage 1 "
            "(the same memory, one compressed exchange per step overlapped with backward), microBatches 1, "
            "or mode bf16, fp16 or int8 with ZeRO-2"
        )
    return None


def _world_size_bound(p: Parallelism) -> str | None:
    if p.world_size > limits.MAX_WORLD_SIZE:
        return (
            f"data x pipeline x context x tensor = {p.data} x {p.pipeline} x {p.context} x {p.tensor} = "
            f"{p.world_size} ranks is "
            f"above the largest job, {limits.MAX_WORLD_SIZE}: lower a degree"
        )
    return None


RULES: tuple[base.Rule[Parallelism], ...] = (
    base.Rule(
        "world-size-bound",
        "spec.parallelism.data",
        "self.parallelism.data * self.parallelism.pipeline * "
        "(has(self.parallelism.context) ? self.parallelism.context : 1) * "
        f"self.parallelism.tensor <= {limits.MAX_WORLD_SIZE}",
        "parallelism.data x pipeline x context x tensor (the world size) must be at most "
        f"{limits.MAX_WORLD_SIZE}",
        _world_size_bound,
    ),
    base.Rule(
        "virtual-stages-need-interleaving",
        "spec.parallelism.virtualStages",
        "self.parallelism.schedule == 'interleaved-1f1b' ? (self.parallelism.virtualStages >= 2 && self.parallelism.pipeline >= 2) : self.parallelism.virtualStages == 1",
        "interleaved-1f1b needs pipeline >= 2 and virtualStages >= 2; other schedules need virtualStages == 1",
        _virtual_stages_need_interleaving,
    ),
    base.Rule(
        "interleaved-micro-batches",
        "spec.parallelism.microBatches",
        "self.parallelism.schedule != 'interleaved-1f1b' || self.parallelism.microBatches % self.parallelism.pipeline == 0",
        "interleaved-1f1b needs parallelism.microBatches to be a multiple of parallelism.pipeline",
        _interleaved_micro_batches,
    ),
    base.Rule(
        "compression-needs-data-parallel",
        "spec.parallelism.gradientCompression.mode",
        "self.parallelism.gradientCompression.mode == 'none' || "
        "(self.parallelism.data >= 2 && (self.parallelism.zeroStage < 3 || "
        "self.parallelism.gradientCompression.mode in ['bf16', 'fp16']))",
        "parallelism.gradientCompression needs parallelism.data >= 2, and under zeroStage 3 mode bf16 or "
        "fp16 (mode none otherwise)",
        _compression_needs_data_parallel,
    ),
    base.Rule(
        "zero3-casts-have-no-warmup",
        "spec.parallelism.gradientCompression.warmupSteps",
        "self.parallelism.zeroStage < 3 || "
        "!(self.parallelism.gradientCompression.mode in ['bf16', 'fp16']) || "
        "!has(self.parallelism.gradientCompression.warmupSteps) || "
        "self.parallelism.gradientCompression.warmupSteps == 0",
        "parallelism.gradientCompression.warmupSteps must be 0 or empty with zeroStage 3 and mode bf16 or fp16 "
        "(FSDP2 fixes its reduce dtype at sharding); use zeroStage 2 for an exact warm-up",
        _zero3_casts_have_no_warmup,
    ),
    base.Rule(
        "zero2-whole-bucket-modes-once-per-step",
        "spec.parallelism.gradientCompression.mode",
        "self.parallelism.zeroStage != 2 || self.parallelism.microBatches <= 1 || "
        "!(self.parallelism.gradientCompression.mode in ['topk', 'powersgd'])",
        "parallelism.gradientCompression.mode topk or powersgd with zeroStage 2 needs microBatches 1 "
        "(ZeRO-2 reduces every micro-batch): use zeroStage 1, or mode bf16, fp16 or int8",
        _zero2_whole_bucket_modes_once_per_step,
    ),
)
"""Rules on the parallelism section alone (the ones that read other sections are in
:mod:`meshtrain.api.spec.cross_section`)."""
