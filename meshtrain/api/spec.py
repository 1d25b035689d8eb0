"""The TrainingJob spec: one typed model shared by the operator and the trainer.

This module is the single source of truth for what a TrainingJob may say.  The
CRD's OpenAPI schema is generated from these classes (:mod:`meshtrain.api.crd`)
and the cross-field rules live in :mod:`meshtrain.api.rules`, so the operator,
the trainer and ``kubectl apply`` agree on what a valid job is.

Attributes are snake_case in Python and camelCase in YAML (``micro_batches`` is
``microBatches``).  The models are frozen: derive a changed spec with
:func:`meshtrain.api.loading.apply_overrides` or ``model_copy(update=...)``.
Reading and validating a job (model and rules together) is :mod:`meshtrain.api.loading`.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

import pydantic
from pydantic import ConfigDict, Field
from pydantic.alias_generators import to_camel

from meshtrain.api import presets

API_GROUP = "meshtrain.io"
API_VERSION = "v1alpha1"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SHORT_NAME = "tj"

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
Precision = Literal["auto", "fp32", "bf16"]
TokenDtype = Literal["uint16", "uint32"]
Family = Literal["gpt", "llama"]


class _Model(pydantic.BaseModel):
    """Base for every spec section: camelCase in YAML, frozen, no unknown keys."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        extra="forbid",
    )


class GradientCompression(_Model):
    """How data-parallel gradients are compressed on the wire (error feedback for int8, topk, powersgd)."""

    mode: Literal["none", "bf16", "fp16", "int8", "topk", "powersgd"] = Field(
        "none",
        description="none (fp32 all-reduce), bf16/fp16 (16-bit all-reduce), int8 (per-rank scale, all-gathered, "
        "summed in fp32), topk (largest elements with error feedback), powersgd (rank-r approximation of each gradient matrix with error feedback).",
    )
    rank: int = Field(
        4,
        ge=1,
        description="powersgd: rank of each matrix's approximation; at most the smallest matrix dimension.",
    )
    topk_ratio: float = Field(
        0.01, gt=0, le=1, description="topk: share of each bucket's elements a rank sends per step."
    )
    warm_start: bool = Field(
        True, description="powersgd: start each step's power iteration from the previous step's Q."
    )


class Parallelism(_Model):
    """How the job is split: data x pipeline x tensor, and how each axis runs."""

    data: int = Field(
        1, ge=1, description="Data-parallel degree: model replicas that split the global batch."
    )
    pipeline: int = Field(
        1,
        ge=1,
        description="Pipeline-parallel degree: number of pipeline stages (layers split across them).",
    )
    tensor: int = Field(
        1,
        ge=1,
        description="Tensor-parallel degree: GPUs that split every layer; must divide gpusPerNode so a group stays inside one NVLink domain.",
    )
    schedule: Schedule = Field(
        "1f1b",
        description="Pipeline schedule: gpipe (all forwards, then all backwards), 1f1b (one forward one backward, bounded activation memory), interleaved-1f1b (virtual stages, smaller bubble).",
    )
    virtual_stages: int = Field(
        1,
        ge=1,
        description="Model chunks per pipeline rank for interleaved-1f1b (v >= 2); must be 1 for other schedules.",
    )
    micro_batches: int = Field(
        1,
        ge=1,
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
        description="Gradient all-reduce bucket size in MiB; a bucket is reduced as soon as all its gradients are ready.",
    )
    all_reduce: Literal["flat", "hierarchical"] = Field(
        "flat",
        description="Data-parallel gradient all-reduce: flat (one all-reduce over the group) or hierarchical "
        "(reduce-scatter inside each node, all-reduce of the shard across nodes, all-gather inside the node).",
    )
    gradient_compression: GradientCompression = Field(
        default_factory=GradientCompression,
        description="Compression of the data-parallel gradient reduction (needs data > 1 and zeroStage < 2).",
    )

    @property
    def world_size(self) -> int:
        """Processes in the job: data x pipeline x tensor."""
        return self.data * self.pipeline * self.tensor

    @property
    def layout_string(self) -> str:
        """Human layout such as ``dp2·pp4·tp8`` (printer column, logs)."""
        return f"dp{self.data}·pp{self.pipeline}·tp{self.tensor}"


class Toleration(_Model):
    """A pod toleration, as in the core API."""

    key: str | None = Field(
        None,
        description="Taint key the toleration applies to; empty matches all keys with operator Exists.",
    )
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Exists or Equal.")
    value: str | None = Field(None, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty tolerates all effects."
    )
    toleration_seconds: int | None = Field(
        None,
        ge=0,
        description="For NoExecute: how long the pod stays bound after the taint appears.",
    )


class KeyRef(_Model):
    """One key of a Secret or ConfigMap in the job's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Name of the Secret or ConfigMap.")
    key: str = Field(min_length=1, max_length=253, description="Key within it.")
    optional: bool | None = Field(None, description="Start the pod even if the key is missing.")


class FieldRef(_Model):
    """A field of the pod itself (Downward API)."""

    field_path: str = Field(
        min_length=1,
        max_length=253,
        description="e.g. metadata.name, status.hostIP, spec.nodeName.",
    )


class EnvSource(_Model):
    """Where an environment variable's value comes from; exactly one member is set."""

    secret_key_ref: KeyRef | None = Field(None, description="A key of a Secret.")
    config_map_key_ref: KeyRef | None = Field(None, description="A key of a ConfigMap.")
    field_ref: FieldRef | None = Field(None, description="A field of the pod.")


ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"


class EnvVar(_Model):
    """An environment variable of the trainer container, e.g. an NCCL_* setting."""

    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=ENV_NAME_PATTERN,
        description="Variable name: a C identifier (letters, digits, underscores; no leading digit).",
    )
    value: str | None = Field(
        None, max_length=4096, description="Literal value (never a secret: use valueFrom)."
    )
    value_from: EnvSource | None = Field(
        None, description="Value from a Secret, ConfigMap or pod field."
    )


class PodSettings(_Model):
    """Settings of every pod of the gang that clusters need beyond the training itself."""

    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=128,
        description="Extra environment variables of the trainer container (NCCL_*, proxies, "
        "experiment trackers); secrets through valueFrom.secretKeyRef.",
    )
    image_pull_secrets: list[
        Annotated[str, Field(min_length=1, max_length=253, description="A Secret's name.")]
    ] = Field(
        default_factory=list,
        max_length=16,
        description="Names of Secrets in the job's namespace used to pull the trainer image.",
    )
    service_account_name: str | None = Field(
        None,
        max_length=253,
        description="ServiceAccount the pods run as; its token is mounted only when this is set.",
    )
    priority_class_name: str | None = Field(
        None, max_length=253, description="PriorityClass of the pods (preemption order)."
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description="Extra pod labels (not meshtrain.io/* nor app.kubernetes.io/managed-by).",
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description="Extra pod annotations, e.g. k8s.v1.cni.cncf.io/networks for Multus.",
    )
    rdma: bool = Field(
        False,
        description="Add the IPC_LOCK capability (RDMA memory registration for NCCL over InfiniBand/RoCE) "
        "and request one rdmaResource per pod. Beyond the restricted and baseline Pod Security levels: "
        "the namespace must admit privileged pods.",
    )
    rdma_resource: str = Field(
        "rdma/ib",
        max_length=253,
        description="The RDMA device plugin's extended resource that rdma requests one of per pod "
        "(e.g. rdma/ib, rdma/hca_shared_devices_a); empty requests none. resources.extraResources "
        "naming it sets another count.",
    )


class TrainerProgram(_Model):
    """Which program the pods run: meshtrain's trainer, or the user's own PyTorch program.

    A custom program runs in ``spec.image`` with the same placement, gang, restarts, checkpoint
    volume and environment: ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
    ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` make a plain ``torchrun train.py`` join the gang.
    """

    type: Literal["builtin", "custom"] = Field(
        "builtin",
        description="builtin: meshtrain's trainer (model, training, parallelism sections); "
        "custom: the command below, launched one pod per node slot like the built-in trainer.",
    )
    command: list[Annotated[str, Field(max_length=4096, description="An argument.")]] = Field(
        default_factory=list,
        max_length=64,
        description="custom: the container command, e.g. [torchrun, /app/train.py]; torchrun "
        "reads the gang's size, rank and rendezvous address from PET_* variables.",
    )
    args: list[Annotated[str, Field(max_length=4096, description="An argument.")]] = Field(
        default_factory=list, max_length=256, description="custom: arguments after the command."
    )
    working_dir: str | None = Field(
        None, max_length=4096, description="custom: working directory of the container."
    )


QUANTITY_MAX_LENGTH = 32
"""Longest quantity string (bounds the cost of the CEL isQuantity rules)."""


class Resources(_Model):
    """What each pod (one per node slot) asks of its node."""

    gpus_per_node: int = Field(
        8,
        ge=1,
        description="GPUs per pod; one pod per node runs torchrun --nproc-per-node=gpusPerNode.",
    )
    gpu_resource_name: str = Field(
        "nvidia.com/gpu", min_length=1, description="Extended resource name of a GPU."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Labels a node must carry to host this job's pods."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        description="Tolerations added to every pod (e.g. for GPU node taints).",
    )
    extra_resources: dict[str, Annotated[str, Field(max_length=QUANTITY_MAX_LENGTH)]] = Field(
        default_factory=dict,
        max_length=16,
        description="More extended resources per pod, e.g. {rdma/ib: '1'} for InfiniBand devices.",
    )
    cpu: str | None = Field(
        None,
        max_length=QUANTITY_MAX_LENGTH,
        description="CPU request and limit per pod (Kubernetes quantity); empty leaves it unset.",
    )
    memory: str | None = Field(
        None,
        max_length=QUANTITY_MAX_LENGTH,
        description="Memory request and limit per pod (Kubernetes quantity); empty leaves it unset.",
    )
    shm_size: str = Field(
        "16Gi",
        max_length=QUANTITY_MAX_LENGTH,
        description="Size of the in-memory /dev/shm volume (NCCL and data loader workers need more than the default 64Mi).",
    )


class RopeScaling(_Model):
    """Llama 3.1's RoPE frequency rewrite (transformers' ``rope_type: llama3``)."""

    factor: float = Field(gt=0, description="Divisor of the low (long-wavelength) frequencies.")
    low_freq_factor: float = Field(
        gt=0,
        description="Wavelengths above originalMaxPositionEmbeddings / lowFreqFactor are divided by factor.",
    )
    high_freq_factor: float = Field(
        gt=0,
        description="Wavelengths below originalMaxPositionEmbeddings / highFreqFactor are kept; between the two they are blended.",
    )
    original_max_position_embeddings: int = Field(
        ge=1, description="Context length the model was pretrained at (8192 for Llama 3.1)."
    )


class ModelShape(_Model):
    """A resolved decoder shape (no preset names left)."""

    layers: int = Field(ge=1, description="Transformer blocks.")
    hidden: int = Field(ge=1, description="Model width.")
    heads: int = Field(ge=1, description="Attention heads.")
    vocab: int = Field(ge=2, description="Vocabulary size.")
    seq_len: int = Field(ge=1, description="Sequence length in tokens.")
    ffn_hidden: int = Field(ge=1, description="MLP inner width.")
    family: Family = Field("gpt", description="Decoder family.")
    kv_heads: int = Field(0, ge=0, description="Key/value heads (llama); 0 means heads.")
    tie_embeddings: bool = Field(False, description="LM head shares the token embedding.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base (llama).")
    rope_scaling: RopeScaling | None = Field(
        None, description="Llama 3.1 RoPE frequency rewrite (llama); none: plain RoPE."
    )
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon (llama).")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    @property
    def key_value_heads(self) -> int:
        """Key/value heads: ``kv_heads``, or one per attention head (GPT's multi-head attention)."""
        return self.kv_heads or self.heads


class ModelInit(_Model):
    """Where the starting weights come from (default: the seed)."""

    from_hf: str | None = Field(
        None,
        alias="fromHF",
        description="A Hugging Face model directory (config.json + *.safetensors, e.g. from meshtrain export) "
        "whose weights start the run on any layout; its config must agree with the model shape.",
    )


SHAPE_OVERRIDES = (
    "layers",
    "hidden",
    "heads",
    "vocab",
    "seq_len",
    "ffn_hidden",
    "family",
    "kv_heads",
    "tie_embeddings",
    "rope_theta",
    "rope_scaling",
    "norm_eps",
)
"""ModelSpec fields that override a preset's value in the resolved shape."""


class ModelSpec(_Model):
    """The model: a named preset, explicit sizes, or a preset with overrides."""

    preset: presets.PresetName | None = Field(
        None,
        description="Named shape: tiny (tests), 125m, 350m, 1.3b, 7b (GPT); llama-tiny, llama3.2-1b, llama3-8b, "
        "llama3-70b (Llama family). Explicit fields override it.",
    )
    family: Family | None = Field(
        None,
        description="Decoder family: gpt (learned positions, LayerNorm, GELU, multi-head attention) or llama "
        "(RoPE, RMSNorm, SwiGLU, grouped-query attention). Empty: the preset's, else gpt.",
    )
    kv_heads: int | None = Field(
        None,
        ge=1,
        description="Key/value heads of grouped-query attention (llama); must divide heads. Empty: the preset's, else heads.",
    )
    tie_embeddings: bool | None = Field(
        None,
        description="The LM head reuses the token embedding matrix (needs pipeline 1). Empty: the preset's, else false.",
    )
    rope_theta: float | None = Field(
        None, gt=0, description="RoPE base frequency (llama). Empty: the preset's, else 10000."
    )
    norm_eps: float | None = Field(
        None, gt=0, description="RMSNorm epsilon (llama). Empty: the preset's, else 1e-5."
    )
    rope_scaling: RopeScaling | None = Field(
        None,
        description="Llama 3.1's RoPE frequency rewrite (llama; transformers' rope_type llama3). "
        "Empty: plain RoPE.",
    )
    init: ModelInit = Field(
        default_factory=ModelInit,
        description="Starting weights: the seed, or a Hugging Face directory.",
    )
    layers: int | None = Field(None, ge=1, description="Transformer blocks (overrides the preset).")
    hidden: int | None = Field(None, ge=1, description="Model width (overrides the preset).")
    heads: int | None = Field(None, ge=1, description="Attention heads (overrides the preset).")
    vocab: int | None = Field(
        None, ge=2, description="Vocabulary size (overrides the preset); 256 for byte-level data."
    )
    seq_len: int | None = Field(
        None, ge=1, description="Sequence length in tokens (overrides the preset)."
    )
    ffn_hidden: int | None = Field(
        None,
        ge=1,
        description="MLP inner width; defaults to 4 x hidden (gpt) or 8/3 x hidden rounded up to a multiple of 256 (llama).",
    )

    def missing_fields(self) -> list[str]:
        """Shape fields that neither the preset nor the spec gives."""
        base = presets.PRESETS[self.preset] if self.preset else {}
        return [
            f
            for f in ("layers", "hidden", "heads", "vocab", "seq_len")
            if getattr(self, f) is None and f not in base
        ]

    def shape(self) -> ModelShape:
        """The resolved shape: preset values overridden by explicit fields."""
        values: dict[str, Any] = dict(presets.PRESETS[self.preset]) if self.preset else {}
        for name in SHAPE_OVERRIDES:
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if "ffn_hidden" not in values:
            values["ffn_hidden"] = (
                -(-8 * values["hidden"] // 3 // 256) * 256  # Llama's SwiGLU width, multiple of 256
                if values.get("family") == "llama"
                else 4 * values["hidden"]
            )
        return ModelShape(**values)


class DatasetSource(_Model):
    """One source of a data mixture."""

    path: str = Field(
        min_length=1,
        description="A token file, or a glob of them (its files share the weight by token count).",
    )
    weight: float = Field(
        1.0, gt=0, description="Relative share of the training windows drawn from this source."
    )


class LrScaling(_Model):
    """How the learning rate follows the global batch (Goyal et al. 2017 linear; sqrt for Adam-like
    optimizers, Hoffer et al. 2017), so a layout change that alters the batch keeps training honest."""

    rule: Literal["none", "linear", "sqrt"] = Field(
        "none",
        description="none: learningRate as written at the batch the run started with (a run resumed at "
        "another global batch, after a resize or a layout change, multiplies it by the batch ratio); linear: "
        "times globalBatch / referenceBatch; sqrt: times its square root. minLearningRate scales the same way; "
        "warmup is kept; a rate raised at a resume ramps up at the warmup's slope.",
    )
    reference_batch: int | None = Field(
        None,
        ge=1,
        description="The global batch learningRate was tuned at (required unless rule is none).",
    )

    def factor(self, global_batch: int) -> float:
        """What the learning rates are multiplied by at ``global_batch``."""
        if self.rule == "none" or self.reference_batch is None:
            return 1.0
        ratio = global_batch / self.reference_batch
        return ratio if self.rule == "linear" else ratio**0.5

    def carried_scale(self, from_batch: int, to_batch: int) -> float:
        """The extra multiplier when a run resumes at ``to_batch`` from a checkpoint trained at
        ``from_batch``: under ``none`` the batch ratio (linear, the checkpoint's batch as the
        reference); ``linear`` and ``sqrt`` already follow the batch through :meth:`factor`."""
        return to_batch / from_batch if self.rule == "none" else 1.0


class Evaluation(_Model):
    """Validation loss: a fixed set of held-out batches, evaluated every ``interval`` steps."""

    interval: int = Field(
        0,
        ge=0,
        description="Evaluate every N optimizer steps (and after the last); 0 turns evaluation off.",
    )
    batches: int = Field(
        2,
        ge=1,
        description="Global batches (of the training batch size) per evaluation; the same ones every time.",
    )
    dataset: str | None = Field(
        None,
        description="Held-out token file or glob (training.tokenDtype); empty: the last heldOut share of every training file.",
    )
    held_out: float = Field(
        0.0,
        ge=0,
        # Inclusive: the API server checks a number that arrives as a JSON integer (the default
        # 0.0 does) against an exclusive fractional maximum truncated to an integer, so
        # "< 0.5" refused 0 and with it the whole CRD (its defaults) at install.
        le=0.5,
        description="Share of the end of every training file reserved for evaluation (training never draws from it) when dataset is empty.",
    )


class LossGuard(_Model):
    """Skip updates whose loss or gradient norm is bad; stop after too many in a row."""

    enabled: bool = Field(
        True,
        description="Skip an update whose loss or gradient norm is not finite (and, with spikeFactor, a spike).",
    )
    spike_factor: float = Field(
        0.0,
        ge=0,
        description="Also skip when the loss exceeds this factor x the median of the last window accepted losses; 0 off.",
    )
    window: int = Field(
        20, ge=1, description="Accepted steps whose median loss a spike is measured against."
    )
    max_consecutive_skips: int = Field(
        5,
        ge=0,
        description="Stop the job (exit 5, permanent) after this many skipped updates in a row; the last good "
        "checkpoint is kept. 0 never stops.",
    )


class Training(_Model):
    """Optimisation: batch, steps, learning-rate schedule, precision, data."""

    global_batch: int | None = Field(
        None,
        ge=1,
        description="Sequences per optimizer step; must equal microBatch x microBatches x data. Empty derives it.",
    )
    micro_batch: int = Field(
        1, ge=1, description="Sequences per micro-batch per data-parallel replica."
    )
    steps: int = Field(100, ge=1, description="Optimizer steps to train.")
    learning_rate: float = Field(3e-4, gt=0, description="Peak learning rate (after warmup).")
    min_learning_rate: float = Field(
        3e-5, ge=0, description="Learning rate at the end of the cosine decay."
    )
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps from 0 to learningRate.")
    lr_scaling: LrScaling = Field(
        default_factory=LrScaling,
        description="Scale learningRate and minLearningRate with the global batch (none, linear, sqrt).",
    )
    weight_decay: float = Field(
        0.1, ge=0, description="AdamW decoupled weight decay (not applied to norms and biases)."
    )
    grad_clip: float = Field(
        1.0, ge=0, description="Clip gradients to this global L2 norm (0 disables)."
    )
    precision: Precision = Field(
        "auto", description="auto: bf16 autocast with fp32 master weights on GPU, fp32 on CPU."
    )
    seed: int = Field(
        1234,
        ge=0,
        description="Seed for weights and data order; the same seed gives the same run on every layout.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each block's activations in backward instead of keeping them: a block keeps only its "
        "input, for about one more forward pass of compute (not counted in MFU).",
    )
    selective_recompute: list[
        Annotated[
            Literal["attention", "mlp"],
            Field(description="A part of every block to recompute: attention or mlp."),
        ]
    ] = Field(
        default_factory=list,
        description="Recompute only these parts of every block in backward instead of keeping their activations: "
        "attention (the attention core: scores, softmax, their product with V) and/or mlp (the MLP sub-layer from "
        "its input: norm, up-projection, activation). Empty: none. Not with activationCheckpointing, which "
        "recomputes whole blocks.",
    )
    compile: bool = Field(
        False,
        description="Compile every transformer block with torch.compile (fuses norms, activations and residual "
        "adds); where the backend cannot compile on the machine the blocks run eagerly, with a warning.",
    )
    dataset: str = Field(
        "stdlib",
        min_length=1,
        description="'stdlib' (byte-level tokens of the Python standard library sources), the path of a token file, "
        "or a glob of token files (each weighted by its token count).",
    )
    datasets: list[DatasetSource] = Field(
        default_factory=list,
        description="Several token files (paths or globs) with mixing weights; replaces dataset when set.",
    )
    token_dtype: TokenDtype = Field(
        "uint16",
        description="Element type of the token files: uint16 (vocabulary up to 65,536) or uint32 (larger ones, e.g. Llama 3's 128,256).",
    )

    eval: Evaluation = Field(
        default_factory=Evaluation, description="Validation loss: interval, batches, held-out data."
    )
    loss_guard: LossGuard = Field(
        default_factory=LossGuard,
        description="Skip non-finite or spiking updates; stop after maxConsecutiveSkips in a row.",
    )

    def effective_global_batch(self, parallelism: Parallelism) -> int:
        """The global batch the layout produces: microBatch x microBatches x data."""
        return self.micro_batch * parallelism.micro_batches * parallelism.data

    def learning_rates(self, parallelism: Parallelism) -> tuple[float, float]:
        """Peak and minimum learning rate at this layout's global batch (``lrScaling`` applied)."""
        factor = self.lr_scaling.factor(self.effective_global_batch(parallelism))
        return self.learning_rate * factor, self.min_learning_rate * factor


class Checkpoint(_Model):
    """Where and how often training state is saved; resume is automatic."""

    path: str = Field(
        "/checkpoints",
        min_length=1,
        description="Directory for checkpoints inside the pod (or on this machine for meshtrain run).",
    )
    claim_name: str | None = Field(
        None,
        description="PersistentVolumeClaim mounted at path; empty uses an emptyDir (lost with the pod).",
    )
    interval_steps: int = Field(
        100, ge=0, description="Save every N optimizer steps (0: only at the end)."
    )
    keep: int = Field(3, ge=1, description="Complete checkpoints to keep; older ones are pruned.")
    async_save: bool = Field(
        True,
        description="Write a due checkpoint in the background while training goes on (the step waits only "
        "for the copy of the state to host memory); false writes it before the next step.",
    )


class FabricLevel(_Model):
    """One level of the network fabric, named by a node label."""

    label: str = Field(
        min_length=1,
        description="Node label whose value names the domain at this level, e.g. network.topology.nvidia.com/block.",
    )
    mode: Literal["required", "preferred"] = Field(
        "preferred",
        description="required: the whole job must fit in one domain of this level; preferred: minimise traffic across it.",
    )


class Topology(_Model):
    """How the cluster's network is described by node labels."""

    nvlink_domain_label: str | None = Field(
        None,
        description="Node label naming a multi-node NVLink domain (e.g. nvidia.com/gpu.clique); empty: the node itself.",
    )
    levels: list[FabricLevel] = Field(
        default_factory=list,
        description="Fabric levels from the top (block) down to the bottom (leaf/rack); empty detects the NVIDIA, GKE or AWS topology labels on the nodes.",
    )


class Elastic(_Model):
    """The data-parallel degrees a job may run at when nodes are lost or come back.

    ``parallelism.data`` states the global batch (microBatch x microBatches x data); at another
    degree the operator raises or lowers microBatches to keep it, or states the change in status.
    """

    min_data: int = Field(
        ge=1,
        description="Smallest data-parallel degree the job may shrink to when a node is lost and no equal "
        "replacement fits.",
    )
    max_data: int = Field(
        ge=1,
        description="Largest data-parallel degree the job may grow to when capacity is free (at the next "
        "checkpoint).",
    )
    grow_stable_seconds: int = Field(
        120,
        ge=0,
        le=86400,
        description="Grow only after room for a larger degree was found at every check (about every 10 s) "
        "for this long, so capacity that comes and goes (a flapping node) does not rebuild the gang.",
    )
    min_resize_interval_seconds: int = Field(
        600,
        ge=0,
        le=86400,
        description="Least time between two resizes of the gang: a grow waits until this long after the last "
        "shrink or grow. A shrink is never delayed (the gang lost a node and cannot run at its size), but it "
        "starts the interval.",
    )


class StragglerPolicy(_Model):
    """What to do about a rank that computes persistently slower than its data-parallel peers."""

    action: Literal["ignore", "report", "replace"] = Field(
        "report",
        description="ignore: no detection; report: status.straggler, a Straggler condition, an Event and the "
        "slowdown metric; replace: also stop the gang at a step boundary with a checkpoint and place it again "
        "without the slow rank's node (status.excludedNodes), resuming from that step.",
    )
    threshold: float = Field(
        1.25,
        gt=1,
        description="A rank is a straggler when its compute time is more than this factor of its peers' median "
        "(the median over the window of per-step ratios); must be above 1.",
    )
    window: int = Field(
        20,
        ge=4,
        le=10000,
        description="Steps the slowdown is judged over; a rank is flagged once more than half of the last "
        "window steps were slow, so detection takes about window/2 steps.",
    )
    max_replacements: int = Field(
        3,
        ge=0,
        description="replace: nodes excluded for this job at most; after that a straggler is only reported.",
    )


class RunPolicy(_Model):
    """Failure, time and lifetime policy."""

    backoff_limit: int = Field(3, ge=0, description="Gang restarts allowed before the job fails.")
    active_deadline_seconds: int | None = Field(
        None, ge=1, description="Fail the job when it has been active this long."
    )
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete the job this long after it succeeded or failed."
    )
    startup_timeout_seconds: int = Field(
        600,
        ge=1,
        description="Pods not all Running this long after creation count as a failed start.",
    )
    suspend: bool = Field(
        False,
        description="Remove the pods but keep the job and its status; setting it back to false re-places the job.",
    )
    termination_grace_period_seconds: int = Field(
        60,
        ge=10,
        le=86400,
        description="How long a deleted pod (suspend, spec change, drain) gets to stop: its ranks finish the current step "
        "and checkpoint it. The pods' terminationGracePeriodSeconds; torchrun waits 5 s less before killing the ranks.",
    )
    elastic: Elastic | None = Field(
        None,
        description="Run at any data-parallel degree from minData to maxData: the largest that fits, shrinking "
        "when a node is lost and growing back when capacity returns; empty: only at parallelism.data.",
    )
    straggler_policy: StragglerPolicy = Field(
        default_factory=StragglerPolicy,
        description="Detection of a slow rank (compared with its data-parallel peers) and what to do about it.",
    )


class Metrics(_Model):
    """The trainer's Prometheus exporter."""

    port: int = Field(
        9400, ge=1024, le=65535, description="Port of the Prometheus exporter in every pod."
    )
    peak_flops: float | None = Field(
        None,
        gt=0,
        description="Peak FLOP/s per device for MFU; empty uses the detected GPU's bf16 peak (or a measured CPU figure).",
    )


class TrainingJobSpec(_Model):
    """The spec of a TrainingJob."""

    image: str = Field(
        "",
        description="Trainer image; it must contain the meshtrain package. Empty: the cluster's "
        "default trainer image (the operator's --trainer-image, set by the Helm chart).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Pull policy of the trainer image."
    )
    parallelism: Parallelism = Field(
        default_factory=Parallelism, description="Data x pipeline x tensor layout and schedule."
    )
    resources: Resources = Field(
        default_factory=Resources, description="Per-pod GPUs and other resources."
    )
    model: ModelSpec = Field(
        default_factory=lambda: ModelSpec(preset="tiny"), description="GPT decoder shape."
    )
    training: Training = Field(
        default_factory=Training, description="Batch, steps, schedule, precision and data."
    )
    checkpoint: Checkpoint = Field(
        default_factory=Checkpoint, description="Checkpoint location and frequency."
    )
    topology: Topology = Field(
        default_factory=Topology, description="NVLink domain and fabric labels."
    )
    run_policy: RunPolicy = Field(
        default_factory=RunPolicy, description="Restarts, deadlines, TTL and suspend."
    )
    metrics: Metrics = Field(default_factory=Metrics, description="Prometheus exporter settings.")
    trainer: TrainerProgram = Field(
        default_factory=TrainerProgram,
        description="The program the pods run: the built-in trainer, or a custom PyTorch program.",
    )
    pod: PodSettings = Field(
        default_factory=PodSettings,
        description="Pod settings: env, image pull secrets, ServiceAccount, priority, labels, annotations.",
    )

    @property
    def world_size(self) -> int:
        """Processes in the job."""
        return self.parallelism.world_size

    @property
    def pods(self) -> int:
        """Pods in the gang: one per node slot of gpusPerNode ranks."""
        return self.world_size // self.resources.gpus_per_node

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.training.effective_global_batch(self.parallelism)


class Phase(str, enum.Enum):
    """Lifecycle phase of a TrainingJob (see docs/architecture.md)."""

    PENDING = "Pending"
    PLACING = "Placing"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


class Condition(_Model):
    """A Kubernetes-style condition."""

    type: str = Field(
        description="Condition type, e.g. Placed, Running, Succeeded, Failed, WontFit."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(
        description="CamelCase reason, a constant of meshtrain.operator.policy.conditions."
    )
    message: str = Field("", description="Human explanation with the numbers.")
    last_transition_time: str = Field(description="RFC 3339 time the status last changed.")


class PodPlacement(_Model):
    """The node chosen for one pod of the gang."""

    pod_index: int = Field(
        ge=0, description="Node rank: the pod holds ranks [i*gpusPerNode, (i+1)*gpusPerNode)."
    )
    node: str = Field(description="Node name.")


class Progress(_Model):
    """Last training progress reported by rank 0."""

    step: int = Field(0, ge=0, description="Last completed optimizer step.")
    loss: float | None = Field(None, description="Loss at that step.")
    tokens_per_second: float | None = Field(None, description="Throughput of the whole job.")
    eval_loss: float | None = Field(None, description="Validation loss of the last evaluation.")
    skipped_updates: int | None = Field(
        None, ge=0, description="Updates the loss guard skipped so far (in this run of the gang)."
    )
    gradient_noise_scale: float | None = Field(
        None,
        description="Measured gradient noise scale (McCandlish et al. 2018): the batch beyond which more "
        "data parallelism stops paying (needs data >= 2).",
    )
    updated_at: str | None = Field(None, description="RFC 3339 time of the report.")


class ElasticStatus(_Model):
    """The size a gang of a job with ``runPolicy.elastic`` was placed at."""

    data: int = Field(ge=1, description="Data-parallel degree of the placed gang.")
    micro_batches: int = Field(ge=1, description="Micro-batches per replica at that degree.")
    global_batch: int = Field(ge=1, description="Global batch at that degree.")
    learning_rate: float = Field(
        description="Peak learning rate at that global batch (training.lrScaling applied; under none the "
        "declared rate times the batch ratio)."
    )
    checkpoint_step: int | None = Field(
        None,
        description=(
            "Checkpoint step the gang placed at this size resumed from, as its first progress report "
            "states it (unset until then); it grows only after a newer one."
        ),
    )
    message: str = Field("", description="What changed and why.")
    resized_at: str | None = Field(
        None,
        description="RFC 3339 time the gang was last placed at another degree than before (a shrink or a "
        "grow); the next grow waits runPolicy.elastic.minResizeIntervalSeconds from it.",
    )
    room_since: str | None = Field(
        None,
        description="RFC 3339 time since which every grow check found room for a larger degree (empty when "
        "the last one found none); the gang grows once that lasted runPolicy.elastic.growStableSeconds.",
    )


class OtherStraggler(_Model):
    """Another rank flagged at the same time, and where it runs."""

    rank: int = Field(ge=0, description="Global rank.")
    pod_index: int | None = Field(None, ge=0, description="Node rank of its pod.")
    node: str | None = Field(None, description="Node the pod was placed on.")
    slowdown: float = Field(description="Its compute time over its peers' median.")


class Straggler(_Model):
    """The rank the trainer flagged as persistently slower than its peers, and where it runs."""

    rank: int = Field(ge=0, description="Global rank of the slowest flagged rank.")
    pod_index: int | None = Field(None, ge=0, description="Node rank of its pod.")
    node: str | None = Field(None, description="Node the pod was placed on.")
    slowdown: float = Field(
        description="Its compute time over its peers' median (median over the window)."
    )
    since_step: int | None = Field(
        None, ge=0, description="Step at which it was first flagged in this run of the gang."
    )
    since: str | None = Field(None, description="RFC 3339 time the operator first saw it.")
    others: list[OtherStraggler] = Field(
        default_factory=list,
        description="The other ranks flagged now, slowest first; replace excludes their nodes too.",
    )


class ExcludedNode(_Model):
    """A node this job is not placed on again."""

    node: str = Field(description="Node name.")
    reason: str = Field(description="Why, e.g. Straggler.")
    message: str = Field("", description="With the numbers: rank, slowdown, step.")
    time: str | None = Field(None, description="RFC 3339 time it was excluded.")
    rank: int | None = Field(
        None, ge=0, description="The straggler rank that was on it (reason Straggler)."
    )


class TrainingJobStatus(_Model):
    """The status subresource of a TrainingJob."""

    phase: Phase = Field(Phase.PENDING, description="Lifecycle phase.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Conditions with reasons and messages."
    )
    layout: str | None = Field(None, description="Layout such as dp2·pp4·tp8.")
    world_size: int | None = Field(None, description="Processes in the job, one GPU each.")
    placement: list[PodPlacement] = Field(
        default_factory=list, description="Node per pod (rank block)."
    )
    cross_level_bytes: dict[str, float] = Field(
        default_factory=dict, description="Predicted bytes per step crossing each fabric level."
    )
    restarts: int = Field(0, ge=0, description="Gang restarts so far.")
    disruption_restarts: int = Field(
        0,
        ge=0,
        description="Of restarts, those caused by a node lost or a pod disrupted (eviction, preemption, "
        "drain, node shutdown): not counted against runPolicy.backoffLimit.",
    )
    last_checkpoint_step: int | None = Field(
        None, description="Step of the newest complete checkpoint."
    )
    progress: Progress | None = Field(None, description="Last reported training progress.")
    plan: dict[str, Any] = Field(
        default_factory=dict,
        description="Key numbers of the planner: memory per GPU, step time, bubble.",
    )
    start_time: str | None = Field(None, description="When the pods first ran.")
    completion_time: str | None = Field(None, description="When the job succeeded or failed.")
    observed_generation: int | None = Field(
        None, description="Spec generation the status describes."
    )
    spec_hash: str | None = Field(
        None,
        description="Hash of the spec (runPolicy left out) the placed gang was built from; "
        "a spec with another hash makes the operator rebuild the gang.",
    )
    elastic: ElasticStatus | None = Field(
        None,
        description="Set once a job with runPolicy.elastic is placed: the data-parallel degree, batch and "
        "learning rate its gang runs with (the Resized condition says whether that is parallelism.data).",
    )
    straggler: Straggler | None = Field(
        None,
        description="The rank the trainer flags as a straggler now (runPolicy.stragglerPolicy); empty when none.",
    )
    excluded_nodes: list[ExcludedNode] = Field(
        default_factory=list,
        description="Nodes a straggler was replaced on; each is left out of this job's placements for 24 h after its time.",
    )
    straggler_replacements: int = Field(
        0, ge=0, description="Gangs rebuilt without a straggler's node so far."
    )


def to_manifest(name: str, spec: TrainingJobSpec, namespace: str | None = None) -> dict[str, Any]:
    """A TrainingJob object for the API server (defaults included, nulls dropped)."""
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": metadata,
        "spec": spec.model_dump(by_alias=True, exclude_none=True, mode="json"),
    }
