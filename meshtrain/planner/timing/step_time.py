"""The step-time model: each stage's work priced by a machine, and the step put together from it.

:func:`plan_time` chooses the machine the profile describes once (:func:`machine_for`) and
composes ``step = window + exposed dp + closing all-reduces + optimizer`` (plus what the machine
runs after the window) from its answers whatever its kind, or longer where the machine's capacity
bounds it (a CPU host's cores).  Within a step only the data-parallel reduction overlaps compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshtrain.api import spec as api_spec
from meshtrain.planner import comm, mfu, profiles
from meshtrain.planner.timing import (
    core_share,
    cpu_host,
    device_node,
    machine,
    network,
    pipeline_window,
    shared_host,
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
    """Peak FLOP/s of one device, as MFU counts it (:func:`meshtrain.planner.mfu.device_peak`)."""
    pipeline_seconds: float = 0.0
    """The pipeline window with each stage's own times (:mod:`.pipeline_window`): compute, fill, drain, sends."""
    bubble_stage0: float = 0.0
    """Idle share of stage 0's pipeline window: what the trainer measures as the bubble."""
    rank_flops: float = 0.0
    """Matmul FLOP/s one rank computes at on the critical path (shared cores accounted for)."""
    dependency_seconds: float = 0.0
    """The schedule's critical path: pipeline window, exposed reduction, optimizer."""
    host: shared_host.HostLoad | None = None
    """What the step asks of a host whose cores the ranks share (None: each rank has its own device)."""
    mfu_devices: float = 0.0
    """Devices the MFU denominator counts (:func:`meshtrain.planner.mfu.devices`; 0: ``world_size``)."""

    @property
    def work_bound(self) -> bool:
        """Whether the machine's capacity (a CPU host's cores), not the schedule's critical path, set the step."""
        return self.step_seconds > self.dependency_seconds

    # The host's figures as the report (``meshtrain plan --json``) and calibration read them,
    # whatever the kind of machine: threads over cores 1, CPU work 0 where no host prices them.

    @property
    def oversubscription(self) -> float:
        """Threads the ranks of one host run over its cores (above 1 they time-share; 1 without a shared host)."""
        return self.host.oversubscription if self.host else 1.0

    @property
    def cpu_seconds(self) -> float:
        """CPU seconds of all ranks in one step (0 where CPU time is not priced)."""
        return self._cpu_work.cpu_seconds if self._cpu_work else 0.0

    @property
    def available_cores(self) -> float:
        """Cores the ranks share; ``cpu_seconds / available_cores`` bounds the step (0 where CPU time is not priced)."""
        return self._cpu_work.available_cores if self._cpu_work else 0.0

    @property
    def rank_cpu_seconds(self) -> tuple[float, ...]:
        """CPU seconds of one rank of each stage in one step, the step loop included (empty where CPU time is not priced)."""
        return self._cpu_work.rank_cpu_seconds if self._cpu_work else ()

    @property
    def _cpu_work(self) -> shared_host.CpuWork | None:
        return self.host.work if self.host else None

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
        """Predicted model FLOPs utilisation (:mod:`meshtrain.planner.mfu`)."""
        return self.mfu_at(self.step_seconds)

    def mfu_at(self, step_seconds: float) -> float:
        """MFU of this job's step had it taken ``step_seconds`` (a measured step, for comparison)."""
        return mfu.ratio(
            self.model_flops, step_seconds, self.peak_flops, self.mfu_devices or self.world_size
        )


def machine_for(
    job: api_spec.TrainingJobSpec,
    profile: profiles.Profile,
    pod_domains: Sequence[str] | None = None,
) -> machine.Machine:
    """The kind of machine ``profile`` describes, as ``job``'s ranks use it.

    A CPU host with CPU-time figures (``core_flops``, from calibration) prices CPU seconds over its
    cores; one without them (``cores`` only) each rank as a device at its share of the cores; a
    profile without ``cores`` a device per rank.
    """
    if profile.cpu_time_model:
        return cpu_host.CpuHost(job, profile, pod_domains)
    if profile.cores:
        return core_share.CoreShareHost(job, profile, pod_domains)
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
    all-reduces, the optimizer and what the machine runs after the window
    (a CPU host's step loop) follow.
    """
    on_machine = machine_for(job, profile, pod_domains)
    prices = on_machine.prices
    work = [stage_work.price(job, sc, prices) for sc in stage_comms]
    stages = [on_machine.on_path(st, sc) for st, sc in zip(work, stage_comms)]
    pp_link = prices.links["pp"]
    send = on_machine.seconds_on_path(_send_seconds(stage_comms[0], pp_link))
    # The stages' closing all-reduces (tied embeddings, the norm) run once, after the last backward.
    closing = [on_machine.seconds_on_path(_closing_seconds(sc, pp_link)) for sc in stage_comms]
    durations = [
        _per_microbatch(job, st, sc, closes, pp_link, on_machine)
        for st, sc, closes in zip(stages, stage_comms, closing)
    ]
    piped = on_machine.window(durations, send)
    tail = max(st.dp_exposed + c + st.optimizer for st, c in zip(stages, closing))
    tail += piped.after_window
    dependencies = piped.window.seconds + tail
    bound = on_machine.bound(work, dependencies)
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
        model_flops=stage_work.model_flops_per_token(shape, span=stage_work.attention_span(job))
        * tokens,
        world_size=job.world_size,
        peak_flops=mfu.device_peak(
            profile.peak_flops, on_cpu=profile.cores > 0, configured=job.metrics.peak_flops
        ),
        mfu_devices=mfu.devices(
            job.world_size, ranks_per_host=shared_host.ranks(job), host_cores=profile.cores
        ),
        pipeline_seconds=piped.window.seconds,
        bubble_stage0=piped.window.idle_share(0, closing=closing[0], exposed=stages[0].dp_exposed),
        rank_flops=on_machine.rank_flops,
        dependency_seconds=dependencies,
        host=bound.host,
    )


def _per_microbatch(
    job: api_spec.TrainingJobSpec,
    stage: stage_work.StageTime,
    stage_comm: comm.StageComm,
    closing: float,
    link: network.Link,
    on_machine: machine.Machine,
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
    busy = (
        stage.busy - on_machine.seconds_on_path(sends) - closing
    ) / job.parallelism.micro_batches
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
