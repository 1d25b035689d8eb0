"""The trainer's telemetry recorder: the engine's :class:`~.recording.StepRecorder`, made useful.

:class:`TelemetryRecorder` collects a step's events like every recorder and, once per step at
``step_end``, summarises them (:func:`.stepstats.summarise`) for its sinks: exporter, progress,
step log and trace.  The per-event calls only append under a lock (they may come from a
communication thread).  :func:`make_recorder` is the trainer's one point of construction.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from meshtrain.api import layout as layout_mod
from meshtrain.trainer.guards import stragglers
from meshtrain.trainer.models import gpt
from meshtrain.trainer.optim import batch_change
from meshtrain.trainer.telemetry import (
    context,
    exporter,
    goodput_live,
    peak,
    progress,
    recording,
    stepstats,
    trace,
)

KEEP_STEPS = 100
"""Step records kept in :attr:`TelemetryRecorder.steps`."""


class TelemetryRecorder(recording.EventCollector):
    """A :class:`~meshtrain.trainer.telemetry.recording.StepRecorder` that reports each step.

    Collects a step's events as every recorder does (:class:`~.recording.EventCollector`);
    ``step_end`` summarises them and hands the summary to the sinks.
    """

    def __init__(
        self,
        identity: context.RankIdentity,
        facts: stepstats.JobFacts,
        sinks: Sequence[context.Sink],
        device: Any = None,
        tracker: goodput_live.Tracker | None = None,
    ) -> None:
        super().__init__(started=time.perf_counter())
        self.identity = identity
        """Labels of this rank."""
        self.facts = facts
        """Job facts the ratios need."""
        self.sinks = list(sinks)
        """Exporter, step log, ..."""
        self.device = device
        """Device of this rank (peak memory is read from it on a GPU)."""
        self.progress = next((s for s in self.sinks if isinstance(s, progress.Progress)), None)
        """The progress document of global rank 0 (None on other ranks)."""
        self.last: stepstats.StepStats | None = None
        """Summary of the last finished step."""
        self.steps: list[dict[str, float | int]] = []
        """steps.jsonl records of the recent steps (newest last, at most ``KEEP_STEPS``)."""
        self.tracker = tracker
        """Global rank 0's goodput account (None elsewhere, or without a log directory)."""
        self._measure: Callable[[], Mapping[str, int]] | None = None
        self._payload: Callable[[], tuple[int, int]] | None = None

    def watch(
        self,
        measure: Callable[[], Mapping[str, int]],
        payload: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        """Measure this rank's training state at every step.

        ``measure`` returns the bytes held now by component (parameters,
        gradients, optimizer): :func:`meshtrain.trainer.parallel.state_bytes.meter`.
        ``payload`` is the data-parallel reducer's ``payload_bytes`` (None without one).
        """
        self._measure = measure
        self._payload = payload

    # -- StepRecorder: step_start and the events are the collector's ---------

    def step_end(
        self, step: int, loss: float, tokens: int, seconds: float, model_flops: float | None = None
    ) -> None:
        events, start = self.take()
        stats = stepstats.summarise(
            events,
            self.facts,
            step=step,
            loss=float(loss),
            tokens=int(tokens),
            seconds=seconds,
            start=start,
            model_flops=model_flops,
        )
        if self._payload is not None:
            uncompressed, sent = self._payload()
            stats = dataclasses.replace(
                stats, dp_uncompressed_bytes=uncompressed, dp_sent_bytes=sent
            )
        self.last = stats
        ended = time.time()  # the step record's time: the live goodput and its replay agree
        self.steps.append(stats.log_record() | {"time": ended})
        del self.steps[:-KEEP_STEPS]
        self._goodput(stats, ended)
        memory = self.memory()
        for sink in self.sinks:
            sink.publish(stats, events, start, memory)

    def _goodput(self, stats: stepstats.StepStats, now: float) -> None:
        """Rank 0: the step (ended at ``now``) into the goodput account, the account to /progress
        and the exporter."""
        if self.tracker is None:
            return
        found = self.tracker.step(stats.step, stats.seconds, now)
        account = self.tracker.accountant.account(now)
        for sink in self.sinks:
            if isinstance(sink, exporter.Exporter):
                sink.goodput(account, found)
        if self.progress is not None:
            self.progress.update(goodput=account.progress())

    # -- beyond the protocol -------------------------------------------------

    def learning_rates(self, plan: batch_change.LrPlan) -> None:
        """The rates follow ``plan`` from now on (a resume at another batch): the exported
        ``meshtrain_learning_rate`` is the rate the engine uses."""
        self.facts = dataclasses.replace(self.facts, lr_plan=plan)
        for sink in self.sinks:
            if isinstance(sink, exporter.Exporter):
                sink.facts = self.facts

    def checkpoint_saved(self, step: int) -> None:
        """Tell the sinks (the /progress document) that a checkpoint of ``step`` is complete
        (published), and the goodput tracker (its summary)."""
        if self.tracker is not None:
            self.tracker.checkpoint_saved(step)
        for sink in self.sinks:
            sink.checkpoint_saved(step)

    def health(
        self,
        step: int,
        *,
        eval_loss: float | None,
        skipped: str,
        noise_scale: float | None = None,
        epoch: int | None = None,
    ) -> None:
        """Validation loss, loss-guard verdict, gradient noise scale and epoch of ``step``, to every sink."""
        for sink in self.sinks:
            sink.health(
                step, eval_loss=eval_loss, skipped=skipped, noise_scale=noise_scale, epoch=epoch
            )

    def straggler_verdict(self, verdict: stragglers.Verdict) -> None:
        """The straggler detector's verdict, to every sink."""
        for sink in self.sinks:
            sink.straggler_verdict(verdict)

    def memory(self) -> context.MemorySample:
        """Bytes of the watched training state now (each storage once), and the peak."""
        peak_bytes = peak.peak_memory_bytes(self.device)
        if self._measure is None:
            return context.MemorySample(peak_allocated=peak_bytes)
        state = self._measure()
        return context.MemorySample(
            peak_allocated=peak_bytes,
            parameters=state["parameters"],
            gradients=state["gradients"],
            optimizer=state["optimizer"],
        )

    def close(self) -> None:
        """Close every sink (files, HTTP server)."""
        for sink in self.sinks:
            sink.close()


def job_facts(
    spec: Any,
    layout: layout_mod.ParallelLayout,
    rank: int,
    peak_flops: float,
    mfu_devices: float = 0.0,
) -> stepstats.JobFacts:
    """The :class:`~.stepstats.JobFacts` of a spec."""
    par = spec.parallelism
    config = gpt.GPTConfig.from_shape(spec.model.shape())
    peak_lr, min_lr = spec.training.learning_rates(par)
    return stepstats.JobFacts(
        stages=layout.pipeline,
        micro_batches=par.micro_batches,
        virtual_stages=par.virtual_stages,
        world_size=layout.world_size,
        group_sizes={
            "dp": layout.data * layout.context,  # cp ranks join the gradient reduction
            "tp": layout.tensor,
            "pp": layout.pipeline,
            "cp": layout.context,
        },
        flops_per_token=gpt.flops_per_token(config),
        peak_flops=peak_flops,
        mfu_devices=mfu_devices,
        training_steps=spec.training.steps,
        checkpoint_interval_steps=spec.checkpoint.interval_steps,
        peak_learning_rate=peak_lr,
        min_learning_rate=min_lr,
        warmup_steps=spec.training.warmup_steps,
        global_batch=spec.training.effective_global_batch(par),
    )


def make_recorder(
    spec: Any,
    layout: layout_mod.ParallelLayout,
    rank: int,
    log_dir: str | Path | None,
    *,
    local_rank: int | None = None,
    device: Any = None,
    serve: bool = True,
    steps_log: bool = True,
    tracker: goodput_live.Tracker | None = None,
) -> TelemetryRecorder:
    """The trainer's recorder: Prometheus exporter on ``$MESHTRAIN_METRICS_HOST:spec.metrics.port + local_rank``
    (rank 0 also keeps and serves the /progress document), steps.jsonl (rank 0)
    and the event trace under ``log_dir``.

    ``serve=False`` skips the HTTP server; ``steps_log=False`` leaves steps.jsonl
    to a caller that writes it itself from :attr:`TelemetryRecorder.steps`.  ``tracker``: the
    goodput account to keep (a supervised worker's, one per process); None: rank 0 with a log
    directory reads a new one.
    """
    identity = context.RankIdentity.from_env(layout, rank, local_rank)
    facts = job_facts(
        spec,
        layout,
        rank,
        peak.resolve_peak_flops(spec.metrics.peak_flops, device),
        peak.mfu_devices(layout.world_size, device),
    )
    sinks: list[context.Sink] = []
    document = (
        progress.Progress() if rank == 0 else None
    )  # kept even when not served: the final copy
    if document is not None:
        sinks.append(document)
    if serve:
        sinks.append(
            exporter.Exporter(
                identity,
                facts,
                port=spec.metrics.port + identity.local_rank,
                progress=document,
                host=exporter.bind_host(),
            )
        )
    if log_dir is not None:
        sinks.append(
            trace.TraceLog(
                Path(log_dir), identity, facts, schedule=spec.parallelism.schedule, steps=steps_log
            )
        )
    if tracker is None and rank == 0 and log_dir is not None:
        tracker = goodput_live.Tracker(log_dir)
    return TelemetryRecorder(identity, facts, sinks, device=device, tracker=tracker)


__all__ = ["TelemetryRecorder", "job_facts", "make_recorder"]
