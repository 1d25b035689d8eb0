"""What ``checkpoint.inMemory`` costs a pod: each rank's snapshot, its copies, and whether
``/dev/shm`` and the memory limit hold them (``meshtrain validate`` refuses a job whose pods
cannot; docs/checkpoints.md, "In-memory checkpoints")."""

from __future__ import annotations

import dataclasses
import math

from meshtrain.api import spec as api_spec
from meshtrain.api.spec import resources as resources_mod
from meshtrain.planner import context, memory, parameters, precision

SNAPSHOT_SCHEME = precision.FP32
"""What a snapshot holds per parameter: the trainer keeps fp32 weights and Adam moments in bf16
training too (:data:`~.precision.AUTOCAST` has the same 4 + 8 bytes)."""


def snapshot_bytes(job: api_spec.TrainingJobSpec) -> float:
    """Bytes of one rank's in-memory snapshot, the largest over the pipeline stages: what a storage
    checkpoint holds of the rank (weights and optimizer moments as ZeRO shards them, gradient
    compression's state); the trainer record and RNG state are a few KiB."""
    shape, par = job.model.shape(), job.parallelism
    scheme = SNAPSHOT_SCHEME
    largest = 0.0
    for stage in range(par.pipeline):  # at most limits.MAX_PIPELINE
        params = parameters.rank_params(shape, par.pipeline, par.tensor, stage)
        state = memory.state_bytes(params, scheme, par.zero_stage, context.reducers(par))
        last = stage == par.pipeline - 1
        biggest = memory.largest_param(shape, par.tensor, first=stage == 0, last=last)
        compression, _ = memory.exchange_bytes(job, stage, params, biggest, scheme)
        largest = max(largest, state.weights + state.optimizer + compression)
    return largest


@dataclasses.dataclass(frozen=True)
class SnapshotMemory:
    """What ``checkpoint.inMemory`` costs one pod."""

    per_rank: float
    """Bytes of one rank's snapshot (:func:`snapshot_bytes`)."""
    copies: int
    """Snapshots a rank's pod keeps per rank: its own, and a peer's with ``peer`` and 2+ pods."""
    shm: float
    """Bytes of ``/dev/shm`` at the peak: every copy of every local rank, twice while a newer
    snapshot is written (the previous one is kept until the new one is complete)."""
    memory: float
    """Bytes the pod's memory limit must hold for them: ``shm`` (a memory-backed emptyDir) plus
    each rank's transient host copy of its state."""


def snapshot_memory(job: api_spec.TrainingJobSpec) -> SnapshotMemory | None:
    """The pod's cost of in-memory checkpoints; None when they are off."""
    in_memory = job.checkpoint.in_memory
    if in_memory.interval_steps == 0:
        return None
    per_rank, ranks = snapshot_bytes(job), job.resources.gpus_per_node
    copies = 2 if in_memory.peer and job.pods > 1 else 1
    shm = 2 * copies * ranks * per_rank
    return SnapshotMemory(per_rank, copies, shm, shm + ranks * per_rank)


def snapshot_problems(job: api_spec.TrainingJobSpec) -> list[str]:
    """Why the pod cannot hold its in-memory snapshots (``/dev/shm`` or the memory limit); empty when it can."""
    cost = snapshot_memory(job)
    if cost is None:
        return []
    resources, gib = job.resources, 2**30
    what = (
        f"checkpoint.inMemory (intervalSteps {job.checkpoint.in_memory.interval_steps}) keeps "
        f"{cost.copies} snapshot(s) of {cost.per_rank / gib:.2f} GiB per rank for "
        f"{resources.gpus_per_node} rank(s) a pod, twice while a newer one is written"
    )
    fixes = "set checkpoint.inMemory.intervalSteps to 0 to keep storage checkpoints only"
    if cost.copies == 2:
        fixes = f"set checkpoint.inMemory.peer to false, or {fixes}"
    problems = []
    shm = resources_mod.quantity_value(resources.shm_size)
    if cost.shm > shm:
        problems.append(
            f"{what}: {cost.shm / gib:.2f} GiB of /dev/shm, more than resources.shmSize "
            f"{resources.shm_size}; raise resources.shmSize to at least "
            f"{math.ceil(cost.shm / gib)}Gi, or {fixes}"
        )
    if resources.memory is not None and cost.memory > resources_mod.quantity_value(
        resources.memory
    ):
        problems.append(
            f"{what}: {cost.memory / gib:.2f} GiB with the host copies, more than "
            f"resources.memory {resources.memory} (/dev/shm is memory-backed and counts "
            f"against it); raise resources.memory above {math.ceil(cost.memory / gib)}Gi plus "
            f"what the trainer itself needs, or {fixes}"
        )
    return problems
