"""Time model: alpha-beta communication, FLOP-based compute, pipeline bubble, step time.

Pure functions that price the collectives of :mod:`.comm` on the
link each process group uses and the FLOPs of each stage on the device's
achievable FLOP/s, and put them together into a predicted step time:

* collectives: the alpha-beta price on the link each group uses
  (:mod:`.network`);
* compute: ``6 N`` FLOPs per token for the matmuls of the parameters a rank
  holds plus ``12 l s h / t`` for attention (Kaplan et al. 2020; Narayanan et
  al. 2021), at the rank's FLOP/s (``peak x achievable_fraction``, or the
  calibrated figure for the ranks sharing a host's cores), plus a fixed
  cost per tensor operation (the trainer's block runs 28 forward and 53
  backward);
* pipeline: the window of :mod:`.pipeline_window` (each stage's own times, the
  sends); the theoretical bubble ``(p-1)/(v m + p - 1)`` (Huang et al. 2019;
  Narayanan et al. 2021) is reported beside it;
* data-parallel bucket exchanges (each bucket's whole chain of collectives:
  flat, hierarchical or compressed) overlap the last micro-batch's backward;
  what does not fit behind it (at least the last bucket's exchange) is
  exposed, and so is everything after backward (ZeRO's gathers, the norm);
* the optimizer streams 32 bytes per updated parameter through device memory
  and pays the per-operation cost per parameter tensor;
* on a calibrated CPU host the same terms are CPU seconds, plus each rank's
  step loop (``rank_step_cpu_seconds``), and the step is the larger of the
  critical path and all ranks' CPU work over the cores available
  (:mod:`.cpu_host`); a pipeline's window there is a replay of the schedule
  with the cores shared among the runnable ranks and the step loop's
  calibrated share outside every event (``step_loop_between_share``)
  between a stage's actions, the rest inside them, and each message at its
  calibrated wall latency where measured (:mod:`.shared_pipeline`).

The computation-to-communication ratio compares compute seconds with the
sum of all collective seconds of the busiest rank; below 1 the job is
communication-bound.  Not a simulator of overlap inside a step,
or a measurement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshtrain.api import spec as api_spec
from meshtrain.planner import comm, memory, profiles
from meshtrain.planner.timing import cpu_host, network, pipeline_replay, pipeline_window

DEFAULT_CRITICAL_BATCH_TOKENS = 4 * 2**20
"""Tokens per step past which a warning is printed (GPT-3 trained at ~3.2M tokens; see docs/planner.md)."""

OPTIMIZER_BYTES_PER_PARAM = 32
"""AdamW reads weight, gradient and both moments and writes weight and moments (7 x 4 B), plus the norm pass (4 B)."""

BACKWARD_SHARE = 2.0 / 3.0
"""Backward's share of a block's matmul FLOPs (input and weight gradients: twice the forward)."""

BLOCK_OPS = (28, 53)
"""Tensor operations (forward, backward) of one block and micro-batch; tests count the trainer's Block."""

OUTSIDE_BLOCK_OPS = (11, 15)
"""Tensor operations (forward, backward) of the embeddings, final norm and head of one micro-batch, beside the loss's chunks."""

LOSS_OPS_PER_CHUNK = 44
"""Forward operations per token chunk of the trainer's fused loss (logits, softmax, both gradients); tests count them."""

OPTIMIZER_OPS_PER_TENSOR = 16
"""Per parameter tensor and step: AdamW's single-tensor update (~12 ops), the norm and zeroing."""


def bubble_ratio(pipeline: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Theoretical idle share of a stage: ``(p - 1) / (v m + p - 1)`` (GPipe and 1F1B: v = 1)."""
    return (pipeline - 1) / (virtual_stages * micro_batches + pipeline - 1)


def rank_flops_per_microbatch(
    shape: api_spec.ModelShape, pipeline: int, tensor: int, stage: int, micro_batch: int
) -> float:
    """Training FLOPs of one micro-batch on one rank of ``stage``: (6 N_rank + 12 l s h / t) x tokens.

    ``N_rank`` counts the parameters the rank multiplies with (its blocks and,
    on the last stage, the final norm and head; embedding lookups are not
    matmuls), as :func:`meshtrain.trainer.models.gpt.flops_per_token` does for the
    whole model.
    """
    layers = shape.layers // pipeline
    n_rank = layers * memory.layer_params(shape, tensor)
    if stage == pipeline - 1:
        n_rank += memory.head_params(shape, tensor)
        n_rank += memory.vocab_rows(shape, tensor) * shape.hidden if shape.tie_embeddings else 0
    attention = 12 * layers * shape.seq_len * shape.hidden / tensor
    return (6 * n_rank + attention) * micro_batch * shape.seq_len


def rank_forward_flops_per_microbatch(
    shape: api_spec.ModelShape, pipeline: int, tensor: int, stage: int, micro_batch: int
) -> float:
    """The part of :func:`rank_flops_per_microbatch` that runs in forward.

    A third of the blocks' (backward computes the input and the weight
    gradients) and, on the last stage, all of the head's: the trainer's
    fused loss (``trainer/meshtrain/trainer/parallel/loss.py``) computes the head's gradients
    in forward, chunk by chunk, and backward only scales them.
    """
    layers = shape.layers // pipeline
    tokens = micro_batch * shape.seq_len
    blocks = (
        6 * layers * memory.layer_params(shape, tensor)
        + 12 * layers * shape.seq_len * shape.hidden / tensor
    )
    head = rank_flops_per_microbatch(shape, pipeline, tensor, stage, micro_batch) - blocks * tokens
    return blocks * tokens * (1 - BACKWARD_SHARE) + head


def recompute_flops_per_microbatch(
    shape: api_spec.ModelShape, pipeline: int, tensor: int, micro_batch: int
) -> float:
    """Extra FLOPs of activation checkpointing: one more forward of the stage's blocks, (2 N_blocks + 4 l s h / t) x tokens.

    Hardware work, not model work: MFU does not count it.
    """
    layers = shape.layers // pipeline
    forward = (
        2 * layers * memory.layer_params(shape, tensor)
        + 4 * layers * shape.seq_len * shape.hidden / tensor
    )
    return forward * micro_batch * shape.seq_len


def rank_ops_per_microbatch(
    shape: api_spec.ModelShape, pipeline: int, stage: int, recompute: bool, loss_chunks: int = 1
) -> tuple[int, int]:
    """Tensor operations (forward, backward) of one micro-batch on one rank of ``stage``.

    ``loss_chunks``: token chunks the last stage's fused loss walks
    (:func:`~.memory.loss_chunks`).
    """
    layers = shape.layers // pipeline
    forward = layers * BLOCK_OPS[0]
    backward = layers * (BLOCK_OPS[1] + (BLOCK_OPS[0] if recompute else 0))
    if stage in (0, pipeline - 1):  # embeddings on the first stage, norm and head on the last
        share = 0.5 if pipeline > 1 else 1.0
        forward += round(OUTSIDE_BLOCK_OPS[0] * share)
        backward += round(OUTSIDE_BLOCK_OPS[1] * share)
    if stage == pipeline - 1:
        forward += LOSS_OPS_PER_CHUNK * loss_chunks
    return forward, backward


@dataclasses.dataclass(frozen=True)
class StageTime:
    """Predicted seconds of one rank of one pipeline stage in one step."""

    stage: int
    """Pipeline stage (0-based)."""
    compute: float
    """Forward and backward matmul FLOPs of all micro-batches at the rank's FLOP/s."""
    tp: float
    """Tensor-parallel collectives (on the critical path)."""
    pp: float
    """Pipeline sends and the norm reduction over the pipeline group."""
    dp: float
    """Data-parallel gradient reduction (and ZeRO parameter gather), before overlap."""
    dp_exposed: float
    """Part of ``dp`` not hidden behind the last backward."""
    optimizer: float
    """The optimizer step (memory traffic and per-tensor operations)."""
    overhead: float = 0.0
    """Fixed cost of the forward and backward tensor operations of all micro-batches."""
    forward: float = 0.0
    """The forward part of ``compute + overhead`` (the rest is backward)."""

    @property
    def busy(self) -> float:
        """Compute plus the communication that blocks it (tp, pp)."""
        return self.compute + self.overhead + self.tp + self.pp

    @property
    def comm(self) -> float:
        """All communication seconds, overlapped or not."""
        return self.tp + self.pp + self.dp


@dataclasses.dataclass(frozen=True)
class TimePlan:
    """The predicted step of a job."""

    links: dict[str, network.Link]
    """Link used by each group axis (dp, tp, pp)."""
    stages: tuple[StageTime, ...]
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
    def worst(self) -> StageTime:
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


def model_flops_per_token(shape: api_spec.ModelShape) -> float:
    """``6 N + 12 L s h`` with ``N`` the non-embedding parameters (the trainer's MFU numerator)."""
    tied_head = shape.vocab * shape.hidden if shape.tie_embeddings else 0  # still a matmul
    n = memory.total_params(shape) - memory.embedding_params(shape) + tied_head
    return 6 * n + 12 * shape.layers * shape.seq_len * shape.hidden


def _stage_time(
    job: api_spec.TrainingJobSpec,
    profile: profiles.Profile,
    stage_comm: comm.StageComm,
    used: dict[str, network.Link],
    rank_flops: float,
) -> StageTime:
    shape, par = job.model.shape(), job.parallelism
    stage = stage_comm.stage
    per_mb = rank_flops_per_microbatch(
        shape, par.pipeline, par.tensor, stage, job.training.micro_batch
    )
    if job.training.activation_checkpointing:
        per_mb += recompute_flops_per_microbatch(
            shape, par.pipeline, par.tensor, job.training.micro_batch
        )
    forward_mb = rank_forward_flops_per_microbatch(
        shape, par.pipeline, par.tensor, stage, job.training.micro_batch
    )
    compute = per_mb * par.micro_batches / rank_flops
    ops_forward, ops_backward = rank_ops_per_microbatch(
        shape,
        par.pipeline,
        stage,
        job.training.activation_checkpointing,
        memory.loss_chunks(shape, job.training.micro_batch, par.tensor),
    )
    overhead = (ops_forward + ops_backward) * par.micro_batches * profile.op_overhead
    forward = (forward_mb / rank_flops + ops_forward * profile.op_overhead) * par.micro_batches
    seconds = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    dp_calls = 0
    after_backward = 0.0
    nvlink = network.links(profile)["nvlink"]
    for c in stage_comm.collectives:
        c, link = network.hierarchical_leg(job, c, used[c.group], nvlink)
        spent = network.collective_seconds(c, link)
        seconds[c.group] += spent
        if c.group == "dp" and c.after_backward:
            after_backward += spent
        elif c.group == "dp":
            dp_calls += c.calls
    reduce = seconds["dp"] - after_backward
    window = (per_mb - forward_mb) / rank_flops  # one micro-batch's backward
    if par.zero_stage == 2:  # each micro-batch reduce-scatters its buckets behind its own backward
        window *= par.micro_batches
    exchanges = stage_comm.dp_exchanges or dp_calls  # each bucket's exchange is one chain
    # the last bucket's chain starts when backward ends, so it is exposed whole (ZeRO-3: the average)
    last_chain = sum(
        network.collective_seconds(*network.hierarchical_leg(job, c, used[c.group], nvlink))
        for c in stage_comm.dp_last_exchange
    )
    if exchanges and not stage_comm.dp_last_exchange:
        last_chain = reduce / exchanges
    exposed = max(reduce - window, last_chain) if exchanges else 0.0
    params = memory.rank_params(shape, par.pipeline, par.tensor, stage)
    updated = params / par.data if par.zero_stage >= 1 else params
    tensors = len(
        comm.chunk_param_sizes(
            shape,
            par.tensor,
            shape.layers // par.pipeline,
            first=stage == 0,
            last=stage == par.pipeline - 1,
        )
    )
    optimizer = (
        updated * OPTIMIZER_BYTES_PER_PARAM / profile.memory_bandwidth
        + tensors * OPTIMIZER_OPS_PER_TENSOR * profile.op_overhead
    )
    return StageTime(
        stage=stage,
        compute=compute,
        tp=seconds["tp"],
        pp=seconds["pp"],
        dp=seconds["dp"],
        dp_exposed=exposed + after_backward,
        optimizer=optimizer,
        overhead=overhead,
        forward=forward,
    )


def _send_seconds(
    job: api_spec.TrainingJobSpec, stage_comm: comm.StageComm, link: network.Link
) -> float:
    """Seconds one pipeline message takes (0 without a pipeline)."""
    sends = [c for c in stage_comm.collectives if c.group == "pp" and c.op == "send"]
    if not sends:
        return 0.0
    one = sends[0]
    return network.send_seconds(one.nbytes / one.calls, link.for_op("send", 2))


def ranks_per_host(job: api_spec.TrainingJobSpec, profile: profiles.Profile) -> int:
    """Ranks sharing one host: a pod's ``gpusPerNode``; on a CPU profile (``cores``) every rank, as ``meshtrain run`` starts them."""
    return job.world_size if profile.cores else job.resources.gpus_per_node


def cpu_sharing(
    job: api_spec.TrainingJobSpec, profile: profiles.Profile
) -> pipeline_replay.Sharing:
    """How the job's ranks share a CPU host's cores, from the cores they receive together (``available_cores``)."""
    threads = cpu_host.threads_per_rank(profile, ranks_per_host(job, profile))
    return pipeline_replay.Sharing(cpu_host.available_cores(profile), threads)


def host_oversubscription(job: api_spec.TrainingJobSpec, profile: profiles.Profile) -> float:
    """Threads of one host's ranks over its cores (each rank runs ``max(1, cores // ranks)`` threads)."""
    if not profile.cores:
        return 1.0
    ranks = ranks_per_host(job, profile)
    threads = max(1, profile.cores // ranks)
    return max(1.0, ranks * threads / profile.cores)


def plan_time(
    job: api_spec.TrainingJobSpec,
    profile: profiles.Profile,
    stage_comms: Sequence[comm.StageComm],
    pod_domains: Sequence[str] | None = None,
) -> TimePlan:
    """Price every stage's compute and collectives and assemble the step.

    The pipeline window comes from each stage's forward and backward
    seconds (:mod:`.pipeline_window`); ranks that share a host's cores compute at
    :meth:`~.profiles.Profile.rank_flops` of that many ranks.  Then the
    exposed data-parallel reduction and the optimizer follow.
    """
    shape = job.model.shape()
    par = job.parallelism
    virtual = par.virtual_stages if par.schedule == "interleaved-1f1b" else 1
    cpu_model = profile.cpu_time_model
    priced = cpu_host.cpu_work_profile(profile) if cpu_model else profile
    kinds = network.links(priced)
    used = {axis: kinds[kind] for axis, kind in network.group_links(job, pod_domains).items()}
    if cpu_model:
        # The CPU of a tensor-parallel call as the trainer's own calls cost it in calibration.
        used["tp"] = used["tp"].preferring(
            tuple(
                cpu_host.cpu_cost_fit(f)
                for f in profile.tp_collectives
                if f.cpu_call_seconds > 0 and f.cpu_bandwidth > 0
            )
        )
        # Stage times are CPU seconds, run at the cores a rank has when it is the one runnable.
        rank_flops = profile.core_flops
        speed = cpu_host.rank_speed(profile, ranks_per_host(job, profile))
    else:
        rank_flops = profile.rank_flops(ranks_per_host(job, profile))
        speed = 1.0
    work = [_stage_time(job, priced, sc, used, rank_flops) for sc in stage_comms]
    stages = [_scaled(st, 1 / speed) for st in work]
    if cpu_model and host_oversubscription(job, profile) <= 1.0:
        # A rank per core: a blocked tensor-parallel collective idles its core for its wall
        # time (with more ranks than cores another rank runs meanwhile: the work bound).
        stages = [
            dataclasses.replace(st, tp=max(st.tp, _wall_tp_seconds(job, profile, sc, pod_domains)))
            for st, sc in zip(stages, stage_comms)
        ]
    send = _send_seconds(job, stage_comms[0], used["pp"]) / speed
    # Calibration timed the trainer's own messages in a run of the job's layout (wall
    # seconds, the receiver's wake-up included): where it did, that replaces the fit.
    measured = (
        (profile.activation_message_seconds, profile.gradient_message_seconds)
        if cpu_model
        else (0.0, 0.0)
    )
    activations, gradients = (seconds if seconds > 0 else send for seconds in measured)
    # The stages' closing all-reduces (tied embeddings, the norm) run once, after the last backward.
    closing = [_closing_seconds(sc, used["pp"]) / speed for sc in stage_comms]
    per_microbatch = []
    for st, closes in zip(stages, closing):
        sends = sum(
            network.collective_seconds(c, used["pp"])
            for c in stage_comms[st.stage].collectives
            if c.group == "pp" and c.op == "send"
        )
        busy = (
            st.busy - sends / speed - closes
        ) / par.micro_batches  # the window adds the sends on its critical path
        own = st.compute + st.overhead
        share = st.forward / own if own > 0 else 1 - BACKWARD_SHARE
        per_microbatch.append(
            pipeline_window.StageDurations(forward=busy * share, backward=busy * (1 - share))
        )
    loop = profile.rank_step_cpu_seconds if cpu_model else 0.0
    replayed = cpu_model and par.pipeline > 1 and virtual == 1
    # The step loop runs between a stage's actions: inside the window, and not compute.
    # Calibration measures the share of it outside every event; the rest runs inside the actions.
    share = min(1.0, max(0.0, profile.step_loop_between_share))
    actions = 2 * par.micro_batches
    loop_between = loop * share / actions if replayed else 0.0
    loop_inside = loop * (1 - share) / actions if replayed else 0.0
    if replayed:
        # Stages sharing the cores: replay the schedule at CPU seconds with processor sharing.
        piped = pipeline_replay.replay(
            par.schedule,
            par.micro_batches,
            [
                pipeline_window.StageDurations(
                    d.forward * speed + loop_inside, d.backward * speed + loop_inside
                )
                for d in per_microbatch
            ],
            pipeline_replay.Messages(activations, gradients),
            cpu_sharing(job, profile),
            replicas=par.data * par.tensor,
            between=loop_between,
        )
    else:
        piped = pipeline_window.window(par.micro_batches, per_microbatch, send, virtual)
    window = piped.seconds
    in_window = (loop_between + loop_inside) * actions
    tail = max(st.dp_exposed + c + st.optimizer for st, c in zip(stages, closing))
    tail += (loop - in_window) / speed
    dependencies = window + tail
    cpu_seconds = 0.0
    cores = 0.0
    step = dependencies
    rank_cpu: tuple[float, ...] = ()
    if cpu_model:
        rank_cpu = tuple(st.busy + st.dp + st.optimizer + loop for st in work)
        cpu_seconds = par.data * par.tensor * sum(rank_cpu)
        cores = cpu_host.available_cores(profile)
        step = max(dependencies, cpu_seconds / cores)
    tokens = job.global_batch * shape.seq_len
    return TimePlan(
        links=used,
        stages=tuple(stages),
        bubble=bubble_ratio(par.pipeline, par.micro_batches, virtual),
        step_seconds=step,
        tokens_per_step=tokens,
        model_flops=model_flops_per_token(shape) * tokens,
        world_size=job.world_size,
        peak_flops=profile.peak_flops,
        pipeline_seconds=window,
        bubble_stage0=piped.idle_share(0, closing=closing[0], exposed=stages[0].dp_exposed),
        rank_flops=rank_flops * speed,
        oversubscription=host_oversubscription(job, profile),
        dependency_seconds=dependencies,
        cpu_seconds=cpu_seconds,
        available_cores=cores,
        rank_cpu_seconds=rank_cpu,
    )


def _closing_seconds(stage_comm: comm.StageComm, link: network.Link) -> float:
    """A stage's pipeline-group all-reduces: after its last backward, outside the schedule."""
    return sum(
        network.collective_seconds(c, link)
        for c in stage_comm.collectives
        if c.group == "pp" and c.op == "all_reduce"
    )


def _wall_tp_seconds(
    job: api_spec.TrainingJobSpec,
    profile: profiles.Profile,
    stage_comm: comm.StageComm,
    pod_domains: Sequence[str] | None,
) -> float:
    """A stage's tensor-parallel collectives at the calibrated wall time of a call.

    Each one blocks its rank until every member has arrived and been woken:
    the wall time of a call that follows compute, not the CPU the call costs
    (a CPU host's work model), is what the step waits; the trainer's own
    calls in calibration's step-loop run where they were timed
    (``tp_collectives``), else the micro-benchmark's.
    """
    link = network.links(profile)[network.group_links(job, pod_domains)["tp"]]
    link = link.preferring(profile.tp_collectives)
    return sum(
        network.collective_seconds(c, link) for c in stage_comm.collectives if c.group == "tp"
    )


def _scaled(stage: StageTime, factor: float) -> StageTime:
    """``stage`` with every duration multiplied by ``factor`` (CPU seconds to wall seconds)."""
    if factor == 1.0:
        return stage
    return dataclasses.replace(
        stage,
        compute=stage.compute * factor,
        tp=stage.tp * factor,
        pp=stage.pp * factor,
        dp=stage.dp * factor,
        dp_exposed=stage.dp_exposed * factor,
        optimizer=stage.optimizer * factor,
        overhead=stage.overhead * factor,
        forward=stage.forward * factor,
    )
