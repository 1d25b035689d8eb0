"""The step-time model: each stage's work priced by a machine, and the step put together from it.

:func:`plan_time` chooses the machine the profile describes once (:func:`machine_for`) and
composes ``step = window + exposed dp + closing all-reduces + optimizer`` (plus the step loop
outside the window) from its answers whatever its kind, or longer where the machine's capacity
bounds it (a CPU host's cores).  Within a step only the data-parallel reduction overlaps compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshtrain.api import spec as api_spec
from meshtrain.planner import comm, profiles
from meshtrain.planner.timing import (
    cpu_host,
    device_node,
    machine,
    network,
    pipeline_window,
    stage_work,
)


@dataclasses.dataclass(frozen=True)
class TimePlan:
    """The predicted step of a job."""

    links: dict[str, network.Link]
    """Link used by each group axis (dp, tp, pp)."""
    stages: tuple[stage_work.StageTime, ...]
    """Per pipeline stage."""
    bubble: float
    """Theoretical bubble (p-1)/(v m + p - 1)."""
    step_seconds: float
    """Predicted wall time of one optimizer step."""
    tokens_per_step: int
    """Tokens of the global batch."""
    model_flops: float
    """Training FLOPs of one step, whole job."""
    world_size: int
    """Ranks in the job."""
    peak_flops: float
    """Peak FLOP/s of one device."""
    pipeline_seconds: float = 0.0
    """The pipeline window with each stage's own times (:mod:`.pipeline_window`): compute, fill, drain, sends."""
    bubble_stage0: float = 0.0
    """Idle share of stage 0's pipeline window: what the trainer measures as the bubble."""
    rank_flops: float = 0.0
    """Matmul FLOP/s one rank computes at (shared cores accounted for)."""
    oversubscription: float = 1.0
    """Threads the ranks of one host run over its cores (above 1 they time-share; 1 without a core count)."""
    dependency_seconds: float = 0.0
    """The schedule's critical path: pipeline window, exposed reduction, optimizer."""
    cpu_seconds: float = 0.0
    """CPU host: CPU seconds of all ranks in one step (0 elsewhere)."""
    available_cores: float = 0.0
    """CPU host: cores the ranks share; ``cpu_seconds / available_cores`` bounds the step (0 elsewhere)."""
    rank_cpu_seconds: tuple[float, ...] = ()
    """CPU host: CPU seconds of one rank of each stage in one step, the step loop included (empty elsewhere)."""

    @property
    def work_bound(self) -> bool:
        """Whether the host's cores, not the schedule, set the step (CPU hosts)."""
        return self.available_cores > 0 and self.step_seconds > self.dependency_seconds

    @property
    def worst(self) -> stage_work.StageTime:
        """The stage that sets the pace (largest busy time)."""
        return max(self.stages, key=lambda st: (st.busy, st.comm))

    @property
    def compute_comm_ratio(self) -> float:
        """Compute seconds over communication seconds on the pacing stage (inf without communication)."""
        worst = self.worst
        return worst.compute / worst.comm if worst.comm > 0 else float("inf")

    @property
    def verdict(self) -> str:
        """``compute-bound`` when compute outweighs communication, else ``communication-bound``."""
        return "compute-bound" if self.compute_comm_ratio >= 1 else "communication-bound"

    @property
    def tokens_per_second(self) -> float:
        """Predicted throughput of the job."""
        return self.tokens_per_step / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def mfu(self) -> float:
        """Predicted model FLOPs utilisation against the peak."""
        denominator = self.step_seconds * self.world_size * self.peak_flops
        return self.model_flops / denominator if denominator > 0 else 0.0


def machine_for(
    job: api_spec.TrainingJobSpec,
    profile: profiles.Profile,
    pod_domains: Sequence[str] | None = None,
) -> machine.Machine:
    """The kind of machine ``profile`` describes, as ``job``'s ranks use it: a calibrated CPU host's cores, else a device per rank."""
    if profile.cpu_time_model:
        return cpu_host.CpuHost(job, profile, pod_domains)
    return device_node.DeviceNode(job, profile, pod_domains)


def plan_time(
    job: api_spec.TrainingJobSpec,
    profile: profiles.Profile,
    stage_comms: Sequence[comm.StageComm],
    pod_domains: Sequence[str] | None = None,
) -> TimePlan:
    """Price every stage's work on the machine ``profile`` describes and assemble the step.

    The pipeline window comes from each stage's forward and backward
    seconds; then the exposed data-parallel reduction, the stages' closing
    all-reduces, the optimizer and the step loop follow.
    """
    host = machine_for(job, profile, pod_domains)
    prices = host.prices
    work = [stage_work.price(job, sc, prices) for sc in stage_comms]
    stages = [host.on_path(st, sc) for st, sc in zip(work, stage_comms)]
    pp_link = prices.links["pp"]
    send = _send_seconds(stage_comms[0], pp_link) / host.speed
    # The stages' closing all-reduces (tied embeddings, the norm) run once, after the last backward.
    closing = [_closing_seconds(sc, pp_link) / host.speed for sc in stage_comms]
    durations = [
        _per_microbatch(job, st, sc, closes, pp_link, host.speed)
        for st, sc, closes in zip(stages, stage_comms, closing)
    ]
    piped = host.window(durations, send)
    tail = max(st.dp_exposed + c + st.optimizer for st, c in zip(stages, closing))
    tail += (host.step_loop_seconds - piped.step_loop) / host.speed
    dependencies = piped.window.seconds + tail
    bound = host.bound(work, dependencies)
    shape, par = job.model.shape(), job.parallelism
    tokens = job.global_batch * shape.seq_len
    return TimePlan(
        links=prices.links,
        stages=tuple(stages),
        bubble=pipeline_window.bubble_ratio(
            par.pipeline, par.micro_batches, job.parallelism.virtual_stages
        ),
        step_seconds=bound.step_seconds,
        tokens_per_step=tokens,
        model_flops=stage_work.model_flops_per_token(shape) * tokens,
        world_size=job.world_size,
        peak_flops=profile.peak_flops,
        pipeline_seconds=piped.window.seconds,
        bubble_stage0=piped.window.idle_share(0, closing=closing[0], exposed=stages[0].dp_exposed),
        rank_flops=prices.rank_flops * host.speed,
        oversubscription=host.oversubscription,
        dependency_seconds=dependencies,
        cpu_seconds=bound.cpu_seconds,
        available_cores=bound.available_cores,
        rank_cpu_seconds=bound.rank_cpu_seconds,
    )


def _per_microbatch(
    job: api_spec.TrainingJobSpec,
    stage: stage_work.StageTime,
    stage_comm: comm.StageComm,
    closing: float,
    link: network.Link,
    speed: float,
) -> pipeline_window.StageDurations:
    """A stage's forward and backward seconds of one micro-batch on the critical path.

    Its busy time less its sends (the window adds those on its critical path)
    and its closing all-reduces, split by the stage's own forward share.
    """
    sends = sum(
        network.collective_seconds(c, link)
        for c in stage_comm.collectives
        if c.group == "pp" and c.op == "send"
    )
    busy = (stage.busy - sends / speed - closing) / job.parallelism.micro_batches
    own = stage.compute + stage.overhead
    share = stage.forward / own if own > 0 else 1 - stage_work.BACKWARD_SHARE
    return pipeline_window.StageDurations(forward=busy * share, backward=busy * (1 - share))


def _send_seconds(stage_comm: comm.StageComm, link: network.Link) -> float:
    """Seconds one pipeline message takes (0 without a pipeline)."""
    sends = [c for c in stage_comm.collectives if c.group == "pp" and c.op == "send"]
    if not sends:
        return 0.0
    one = sends[0]
    return network.send_seconds(one.nbytes / one.calls, link.for_op("send", 2))


def _closing_seconds(stage_comm: comm.StageComm, link: network.Link) -> float:
    """A stage's pipeline-group all-reduces: after its last backward, outside the schedule."""
    return sum(
        network.collective_seconds(c, link)
        for c in stage_comm.collectives
        if c.group == "pp" and c.op == "all_reduce"
    )
