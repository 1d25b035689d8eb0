"""Pure arithmetic on one step's timing events: bubble, exposed communication, bandwidth, MFU.

The definitions behind every number the trainer reports about a step (docs/telemetry.md,
"Definitions"), as functions of plain values: one rank's :class:`~.recording.Event` list and a few
facts about the job.  Unit-tested without processes or clocks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from meshtrain.planner import mfu
from meshtrain.planner.timing import pipeline_window
from meshtrain.trainer.optim import batch_change, lr_schedule
from meshtrain.trainer.telemetry import recording

ALL_REDUCE_OPS = frozenset({"all_reduce", "allreduce"})
SHARDED_OPS = frozenset(
    {"reduce_scatter", "all_gather", "reduce_scatter_tensor", "all_gather_into_tensor"}
)


@dataclasses.dataclass(frozen=True)
class JobFacts:
    """What a rank knows about the job that turns events into ratios."""

    stages: int
    """Pipeline degree p."""
    micro_batches: int
    """Micro-batches per step m."""
    virtual_stages: int
    """Model chunks per stage v (1 unless interleaved)."""
    world_size: int
    """Ranks in the job (MFU denominator)."""
    group_sizes: dict[str, int]
    """Members of this rank's 'dp', 'tp' and 'pp' groups (bus-bandwidth factor)."""
    flops_per_token: float
    """Training FLOPs per token of the whole model (see docs/telemetry.md)."""
    peak_flops: float
    """Peak FLOP/s of one device, as MFU counts it (:func:`meshtrain.planner.mfu.device_peak`; 0:
    unknown, the steps' MFU is NaN and left out of steps.jsonl)."""
    mfu_devices: float = 0.0
    """Devices the MFU denominator counts (:func:`meshtrain.planner.mfu.devices`; 0: ``world_size``)."""
    training_steps: int = 0
    """training.steps: the step the job ends at (0: unknown)."""
    checkpoint_interval_steps: int = 0
    """checkpoint.intervalSteps (0: saved only at the end)."""
    peak_learning_rate: float = 0.0
    """training.learningRate after lrScaling at this layout's global batch."""
    min_learning_rate: float = 0.0
    """training.minLearningRate after lrScaling."""
    warmup_steps: int = 0
    """training.warmupSteps."""
    global_batch: int = 0
    """Sequences per optimizer step (microBatch x microBatches x data; 0: unknown)."""
    lr_plan: batch_change.LrPlan = dataclasses.field(default_factory=batch_change.LrPlan)
    """The multiplier a resume at another batch put on the rates (the engine's ``lr_plan``)."""

    def learning_rate(self, step: int) -> float:
        """The learning rate the optimizer used at ``step`` (the engine's schedule)."""
        return lr_schedule.lr_at(
            step,
            peak=self.peak_learning_rate,
            minimum=self.min_learning_rate,
            warmup=self.warmup_steps,
            total=max(self.training_steps, 1),
        ) * self.lr_plan.multiplier(step)

    @property
    def bubble_theoretical(self) -> float:
        """(p - 1) / (v * m + p - 1)."""
        return pipeline_window.bubble_ratio(self.stages, self.micro_batches, self.virtual_stages)


@dataclasses.dataclass(frozen=True)
class CollectiveStats:
    """Collectives of one (group, op) during one step on one rank."""

    group: str
    """Process-group axis: dp, tp or pp."""
    op: str
    """all_reduce, reduce_scatter, all_gather, ..."""
    count: int
    """Calls (buckets for the data-parallel gradient reduction)."""
    seconds: float
    """Sum of the calls' durations."""
    busy_seconds: float
    """Union of the calls' intervals (overlapping calls counted once)."""
    nbytes: int
    """Payload bytes, summed over calls."""
    bus_bandwidth: float
    """Bytes/s on the busiest link, nccl-tests convention, over ``busy_seconds``."""


@dataclasses.dataclass(frozen=True)
class StepStats:
    """Everything reported about one optimizer step of one rank."""

    step: int
    """Optimizer step (1-based)."""
    loss: float
    """Mean loss of the step."""
    tokens: int
    """Tokens of the global batch."""
    seconds: float
    """Wall seconds of the step."""
    forward_seconds: float
    """Sum of forward compute intervals."""
    backward_seconds: float
    """Sum of backward compute intervals."""
    compute_seconds: float
    """Union of compute intervals."""
    wait_seconds: float
    """Time blocked on pipeline sends and receives."""
    tp_exposed_seconds: float
    """Time blocked on tensor-parallel collectives: all of each blocking one, the part of an
    overlapped one (``parallelism.overlap.tensor``) its matmuls did not hide."""
    cp_exposed_seconds: float
    """Time blocked on context-parallel ring transfers: what the attention beside them did not
    hide (their flight is the ``cp`` collectives')."""
    exposed_comm_seconds: float
    """Gradient reduction not hidden behind backward compute."""
    update_seconds: float
    """Step time after the pipeline window (optimizer update, loss reduction)."""
    bubble_ratio: float
    """Measured idle share of the pipeline window on this stage."""
    bubble_ratio_theoretical: float
    """(p - 1) / (v * m + p - 1)."""
    tokens_per_second: float
    """Job throughput of this step."""
    model_flops: float
    """Model FLOPs of the step, whole job."""
    mfu: float
    """Model FLOPs utilisation of the step, whole job (NaN: no peak known, not reported)."""
    collectives: tuple[CollectiveStats, ...]
    """Per (group, op) totals."""
    dp_uncompressed_bytes: int = 0
    """Payload a plain all-reduce of this step's gradients has (0: no data-parallel reducer)."""
    dp_sent_bytes: int = 0
    """Payload the data-parallel gradient reduction sent (less under gradientCompression)."""

    @property
    def compression_ratio(self) -> float:
        """Uncompressed over sent gradient bytes (1 without compression; 0 without a reducer)."""
        return self.dp_uncompressed_bytes / self.dp_sent_bytes if self.dp_sent_bytes else 0.0

    def allreduce_seconds(self, group: str = "dp") -> float:
        """Summed duration of ``group``'s collectives (all ops)."""
        return sum(c.seconds for c in self.collectives if c.group == group)

    def log_record(self) -> dict[str, float | int]:
        """The steps.jsonl line of this step."""
        return {
            "step": self.step,
            "loss": self.loss,
            "tokens": self.tokens,
            "step_seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "allreduce_seconds": self.allreduce_seconds("dp"),
            "tp_allreduce_seconds": self.allreduce_seconds("tp"),
            "tp_exposed_seconds": self.tp_exposed_seconds,
            **({"cp_exposed_seconds": self.cp_exposed_seconds} if self.cp_exposed_seconds else {}),
            "pipeline_wait_seconds": self.wait_seconds,
            "exposed_comm_seconds": self.exposed_comm_seconds,
            "compute_seconds": self.compute_seconds,
            "update_seconds": self.update_seconds,
            "bubble_ratio": self.bubble_ratio,
            "bubble_ratio_theoretical": self.bubble_ratio_theoretical,
            **({} if math.isnan(self.mfu) else {"mfu": self.mfu}),
        }


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def bus_factor(op: str, members: int) -> float:
    """nccl-tests bus-bandwidth factor of ``op`` over ``members`` ranks."""
    n = max(members, 1)
    if op in ALL_REDUCE_OPS:
        return 2 * (n - 1) / n
    if op in SHARDED_OPS:
        return (n - 1) / n
    return 1.0


def bus_bandwidth(op: str, nbytes: float, seconds: float, members: int) -> float:
    """Bus bandwidth in bytes/s: algbw (bytes / seconds) x :func:`bus_factor`."""
    if seconds <= 0:
        return 0.0
    return nbytes / seconds * bus_factor(op, members)


def exposed_comm(events: Sequence[recording.Event]) -> float:
    """Seconds from the end of the last backward until the last dp collective ends."""
    backward_ends = [e.end for e in events if e.what == "compute" and e.kind == "backward"]
    dp_ends = [e.end for e in events if e.what == "collective" and e.group == "dp"]
    if not dp_ends:
        return 0.0
    if not backward_ends:
        return union_seconds(
            (e.start, e.end) for e in events if e.what == "collective" and e.group == "dp"
        )
    return max(0.0, max(dp_ends) - max(backward_ends))


def collective_stats(
    events: Sequence[recording.Event], group_sizes: dict[str, int]
) -> tuple[CollectiveStats, ...]:
    """Per (group, op) totals of the collective events, sorted by group then op."""
    by_key: dict[tuple[str, str], list[recording.Event]] = {}
    for e in events:
        if e.what == "collective":
            by_key.setdefault((e.group or "?", e.kind), []).append(e)
    out = []
    for (group, op), calls in sorted(by_key.items()):
        busy = union_seconds((c.start, c.end) for c in calls)
        nbytes = sum(c.nbytes for c in calls)
        out.append(
            CollectiveStats(
                group=group,
                op=op,
                count=len(calls),
                seconds=sum(c.end - c.start for c in calls),
                busy_seconds=busy,
                nbytes=nbytes,
                bus_bandwidth=bus_bandwidth(op, nbytes, busy, group_sizes.get(group, 1)),
            )
        )
    return tuple(out)


def window_seconds(events: Sequence[recording.Event], start: float, seconds: float) -> float:
    """Seconds from ``start`` to the end of the last event (the whole step if there is none)."""
    if not events:
        return seconds
    return min(seconds, max(e.end for e in events) - start)


def summarise(
    events: Sequence[recording.Event],
    facts: JobFacts,
    *,
    step: int,
    loss: float,
    tokens: int,
    seconds: float,
    start: float,
    model_flops: float | None = None,
) -> StepStats:
    """The :class:`StepStats` of one step from this rank's events; ``start`` is the step's origin.

    ``model_flops``: the step's FLOPs as counted from its batch (documents under
    ``training.documentMask``); None: ``facts.flops_per_token`` times ``tokens``.
    """
    compute = [e for e in events if e.what == "compute"]
    compute_union = union_seconds((e.start, e.end) for e in compute)
    exposed = exposed_comm(events)
    window = window_seconds(events, start, seconds)
    bubble = 0.0
    if window > 0:
        bubble = min(1.0, max(0.0, 1.0 - (compute_union + exposed) / window))
    if model_flops is None:
        model_flops = facts.flops_per_token * tokens
    utilisation = math.nan  # no peak (a GPU no profile names): MFU is not reported
    if facts.peak_flops > 0:
        utilisation = mfu.ratio(
            model_flops, seconds, facts.peak_flops, facts.mfu_devices or facts.world_size
        )
    return StepStats(
        step=step,
        loss=loss,
        tokens=tokens,
        seconds=seconds,
        forward_seconds=sum(e.end - e.start for e in compute if e.kind == "forward"),
        backward_seconds=sum(e.end - e.start for e in compute if e.kind == "backward"),
        compute_seconds=compute_union,
        wait_seconds=sum(
            e.end - e.start
            for e in events
            if e.what == "wait" and e.kind in recording.PIPELINE_WAITS
        ),
        tp_exposed_seconds=sum(
            e.end - e.start for e in events if e.what == "wait" and e.kind == "tp"
        ),
        cp_exposed_seconds=sum(
            e.end - e.start for e in events if e.what == "wait" and e.kind == "cp"
        ),
        exposed_comm_seconds=exposed,
        update_seconds=max(0.0, seconds - window),
        bubble_ratio=bubble,
        bubble_ratio_theoretical=facts.bubble_theoretical,
        tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
        model_flops=model_flops,
        mfu=utilisation,
        collectives=collective_stats(events, facts.group_sizes),
    )
