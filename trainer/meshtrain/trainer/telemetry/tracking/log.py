"""Rank 0's step log with the trackers behind it: every record written to steps.jsonl also goes to
each tracker ``spec.tracking`` turns on, and the end draws the run report for MLflow."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from meshtrain.api import job_dir
from meshtrain.api import spec as api_spec
from meshtrain.trainer.telemetry import report, steplog
from meshtrain.trainer.telemetry.tracking import (
    backend,
    mlflow_run,
    runner,
    tensorboard_files,
    wandb_run,
)

REPORT_FILE = "report.html"
"""The run report's name as an artifact."""


def backends(context: backend.Context) -> list[backend.Backend]:
    """The trackers the spec turns on."""
    tracking = context.job.tracking
    chosen: list[backend.Backend] = []
    if tracking.tensorboard is not None:
        chosen.append(tensorboard_files.TensorBoardFiles(tracking.tensorboard, context))
    if tracking.mlflow is not None:
        chosen.append(mlflow_run.MLflowRun(tracking.mlflow, context))
    if tracking.wandb is not None:
        chosen.append(wandb_run.WandbRun(tracking.wandb, context))
    return chosen


def context_of(
    job: api_spec.TrainingJobSpec, log_dir: str | None, home: Path | None, first_step: int
) -> backend.Context:
    """Who the job is (the operator's variables; ``meshtrain run``: ``local`` and the log folder's name)."""
    logs = Path(log_dir) if log_dir else None
    return backend.Context(
        job=job,
        namespace=os.environ.get(job_dir.NAMESPACE_ENV) or job_dir.LOCAL_NAMESPACE,
        name=os.environ.get(job_dir.NAME_ENV) or (logs.name if logs else "job"),
        home=home,
        first_step=first_step,
        log_dir=logs,
    )


class TrackedLog:
    """steps.jsonl (when there is a log directory) and the trackers, one record at a time."""

    def __init__(self, context: backend.Context, trackers: list[backend.Backend]) -> None:
        self.context = context
        self.steps = steplog.StepLog(context.log_dir) if context.log_dir is not None else None
        self.runners = [runner.Runner(tracker) for tracker in trackers]
        self.last_step = 0
        self._closed = False

    def write(self, record: dict[str, Any]) -> None:
        """One step's record: to the file, then queued for every tracker."""
        if self.steps is not None:
            self.steps.write(record)
        self.last_step = int(record["step"])
        values = backend.metrics(record)
        for one in self.runners:
            one.log(self.last_step, values, float(record.get("time", 0.0)))

    def close(self) -> None:
        """Close the file, draw the report (for a tracker that keeps artifacts), end every run."""
        if self._closed:
            return
        self._closed = True
        if self.steps is not None:
            self.steps.close()
        finished = self.last_step >= self.context.job.training.steps
        with tempfile.TemporaryDirectory(prefix="meshtrain-report-") as scratch:
            drawn = self._report(Path(scratch)) if self._wants_report() else None
            for one in self.runners:
                one.close(drawn, finished)

    def _wants_report(self) -> bool:
        return any(one.failed is None and one.tracker.name == "mlflow" for one in self.runners)

    def _report(self, scratch: Path) -> Path | None:
        """``meshtrain report``'s page of this run (None, said on stderr, when it cannot be drawn)."""
        if self.context.log_dir is None:
            return None
        try:
            return report.write_html(report.load(self.context.log_dir), scratch / REPORT_FILE)
        except (report.ReportError, OSError, ValueError) as err:
            print(f"WARNING: no run report for the trackers: {err}", file=sys.stderr)
            return None


def step_log(
    job: api_spec.TrainingJobSpec, log_dir: str | None, home: Path | None, first_step: int
) -> steplog.StepLog | TrackedLog | None:
    """Rank 0's log: a plain step log when no tracker is on (None without a log directory)."""
    context = context_of(job, log_dir, home, first_step)
    trackers = backends(context)
    if trackers:
        return TrackedLog(context, trackers)
    return steplog.StepLog(log_dir) if log_dir else None


Writer = steplog.StepLog | TrackedLog
"""What rank 0 writes its step records to."""


def home(checkpoint_dir: object, log_dir: str | None) -> Path | None:
    """Where the trackers keep their files: the job's checkpoint directory when it is local, else
    (checkpoints in a bucket) the log directory; None when there is neither."""
    if isinstance(checkpoint_dir, Path):
        return checkpoint_dir
    return Path(log_dir) if log_dir else None
