"""Time model: alpha-beta communication, FLOP-based compute, pipeline bubble, step time.

Pure functions that price the collectives of :mod:`.comm` on the
link each process group uses and the FLOPs of each stage on the device's
achievable FLOP/s, and put them together into a predicted step time:

* collectives (Hockney's alpha-beta model; ring algorithms as analysed by
  Patarasuk and Yuan 2009 and Thakur et al. 2005): all-reduce
  ``2 (n-1) alpha + 2 (n-1)/n M / B``; all-gather and reduce-scatter
  ``(n-1) alpha + (n-1)/n M / B``; a point-to-point send ``alpha + M / B``;
* the link of a group: the NVLink domain's (``nvlink_*`` of the profile) when
  all of the group's ranks sit in one domain, else the fabric's (``nic_*``);
* compute: ``6 N`` FLOPs per token for the matmuls of the parameters a rank
  holds plus ``12 l s h / t`` for attention (Kaplan et al. 2020; Narayanan et
  al. 2021), at ``peak x achievable_fraction``;
* pipeline: a stage is busy ``v m`` chunk-slots out of ``v m + p - 1``, the
  bubble ``(p-1)/(v m + p - 1)`` (Huang et al. 2019; Narayanan et al. 2021);
* data-parallel buckets overlap the last micro-batch's backward; what does
  not fit behind it (at least the last bucket) is exposed;
* the optimizer streams 32 bytes per updated parameter through device memory.

The computation-to-communication ratio compares compute seconds with the
sum of all collective seconds of the busiest rank; below 1 the job is
communication-bound.  Not a simulator of overlap inside a step,
or a measurement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshtrain import layout as layout_mod
from meshtrain.api import spec as api_spec
from meshtrain.planner import comm, memory, profiles

DEFAULT_CRITICAL_BATCH_TOKENS = 4 * 2**20
"""Tokens per step past which a warning is printed (GPT-3 trained at ~3.2M tokens; see docs/planner.md)."""

OPTIMIZER_BYTES_PER_PARAM = 32
"""AdamW reads weight, gradient and both moments and writes weight and moments (7 x 4 B), plus the norm pass (4 B)."""

BACKWARD_SHARE = 2.0 / 3.0
"""Backward's share of a micro-batch's compute (it costs twice the forward)."""


@dataclasses.dataclass(frozen=True)
class Link:
    """A network path as the alpha-beta model sees it."""

    name: str
    """``nvlink`` (inside an NVLink domain) or ``fabric`` (between domains)."""
    bandwidth: float
    """Bytes/s per direction per rank (beta = 1 / bandwidth)."""
    latency: float
    """Seconds per message step (alpha)."""


def links(profile: profiles.Profile) -> dict[str, Link]:
    """The two link kinds of a profile."""
    return {
        "nvlink": Link("nvlink", profile.nvlink_bandwidth, profile.nvlink_latency),
        "fabric": Link("fabric", profile.nic_bandwidth, profile.nic_latency),
    }


def ring_allreduce_seconds(nbytes: float, members: int, link: Link, calls: int = 1) -> float:
    """Ring all-reduce: ``2 (n-1) alpha`` per call plus ``2 (n-1)/n x M / B``."""
    if members <= 1:
        return 0.0
    n = members
    return calls * 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def ring_gather_seconds(nbytes: float, members: int, link: Link, calls: int = 1) -> float:
    """Ring all-gather or reduce-scatter of a full buffer of ``nbytes``: ``(n-1) alpha + (n-1)/n M / B``."""
    if members <= 1:
        return 0.0
    n = members
    return calls * (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def send_seconds(nbytes: float, link: Link, calls: int = 1) -> float:
    """Point-to-point messages: ``alpha`` per call plus ``M / B``."""
    return calls * link.latency + nbytes / link.bandwidth


def collective_seconds(collective: comm.Collective, link: Link) -> float:
    """Time of one :class:`~.comm.Collective` entry on ``link``."""
    if collective.op == "all_reduce":
        return ring_allreduce_seconds(collective.nbytes, collective.members, link, collective.calls)
    if collective.op in ("all_gather", "reduce_scatter"):
        return ring_gather_seconds(collective.nbytes, collective.members, link, collective.calls)
    return send_seconds(collective.nbytes, link, collective.calls)


def bubble_ratio(pipeline: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Theoretical idle share of a stage: ``(p - 1) / (v m + p - 1)`` (GPipe and 1F1B: v = 1)."""
    return (pipeline - 1) / (virtual_stages * micro_batches + pipeline - 1)


def group_links(
    job: api_spec.TrainingJobSpec, pod_domains: Sequence[str] | None = None
) -> dict[str, str]:
    """Which link kind each group axis uses: ``nvlink`` if every group of the axis stays in one domain.

    ``pod_domains[i]`` names the NVLink domain of pod ``i`` (its node, or its
    clique); without it every pod is its own domain (one node per pod).
    """
    grid = layout_mod.from_spec(job.parallelism)
    per_node = job.resources.gpus_per_node
    domains = (
        list(pod_domains) if pod_domains is not None else [f"pod-{i}" for i in range(job.pods)]
    )
    out = {}
    for axis in ("dp", "tp", "pp"):
        spans = any(
            len({domains[grid.pod_of(r, per_node)] for r in group}) > 1
            for group in grid.all_groups(axis)
        )
        out[axis] = "fabric" if spans else "nvlink"
    return out


def rank_flops_per_microbatch(
    shape: api_spec.ModelShape, pipeline: int, tensor: int, stage: int, micro_batch: int
) -> float:
    """Training FLOPs of one micro-batch on one rank of ``stage``: (6 N_rank + 12 l s h / t) x tokens.

    ``N_rank`` counts the parameters the rank multiplies with (its blocks and,
    on the last stage, the final norm and head; embedding lookups are not
    matmuls), as :func:`meshtrain.trainer.model.flops_per_token` does for the
    whole model.
    """
    layers = shape.layers // pipeline
    n_rank = layers * memory.layer_params(shape, tensor)
    if stage == pipeline - 1:
        n_rank += memory.head_params(shape, tensor)
        n_rank += shape.vocab * shape.hidden // tensor if shape.tie_embeddings else 0
    attention = 12 * layers * shape.seq_len * shape.hidden / tensor
    return (6 * n_rank + attention) * micro_batch * shape.seq_len


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


@dataclasses.dataclass(frozen=True)
class StageTime:
    """Predicted seconds of one rank of one pipeline stage in one step."""

    stage: int
    """Pipeline stage (0-based)."""
    compute: float
    """Forward and backward compute of all micro-batches."""
    tp: float
    """Tensor-parallel collectives (on the critical path)."""
    pp: float
    """Pipeline sends and the norm reduction over the pipeline group."""
    dp: float
    """Data-parallel gradient reduction (and ZeRO parameter gather), before overlap."""
    dp_exposed: float
    """Part of ``dp`` not hidden behind the last backward."""
    optimizer: float
    """The optimizer step."""

    @property
    def busy(self) -> float:
        """Compute plus the communication that blocks it (tp, pp)."""
        return self.compute + self.tp + self.pp

    @property
    def comm(self) -> float:
        """All communication seconds, overlapped or not."""
        return self.tp + self.pp + self.dp


@dataclasses.dataclass(frozen=True)
class TimePlan:
    """The predicted step of a job."""

    links: dict[str, Link]
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


def plan_time(
    job: api_spec.TrainingJobSpec,
    profile: profiles.Profile,
    scheme: memory.StateScheme,
    stage_comms: Sequence[comm.StageComm],
    pod_domains: Sequence[str] | None = None,
) -> TimePlan:
    """Price every stage's compute and collectives and assemble the step."""
    shape = job.model.shape()
    par = job.parallelism
    virtual = par.virtual_stages if par.schedule == "interleaved-1f1b" else 1
    kinds = links(profile)
    used = {axis: kinds[kind] for axis, kind in group_links(job, pod_domains).items()}
    stages = []
    for stage_comm in stage_comms:
        stage = stage_comm.stage
        per_mb = rank_flops_per_microbatch(
            shape, par.pipeline, par.tensor, stage, job.training.micro_batch
        )
        if job.training.activation_checkpointing:
            per_mb += recompute_flops_per_microbatch(
                shape, par.pipeline, par.tensor, job.training.micro_batch
            )
        compute = per_mb * par.micro_batches / profile.achievable_flops
        seconds = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
        dp_calls = 0
        for c in stage_comm.collectives:
            seconds[c.group] += collective_seconds(c, used[c.group])
            if c.group == "dp" and c.op != "all_gather":
                dp_calls += c.calls
        gather = sum(
            collective_seconds(c, used["dp"])
            for c in stage_comm.collectives
            if c.group == "dp" and c.op == "all_gather"
        )
        reduce = seconds["dp"] - gather
        window = BACKWARD_SHARE * compute / par.micro_batches
        exposed = max(reduce - window, reduce / dp_calls) if dp_calls else 0.0
        params = memory.rank_params(shape, par.pipeline, par.tensor, stage)
        updated = params / par.data if par.zero_stage >= 1 else params
        optimizer = updated * OPTIMIZER_BYTES_PER_PARAM / profile.memory_bandwidth
        stages.append(
            StageTime(
                stage=stage,
                compute=compute,
                tp=seconds["tp"],
                pp=seconds["pp"],
                dp=seconds["dp"],
                dp_exposed=exposed + gather,
                optimizer=optimizer,
            )
        )
    bubble = bubble_ratio(par.pipeline, par.micro_batches, virtual)
    pace = max(st.busy for st in stages)
    tail = max(st.dp_exposed + st.optimizer for st in stages)
    step = pace / (1 - bubble) + tail
    tokens = job.global_batch * shape.seq_len
    return TimePlan(
        links=used,
        stages=tuple(stages),
        bubble=bubble,
        step_seconds=step,
        tokens_per_step=tokens,
        model_flops=model_flops_per_token(shape) * tokens,
        world_size=job.world_size,
        peak_flops=profile.peak_flops,
    )
