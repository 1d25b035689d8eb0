"""Prometheus exporter of one rank, and the ``/progress`` endpoint of global rank 0.

One small HTTP server per rank on ``metrics.port + local_rank`` (:mod:`http_server`: bounded in
time and connections), every series with the rank's labels; sums and quantiles across ranks are PromQL's.  Per rank rather than per pod because
torchrun's ranks are separate processes (docs/telemetry.md, "Exporter: one HTTP server per
rank").  The metric families are one table, :data:`DECLARATIONS`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
from collections.abc import Sequence
from typing import Any, Literal

import prometheus_client
from prometheus_client import exposition

from meshtrain.trainer.guards import stragglers
from meshtrain.trainer.telemetry import context, http_server, recording, stepstats
from meshtrain.trainer.telemetry import goodput as goodput_mod
from meshtrain.trainer.telemetry import progress as progress_mod

log = logging.getLogger(__name__)

HOST_ENV = "MESHTRAIN_METRICS_HOST"
"""Environment variable naming the address the HTTP servers bind (default ``0.0.0.0``: every interface)."""
DEFAULT_HOST = "0.0.0.0"


def bind_host() -> str:
    """The address to serve metrics on: ``$MESHTRAIN_METRICS_HOST``, else every IPv4 interface."""
    return os.environ.get(HOST_ENV) or DEFAULT_HOST


STEP_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    25.0,
    60.0,
    120.0,
    300.0,
)
"""Step and compute durations: 5 ms (tiny CPU model) to 5 min (huge step)."""
COMM_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Collective and exposed-communication durations: 100 us to 10 s."""
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""A recovery phase's seconds: 100 ms (an in-place rejoin) to 30 min (a gang rebuilt elsewhere)."""


MAX_CAUSES = 16
"""Distinct ``cause`` label values of ``meshtrain_recoveries_total`` (more read ``other``)."""

Kind = Literal["counter", "gauge", "histogram"]
"""The Prometheus metric types a rank exports (their ``# TYPE`` names)."""


@dataclasses.dataclass(frozen=True)
class Declaration:
    """One metric family of a rank, as :class:`Metrics` registers it."""

    attribute: str
    """The :class:`Metrics` attribute that holds it."""
    kind: Kind
    """Counter, gauge or histogram."""
    name: str
    """Prometheus name (a counter's without its ``_total``)."""
    help: str
    """The HELP text."""
    labels: tuple[str, ...] = ()
    """Labels after the rank's (:meth:`context.RankIdentity.labels`)."""
    buckets: tuple[float, ...] = ()
    """A histogram's bucket bounds."""
    lazy: bool = False
    """No series until first set (rather than a false 0 before it): the attribute holds the family."""

    @property
    def series_now(self) -> bool:
        """The attribute holds the rank's series, made at once (no extra labels, not lazy)."""
        return not self.labels and not self.lazy


COMM = ("group", "op")
"""Labels of a collective's metrics after the rank's."""

DECLARATIONS: tuple[Declaration, ...] = (
    Declaration(
        "tokens",
        "counter",
        "meshtrain_tokens",
        "Tokens of the global batches trained (job-wide, as seen by this rank); throughput is its"
        " rate().",
    ),
    Declaration(
        "step_seconds",
        "histogram",
        "meshtrain_step_seconds",
        "Wall time of an optimizer step.",
        buckets=STEP_BUCKETS,
    ),
    Declaration(
        "compute_seconds",
        "histogram",
        "meshtrain_compute_seconds",
        "Forward+backward compute time of this rank in a step (straggler signal).",
        buckets=STEP_BUCKETS,
    ),
    Declaration("step", "gauge", "meshtrain_step", "Last completed optimizer step."),
    Declaration(
        "last_step_time",
        "gauge",
        "meshtrain_last_step_timestamp_seconds",
        "Unix time the last step completed; the start of training before the first.",
    ),
    Declaration("loss", "gauge", "meshtrain_loss", "Mean training loss of the last step."),
    Declaration(
        "learning_rate",
        "gauge",
        "meshtrain_learning_rate",
        "Learning rate of the last step (schedule with training.lrScaling applied).",
    ),
    Declaration(  # labelled at the first evaluation
        "eval_loss",
        "gauge",
        "meshtrain_eval_loss",
        "Validation loss of the last evaluation (training.eval).",
        lazy=True,
    ),
    Declaration(
        "skipped_updates",
        "counter",
        "meshtrain_skipped_updates",
        "Optimizer updates the loss guard skipped (non-finite or spiking loss or gradient norm).",
    ),
    Declaration(  # labelled at the first judged step: no series for a job without peers or detection
        "slowdown",
        "gauge",
        "meshtrain_rank_slowdown_ratio",
        "Compute time of this rank over its data-parallel peers' median, median over the "
        "runPolicy.stragglerPolicy window (1 = as fast as its peers).",
        labels=("node",),
    ),
    Declaration(
        "straggler",
        "gauge",
        "meshtrain_rank_straggler",
        "1 while the trainer flags this rank as a straggler (slowdown above the policy threshold for the window), else 0.",
        labels=("node",),
    ),
    Declaration(
        "mfu",
        "gauge",
        "meshtrain_model_flops_utilization_ratio",
        "Model FLOPs of the last step over world size x peak FLOP/s x step seconds.",
    ),
    Declaration(
        "peak_flops",
        "gauge",
        "meshtrain_device_peak_flops_per_second",
        "Peak FLOP/s per device used as the MFU denominator.",
    ),
    Declaration(
        "bubble",
        "gauge",
        "meshtrain_pipeline_bubble_ratio",
        "Measured share of the last step's pipeline window this stage spent neither computing nor in exposed communication.",
    ),
    Declaration(
        "bubble_theory",
        "gauge",
        "meshtrain_pipeline_bubble_ratio_theoretical",
        "(p-1)/(v*m+p-1) for this job's schedule.",
    ),
    Declaration(
        "wait",
        "counter",
        "meshtrain_pipeline_wait_seconds",
        "Time blocked on pipeline sends and receives.",
    ),
    Declaration(
        "exposed",
        "histogram",
        "meshtrain_exposed_comm_seconds",
        "Gradient reduction time not hidden behind backward compute, per step.",
        buckets=(0.0, *COMM_BUCKETS),
    ),
    Declaration(
        "allreduce_seconds",
        "histogram",
        "meshtrain_allreduce_seconds",
        "Duration of one collective call (one gradient bucket for dp); level: flat, or intra / inter"
        " node for the stages of parallelism.allReduce hierarchical.",
        labels=(*COMM, "level"),
        buckets=COMM_BUCKETS,
    ),
    Declaration(
        "ring_seconds",
        "histogram",
        "meshtrain_context_ring_seconds",
        "Duration of one context-parallel ring transfer (keys and values to the next cp rank, or"
        " their gradients back), from its launch beside a block's attention until its wait"
        " returned: an upper bound on the transfer, the attention beside it included (the exposed"
        " part is cp_exposed_seconds in steps.jsonl).",
        labels=COMM,
        buckets=COMM_BUCKETS,
    ),
    Declaration(
        "allreduce_bytes",
        "counter",
        "meshtrain_allreduce_bytes",
        "Payload bytes of collectives.",
        labels=COMM,
    ),
    Declaration(
        "bus_bytes",
        "counter",
        "meshtrain_collective_bus_bytes",
        "Payload bytes of collectives times the nccl-tests bus factor (2(n-1)/n all-reduce, (n-1)/n"
        " reduce-scatter and all-gather); its rate() over busy seconds' rate() is the bus bandwidth.",
        labels=COMM,
    ),
    Declaration(
        "busy_seconds",
        "counter",
        "meshtrain_collective_busy_seconds",
        "Time at least one collective of the group and op was in flight (overlapping calls once).",
        labels=COMM,
    ),
    Declaration(
        "gradient_bytes",
        "counter",
        "meshtrain_gradient_reduction_bytes",
        "Payload bytes of the data-parallel gradient reduction: stage=uncompressed (a plain fp32"
        " all-reduce's) or sent (after parallelism.gradientCompression); the compression ratio is"
        " rate(uncompressed) / rate(sent).",
        labels=("stage",),
    ),
    Declaration(
        "memory",
        "gauge",
        "meshtrain_memory_bytes",
        "Bytes of training state held by this rank, by component: parameters, gradients, optimizer.",
        labels=("component",),
    ),
    Declaration(
        "memory_peak",
        "gauge",
        "meshtrain_memory_peak_bytes",
        "Peak memory of this rank: CUDA max_memory_allocated on a GPU, the process' peak resident set on CPU.",
    ),
    Declaration(
        "training_steps",
        "gauge",
        "meshtrain_training_steps",
        "training.steps: the step the job ends at.",
    ),
    Declaration(
        "global_batch",
        "gauge",
        "meshtrain_global_batch_sequences",
        "Sequences per optimizer step (microBatch x microBatches x data).",
    ),
    Declaration(
        "noise_scale",
        "gauge",
        "meshtrain_gradient_noise_scale",
        "Gradient noise scale in sequences (McCandlish et al. 2018, from the replicas' own and the"
        " all-reduced gradient norms; needs data >= 2, ZeRO 0 or 1, no sequence parallelism).",
    ),
    Declaration(
        "epoch",
        "gauge",
        "meshtrain_epoch",
        "training.sampling: epochs: the epoch (0-based) of the last step's first window (0 under random).",
    ),
    Declaration(
        "checkpoint_interval",
        "gauge",
        "meshtrain_checkpoint_interval_steps",
        "checkpoint.intervalSteps (0: saved only at the end).",
    ),
    Declaration(
        "checkpoint_step",
        "gauge",
        "meshtrain_checkpoint_last_step",
        "Step of the newest complete checkpoint.",
    ),
    Declaration(
        "checkpoint_time",
        "gauge",
        "meshtrain_checkpoint_last_timestamp_seconds",
        "Unix time the newest complete checkpoint was saved or resumed from; the start of"
        " training before the first.",
    ),
    Declaration(  # global rank 0 only, from its first step
        "goodput",
        "gauge",
        "meshtrain_goodput_ratio",
        "Productive step time (each step's last run) over wall time since the job's start"
        " (MESHTRAIN_JOB_STARTED_AT, else its first step), across restarts (global rank 0).",
        lazy=True,
    ),
    Declaration(  # global rank 0 only, from its first step
        "goodput_productive",
        "gauge",
        "meshtrain_goodput_productive_seconds",
        "Productive step time of the whole run so far (each step's last run; global rank 0).",
        lazy=True,
    ),
    Declaration(  # global rank 0 only, from its first step
        "goodput_wall",
        "gauge",
        "meshtrain_goodput_wall_seconds",
        "Wall time of the whole run so far, from the job's start (global rank 0).",
        lazy=True,
    ),
    Declaration(
        "goodput_lost",
        "gauge",
        "meshtrain_goodput_lost_seconds",
        "Seconds failures cost the whole run so far, by phase (global rank 0; status.goodput's"
        " lostSeconds).",
        labels=("phase",),
    ),
    Declaration(
        "recovery_seconds",
        "histogram",
        "meshtrain_recovery_seconds",
        "Seconds one failure cost, by phase (detection, restart, reload, recompute) and the tier"
        " that recovered it (global rank 0).",
        labels=("phase", "tier"),
        buckets=RECOVERY_BUCKETS,
    ),
    Declaration(
        "recoveries",
        "counter",
        "meshtrain_recoveries",
        "Failures recovered, by tier and cause, seen by this process (global rank 0).",
        labels=("tier", "cause"),
    ),
    Declaration(
        "lost_steps",
        "counter",
        "meshtrain_lost_steps",
        "Steps done and done again after a restore to an earlier step (global rank 0).",
        lazy=True,
    ),
)
"""Every metric family of a rank, in the order of the scrape."""


class Metrics:
    """The metric families of one rank, in a private registry: one attribute per :data:`DECLARATIONS` row.

    A row's attribute holds the rank's series (labelled at once), or the
    family where the row has labels of its own or is lazy.
    """

    tokens: prometheus_client.Counter
    step_seconds: prometheus_client.Histogram
    compute_seconds: prometheus_client.Histogram
    step: prometheus_client.Gauge
    last_step_time: prometheus_client.Gauge
    loss: prometheus_client.Gauge
    learning_rate: prometheus_client.Gauge
    eval_loss: prometheus_client.Gauge
    skipped_updates: prometheus_client.Counter
    slowdown: prometheus_client.Gauge
    straggler: prometheus_client.Gauge
    mfu: prometheus_client.Gauge
    peak_flops: prometheus_client.Gauge
    bubble: prometheus_client.Gauge
    bubble_theory: prometheus_client.Gauge
    wait: prometheus_client.Counter
    exposed: prometheus_client.Histogram
    allreduce_seconds: prometheus_client.Histogram
    ring_seconds: prometheus_client.Histogram
    allreduce_bytes: prometheus_client.Counter
    bus_bytes: prometheus_client.Counter
    busy_seconds: prometheus_client.Counter
    gradient_bytes: prometheus_client.Counter
    memory: prometheus_client.Gauge
    memory_peak: prometheus_client.Gauge
    training_steps: prometheus_client.Gauge
    global_batch: prometheus_client.Gauge
    noise_scale: prometheus_client.Gauge
    epoch: prometheus_client.Gauge
    checkpoint_interval: prometheus_client.Gauge
    checkpoint_step: prometheus_client.Gauge
    checkpoint_time: prometheus_client.Gauge
    goodput: prometheus_client.Gauge
    goodput_productive: prometheus_client.Gauge
    goodput_wall: prometheus_client.Gauge
    goodput_lost: prometheus_client.Gauge
    recovery_seconds: prometheus_client.Histogram
    recoveries: prometheus_client.Counter
    lost_steps: prometheus_client.Counter

    def __init__(self, identity: context.RankIdentity) -> None:
        prometheus_client.disable_created_metrics()  # *_created series only add noise to every counter
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        """Registry served by this rank (not the process-global default)."""
        self.base = identity.labels()
        """Labels of this rank."""
        for row in DECLARATIONS:
            family = _register(row, self.registry, tuple(self.base))
            setattr(self, row.attribute, family.labels(**self.base) if row.series_now else family)
        self._comm_children: dict[tuple[str, str], tuple[Any, Any, Any, Any]] = {}

    def comm(self, group: str, op: str) -> tuple[Any, Any, Any, Any]:
        """(seconds histogram, bytes, bus bytes and busy seconds counters) children of (group, op)."""
        key = (group, op)
        if key not in self._comm_children:
            labels = {**self.base, "group": group, "op": op}
            seconds = (  # point-to-point ring transfers are not collective calls
                self.ring_seconds.labels(**labels)
                if op == recording.RING_OP
                else self.allreduce_seconds.labels(**labels, level="flat")
            )
            self._comm_children[key] = (
                seconds,
                self.allreduce_bytes.labels(**labels),
                self.bus_bytes.labels(**labels),
                self.busy_seconds.labels(**labels),
            )
        return self._comm_children[key]


def _register(
    row: Declaration, registry: prometheus_client.CollectorRegistry, base: tuple[str, ...]
) -> prometheus_client.Counter | prometheus_client.Gauge | prometheus_client.Histogram:
    """The family of ``row``, registered in ``registry`` with the rank's label names ``base``."""
    labelnames = (*base, *row.labels)
    if row.kind == "histogram":
        return prometheus_client.Histogram(
            row.name, row.help, labelnames, registry=registry, buckets=row.buckets
        )
    kind = prometheus_client.Counter if row.kind == "counter" else prometheus_client.Gauge
    return kind(row.name, row.help, labelnames, registry=registry)


def _routes(
    registry: prometheus_client.CollectorRegistry, progress: progress_mod.Progress | None
) -> dict[str, http_server.Route]:
    """What a rank serves: /metrics and /healthz; rank 0 adds /progress."""
    routes: dict[str, http_server.Route] = {
        "/metrics": lambda: (
            exposition.generate_latest(registry),
            exposition.CONTENT_TYPE_LATEST,
        ),
        "/healthz": lambda: (b"ok\n", "text/plain"),
    }
    if progress is not None:
        routes["/progress"] = lambda: (
            json.dumps(progress.document()).encode(),
            "application/json",
        )
    return routes


class Exporter:
    """Metrics of one rank, served over HTTP; rank 0 adds /progress."""

    def __init__(
        self,
        identity: context.RankIdentity,
        facts: stepstats.JobFacts,
        *,
        port: int,
        progress: progress_mod.Progress | None,
        host: str = DEFAULT_HOST,
    ) -> None:
        self.metrics = Metrics(identity)
        self.identity = identity
        self.progress = progress
        """The /progress document served (global rank 0 only; another sink keeps it up to date)."""
        self.facts = facts
        self.metrics.bubble_theory.set(facts.bubble_theoretical)
        self.metrics.peak_flops.set(facts.peak_flops)
        self.metrics.training_steps.set(facts.training_steps)
        self.metrics.global_batch.set(facts.global_batch)
        self.metrics.noise_scale.set(float("nan"))  # unmeasured: no ratio against the batch
        self.metrics.checkpoint_interval.set(facts.checkpoint_interval_steps)
        self.metrics.checkpoint_time.set_to_current_time()  # the interval's clock starts with training
        # A 0 would read as "no step since 1970" and page MeshtrainJobStalled during every start-up.
        self.metrics.last_step_time.set_to_current_time()
        self._causes: set[str] = set()
        if progress is not None:  # global rank 0: every phase and tier at 0 until a failure
            self.goodput(None, [])
        self.port = port
        """TCP port of the HTTP server."""
        self._server: http_server.Server | None = None
        try:
            self._server = http_server.Server(
                host, port, _routes(self.metrics.registry, self.progress)
            )
        except OSError as err:
            log.warning(
                "rank %d: metrics address %s:%d unavailable (%s); metrics are not served",
                identity.rank,
                host,
                port,
                err,
            )
            return

    @property
    def serving(self) -> bool:
        """Whether the HTTP server is up."""
        return self._server is not None

    def publish(
        self,
        stats: stepstats.StepStats,
        events: Sequence[recording.Event],
        start: float,
        memory: context.MemorySample | None,
    ) -> None:
        m = self.metrics
        m.tokens.inc(stats.tokens)
        m.step_seconds.observe(stats.seconds)
        m.compute_seconds.observe(stats.compute_seconds)
        m.step.set(stats.step)
        m.last_step_time.set_to_current_time()
        m.loss.set(stats.loss)
        m.learning_rate.set(self.facts.learning_rate(stats.step))
        m.mfu.set(stats.mfu)
        m.bubble.set(stats.bubble_ratio)
        m.bubble_theory.set(stats.bubble_ratio_theoretical)
        m.wait.inc(stats.wait_seconds)
        m.exposed.observe(stats.exposed_comm_seconds)
        for e in events:
            if e.what == "collective" and e.level == "flat":
                m.comm(e.group or "?", e.kind)[0].observe(e.end - e.start)
            elif e.what == "collective":  # a stage of a hierarchical all-reduce
                m.allreduce_seconds.labels(
                    **m.base, group=e.group or "?", op=e.kind, level=e.level
                ).observe(e.end - e.start)
        for (
            c
        ) in stats.collectives:  # bus bandwidth is a ratio of rates: no gauge of the last step's
            _, nbytes, bus_bytes, busy = m.comm(c.group, c.op)
            nbytes.inc(c.nbytes)
            bus_bytes.inc(c.bus_bandwidth * c.busy_seconds)
            busy.inc(c.busy_seconds)
        if stats.dp_sent_bytes:
            m.gradient_bytes.labels(**m.base, stage="uncompressed").inc(stats.dp_uncompressed_bytes)
            m.gradient_bytes.labels(**m.base, stage="sent").inc(stats.dp_sent_bytes)
        if memory is not None:
            for component, value in memory.components().items():
                m.memory.labels(**m.base, component=component).set(value)
            m.memory_peak.set(memory.peak_allocated)

    def goodput(
        self, account: goodput_mod.Account | None, failures: Sequence[goodput_mod.Failure]
    ) -> None:
        """Rank 0's goodput after a step (None: none yet, every phase and tier made at 0), and the
        failures found since the last one (causes past the first :data:`MAX_CAUSES` read ``other``)."""
        m = self.metrics
        if account is not None and account.ratio is not None:
            m.goodput.labels(**m.base).set(account.ratio)
            m.goodput_productive.labels(**m.base).set(account.productive_seconds)
            m.goodput_wall.labels(**m.base).set(account.wall_seconds)
        for phase in goodput_mod.PHASES:  # the whole run's, across processes (the account's)
            seconds = account.lost_seconds[phase] if account is not None else 0.0
            m.goodput_lost.labels(**m.base, phase=phase).set(seconds)
        for phase, tier in itertools.product(goodput_mod.PHASES, goodput_mod.TIERS):
            m.recovery_seconds.labels(**m.base, phase=phase, tier=tier)
        lost = m.lost_steps.labels(**m.base)
        for failure in failures:
            for phase, seconds in failure.seconds.items():
                m.recovery_seconds.labels(**m.base, phase=phase, tier=failure.tier).observe(seconds)
            if failure.cause not in self._causes and len(self._causes) < MAX_CAUSES:
                self._causes.add(failure.cause)
            cause = failure.cause if failure.cause in self._causes else "other"
            m.recoveries.labels(**m.base, tier=failure.tier, cause=cause).inc()
            lost.inc(failure.lost_steps)

    def checkpoint_saved(self, step: int) -> None:
        self.metrics.checkpoint_step.set(step)
        self.metrics.checkpoint_time.set_to_current_time()

    def health(
        self,
        step: int,
        *,
        eval_loss: float | None,
        skipped: str,
        noise_scale: float | None = None,
        epoch: int | None = None,
    ) -> None:
        if noise_scale is not None:
            self.metrics.noise_scale.set(noise_scale)
        if epoch is not None:
            self.metrics.epoch.set(epoch)
        if eval_loss is not None:
            self.metrics.eval_loss.labels(**self.metrics.base).set(eval_loss)
        if skipped:
            self.metrics.skipped_updates.inc()

    def straggler_verdict(self, verdict: stragglers.Verdict) -> None:
        rank = self.identity.rank
        value = verdict.slowdowns[rank]
        if value is None:
            return
        labels = {**self.metrics.base, "node": self.identity.node}
        self.metrics.slowdown.labels(**labels).set(value)
        self.metrics.straggler.labels(**labels).set(1.0 if verdict.is_flagged(rank) else 0.0)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
