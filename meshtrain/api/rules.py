"""Cross-field rules of a TrainingJob spec, each stated once for Python and for CEL.

Every rule has a Python check (which sees the resolved model shape, presets
included, and reports the actual values) and, where the API server can decide
it from the object alone, a CEL expression that the CRD carries as an
``x-kubernetes-validations`` entry so ``kubectl apply`` refuses the job.  The
CEL form only judges explicit model fields; preset-based shapes are checked by
the operator, which reports the same message in the job's status.

Pure: no I/O.  Single-field constraints (minimums, enums) live on the model in
:mod:`meshtrain.api.spec`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pydantic
from pydantic.alias_generators import to_snake

from meshtrain.api import elastic
from meshtrain.api.spec import TrainingJobSpec


class Problem(pydantic.BaseModel):
    """One broken rule: the field path, and a message with the values and the fix."""

    model_config = pydantic.ConfigDict(frozen=True)

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclasses.dataclass(frozen=True)
class Rule:
    """A cross-field invariant."""

    name: str
    """Short identifier used in tests and docs."""
    path: str
    """Field the message points at (YAML path from ``spec``)."""
    cel: str | None
    """CEL over the spec object (``self``) for the CRD; None when only Python can judge it."""
    cel_message: str
    """Static message the API server prints when the CEL rule fails."""
    check: Callable[[TrainingJobSpec], str | None]
    """Returns a message with the values when the rule is broken, else None."""


def _tensor_divides_gpus(spec: TrainingJobSpec) -> str | None:
    tp, gpus = spec.parallelism.tensor, spec.resources.gpus_per_node
    if gpus % tp:
        return (
            f"tensor={tp} does not divide gpusPerNode={gpus}; a tensor-parallel group must stay inside one "
            f"node's NVLink domain: choose tensor from the divisors of {gpus}"
        )
    return None


def _world_multiple_of_node(spec: TrainingJobSpec) -> str | None:
    world, gpus = spec.world_size, spec.resources.gpus_per_node
    if world % gpus:
        return (
            f"world size data x pipeline x tensor = {spec.parallelism.layout_string} = {world} is not a multiple "
            f"of gpusPerNode={gpus}; every pod runs gpusPerNode ranks: change the degrees or gpusPerNode"
        )
    return None


def _batch_arithmetic(spec: TrainingJobSpec) -> str | None:
    t, p = spec.training, spec.parallelism
    if t.global_batch is not None and t.global_batch != t.effective_global_batch(p):
        return (
            f"globalBatch={t.global_batch} but microBatch x microBatches x data = {t.micro_batch} x "
            f"{p.micro_batches} x {p.data} = {t.effective_global_batch(p)}: make them equal or leave globalBatch empty"
        )
    return None


def _layers_split_over_stages(spec: TrainingJobSpec) -> str | None:
    shape, p = spec.model.shape(), spec.parallelism
    chunks = p.pipeline * p.virtual_stages
    if shape.layers % chunks:
        return (
            f"layers={shape.layers} is not divisible by pipeline x virtualStages = {p.pipeline} x {p.virtual_stages} = "
            f"{chunks}; stages must be balanced: change model.layers or the pipeline degree"
        )
    return None


def _heads_split_over_tensor(spec: TrainingJobSpec) -> str | None:
    shape, tp = spec.model.shape(), spec.parallelism.tensor
    if shape.heads % tp:
        return f"heads={shape.heads} is not divisible by tensor={tp}; each tensor-parallel rank owns whole heads"
    return None


def _hidden_split_over_heads(spec: TrainingJobSpec) -> str | None:
    shape = spec.model.shape()
    if shape.hidden % shape.heads:
        return f"hidden={shape.hidden} is not divisible by heads={shape.heads}"
    return None


def _rope_scaling_frequency_band(spec: TrainingJobSpec) -> str | None:
    scaling = spec.model.shape().rope_scaling
    if scaling is not None and scaling.low_freq_factor >= scaling.high_freq_factor:
        return (
            f"lowFreqFactor={scaling.low_freq_factor} is not below highFreqFactor={scaling.high_freq_factor}; "
            "the blended band between them would be empty (Llama 3.1 uses 1 and 4)"
        )
    return None


def _rope_scaling_needs_llama(spec: TrainingJobSpec) -> str | None:
    shape = spec.model.shape()
    if shape.rope_scaling is not None and shape.family != "llama":
        return f"ropeScaling is set but family={shape.family}; only the llama family has RoPE: remove it"
    return None


def _ffn_split_over_tensor(spec: TrainingJobSpec) -> str | None:
    shape, tp = spec.model.shape(), spec.parallelism.tensor
    if shape.ffn_hidden % tp:
        return f"ffnHidden={shape.ffn_hidden} is not divisible by tensor={tp}"
    return None


def _sequence_split_over_tensor(spec: TrainingJobSpec) -> str | None:
    shape, p = spec.model.shape(), spec.parallelism
    if p.sequence_parallel and shape.seq_len % p.tensor:
        return f"sequenceParallel needs seqLen divisible by tensor: seqLen={shape.seq_len}, tensor={p.tensor}"
    return None


def _virtual_stages_need_interleaving(spec: TrainingJobSpec) -> str | None:
    p = spec.parallelism
    if p.schedule == "interleaved-1f1b" and (p.virtual_stages < 2 or p.pipeline < 2):
        return (
            f"interleaved-1f1b needs pipeline >= 2 and virtualStages >= 2 (got pipeline={p.pipeline}, "
            f"virtualStages={p.virtual_stages}); use 1f1b otherwise"
        )
    if p.schedule != "interleaved-1f1b" and p.virtual_stages != 1:
        return f"virtualStages={p.virtual_stages} only applies to schedule interleaved-1f1b (schedule is {p.schedule})"
    return None


def _interleaved_micro_batches(spec: TrainingJobSpec) -> str | None:
    p = spec.parallelism
    if p.schedule == "interleaved-1f1b" and p.micro_batches % p.pipeline:
        return (
            f"interleaved-1f1b runs micro-batches in rounds of pipeline={p.pipeline}: microBatches={p.micro_batches} "
            f"must be a multiple of it"
        )
    return None


def _model_shape_complete(spec: TrainingJobSpec) -> str | None:
    missing = spec.model.missing_fields()
    if missing:
        return f"no preset and no value for {', '.join(missing)}: set model.preset or give every shape field"
    return None


def _kv_heads_divide_heads(spec: TrainingJobSpec) -> str | None:
    shape = spec.model.shape()
    if shape.family == "gpt" and shape.kv_heads not in (0, shape.heads):
        return f"kvHeads={shape.kv_heads} needs family llama (gpt uses multi-head attention: kvHeads = heads)"
    if shape.heads % shape.key_value_heads:
        return (
            f"heads={shape.heads} is not a multiple of kvHeads={shape.key_value_heads}; "
            "each key/value head serves an equal group of query heads"
        )
    return None


def _kv_heads_split_over_tensor(spec: TrainingJobSpec) -> str | None:
    kv, tp = spec.model.shape().key_value_heads, spec.parallelism.tensor
    if kv % tp and tp % kv:
        return (
            f"kvHeads={kv} and tensor={tp}: each tensor-parallel rank needs whole key/value heads, so "
            f"either tensor divides kvHeads (the heads are split) or kvHeads divides tensor (each head "
            f"is replicated on tensor/kvHeads ranks): choose tensor from the divisors or multiples of {kv}"
        )
    return None


def _tied_embeddings_across_stages_unsharded(spec: TrainingJobSpec) -> str | None:
    par = spec.parallelism
    if spec.model.shape().tie_embeddings and par.pipeline > 1 and par.zero_stage >= 2:
        return (
            f"tieEmbeddings with pipeline={par.pipeline} keeps the matrix on the first and the last stage "
            f"and sums their gradients whole, which ZeRO-{par.zero_stage} does not hold (each rank keeps a "
            "shard): use zeroStage 0 or 1, pipeline 1 or untied embeddings"
        )
    return None


def _eval_has_data(spec: TrainingJobSpec) -> str | None:
    ev = spec.training.eval
    if ev.interval and not ev.dataset and not ev.held_out:
        return (
            f"eval.interval={ev.interval} but neither eval.dataset nor eval.heldOut is set: give a held-out "
            "token file, or a share of the training data to hold out (e.g. heldOut: 0.01)"
        )
    return None


def _one_dataset_field(spec: TrainingJobSpec) -> str | None:
    t = spec.training
    if t.datasets and t.dataset != "stdlib":
        return (
            f"both dataset={t.dataset!r} and datasets ({len(t.datasets)} sources) are set: "
            "datasets replaces dataset, so remove one of them"
        )
    return None


def _compression_needs_data_parallel(spec: TrainingJobSpec) -> str | None:
    par = spec.parallelism
    mode = par.gradient_compression.mode
    if mode != "none" and par.data < 2:
        return (
            f"gradientCompression.mode={mode} with data={par.data}: there is no data-parallel reduction "
            "to compress: set data >= 2 or mode none"
        )
    if mode != "none" and par.zero_stage >= 2:
        return (
            f"gradientCompression.mode={mode} with zeroStage={par.zero_stage}: "
            f"ZeRO-{par.zero_stage}'s reduce-scatter is not compressed: "
            "use zeroStage 0 or 1, or mode none"
        )
    return None


def _hierarchical_all_reduce_fits(spec: TrainingJobSpec) -> str | None:
    par, gpus = spec.parallelism, spec.resources.gpus_per_node
    if par.all_reduce != "hierarchical":
        return None
    if par.data < 2 or par.zero_stage >= 2 or par.gradient_compression.mode != "none":
        return (
            f"allReduce=hierarchical with data={par.data}, zeroStage={par.zero_stage}, "
            f"gradientCompression.mode={par.gradient_compression.mode}: it replaces the plain data-parallel "
            "all-reduce, so it needs data >= 2, zeroStage 0 or 1 and mode none: set allReduce flat or change those"
        )
    per_node = min(max(gpus // par.tensor, 1), par.data)
    if par.data % per_node:
        return (
            f"allReduce=hierarchical with data={par.data} and {per_node} data-parallel ranks per node "
            f"(gpusPerNode={gpus} / tensor={par.tensor}): every node must hold the same number of a group's "
            "ranks: choose data a multiple of gpusPerNode / tensor, or allReduce flat"
        )
    return None


def _powersgd_rank_fits(spec: TrainingJobSpec) -> str | None:
    par = spec.parallelism
    if par.gradient_compression.mode != "powersgd" or spec.model.missing_fields():
        return None
    shape = spec.model.shape()
    smallest = min(shape.hidden // par.tensor, shape.seq_len)
    rank = par.gradient_compression.rank
    if rank > smallest:
        return (
            f"gradientCompression.rank={rank} is larger than the smallest weight matrix dimension "
            f"{smallest} (min of hidden/tensor = {shape.hidden}/{par.tensor} and seqLen = {shape.seq_len}): "
            f"choose a rank of at most {smallest}"
        )
    return None


def _learning_rate_order(spec: TrainingJobSpec) -> str | None:
    t = spec.training
    if t.min_learning_rate > t.learning_rate:
        return f"minLearningRate={t.min_learning_rate} exceeds learningRate={t.learning_rate}"
    return None


RENDEZVOUS_PORT = 29500
"""torchrun's rendezvous port in every pod (``meshtrain.operator.policy.naming.MASTER_PORT``)."""


def _metrics_ports(spec: TrainingJobSpec) -> str | None:
    first, count = spec.metrics.port, spec.resources.gpus_per_node
    last = first + count - 1
    if last > 65535:
        return (
            f"metrics.port={first} with gpusPerNode={count} needs ports {first}-{last}, past 65535 "
            f"(each local rank serves metrics.port + its local rank): choose a port <= {65536 - count}"
        )
    if first <= RENDEZVOUS_PORT <= last:
        return (
            f"metrics.port={first} with gpusPerNode={count} takes ports {first}-{last}, which include the "
            f"rendezvous port {RENDEZVOUS_PORT}: choose a port above {RENDEZVOUS_PORT} or at most {RENDEZVOUS_PORT - count}"
        )
    return None


SHAPE_RULE = Rule(
    "model-shape-complete",
    "spec.model",
    "has(self.preset) || (has(self.layers) && has(self.hidden) && has(self.heads) && has(self.vocab) && has(self.seqLen))",
    "model needs a preset or all of layers, hidden, heads, vocab, seqLen",
    _model_shape_complete,
)

# Environment the operator sets for torchrun and the trainer; a job may not override it.
RESERVED_ENV_PREFIXES = ("MESHTRAIN_", "PET_", "TORCHELASTIC_")
RESERVED_ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
# A plain `value` under such a name is almost certainly a credential.
SECRET_ENV_NAME = r"(?i)(secret|token|passw(or)?d|api_?key|access_?key|private_?key|credential)"
# Labels the operator selects its pods by.
RESERVED_LABEL_PREFIX = "meshtrain.io/"
RESERVED_LABELS = ("app.kubernetes.io/managed-by",)


def _env_value_or_source(spec: TrainingJobSpec) -> str | None:
    for i, var in enumerate(spec.pod.env):
        sources = var.value_from and [
            s
            for s in (
                var.value_from.secret_key_ref,
                var.value_from.config_map_key_ref,
                var.value_from.field_ref,
            )
            if s is not None
        ]
        if (var.value is None) == (var.value_from is None) or (
            var.value_from is not None and len(sources or []) != 1
        ):
            return (
                f"env[{i}] {var.name} must set exactly one of value or valueFrom, and valueFrom exactly "
                "one of secretKeyRef, configMapKeyRef, fieldRef"
            )
    return None


def _env_not_reserved(spec: TrainingJobSpec) -> str | None:
    for i, var in enumerate(spec.pod.env):
        if var.name.startswith(RESERVED_ENV_PREFIXES) or var.name in RESERVED_ENV_NAMES:
            return (
                f"env[{i}] {var.name} is set by the operator for torchrun and the trainer "
                f"({', '.join(p + '*' for p in RESERVED_ENV_PREFIXES)}, {', '.join(RESERVED_ENV_NAMES)}): "
                "remove it; the layout comes from spec.parallelism"
            )
    return None


def _env_no_plain_secrets(spec: TrainingJobSpec) -> str | None:
    for i, var in enumerate(spec.pod.env):
        if var.value is not None and re.search(SECRET_ENV_NAME, var.name):
            return (
                f"env[{i}] {var.name} looks like a credential but has a plain value, which anyone who "
                "can read the TrainingJob sees: put it in a Secret and use valueFrom.secretKeyRef"
            )
    return None


def _labels_not_reserved(spec: TrainingJobSpec) -> str | None:
    taken = sorted(
        k for k in spec.pod.labels if k.startswith(RESERVED_LABEL_PREFIX) or k in RESERVED_LABELS
    )
    if taken:
        return (
            f"labels {taken} are the operator's own (it selects its pods by them): "
            f"choose keys outside {RESERVED_LABEL_PREFIX}* and {', '.join(RESERVED_LABELS)}"
        )
    return None


def _custom_trainer_command(spec: TrainingJobSpec) -> str | None:
    program = spec.trainer
    if program.type == "custom" and not program.command:
        return (
            "trainer.type is custom but trainer.command is empty: give the program to run, e.g. "
            "[torchrun, /app/train.py] (torchrun reads the gang from the PET_* variables)"
        )
    if program.type == "builtin" and (program.command or program.args or program.working_dir):
        return (
            "trainer.command, args and workingDir are for trainer.type custom; the built-in trainer "
            "is configured by the model, training and parallelism sections: remove them or set "
            "trainer.type: custom"
        )
    return None


def _lr_scaling_reference(spec: TrainingJobSpec) -> str | None:
    scaling = spec.training.lr_scaling
    if scaling.rule != "none" and scaling.reference_batch is None:
        return (
            f"lrScaling.rule is {scaling.rule} but referenceBatch is empty: give the global batch "
            f"learningRate was tuned at (this layout's is {spec.global_batch})"
        )
    return None


def _elastic_bounds(spec: TrainingJobSpec) -> str | None:
    bounds = spec.run_policy.elastic
    if bounds is not None and bounds.min_data > bounds.max_data:
        return (
            f"elastic.minData={bounds.min_data} is above elastic.maxData={bounds.max_data}: "
            "minData is the smallest data-parallel degree, maxData the largest"
        )
    return None


def _straggler_replace_needs_peers(spec: TrainingJobSpec) -> str | None:
    data = spec.parallelism.data
    if spec.run_policy.straggler_policy.action == "replace" and data < 2:
        return (
            f"stragglerPolicy.action is replace but parallelism.data={data}: a straggler is found by comparing "
            "a rank with its data-parallel peers, and there are none: set data >= 2 or action report"
        )
    return None


def _elastic_holds_data(spec: TrainingJobSpec) -> str | None:
    bounds, data = spec.run_policy.elastic, spec.parallelism.data
    if bounds is not None and not bounds.min_data <= data <= bounds.max_data:
        return (
            f"parallelism.data={data} is outside elastic [minData={bounds.min_data}, "
            f"maxData={bounds.max_data}]: the declared degree must be one the job may run at"
        )
    return None


def _elastic_min_keeps_batch(spec: TrainingJobSpec) -> str | None:
    bounds = spec.run_policy.elastic
    if bounds is None:
        return None
    smallest = elastic.size_at(spec, bounds.min_data)
    if smallest is None or not smallest.keeps_global_batch:
        par = spec.parallelism
        step = " x pipeline" if par.schedule == "interleaved-1f1b" else ""
        return (
            f"elastic.minData={bounds.min_data} cannot keep the global batch {spec.global_batch}: it must be "
            f"divisible by microBatch={spec.training.micro_batch} x minData{step}, minData x pipeline x tensor a "
            f"multiple of gpusPerNode={spec.resources.gpus_per_node} (and minData >= 2 with gradientCompression): "
            f"pick a minData that divides microBatches x data = {par.micro_batches * par.data}"
        )
    return None


def _straggler_replace_keeps_checkpoints(spec: TrainingJobSpec) -> str | None:
    if spec.run_policy.straggler_policy.action == "replace" and not spec.checkpoint.claim_name:
        return (
            "stragglerPolicy.action is replace but checkpoint.claimName is empty: the rebuilt gang runs on "
            "other nodes and an emptyDir checkpoint stays behind, so training would restart from step 0: "
            "give checkpoint.claimName (a PersistentVolumeClaim every node can mount) or use action report"
        )
    return None


def _elastic_keeps_checkpoints(spec: TrainingJobSpec) -> str | None:
    bounds = spec.run_policy.elastic
    if bounds is not None and bounds.max_data > bounds.min_data and not spec.checkpoint.claim_name:
        return (
            f"runPolicy.elastic [minData={bounds.min_data}, maxData={bounds.max_data}] but checkpoint.claimName "
            "is empty: every resize rebuilds the gang, possibly on other nodes, and an emptyDir checkpoint stays "
            "behind, so training would restart from step 0 at each: give checkpoint.claimName (a "
            "PersistentVolumeClaim every node can mount) or drop runPolicy.elastic"
        )
    return None


def _selective_or_full_recompute(spec: TrainingJobSpec) -> str | None:
    training = spec.training
    if training.activation_checkpointing and training.selective_recompute:
        return (
            f"selectiveRecompute={list(training.selective_recompute)} with activationCheckpointing=true: "
            "full activation checkpointing already recomputes every part of every block; set one of them"
        )
    return None


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


RULES: tuple[Rule, ...] = (
    Rule(
        "tensor-divides-gpus-per-node",
        "spec.parallelism.tensor",
        "self.resources.gpusPerNode % self.parallelism.tensor == 0",
        "parallelism.tensor must divide resources.gpusPerNode (a tensor-parallel group stays inside one NVLink domain)",
        _tensor_divides_gpus,
    ),
    Rule(
        "world-multiple-of-gpus-per-node",
        "spec.parallelism",
        "(self.parallelism.data * self.parallelism.pipeline * self.parallelism.tensor) % self.resources.gpusPerNode == 0",
        "world size data x pipeline x tensor must be a multiple of resources.gpusPerNode (one pod runs gpusPerNode ranks)",
        _world_multiple_of_node,
    ),
    Rule(
        "global-batch-arithmetic",
        "spec.training.globalBatch",
        "!has(self.training.globalBatch) || self.training.globalBatch == self.training.microBatch * self.parallelism.microBatches * self.parallelism.data",
        "training.globalBatch must equal training.microBatch x parallelism.microBatches x parallelism.data",
        _batch_arithmetic,
    ),
    Rule(
        "virtual-stages-need-interleaving",
        "spec.parallelism.virtualStages",
        "self.parallelism.schedule == 'interleaved-1f1b' ? (self.parallelism.virtualStages >= 2 && self.parallelism.pipeline >= 2) : self.parallelism.virtualStages == 1",
        "interleaved-1f1b needs pipeline >= 2 and virtualStages >= 2; other schedules need virtualStages == 1",
        _virtual_stages_need_interleaving,
    ),
    Rule(
        "interleaved-micro-batches",
        "spec.parallelism.microBatches",
        "self.parallelism.schedule != 'interleaved-1f1b' || self.parallelism.microBatches % self.parallelism.pipeline == 0",
        "interleaved-1f1b needs parallelism.microBatches to be a multiple of parallelism.pipeline",
        _interleaved_micro_batches,
    ),
    Rule(
        "layers-split-over-stages",
        "spec.model.layers",
        "!has(self.model.layers) || self.model.layers % (self.parallelism.pipeline * self.parallelism.virtualStages) == 0",
        "model.layers must be divisible by parallelism.pipeline x parallelism.virtualStages (balanced stages)",
        _layers_split_over_stages,
    ),
    Rule(
        "heads-split-over-tensor",
        "spec.model.heads",
        "!has(self.model.heads) || self.model.heads % self.parallelism.tensor == 0",
        "model.heads must be divisible by parallelism.tensor",
        _heads_split_over_tensor,
    ),
    Rule(
        "hidden-split-over-heads",
        "spec.model.hidden",
        "!has(self.model.hidden) || !has(self.model.heads) || self.model.hidden % self.model.heads == 0",
        "model.hidden must be divisible by model.heads",
        _hidden_split_over_heads,
    ),
    Rule(
        "rope-scaling-frequency-band",
        "spec.model.ropeScaling.highFreqFactor",
        "!has(self.model.ropeScaling) || self.model.ropeScaling.lowFreqFactor < self.model.ropeScaling.highFreqFactor",
        "model.ropeScaling.lowFreqFactor must be below model.ropeScaling.highFreqFactor",
        _rope_scaling_frequency_band,
    ),
    Rule(
        "rope-scaling-needs-llama",
        "spec.model.ropeScaling",
        "!has(self.model.ropeScaling) || (has(self.model.family) ? self.model.family == 'llama' : (has(self.model.preset) && self.model.preset.startsWith('llama')))",
        "model.ropeScaling needs the llama family (GPT has no RoPE)",
        _rope_scaling_needs_llama,
    ),
    Rule(
        "ffn-split-over-tensor",
        "spec.model.ffnHidden",
        "!has(self.model.ffnHidden) || self.model.ffnHidden % self.parallelism.tensor == 0",
        "model.ffnHidden must be divisible by parallelism.tensor",
        _ffn_split_over_tensor,
    ),
    Rule(
        "sequence-split-over-tensor",
        "spec.model.seqLen",
        "!self.parallelism.sequenceParallel || !has(self.model.seqLen) || self.model.seqLen % self.parallelism.tensor == 0",
        "sequenceParallel needs model.seqLen divisible by parallelism.tensor",
        _sequence_split_over_tensor,
    ),
    Rule(
        "kv-heads-divide-heads",
        "spec.model.kvHeads",
        "!has(self.model.kvHeads) || ((!has(self.model.family) || self.model.family == 'llama') && (!has(self.model.heads) || self.model.heads % self.model.kvHeads == 0))",
        "model.kvHeads needs family llama and must divide model.heads",
        _kv_heads_divide_heads,
    ),
    Rule(
        "kv-heads-split-over-tensor",
        "spec.model.kvHeads",
        "!has(self.model.kvHeads) || self.model.kvHeads == 0 || self.model.kvHeads % self.parallelism.tensor == 0 || self.parallelism.tensor % self.model.kvHeads == 0",
        "model.kvHeads and parallelism.tensor must divide one another (key/value heads are split, or replicated when fewer than tensor)",
        _kv_heads_split_over_tensor,
    ),
    Rule(
        "tied-embeddings-across-stages-unsharded",
        "spec.model.tieEmbeddings",
        "!has(self.model.tieEmbeddings) || !self.model.tieEmbeddings || self.parallelism.pipeline == 1 || !has(self.parallelism.zeroStage) || self.parallelism.zeroStage < 2",
        "model.tieEmbeddings with parallelism.pipeline > 1 needs parallelism.zeroStage 0 or 1 (the two stages' gradients are summed whole)",
        _tied_embeddings_across_stages_unsharded,
    ),
    Rule(
        "eval-has-data",
        "spec.training.eval",
        "!has(self.training.eval) || !has(self.training.eval.interval) || self.training.eval.interval == 0 || has(self.training.eval.dataset) || (has(self.training.eval.heldOut) && self.training.eval.heldOut > 0.0)",
        "training.eval.interval needs training.eval.dataset or training.eval.heldOut > 0",
        _eval_has_data,
    ),
    Rule(
        "one-dataset-field",
        "spec.training.datasets",
        "!has(self.training.datasets) || size(self.training.datasets) == 0 || self.training.dataset == 'stdlib'",
        "set training.dataset or training.datasets, not both",
        _one_dataset_field,
    ),
    Rule(
        "compression-needs-data-parallel",
        "spec.parallelism.gradientCompression.mode",
        "self.parallelism.gradientCompression.mode == 'none' || "
        "(self.parallelism.data >= 2 && self.parallelism.zeroStage < 2)",
        "parallelism.gradientCompression needs parallelism.data >= 2 and zeroStage 0 or 1 (mode none otherwise)",
        _compression_needs_data_parallel,
    ),
    Rule(
        "hierarchical-all-reduce-fits",
        "spec.parallelism.allReduce",
        "!has(self.parallelism.allReduce) || self.parallelism.allReduce == 'flat' || "
        "(self.parallelism.data >= 2 && self.parallelism.zeroStage < 2 && "
        "self.parallelism.gradientCompression.mode == 'none' && "
        "(self.resources.gpusPerNode / self.parallelism.tensor >= self.parallelism.data || "
        "self.parallelism.data % (self.resources.gpusPerNode / self.parallelism.tensor) == 0))",
        "parallelism.allReduce hierarchical needs data >= 2, zeroStage 0 or 1, gradientCompression none, and data a "
        "multiple of gpusPerNode / tensor (the same number of a group's ranks on every node)",
        _hierarchical_all_reduce_fits,
    ),
    Rule(
        "powersgd-rank-fits",
        "spec.parallelism.gradientCompression.rank",
        "self.parallelism.gradientCompression.mode != 'powersgd' || "
        "((!has(self.model.hidden) || self.parallelism.gradientCompression.rank * self.parallelism.tensor <= self.model.hidden) && "
        "(!has(self.model.seqLen) || self.parallelism.gradientCompression.rank <= self.model.seqLen))",
        "parallelism.gradientCompression.rank must be at most the smallest weight matrix dimension (hidden/tensor and seqLen)",
        _powersgd_rank_fits,
    ),
    Rule(
        "learning-rate-order",
        "spec.training.minLearningRate",
        "self.training.minLearningRate <= self.training.learningRate",
        "training.minLearningRate must not exceed training.learningRate",
        _learning_rate_order,
    ),
    Rule(
        "metrics-ports-fit",
        "spec.metrics.port",
        f"self.metrics.port + self.resources.gpusPerNode <= 65536 && (self.metrics.port > {RENDEZVOUS_PORT} "
        f"|| self.metrics.port + self.resources.gpusPerNode <= {RENDEZVOUS_PORT})",
        f"metrics.port + gpusPerNode - 1 must be at most 65535 and the range must not contain the rendezvous port {RENDEZVOUS_PORT} "
        "(local rank r serves metrics on metrics.port + r)",
        _metrics_ports,
    ),
    Rule(
        "lr-scaling-reference",
        "spec.training.lrScaling.referenceBatch",
        "!has(self.training.lrScaling) || self.training.lrScaling.rule == 'none' "
        "|| has(self.training.lrScaling.referenceBatch)",
        "training.lrScaling.rule linear or sqrt needs training.lrScaling.referenceBatch "
        "(the global batch learningRate was tuned at)",
        _lr_scaling_reference,
    ),
    Rule(
        "elastic-bounds",
        "spec.runPolicy.elastic.minData",
        "!has(self.runPolicy.elastic) || self.runPolicy.elastic.minData <= self.runPolicy.elastic.maxData",
        "runPolicy.elastic.minData must not exceed runPolicy.elastic.maxData",
        _elastic_bounds,
    ),
    Rule(
        "elastic-holds-data",
        "spec.runPolicy.elastic",
        "!has(self.runPolicy.elastic) || (self.runPolicy.elastic.minData <= self.parallelism.data "
        "&& self.parallelism.data <= self.runPolicy.elastic.maxData)",
        "parallelism.data must lie between runPolicy.elastic.minData and runPolicy.elastic.maxData",
        _elastic_holds_data,
    ),
    Rule(
        "elastic-min-keeps-batch",
        "spec.runPolicy.elastic.minData",
        "!has(self.runPolicy.elastic) || ("
        "(self.runPolicy.elastic.minData * self.parallelism.pipeline * self.parallelism.tensor) "
        "% self.resources.gpusPerNode == 0 && "
        "(self.parallelism.microBatches * self.parallelism.data) % (self.runPolicy.elastic.minData * "
        "(self.parallelism.schedule == 'interleaved-1f1b' ? self.parallelism.pipeline : 1)) == 0 && "
        "(self.parallelism.gradientCompression.mode == 'none' || self.runPolicy.elastic.minData >= 2))",
        "runPolicy.elastic.minData must keep the global batch (divide microBatches x data) and fill whole pods "
        "(minData x pipeline x tensor a multiple of gpusPerNode)",
        _elastic_min_keeps_batch,
    ),
    Rule(
        "elastic-keeps-checkpoints",
        "spec.checkpoint.claimName",
        "!has(self.runPolicy.elastic) || self.runPolicy.elastic.maxData <= self.runPolicy.elastic.minData "
        "|| has(self.checkpoint.claimName)",
        "runPolicy.elastic with maxData above minData needs checkpoint.claimName (each resize rebuilds the "
        "gang and resumes from a checkpoint every node can mount)",
        _elastic_keeps_checkpoints,
    ),
    Rule(
        "straggler-replace-needs-peers",
        "spec.runPolicy.stragglerPolicy.action",
        "!has(self.runPolicy.stragglerPolicy) || self.runPolicy.stragglerPolicy.action != 'replace' "
        "|| self.parallelism.data >= 2",
        "runPolicy.stragglerPolicy.action replace needs parallelism.data >= 2 (a straggler is found by "
        "comparing a rank with its data-parallel peers)",
        _straggler_replace_needs_peers,
    ),
    Rule(
        "straggler-replace-keeps-checkpoints",
        "spec.checkpoint.claimName",
        "!has(self.runPolicy.stragglerPolicy) || self.runPolicy.stragglerPolicy.action != 'replace' "
        "|| has(self.checkpoint.claimName)",
        "runPolicy.stragglerPolicy.action replace needs checkpoint.claimName (the gang is rebuilt on other "
        "nodes and resumes from a checkpoint they can all mount)",
        _straggler_replace_keeps_checkpoints,
    ),
    Rule(
        "selective-or-full-recompute",
        "spec.training.selectiveRecompute",
        "!self.training.activationCheckpointing || size(self.training.selectiveRecompute) == 0",
        "training.selectiveRecompute and training.activationCheckpointing exclude each other (full "
        "checkpointing already recomputes every part of every block)",
        _selective_or_full_recompute,
    ),
    Rule(
        "custom-trainer-command",
        "spec.trainer.command",
        "self.trainer.type == 'custom' ? size(self.trainer.command) > 0 : "
        "(size(self.trainer.command) == 0 && size(self.trainer.args) == 0 && !has(self.trainer.workingDir))",
        "trainer.type custom needs trainer.command; trainer.command, args and workingDir are only "
        "for trainer.type custom",
        _custom_trainer_command,
    ),
    Rule(
        "env-value-or-source",
        "spec.pod.env",
        "self.pod.env.all(e, has(e.value) != has(e.valueFrom) && (!has(e.valueFrom) || "
        "(has(e.valueFrom.secretKeyRef) ? 1 : 0) + (has(e.valueFrom.configMapKeyRef) ? 1 : 0) "
        "+ (has(e.valueFrom.fieldRef) ? 1 : 0) == 1))",
        "every pod.env entry sets exactly one of value or valueFrom, and valueFrom exactly one of "
        "secretKeyRef, configMapKeyRef, fieldRef",
        _env_value_or_source,
    ),
    Rule(
        "env-not-reserved",
        "spec.pod.env",
        "self.pod.env.all(e, "
        + " && ".join(f"!e.name.startsWith('{p}')" for p in RESERVED_ENV_PREFIXES)
        + f" && !(e.name in {_cel_list(RESERVED_ENV_NAMES)}))",
        f"pod.env may not set {', '.join(p + '*' for p in RESERVED_ENV_PREFIXES)} or "
        f"{', '.join(RESERVED_ENV_NAMES)}: the operator sets them for torchrun and the trainer",
        _env_not_reserved,
    ),
    Rule(
        "env-no-plain-secrets",
        "spec.pod.env",
        f"self.pod.env.all(e, !has(e.value) || !e.name.matches('{SECRET_ENV_NAME}'))",
        "a pod.env name that looks like a credential (secret, token, password, api key) needs "
        "valueFrom.secretKeyRef, not a plain value",
        _env_no_plain_secrets,
    ),
    Rule(
        "labels-not-reserved",
        "spec.pod.labels",
        f"self.pod.labels.all(k, !k.startsWith('{RESERVED_LABEL_PREFIX}') && "
        f"!(k in {_cel_list(RESERVED_LABELS)}))",
        f"pod.labels may not use {RESERVED_LABEL_PREFIX}* or {', '.join(RESERVED_LABELS)} "
        "(the operator selects its pods by them)",
        _labels_not_reserved,
    ),
)


QUANTITY = re.compile(r"[+-]?\d*(\.\d*)?(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?")
"""apimachinery's quantity grammar as its parser applies it: a sign, digits and a fraction (each
may be empty: "Gi" and "." parse as zero), then a binary-SI, decimal-SI or exponent suffix."""


def is_quantity(value: str) -> bool:
    """What CEL's ``isQuantity`` (``resource.ParseQuantity``) accepts."""
    return value != "" and QUANTITY.fullmatch(value) is not None


def _quantity_rule(field: str, optional: bool) -> Rule:
    attribute = f"self.resources.{field}"
    cel = f"isQuantity({attribute})"
    path = f"spec.resources.{field}"
    message = (
        f"resources.{field} must be a Kubernetes quantity such as 16Gi, 500m or 2 "
        "(a number with an optional suffix Ki Mi Gi Ti Pi Ei, m k M G T P E, or e<exponent>)"
    )

    def check(spec: TrainingJobSpec) -> str | None:
        value = getattr(spec.resources, to_snake(field))
        if value is None or is_quantity(value):
            return None
        return f"{message}; got {value!r}"

    return Rule(
        f"{field}-is-quantity",
        path,
        f"!has({attribute}) || {cel}" if optional else cel,
        message,
        check,
    )


def _extra_resources_are_quantities(spec: TrainingJobSpec) -> str | None:
    bad = {k: v for k, v in spec.resources.extra_resources.items() if not is_quantity(v)}
    if bad:
        return f"{EXTRA_RESOURCES_MESSAGE}; got {bad}"
    return None


EXTRA_RESOURCES_MESSAGE = (
    "every resources.extraResources value must be a Kubernetes quantity such as 1 or 8"
)


def _extra_resources_leave_the_gpu_to_gpus_per_node(spec: TrainingJobSpec) -> str | None:
    r = spec.resources
    if r.gpu_resource_name in r.extra_resources:
        return (
            f"{EXTRA_GPU_MESSAGE}; got extraResources[{r.gpu_resource_name!r}]="
            f"{r.extra_resources[r.gpu_resource_name]!r} beside gpusPerNode={r.gpus_per_node}"
        )
    return None


EXTRA_GPU_MESSAGE = (
    "resources.extraResources may not name resources.gpuResourceName: set the GPUs per pod with "
    "resources.gpusPerNode (the parallel layout, placement and quota are sized from it)"
)

QUANTITY_RULES: tuple[Rule, ...] = (
    _quantity_rule("cpu", optional=True),
    _quantity_rule("memory", optional=True),
    _quantity_rule("shmSize", optional=False),
    Rule(
        "extra-resources-are-quantities",
        "spec.resources.extraResources",
        "self.resources.extraResources.all(k, isQuantity(self.resources.extraResources[k]))",
        EXTRA_RESOURCES_MESSAGE,
        _extra_resources_are_quantities,
    ),
    Rule(
        "extra-resources-leave-the-gpu-to-gpus-per-node",
        "spec.resources.extraResources",
        "!(self.resources.gpuResourceName in self.resources.extraResources)",
        EXTRA_GPU_MESSAGE,
        _extra_resources_leave_the_gpu_to_gpus_per_node,
    ),
)
"""Quantities the pods carry: malformed, they would make the API server refuse every pod."""

RULES = RULES + QUANTITY_RULES

MAX_NAME_LENGTH = 40
"""Longest TrainingJob name: pod names ``<job>-r<restarts>-<index>`` are pod hostnames and must
stay inside the 63-character DNS label limit."""
DNS_1035_LABEL = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""A Service name (the job's headless Service is named like the job): a DNS-1035 label."""


@dataclasses.dataclass(frozen=True)
class NameRule:
    """A rule on metadata.name, judged by CEL at the root of the object and by Python."""

    name: str
    cel: str
    message: str
    check: Callable[[str], bool]
    """True when the name keeps the rule."""


NAME_RULES: tuple[NameRule, ...] = (
    NameRule(
        "name-length",
        f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
        f"metadata.name must be at most {MAX_NAME_LENGTH} characters (pod hostnames "
        "<name>-r<restarts>-<index> must fit a DNS label)",
        lambda name: len(name) <= MAX_NAME_LENGTH,
    ),
    NameRule(
        "name-dns-1035-label",
        f"self.metadata.name.matches('{DNS_1035_LABEL}')",
        "metadata.name must be a DNS-1035 label: lower-case letters, digits and '-', starting "
        "with a letter and ending with a letter or digit (it names the job's headless Service); "
        "e.g. llama-7b-run2, not llama.7b or 7b-run",
        lambda name: re.fullmatch(DNS_1035_LABEL.strip("^$"), name) is not None,
    ),
)


def check_name(name: str) -> list[Problem]:
    """Every rule ``metadata.name`` breaks, each with the message the API server gives."""
    return [
        Problem(path="metadata.name", message=f"{rule.message}; got {name!r}")
        for rule in NAME_RULES
        if not rule.check(name)
    ]


def check(spec: TrainingJobSpec) -> list[Problem]:
    """Every broken cross-field rule of ``spec`` (empty when valid)."""
    shape_message = SHAPE_RULE.check(spec)
    if shape_message:
        return [Problem(path=SHAPE_RULE.path, message=shape_message)]
    problems = []
    for rule in RULES:
        message = rule.check(spec)
        if message:
            problems.append(Problem(path=rule.path, message=message))
    return problems
