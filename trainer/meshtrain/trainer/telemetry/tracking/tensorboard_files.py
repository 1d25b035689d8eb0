"""TensorBoard event files through the ``tensorboard`` package's own writer (no torch: the
trackers' process stays light).

``tensorboard.summary.Writer`` is marked experimental and has no purge step, so this writes the
events itself with the pieces ``torch.utils.tensorboard`` uses: ``EventFileWriter`` and the event
protos, scalars as ``simple_value`` (what TensorBoard's scalar dashboard and ``EventAccumulator``
read).  One folder per job: a resumed job writes a new event file there that starts with a
session START at its first step, which makes TensorBoard purge the steps the previous attempt
wrote past its checkpoint (``purge_step`` in torch's writer), so each step shows once.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any

from meshtrain.api import job_dir
from meshtrain.api.spec import tracking as api_tracking
from meshtrain.trainer.telemetry.tracking import backend

FLUSH_SECONDS = 10
"""How often the writer flushes its queue to the event file."""
FILE_VERSION = "brain.Event:2"
"""The event file format TensorBoard reads (as torch's writer stamps its purge event)."""


class TensorBoardFiles:
    """Scalars of every step in ``logDir`` (default ``<checkpoint dir>/tensorboard``)."""

    name = "tensorboard"

    def __init__(self, settings: api_tracking.TensorBoard, context: backend.Context) -> None:
        self.settings = settings
        self.context = context
        self._writer: Any = None
        self._events: Any = None
        self._summaries: Any = None

    def directory(self) -> Path:
        """Where the event files go: ``logDir`` (a relative one from the working directory for
        ``meshtrain run``, from the job's checkpoint directory in a pod), else the default."""
        given = Path(self.settings.log_dir) if self.settings.log_dir else None
        if given is not None and (given.is_absolute() or self.context.local):
            return given.absolute()
        if self.context.home is None:
            raise ValueError(
                "the job has no local checkpoint or log directory: set spec.tracking.tensorboard.logDir"
            )
        return self.context.home / (given or job_dir.TENSORBOARD_SUBDIR)

    def start(self) -> None:
        files = importlib.import_module("tensorboard.summary.writer.event_file_writer")
        self._events = importlib.import_module("tensorboard.compat.proto.event_pb2")
        self._summaries = importlib.import_module("tensorboard.compat.proto.summary_pb2")
        folder = self.directory()
        folder.mkdir(parents=True, exist_ok=True)
        self._writer = files.EventFileWriter(str(folder), flush_secs=FLUSH_SECONDS)
        first = self.context.first_step
        if first > 1:  # a resume: purge what the last attempt logged from here on
            now = time.time()
            start = self._events.SessionLog(status=self._events.SessionLog.START)
            self._writer.add_event(
                self._events.Event(wall_time=now, step=first, file_version=FILE_VERSION)
            )
            self._writer.add_event(self._events.Event(wall_time=now, step=first, session_log=start))

    def log(self, step: int, values: dict[str, float], wall_time: float) -> None:
        summary = self._summaries.Summary(
            value=[self._summaries.Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
        )
        self._writer.add_event(self._events.Event(wall_time=wall_time, step=step, summary=summary))

    def finish(self, report: Path | None, finished: bool) -> None:
        self._writer.close()
