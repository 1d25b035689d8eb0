"""The whole plan of one TrainingJob on one device profile (and optionally a cluster).

:func:`make_plan` runs the memory, communication and time models and, given nodes, the operator's
placement, and returns one :class:`Plan` that :mod:`.report` prints and :mod:`.admission`
summarises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshtrain import placement
from meshtrain.api import spec as api_spec
from meshtrain.planner import (
    comm,
    failures,
    float8,
    memory,
    placement_request,
    precision,
    profiles,
    snapshots,
    validation,
)
from meshtrain.planner.timing import step_time

DEFAULT_CRITICAL_BATCH_TOKENS = 4 * 2**20
"""Tokens per step past which a warning is printed (GPT-3 trained at ~3.2M tokens; see docs/planner.md)."""

NOISE_SCALE_FAR_ABOVE = 10.0
"""A global batch this many times the measured gradient noise scale is far above it (warned)."""


@dataclasses.dataclass(frozen=True)
class BatchCheck:
    """The global batch against the measured gradient noise scale, or else the critical batch size."""

    sequences: int
    """Sequences per optimizer step: microBatch x microBatches x data."""
    tokens: int
    """Tokens per optimizer step: sequences x seq_len."""
    critical_tokens: int
    """Threshold in tokens past which larger batches stop paying off."""
    noise_scale: float | None = None
    """The job's measured gradient noise scale in sequences (status.progress.gradientNoiseScale)."""

    @property
    def warning(self) -> str | None:
        """A warning when the batch is far above the measured noise scale (or, unmeasured, the critical size)."""
        if self.noise_scale is not None and self.noise_scale > 0:
            ratio = self.sequences / self.noise_scale
            if ratio <= NOISE_SCALE_FAR_ABOVE:
                return None
            return (
                f"global batch of {self.sequences} sequences is {ratio:.0f}x the job's measured gradient "
                f"noise scale of {self.noise_scale:.3g} sequences (McCandlish et al. 2018): beyond it "
                f"a larger batch buys little per step (lower microBatches or data)"
            )
        if self.tokens <= self.critical_tokens:
            return None
        return (
            f"global batch of {self.tokens:,} tokens exceeds the critical batch size of "
            f"{self.critical_tokens:,} tokens: more data parallelism buys little loss per token "
            f"(lower microBatches or data, or raise --critical-batch-tokens if you know better)"
        )


@dataclasses.dataclass(frozen=True)
class PlacementResult:
    """What the operator's placement planner would do on the given nodes."""

    nodes: tuple[str, ...]
    """Node per pod index (empty when unschedulable)."""
    level_bytes: dict[str, float]
    """Bytes per step crossing each fabric level, as the placement module predicts them."""
    domains_used: dict[str, int]
    """Distinct domains of each level the gang spans."""
    unschedulable_reason: str | None = None
    """Reason constant when the gang cannot be placed."""
    message: str | None = None
    """Human explanation when the gang cannot be placed."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything the planner predicts for a job."""

    job: api_spec.TrainingJobSpec
    profile: profiles.Profile
    """Device profile used."""
    precision: str
    """Training precision resolved from the spec and the profile (bf16 or fp32)."""
    recipe: str
    """How bf16 state is accounted (``meshtrain`` or ``mixed``)."""
    memory: memory.MemoryPlan
    """Per-stage memory."""
    comm: tuple[comm.StageComm, ...]
    """Per-stage collectives."""
    time: step_time.TimePlan
    """Predicted step."""
    batch: BatchCheck
    """Global batch and its warning."""
    placement: PlacementResult | None
    """Placement on the given cluster (None without one)."""
    confidence: validation.Confidence | None = None
    """What the predicted time rests on (set by the caller that knows the host; None: not stated)."""
    failures: failures.FailurePlan | None = None
    """Expected goodput under failures and the best checkpoint intervals (None: not planned)."""

    @property
    def warnings(self) -> list[str]:
        """Every warning of the plan (memory, batch, placement)."""
        out = []
        if not self.memory.fits:
            worst = self.memory.worst
            out.append(
                f"does not fit: stage {worst.stage} needs {worst.total / 2**30:.2f} GiB per GPU, "
                f"{self.profile.name} has {self.memory.describe_capacity()}"
            )
        if self.batch.warning:
            out.append(self.batch.warning)
        fp8_problem = float8.profile_problem(self.job, self.profile)
        if fp8_problem:
            out.append(fp8_problem)
        if self.placement is not None and self.placement.unschedulable_reason:
            out.append(
                f"unschedulable ({self.placement.unschedulable_reason}): {self.placement.message}"
            )
        return out


def _pod_domains(
    job: api_spec.TrainingJobSpec, nodes: Sequence[placement.Node], chosen: Sequence[str]
) -> list[str]:
    """NVLink domain of each pod: the node's clique label value when the job names one, else the node."""
    by_name = {node.name: node for node in nodes}
    label = placement_request.nvlink_domain_label(job)
    out = []
    for name in chosen:
        labels = by_name[name].labels
        out.append(f"{label}={labels[label]}" if label and label in labels else f"node={name}")
    return out


def place(job: api_spec.TrainingJobSpec, nodes: Sequence[placement.Node]) -> PlacementResult:
    """The operator's placement of ``job`` on free ``nodes`` (no reservations)."""
    result = placement.plan(placement_request.request_from_spec(job), nodes, [])
    if isinstance(result, placement.Unschedulable):
        return PlacementResult(
            nodes=(),
            level_bytes={},
            domains_used={},
            unschedulable_reason=result.reason,
            message=result.message,
        )
    return PlacementResult(
        nodes=tuple(result.nodes),
        level_bytes=dict(result.level_bytes),
        domains_used=dict(result.domains_used),
    )


def make_plan(
    job: api_spec.TrainingJobSpec,
    profile: profiles.Profile,
    *,
    recipe: str = "meshtrain",
    nodes: Sequence[placement.Node] | None = None,
    critical_batch_tokens: int = DEFAULT_CRITICAL_BATCH_TOKENS,
    noise_scale: float | None = None,
    failure: failures.Assumptions | None = None,
) -> Plan:
    """Plan ``job`` on ``profile``; with ``nodes``, also place it and price links by that placement.

    ``failure`` (default: :class:`failures.Assumptions`' defaults) prices failures and checkpoints.
    """
    trained_in = precision.resolve_precision(job, profile)
    scheme = precision.scheme_for(trained_in, recipe)
    mem = memory.plan_memory(job, profile, recipe)
    stage_comms = comm.plan_comm(job, scheme)
    placed = place(job, nodes) if nodes is not None else None
    domains = (
        _pod_domains(job, nodes, placed.nodes)
        if nodes is not None and placed is not None and placed.nodes
        else None
    )
    time_plan = step_time.plan_time(job, profile, stage_comms, domains)
    shape = job.model.shape()
    batch = BatchCheck(
        sequences=job.global_batch,
        tokens=job.global_batch * shape.seq_len,
        critical_tokens=critical_batch_tokens,
        noise_scale=noise_scale,
    )
    return Plan(
        job=job,
        profile=profile,
        precision=trained_in,
        recipe=recipe,
        memory=mem,
        comm=stage_comms,
        time=time_plan,
        batch=batch,
        placement=placed,
        failures=failures.plan_failures(
            failure_state(job, profile, mem, time_plan.step_seconds),
            failure or failures.Assumptions(),
        ),
    )


def failure_state(
    job: api_spec.TrainingJobSpec,
    profile: profiles.Profile,
    mem: memory.MemoryPlan,
    step_seconds: float,
) -> failures.JobState:
    """What the failure plan needs of a job: its size, step time and checkpoint bytes.

    A checkpoint holds every parameter's weights and optimizer state once (DCP writes a replicated
    tensor once); a rank copies its own snapshot to host and peer (:func:`snapshots.snapshot_bytes`,
    what the trainer sizes its in-memory checkpoints by).
    """
    scheme = mem.scheme
    return failures.JobState(
        gpus=job.world_size,
        pods=job.pods,
        step_seconds=step_seconds,
        state_bytes=mem.total_params * (scheme.weights + scheme.optimizer),
        rank_bytes=snapshots.snapshot_bytes(job),
        nic_bandwidth=profile.nic_bandwidth,
        storage_interval_steps=job.checkpoint.interval_steps,
        memory_interval_steps=job.checkpoint.in_memory.interval_steps,
        async_save=job.checkpoint.async_save,
    )
