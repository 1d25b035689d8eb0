"""Elastic data parallelism: the sizes a job may run at, and the spec it runs with at each.

At a degree ``d`` other than ``parallelism.data`` the accumulation becomes ``G / (microBatch x d)``,
so the optimizer sees the same global batch ``G``; where that does not divide, the nearest whole
accumulation is used and the changed batch and learning rate are stated (:func:`describe`).
The rule that the smallest degree keeps the batch is here, where the sizes are.
"""

from __future__ import annotations

import dataclasses

from meshtrain.api.spec import TrainingJobSpec, base
from meshtrain.api.spec.status import ElasticStatus


@dataclasses.dataclass(frozen=True)
class Size:
    """One data-parallel degree the job may run at."""

    data: int
    micro_batches: int
    global_batch: int
    keeps_global_batch: bool
    """False when no whole accumulation at ``data`` gives the declared global batch."""


def _runnable(spec: TrainingJobSpec, data: int) -> bool:
    """Whether a gang of ``data`` replicas fills whole pods (each stage too, under a stage-scoped
    ``spec.topology`` level) and has peers for its gradient compression."""
    par = spec.parallelism.model_copy(update={"data": data})
    per = spec.resources.gpus_per_node
    staged = any(level.scope == "stage" for level in spec.topology.levels)
    whole_stages = not staged or (data * par.context * par.tensor) % per == 0
    return par.layout.fills_pods(per) and whole_stages and par.compression_has_peers


def size_at(spec: TrainingJobSpec, data: int) -> Size | None:
    """The size at ``data`` replicas, or None when no gang of that degree can run."""
    if not _runnable(spec, data):
        return None
    declared = spec.global_batch
    per_replica = spec.training.micro_batch * data
    step = spec.parallelism.micro_batch_round
    if declared % (per_replica * step) == 0:
        micro_batches = declared // per_replica
    else:
        micro_batches = max(step, round(declared / (per_replica * step)) * step)
    batch = micro_batches * per_replica
    return Size(data, micro_batches, batch, batch == declared)


def sizes(spec: TrainingJobSpec) -> list[Size]:
    """Every size ``runPolicy.elastic`` allows, largest degree first (only ``parallelism.data`` without it)."""
    elastic = spec.run_policy.elastic
    degrees = (
        range(elastic.max_data, elastic.min_data - 1, -1)
        if elastic is not None
        else [spec.parallelism.data]
    )
    return [s for s in (size_at(spec, d) for d in degrees) if s is not None]


def resized(spec: TrainingJobSpec, size: Size) -> TrainingJobSpec:
    """``spec`` as the gang runs it at ``size``: data, microBatches (and a given globalBatch) changed."""
    par = spec.parallelism.model_copy(
        update={"data": size.data, "micro_batches": size.micro_batches}
    )
    training = spec.training
    if training.global_batch is not None:
        training = training.model_copy(update={"global_batch": size.global_batch})
    return spec.model_copy(update={"parallelism": par, "training": training})


def describe(spec: TrainingJobSpec, size: Size) -> str:
    """What running at ``size`` changes, with the numbers."""
    par, training = spec.parallelism, spec.training
    head = (
        f"data-parallel degree {size.data} instead of {par.data}: microBatches "
        f"{par.micro_batches} -> {size.micro_batches}"
    )
    if size.keeps_global_batch:
        return f"{head}, global batch kept at {size.global_batch}"
    before = training.learning_rates(par)[0]
    after = peak_learning_rate(spec, size)
    why = (
        f"training.lrScaling {training.lr_scaling.rule}"
        if training.lr_scaling.rule != "none"
        else "the batch ratio, training.lrScaling is none"
    )
    rate = f"learning rate {before:.3g} -> {after:.3g} ({why}"
    rate += "; ramped up over part of warmupSteps)" if after > before else ")"
    return (
        f"{head}; global batch {spec.global_batch} -> {size.global_batch} "
        f"({spec.global_batch} is not divisible by microBatch={training.micro_batch} x {size.data}); {rate}"
    )


def peak_learning_rate(spec: TrainingJobSpec, size: Size) -> float:
    """The peak rate a gang at ``size`` trains with after resuming from a checkpoint of the declared
    degree (the trainer's rule, ``meshtrain.trainer.optim.batch_change``)."""
    training = spec.training
    scale = training.lr_scaling.carried_scale(spec.global_batch, size.global_batch)
    return training.learning_rates(resized(spec, size).parallelism)[0] * scale


def status_of(
    spec: TrainingJobSpec, size: Size, checkpoint_step: int | None
) -> ElasticStatus | None:
    """``status.elastic`` for a gang placed at ``size`` (None at the declared degree)."""
    if size.data == spec.parallelism.data:
        return None
    return ElasticStatus(
        data=size.data,
        micro_batches=size.micro_batches,
        global_batch=size.global_batch,
        learning_rate=peak_learning_rate(spec, size),
        checkpoint_step=checkpoint_step,
        message=describe(spec, size),
    )


def running_spec(spec: TrainingJobSpec, status: ElasticStatus | None) -> TrainingJobSpec:
    """The spec the placed gang runs: ``spec`` itself, or resized to ``status.elastic``."""
    if status is None or status.data == spec.parallelism.data:
        return spec
    size = size_at(spec, status.data)
    return spec if size is None else resized(spec, size)


def _min_keeps_batch(spec: TrainingJobSpec) -> str | None:
    bounds = spec.run_policy.elastic
    if bounds is None:
        return None
    smallest = size_at(spec, bounds.min_data)
    if smallest is None or not smallest.keeps_global_batch:
        par = spec.parallelism
        step = " x pipeline" if par.schedule == "interleaved-1f1b" else ""
        staged = any(level.scope == "stage" for level in spec.topology.levels)
        stage = " (and minData x context x tensor, a stage, under a topology level of scope stage)"
        return (
            f"elastic.minData={bounds.min_data} cannot keep the global batch {spec.global_batch}: it must be "
            f"divisible by microBatch={spec.training.micro_batch} x minData{step}, minData x pipeline x tensor a "
            f"multiple of gpusPerNode={spec.resources.gpus_per_node}{stage if staged else ''} (and minData >= 2 "
            "with gradientCompression): "
            f"pick a minData that divides microBatches x data = {par.micro_batches * par.data}"
        )
    return None


MIN_KEEPS_BATCH: base.Rule[TrainingJobSpec] = base.Rule(
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
    _min_keeps_batch,
)
"""``runPolicy.elastic.minData`` is a size the job can run at with its declared global batch."""
