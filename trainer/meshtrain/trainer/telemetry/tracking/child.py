"""The trackers' own process: ``python -m meshtrain.trainer.telemetry.tracking.child``.

Rank 0 starts it and writes JSON lines to its stdin: first the job (:meth:`.backend.Context.start_line`), then one
line per step, then the end.  Here each tracker runs on a thread of its own (:mod:`.runner`), and
the run report is drawn at the end; so their imports, their network calls and the report's
drawing never take the trainer's interpreter lock.  Warnings go to stderr, rank 0's log.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from meshtrain.api import loading
from meshtrain.trainer.telemetry import report
from meshtrain.trainer.telemetry.tracking import (
    backend,
    mlflow_run,
    runner,
    tensorboard_files,
    wandb_run,
)

REPORT_FILE = "report.html"
"""The run report's name as an artifact."""
MAX_LINE = 1_048_576
"""Longest line read from the trainer (a spec is a few KiB, a step record less)."""


def context_of(line: dict[str, Any]) -> backend.Context:
    """The :class:`backend.Context` a :meth:`backend.Context.start_line` describes."""
    return backend.Context(
        job=loading.parse_spec(line["spec"]),
        namespace=str(line["namespace"]),
        name=str(line["name"]),
        home=Path(line["home"]) if line.get("home") else None,
        first_step=int(line["first_step"]),
        log_dir=Path(line["log_dir"]) if line.get("log_dir") else None,
        device_name=str(line["device_name"]) if line.get("device_name") else None,
        local=bool(line.get("local")),
    )


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


def serve(lines: Iterable[str]) -> None:
    """Drive the trackers from the trainer's lines until the end line (or the trainer is gone)."""
    stream = iter(lines)
    context = context_of(json.loads(next(stream)))
    runners = [runner.Runner(tracker) for tracker in backends(context)]
    finished = False
    for text in stream:
        line = json.loads(text)
        if "end" in line:
            finished = bool(line["end"]["finished"])
            break
        for one in runners:
            one.log(int(line["step"]), dict(line["values"]), float(line["time"]))
    budget = runner.close_seconds()
    deadline = time.monotonic() + budget  # one for all trackers, the report's drawing included
    # only MLflow takes the report: the others get their end before it is drawn
    wants = [r for r in runners if r.failed is None and r.tracker.name == mlflow_run.MLflowRun.name]
    runner.end_all([r for r in runners if r not in wants], None, finished, deadline)
    with tempfile.TemporaryDirectory(prefix="meshtrain-report-") as scratch:
        drawn = draw_report(context, Path(scratch)) if wants else None
        runner.end_all(wants, drawn, finished, deadline)
        runner.wait_all(runners, deadline, budget)


def draw_report(context: backend.Context, scratch: Path) -> Path | None:
    """``meshtrain report``'s page of this run (None, said on stderr, when it cannot be drawn)."""
    if context.log_dir is None:
        return None
    try:
        return report.write_html(report.load(context.log_dir), scratch / REPORT_FILE)
    except (report.ReportError, OSError, ValueError) as err:
        print(f"{runner.WARNING_PREFIX}s: no run report: {err}", file=sys.stderr, flush=True)
        return None


def _bounded(stream: IO[str]) -> Iterable[str]:
    while line := stream.readline(MAX_LINE):
        yield line


def main() -> int:
    serve(_bounded(sys.stdin))
    return 0


if __name__ == "__main__":
    sys.exit(main())
