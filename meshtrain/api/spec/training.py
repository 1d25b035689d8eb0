"""``spec.training``: optimisation (batch, steps, learning-rate schedule and its scaling with the
batch, precision, recompute), the data, evaluation and the loss guard, and the rules on the
section alone."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from meshtrain.api import limits
from meshtrain.api.spec import base
from meshtrain.api.spec.parallelism import Parallelism

Precision = Literal["auto", "fp32", "bf16"]
TokenDtype = Literal["uint16", "uint32"]
Sampling = Literal["random", "epochs"]
Float8Recipe = Literal["tensorwise", "rowwise"]


class DatasetSource(base.SpecModel):
    """One source of a data mixture."""

    path: str = Field(
        min_length=1,
        description="A token file, or a glob of them (its files share the weight by token count).",
    )
    weight: float = Field(
        1.0, gt=0, description="Relative share of the training windows drawn from this source."
    )


class LrScaling(base.SpecModel):
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
        le=limits.MAX_GLOBAL_BATCH,
        description="The global batch learningRate was tuned at.",
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


class Evaluation(base.SpecModel):
    """Validation loss: a fixed set of held-out batches, evaluated every ``interval`` steps."""

    interval: int = Field(
        0,
        ge=0,
        le=limits.MAX_STEPS,
        description="Evaluate every N optimizer steps (and after the last); 0 turns evaluation off.",
    )
    batches: int = Field(
        2,
        ge=1,
        le=limits.MAX_EVAL_BATCHES,
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


class LossGuard(base.SpecModel):
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
        20,
        ge=1,
        le=limits.MAX_STEPS,
        description="Accepted steps whose median loss a spike is measured against.",
    )
    max_consecutive_skips: int = Field(
        5,
        ge=0,
        le=limits.MAX_STEPS,
        description="Stop the job (exit 5, permanent) after this many skipped updates in a row; the last good "
        "checkpoint is kept. 0 never stops.",
    )


class Float8(base.SpecModel):
    """fp8 linear layers through torchao's float8 training (``convert_to_float8_training``): the
    blocks' linears run their matmuls in float8 with dynamic scales; the head, the embedding and the
    attention core stay bf16.  Needs bf16 precision and a GPU of compute capability 8.9 or newer
    (H100, H200, L40S); the trainer refuses it at job start anywhere else."""

    recipe: Float8Recipe = Field(
        "tensorwise",
        description="torchao's recipe: tensorwise (one scale per tensor, the fastest) or rowwise (a scale "
        "per row of each operand: more accurate, somewhat slower).",
    )


class Training(base.SpecModel):
    """Optimisation: batch, steps, learning-rate schedule, precision, data."""

    global_batch: int | None = Field(
        None,
        ge=1,
        le=limits.MAX_GLOBAL_BATCH,
        description="Sequences per optimizer step. Empty derives it.",
    )
    micro_batch: int = Field(
        1,
        ge=1,
        le=limits.MAX_GLOBAL_BATCH,
        description="Sequences per micro-batch per data-parallel replica.",
    )
    steps: int = Field(100, ge=1, le=limits.MAX_STEPS, description="Optimizer steps to train.")
    learning_rate: float = Field(3e-4, gt=0, description="Peak learning rate (after warmup).")
    min_learning_rate: float = Field(
        3e-5, ge=0, description="Learning rate at the end of the cosine decay."
    )
    warmup_steps: int = Field(
        10, ge=0, le=limits.MAX_STEPS, description="Linear warmup steps from 0 to learningRate."
    )
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
        le=limits.MAX_SEED,
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
        max_length=2,
        description="Recompute only these parts of every block in backward instead of keeping their activations: "
        "attention (the attention core: scores, softmax, their product with V) and/or mlp (the MLP sub-layer from "
        "its input: norm, up-projection, activation). Empty: none.",
    )
    compile: bool = Field(
        False,
        description="Compile every transformer block with torch.compile (fuses norms, activations and residual "
        "adds); where the backend cannot compile on the machine the blocks run eagerly, with a warning.",
    )
    float8: Float8 | None = Field(
        None,
        description="Run the blocks' linear layers in float8 (torchao's float8 training); empty: bf16. "
        "Needs a GPU of compute capability 8.9+ (H100, H200, L40S).",
    )
    dataset: str = Field(
        "stdlib",
        min_length=1,
        description="'stdlib' (byte-level tokens of the Python standard library sources), the path of a token file, "
        "or a glob of token files (each weighted by its token count).",
    )
    datasets: list[DatasetSource] = Field(
        default_factory=list,
        max_length=limits.MAX_LIST_LENGTH,
        description="Several token files (paths or globs) with mixing weights; replaces dataset when set.",
    )
    token_dtype: TokenDtype = Field(
        "uint16",
        description="Element type of the token files: uint16 (vocabulary up to 65,536) or uint32 (larger ones, e.g. Llama 3's 128,256).",
    )
    document_mask: bool = Field(
        False,
        description="Mask attention at document boundaries: a token attends only to earlier tokens of its own "
        "document (documents end with the end-of-text id that meshtrain data prepare recorded in the token "
        "files' metadata), and positions restart at 0 at each document start.",
    )
    document_length: int | None = Field(
        None,
        ge=1,
        le=limits.MAX_SEQ_LEN,
        description="The documents' attention-weighted length in tokens, sum(d^2) / sum(d) over their lengths d, "
        "for the planner's model FLOPs (the MFU numerator) under documentMask: attention is counted over "
        "documents instead of whole windows (meshtrain data prepare records it as attention_length). Step "
        "time still counts whole windows (the masked kernel computes them). Unset: whole windows.",
    )
    sampling: Sampling = Field(
        "random",
        description="random: each window drawn uniformly (with replacement) from the seed and the step; epochs: "
        "every non-overlapping window once per epoch, in a seeded order that no resume or resize changes.",
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


def _eval_has_data(t: Training) -> str | None:
    ev = t.eval
    if ev.interval and not ev.dataset and not ev.held_out:
        return (
            f"eval.interval={ev.interval} but neither eval.dataset nor eval.heldOut is set: give a held-out "
            "token file, or a share of the training data to hold out (e.g. heldOut: 0.01)"
        )
    return None


def _one_dataset_field(t: Training) -> str | None:
    if t.datasets and t.dataset != "stdlib":
        return (
            f"both dataset={t.dataset!r} and datasets ({len(t.datasets)} sources) are set: "
            "datasets replaces dataset, so remove one of them"
        )
    return None


def _learning_rate_order(t: Training) -> str | None:
    if t.min_learning_rate > t.learning_rate:
        return f"minLearningRate={t.min_learning_rate} exceeds learningRate={t.learning_rate}"
    return None


def _selective_or_full_recompute(t: Training) -> str | None:
    if t.activation_checkpointing and t.selective_recompute:
        return (
            f"selectiveRecompute={list(t.selective_recompute)} with activationCheckpointing=true: "
            "full activation checkpointing already recomputes every part of every block; set one of them"
        )
    return None


def _float8_needs_bf16(t: Training) -> str | None:
    if t.float8 is not None and t.precision == "fp32":
        return (
            "float8 is set with precision=fp32: torchao's float8 linears take bf16 inputs and give bf16 "
            "outputs; set training.precision: bf16 (or auto, which is bf16 on a GPU) or remove training.float8"
        )
    return None


def _documents_known(t: Training) -> str | None:
    if t.document_mask and not t.datasets and t.dataset == "stdlib":
        return (
            "documentMask=true but dataset is 'stdlib', the built-in byte corpus, which has no end-of-text "
            "id: prepare token files with meshtrain data prepare (each document ends with the tokenizer's "
            "end-of-text id) or set documentMask: false"
        )
    return None


def _epochs_without_weights(t: Training) -> str | None:
    weighted = [source.path for source in t.datasets if source.weight != 1.0]
    if t.sampling == "epochs" and weighted:
        return (
            f"sampling=epochs with {len(weighted)} weighted dataset(s) (e.g. {base.quoted(weighted[0])}): an epoch takes every "
            "window of every file once, so each source's share is its token count; remove the "
            "weights or use sampling: random"
        )
    return None


RULES: tuple[base.Rule[Training], ...] = (
    base.Rule(
        "float8-needs-bf16",
        "spec.training.float8",
        "!has(self.training.float8) || !has(self.training.precision) || self.training.precision != 'fp32'",
        "training.float8 needs training.precision bf16 (or auto, bf16 on a GPU), not fp32",
        _float8_needs_bf16,
    ),
    base.Rule(
        "eval-has-data",
        "spec.training.eval",
        "!has(self.training.eval) || !has(self.training.eval.interval) || self.training.eval.interval == 0 || has(self.training.eval.dataset) || (has(self.training.eval.heldOut) && self.training.eval.heldOut > 0.0)",
        "training.eval.interval needs training.eval.dataset or training.eval.heldOut > 0",
        _eval_has_data,
    ),
    base.Rule(
        "one-dataset-field",
        "spec.training.datasets",
        "!has(self.training.datasets) || size(self.training.datasets) == 0 || self.training.dataset == 'stdlib'",
        "set training.dataset or training.datasets, not both",
        _one_dataset_field,
    ),
    base.Rule(
        "learning-rate-order",
        "spec.training.minLearningRate",
        "self.training.minLearningRate <= self.training.learningRate",
        "training.minLearningRate must not exceed training.learningRate",
        _learning_rate_order,
    ),
    base.Rule(
        "documents-known",
        "spec.training.documentMask",
        "!has(self.training.documentMask) || !self.training.documentMask || (has(self.training.datasets) && size(self.training.datasets) > 0) || (has(self.training.dataset) && self.training.dataset != 'stdlib')",
        "training.documentMask needs token files with an end-of-text id (meshtrain data prepare); the "
        "built-in 'stdlib' corpus has none",
        _documents_known,
    ),
    base.Rule(
        "epochs-without-weights",
        "spec.training.sampling",
        "!has(self.training.sampling) || self.training.sampling != 'epochs' || !has(self.training.datasets) || self.training.datasets.all(d, !has(d.weight) || d.weight == 1.0)",
        "training.sampling: epochs takes every window of every file once per epoch: "
        "training.datasets weights do not apply (remove them or use sampling: random)",
        _epochs_without_weights,
    ),
    base.Rule(
        "selective-or-full-recompute",
        "spec.training.selectiveRecompute",
        "!self.training.activationCheckpointing || size(self.training.selectiveRecompute) == 0",
        "training.selectiveRecompute and training.activationCheckpointing exclude each other (full "
        "checkpointing already recomputes every part of every block)",
        _selective_or_full_recompute,
    ),
)
"""Rules on the training section alone (batch arithmetic and the learning-rate scaling's
reference read the parallelism too: :mod:`meshtrain.api.spec.cross_section`)."""
