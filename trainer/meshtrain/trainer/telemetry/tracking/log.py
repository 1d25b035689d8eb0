"""Rank 0's step log with the trackers behind it: every record written to steps.jsonl also goes,
as one JSON line, to the trackers' own process (:mod:`.child`), which ``spec.tracking`` starts.

The trainer's side only queues a line; a thread of its own writes it to the pipe, so a tracker
that stalls fills a bounded queue (steps then dropped, said once) and never holds a step.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from meshtrain.api import job_dir
from meshtrain.api import spec as api_spec
from meshtrain.trainer.telemetry import steplog
from meshtrain.trainer.telemetry.tracking import backend, runner

CHILD_MODULE = "meshtrain.trainer.telemetry.tracking.child"
POD_ENV = "KUBERNETES_SERVICE_HOST"
"""Set by the kubelet in every pod: the job runs in a cluster, not on this host alone."""
EXIT_GRACE_SECONDS = 30.0
"""Beyond the trackers' shared :func:`runner.close_seconds`: how long the end waits for the process."""


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
        device_name=_device_name(),
        local=POD_ENV not in os.environ,
    )


def _device_name() -> str | None:
    """The CUDA device this rank trains on (None on a CPU run); torch is loaded in the trainer."""
    if os.environ.get("MESHTRAIN_DEVICE") == "cpu":
        return None
    import torch  # noqa: PLC0415 - the trainer's own; kept out of the tracker process

    return str(torch.cuda.get_device_name()) if torch.cuda.is_available() else None


class TrackedLog:
    """steps.jsonl (when there is a log directory) and the trackers' process, one record at a time."""

    def __init__(self, context: backend.Context) -> None:
        self.context = context
        self.steps = steplog.StepLog(context.log_dir) if context.log_dir is not None else None
        self.last_step = 0
        self._lines: queue.Queue[str | None] = queue.Queue(maxsize=runner.MAX_PENDING)
        self._warned = False
        self._closed = False
        self._process = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE],
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,  # Ctrl-C reaches the ranks, not this: stdin's end stops it
            encoding="utf-8",
        )
        self._lines.put_nowait(json.dumps(context.start_line()))
        self._writer = threading.Thread(
            target=self._write_lines,
            args=(self._process.stdin,),
            name="meshtrain-trackers",
            daemon=True,
        )
        self._writer.start()

    def write(self, record: dict[str, Any]) -> None:
        """One step's record: to the file, then queued for the trackers."""
        if self.steps is not None:
            self.steps.write(record)
        self.last_step = int(record["step"])
        values = backend.metrics(record)
        self._send({"step": self.last_step, "values": values, "time": record.get("time", 0.0)})

    def _send(self, line: dict[str, Any]) -> None:
        try:
            self._lines.put_nowait(json.dumps(line))
        except queue.Full:
            self._warn(f"they fell {runner.MAX_PENDING} steps behind; steps are dropped")

    def _write_lines(self, pipe: IO[str] | None) -> None:
        assert pipe is not None
        try:
            while (line := self._lines.get()) is not None:
                pipe.write(line + "\n")
                pipe.flush()
            pipe.close()
        except OSError as err:  # the process is gone: it said why on stderr
            self._warn(f"their process stopped reading ({err})")

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            print(f"{runner.WARNING_PREFIX}s: {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Close the file, end every tracker's run and wait (bounded) for their process."""
        if self._closed:
            return
        self._closed = True
        if self.steps is not None:
            self.steps.close()
        finished = self.last_step >= self.context.job.training.steps
        self._send({"end": {"finished": finished}})
        limit = end_seconds()
        deadline = time.monotonic() + limit
        if self._writer.is_alive():  # a dead writer (the process gone) reads no more lines
            with contextlib.suppress(queue.Full):
                self._lines.put(None, timeout=limit)
        self._writer.join(max(0.0, deadline - time.monotonic()))
        try:
            self._process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._warn(f"they did not finish within {limit:g} s; stopped")
            self._process.kill()
            self._process.wait()


def end_seconds() -> float:
    """The longest rank 0 waits for the trackers at the end (docs/tracking.md): their shared
    deadline plus :data:`EXIT_GRACE_SECONDS` for the process to exit."""
    return runner.close_seconds() + EXIT_GRACE_SECONDS


Writer = steplog.StepLog | TrackedLog
"""What rank 0 writes its step records to."""


def step_log(
    job: api_spec.TrainingJobSpec, log_dir: str | None, home: Path | None, first_step: int
) -> Writer | None:
    """Rank 0's log: a plain step log when no tracker is on (None without a log directory)."""
    tracking = job.tracking
    if any(t is not None for t in (tracking.tensorboard, tracking.mlflow, tracking.wandb)):
        return TrackedLog(context_of(job, log_dir, home, first_step))
    return steplog.StepLog(log_dir) if log_dir else None


def home(checkpoint_dir: object, log_dir: str | None) -> Path | None:
    """Where the trackers keep their files: the job's checkpoint directory when it is local, else
    (checkpoints in a bucket) the log directory; None when there is neither."""
    if isinstance(checkpoint_dir, Path):
        return checkpoint_dir
    return Path(log_dir) if log_dir else None
