"""The rules of a TrainingJob spec that read more than one section.

A rule on one section alone sits in that section's module; the ones here relate sections:
the layout to the pods (``gpusPerNode``), to the model's shape and to the batch, the metrics
ports to the pods, the run policy to the layout and the checkpoint.  The elastic sizes' rule
is :mod:`meshtrain.api.elastic`'s.  Every message names the fields, the values and the fix.
"""

from __future__ import annotations

import re

from meshtrain.api.spec import TrainingJobSpec, base, metrics, urls


def _tensor_divides_gpus(spec: TrainingJobSpec) -> str | None:
    return spec.parallelism.layout.tensor_split_problem(spec.resources.gpus_per_node)


def _world_multiple_of_node(spec: TrainingJobSpec) -> str | None:
    return spec.parallelism.layout.pod_fill_problem(spec.resources.gpus_per_node)


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


def _sequence_split_over_context(spec: TrainingJobSpec) -> str | None:
    shape, p = spec.model.shape(), spec.parallelism
    if p.context == 1:
        return None
    if shape.seq_len % (2 * p.context):
        return (
            f"context={p.context} splits each sequence into 2 x context = {2 * p.context} chunks (two per "
            f"rank, balanced for the causal mask): seqLen={shape.seq_len} is not divisible by it; choose "
            "seqLen a multiple of 2 x context"
        )
    if p.sequence_parallel and (shape.seq_len // p.context) % p.tensor:
        return (
            f"sequenceParallel with context={p.context} splits each rank's {shape.seq_len // p.context} "
            f"tokens (seqLen / context) over tensor={p.tensor}: make seqLen / context divisible by tensor"
        )
    return None


def _context_parallel_supported(spec: TrainingJobSpec) -> str | None:
    p = spec.parallelism
    if p.context == 1:
        return None
    if p.all_reduce == "hierarchical":
        return (
            f"context={p.context} with allReduce hierarchical: the gradient reduction spans data x context "
            "ranks, which the node-split all-reduce does not group: use allReduce flat, or context 1"
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
    per_node = par.layout.dp_ranks_per_pod(gpus)
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


FLOAT8_ALIGNMENT = 16
"""torch's scaled (float8) matmul needs both dimensions of a weight divisible by 16."""


def _float8_without_tensor(spec: TrainingJobSpec) -> str | None:
    tp = spec.parallelism.tensor
    if spec.training.float8 is not None and tp > 1:
        return (
            f"training.float8 with tensor={tp}: torchao's float8 linears replace torch.nn.Linear, and "
            "meshtrain's own tensor-parallel layers are not nn.Linear (their weights are shards with "
            "their own collectives), so fp8 would not reach them: use tensor 1 (data, pipeline and "
            "ZeRO compose with fp8) or remove training.float8"
        )
    return None


def _float8_dims(spec: TrainingJobSpec) -> str | None:
    if spec.training.float8 is None or spec.model.missing_fields():
        return None
    shape, n = spec.model.shape(), FLOAT8_ALIGNMENT
    if shape.hidden % n or shape.ffn_hidden % n:
        return (
            f"training.float8 with hidden={shape.hidden} and ffnHidden={shape.ffn_hidden}: torch's float8 "
            f"matmul needs every linear's dimensions divisible by {n}: choose hidden and ffnHidden "
            f"multiples of {n} or remove training.float8"
        )
    # llama fuses Q, K and V into one linear of (heads + 2 x kvHeads) x headDim outputs
    qkv = shape.hidden + 2 * shape.key_value_heads * shape.head_dim
    if shape.family == "llama" and qkv % n:
        return (
            f"training.float8 with hidden={shape.hidden}, kvHeads={shape.key_value_heads} and headDim="
            f"{shape.head_dim}: the fused QKV linear's {qkv} outputs are not divisible by {n}, so torch's "
            f"float8 matmul cannot take it: choose heads and kvHeads with 2 x kvHeads x headDim a "
            f"multiple of {n} or remove training.float8"
        )
    return None


def _metrics_ports(spec: TrainingJobSpec) -> str | None:
    first, count = spec.metrics.port, spec.resources.gpus_per_node
    last = first + count - 1
    if last > 65535:
        return (
            f"metrics.port={first} with gpusPerNode={count} needs ports {first}-{last}, past 65535 "
            f"(each local rank serves metrics.port + its local rank): choose a port <= {65536 - count}"
        )
    if first <= metrics.RENDEZVOUS_PORT <= last:
        return (
            f"metrics.port={first} with gpusPerNode={count} takes ports {first}-{last}, which include the "
            f"rendezvous port {metrics.RENDEZVOUS_PORT}: choose a port above {metrics.RENDEZVOUS_PORT} or at most {metrics.RENDEZVOUS_PORT - count}"
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


def _elastic_holds_data(spec: TrainingJobSpec) -> str | None:
    bounds, data = spec.run_policy.elastic, spec.parallelism.data
    if bounds is not None and not bounds.min_data <= data <= bounds.max_data:
        return (
            f"parallelism.data={data} is outside elastic [minData={bounds.min_data}, "
            f"maxData={bounds.max_data}]: the declared degree must be one the job may run at"
        )
    return None


def _persistent(spec: TrainingJobSpec) -> bool:
    """Whether the checkpoints outlive the pods: on a claim, or in a bucket."""
    return bool(spec.checkpoint.claim_name) or urls.is_url(spec.checkpoint.path)


def _elastic_keeps_checkpoints(spec: TrainingJobSpec) -> str | None:
    bounds = spec.run_policy.elastic
    if bounds is not None and bounds.max_data > bounds.min_data and not _persistent(spec):
        return (
            f"runPolicy.elastic [minData={bounds.min_data}, maxData={bounds.max_data}] but checkpoint.claimName "
            "is empty: every resize rebuilds the gang, possibly on other nodes, and an emptyDir checkpoint stays "
            "behind, so training would restart from step 0 at each: give checkpoint.claimName (a "
            "PersistentVolumeClaim every node can mount), an s3:// checkpoint.path, or drop runPolicy.elastic"
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


def _straggler_replace_keeps_checkpoints(spec: TrainingJobSpec) -> str | None:
    if spec.run_policy.straggler_policy.action == "replace" and not _persistent(spec):
        return (
            "stragglerPolicy.action is replace but checkpoint.claimName is empty: the rebuilt gang runs on "
            "other nodes and an emptyDir checkpoint stays behind, so training would restart from step 0: "
            "give checkpoint.claimName (a PersistentVolumeClaim every node can mount), an s3:// checkpoint.path, "
            "or use action report"
        )
    return None


def _warm_spares_fit(spec: TrainingJobSpec) -> str | None:
    spares, gpus = spec.run_policy.recovery.warm_spares, spec.resources.gpus_per_node
    if spares > gpus:
        return (
            f"runPolicy.recovery.warmSpares={spares} is above resources.gpusPerNode={gpus}: a pod never "
            f"loses more ranks than it runs, so more spares only hold memory: choose at most {gpus}"
        )
    return None


def _stage_scope_fills_pods(spec: TrainingJobSpec) -> str | None:
    staged = [i for i, level in enumerate(spec.topology.levels) if level.scope == "stage"]
    p, per = spec.parallelism, spec.resources.gpus_per_node
    stage = p.data * p.context * p.tensor
    if staged and stage % per:
        return (
            f"spec.topology.levels[{staged[0]}] has scope stage, but a pipeline stage's ranks, data x "
            f"context x tensor = {p.data} x {p.context} x {p.tensor} = {stage}, are not a multiple of "
            f"resources.gpusPerNode={per}: stages share pods, so no pod belongs to one stage; make "
            f"data x context x tensor a multiple of {per}, or use scope job"
        )
    return None


def object_urls(spec: TrainingJobSpec) -> list[tuple[str, str]]:
    """(field, URL) of every ``s3://`` URL the spec names."""
    t = spec.training
    named = [
        ("spec.training.dataset", t.dataset),
        *((f"spec.training.datasets[{i}].path", d.path) for i, d in enumerate(t.datasets)),
        ("spec.training.eval.dataset", t.eval.dataset),
        ("spec.model.init.fromHF", spec.model.init.from_hf),
        ("spec.checkpoint.path", spec.checkpoint.path),
    ]
    return [(field, url) for field, url in named if url is not None and urls.is_url(url)]


def _object_storage_for_urls(spec: TrainingJobSpec) -> str | None:
    found = object_urls(spec)
    for field, url in found:
        if not re.fullmatch(urls.PATTERN.strip("^$"), url):
            return (
                f"{field}={base.quoted(url)} is not an s3://bucket/key URL (a bucket of 3-63 lower-case "
                "letters, digits, '.' and '-', then the key): correct the URL"
            )
    if found and spec.object_storage is None:
        field, url = found[0]
        return (
            f"{field}={base.quoted(url)} is an object-storage URL but spec.objectStorage is not set: add "
            "objectStorage: {endpoint: https://<your S3 endpoint>, region: <region>} (and credentialsSecret: "
            "<Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY> unless the pods get credentials from "
            "their service account, e.g. IRSA or EKS pod identity), or use a path in the pod"
        )
    return None


_CEL_URL_FIELDS = " || ".join(
    (
        "self.training.dataset.startsWith('s3://')",
        "(has(self.training.datasets) && self.training.datasets.exists(d, d.path.startsWith('s3://')))",
        "(has(self.training.eval) && has(self.training.eval.dataset) "
        "&& self.training.eval.dataset.startsWith('s3://'))",
        "(has(self.model.init) && has(self.model.init.fromHF) && self.model.init.fromHF.startsWith('s3://'))",
        "self.checkpoint.path.startsWith('s3://')",
    )
)


RULES: tuple[base.Rule[TrainingJobSpec], ...] = (
    base.Rule(
        "tensor-divides-gpus-per-node",
        "spec.parallelism.tensor",
        "self.resources.gpusPerNode % self.parallelism.tensor == 0",
        "parallelism.tensor must divide resources.gpusPerNode (a tensor-parallel group stays inside one NVLink domain)",
        _tensor_divides_gpus,
    ),
    base.Rule(
        "world-multiple-of-gpus-per-node",
        "spec.parallelism",
        "(self.parallelism.data * self.parallelism.pipeline * (has(self.parallelism.context) ? self.parallelism.context : 1) * self.parallelism.tensor) % self.resources.gpusPerNode == 0",
        "world size data x pipeline x context x tensor must be a multiple of resources.gpusPerNode (one pod runs gpusPerNode ranks)",
        _world_multiple_of_node,
    ),
    base.Rule(
        "global-batch-arithmetic",
        "spec.training.globalBatch",
        "!has(self.training.globalBatch) || self.training.globalBatch == self.training.microBatch * self.parallelism.microBatches * self.parallelism.data",
        "training.globalBatch must equal training.microBatch x parallelism.microBatches x parallelism.data",
        _batch_arithmetic,
    ),
    base.Rule(
        "layers-split-over-stages",
        "spec.model.layers",
        "!has(self.model.layers) || self.model.layers % (self.parallelism.pipeline * self.parallelism.virtualStages) == 0",
        "model.layers must be divisible by parallelism.pipeline x parallelism.virtualStages (balanced stages)",
        _layers_split_over_stages,
    ),
    base.Rule(
        "heads-split-over-tensor",
        "spec.model.heads",
        "!has(self.model.heads) || self.model.heads % self.parallelism.tensor == 0",
        "model.heads must be divisible by parallelism.tensor",
        _heads_split_over_tensor,
    ),
    base.Rule(
        "ffn-split-over-tensor",
        "spec.model.ffnHidden",
        "!has(self.model.ffnHidden) || self.model.ffnHidden % self.parallelism.tensor == 0",
        "model.ffnHidden must be divisible by parallelism.tensor",
        _ffn_split_over_tensor,
    ),
    base.Rule(
        "sequence-split-over-tensor",
        "spec.model.seqLen",
        "!self.parallelism.sequenceParallel || !has(self.model.seqLen) || self.model.seqLen % self.parallelism.tensor == 0",
        "sequenceParallel needs model.seqLen divisible by parallelism.tensor",
        _sequence_split_over_tensor,
    ),
    base.Rule(
        "sequence-split-over-context",
        "spec.model.seqLen",
        "!has(self.parallelism.context) || self.parallelism.context == 1 || !has(self.model.seqLen) || "
        "(self.model.seqLen % (2 * self.parallelism.context) == 0 && (!self.parallelism.sequenceParallel || "
        "(self.model.seqLen / self.parallelism.context) % self.parallelism.tensor == 0))",
        "parallelism.context needs model.seqLen divisible by 2 x context (and seqLen / context by tensor under sequenceParallel)",
        _sequence_split_over_context,
    ),
    base.Rule(
        "context-parallel-supported",
        "spec.parallelism.context",
        "!has(self.parallelism.context) || self.parallelism.context == 1 || "
        "!has(self.parallelism.allReduce) || self.parallelism.allReduce == 'flat'",
        "parallelism.context > 1 needs parallelism.allReduce flat",
        _context_parallel_supported,
    ),
    base.Rule(
        "kv-heads-split-over-tensor",
        "spec.model.kvHeads",
        "!has(self.model.kvHeads) || self.model.kvHeads == 0 || self.model.kvHeads % self.parallelism.tensor == 0 || self.parallelism.tensor % self.model.kvHeads == 0",
        "model.kvHeads and parallelism.tensor must divide one another (key/value heads are split, or replicated when fewer than tensor)",
        _kv_heads_split_over_tensor,
    ),
    base.Rule(
        "tied-embeddings-across-stages-unsharded",
        "spec.model.tieEmbeddings",
        "!has(self.model.tieEmbeddings) || !self.model.tieEmbeddings || self.parallelism.pipeline == 1 || !has(self.parallelism.zeroStage) || self.parallelism.zeroStage < 2",
        "model.tieEmbeddings with parallelism.pipeline > 1 needs parallelism.zeroStage 0 or 1 (the two stages' gradients are summed whole)",
        _tied_embeddings_across_stages_unsharded,
    ),
    base.Rule(
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
    base.Rule(
        "powersgd-rank-fits",
        "spec.parallelism.gradientCompression.rank",
        "self.parallelism.gradientCompression.mode != 'powersgd' || "
        "((!has(self.model.hidden) || self.parallelism.gradientCompression.rank * self.parallelism.tensor <= self.model.hidden) && "
        "(!has(self.model.seqLen) || self.parallelism.gradientCompression.rank <= self.model.seqLen))",
        "parallelism.gradientCompression.rank must be at most the smallest weight matrix dimension (hidden/tensor and seqLen)",
        _powersgd_rank_fits,
    ),
    base.Rule(
        "metrics-ports-fit",
        "spec.metrics.port",
        f"self.metrics.port + self.resources.gpusPerNode <= 65536 && (self.metrics.port > {metrics.RENDEZVOUS_PORT} "
        f"|| self.metrics.port + self.resources.gpusPerNode <= {metrics.RENDEZVOUS_PORT})",
        f"metrics.port + gpusPerNode - 1 must be at most 65535 and the range must not contain the rendezvous port {metrics.RENDEZVOUS_PORT} "
        "(local rank r serves metrics on metrics.port + r)",
        _metrics_ports,
    ),
    base.Rule(
        "lr-scaling-reference",
        "spec.training.lrScaling.referenceBatch",
        "!has(self.training.lrScaling) || self.training.lrScaling.rule == 'none' "
        "|| has(self.training.lrScaling.referenceBatch)",
        "training.lrScaling.rule linear or sqrt needs training.lrScaling.referenceBatch "
        "(the global batch learningRate was tuned at)",
        _lr_scaling_reference,
    ),
    base.Rule(
        "elastic-holds-data",
        "spec.runPolicy.elastic",
        "!has(self.runPolicy.elastic) || (self.runPolicy.elastic.minData <= self.parallelism.data "
        "&& self.parallelism.data <= self.runPolicy.elastic.maxData)",
        "parallelism.data must lie between runPolicy.elastic.minData and runPolicy.elastic.maxData",
        _elastic_holds_data,
    ),
    base.Rule(
        "elastic-keeps-checkpoints",
        "spec.checkpoint.claimName",
        "!has(self.runPolicy.elastic) || self.runPolicy.elastic.maxData <= self.runPolicy.elastic.minData "
        "|| has(self.checkpoint.claimName) || self.checkpoint.path.startsWith('s3://')",
        "runPolicy.elastic with maxData above minData needs checkpoint.claimName (each resize rebuilds the "
        "gang and resumes from a checkpoint every node can mount)",
        _elastic_keeps_checkpoints,
    ),
    base.Rule(
        "straggler-replace-needs-peers",
        "spec.runPolicy.stragglerPolicy.action",
        "!has(self.runPolicy.stragglerPolicy) || self.runPolicy.stragglerPolicy.action != 'replace' "
        "|| self.parallelism.data >= 2",
        "runPolicy.stragglerPolicy.action replace needs parallelism.data >= 2 (a straggler is found by "
        "comparing a rank with its data-parallel peers)",
        _straggler_replace_needs_peers,
    ),
    base.Rule(
        "straggler-replace-keeps-checkpoints",
        "spec.checkpoint.claimName",
        "!has(self.runPolicy.stragglerPolicy) || self.runPolicy.stragglerPolicy.action != 'replace' "
        "|| has(self.checkpoint.claimName) || self.checkpoint.path.startsWith('s3://')",
        "runPolicy.stragglerPolicy.action replace needs checkpoint.claimName (the gang is rebuilt on other "
        "nodes and resumes from a checkpoint they can all mount)",
        _straggler_replace_keeps_checkpoints,
    ),
    base.Rule(
        "warm-spares-fit",
        "spec.runPolicy.recovery.warmSpares",
        "!has(self.runPolicy.recovery) || !has(self.runPolicy.recovery.warmSpares) "
        "|| self.runPolicy.recovery.warmSpares <= self.resources.gpusPerNode",
        "runPolicy.recovery.warmSpares must be at most resources.gpusPerNode (a pod's ranks)",
        _warm_spares_fit,
    ),
    base.Rule(
        "float8-without-tensor",
        "spec.training.float8",
        "!has(self.training.float8) || self.parallelism.tensor == 1",
        "training.float8 needs parallelism.tensor 1 (meshtrain's tensor-parallel layers are not "
        "torch.nn.Linear, which torchao's float8 conversion replaces)",
        _float8_without_tensor,
    ),
    base.Rule(
        "float8-dims",
        "spec.training.float8",
        # A preset's shape is known only to Python; CEL judges the fields written out.
        "!has(self.training.float8) || ((!has(self.model.hidden) || self.model.hidden % 16 == 0) "
        "&& (!has(self.model.ffnHidden) || self.model.ffnHidden % 16 == 0))",
        "training.float8 needs model.hidden and model.ffnHidden divisible by 16 (torch's float8 matmul)",
        _float8_dims,
    ),
    base.Rule(
        "object-storage-for-urls",
        "spec.objectStorage",
        f"has(self.objectStorage) || !({_CEL_URL_FIELDS})",
        "s3:// URLs in training.dataset(s), training.eval.dataset, model.init.fromHF or checkpoint.path "
        "need spec.objectStorage (endpoint, region; credentialsSecret unless the pod has its own identity)",
        _object_storage_for_urls,
    ),
    base.Rule(
        "stage-scope-fills-pods",
        "spec.topology.levels",
        "!has(self.topology.levels) || !self.topology.levels.exists(l, has(l.scope) && l.scope == 'stage') "
        "|| (self.parallelism.data * (has(self.parallelism.context) ? self.parallelism.context : 1) "
        "* self.parallelism.tensor) % self.resources.gpusPerNode == 0",
        "topology.levels[].scope stage needs each pipeline stage to fill whole pods: data x context x tensor "
        "a multiple of resources.gpusPerNode",
        _stage_scope_fills_pods,
    ),
)
"""Rules across sections, judged on the whole spec."""
