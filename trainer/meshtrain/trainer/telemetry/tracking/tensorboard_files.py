"""TensorBoard event files through ``torch.utils.tensorboard`` (the ``tensorboard`` package).

One folder per job: a resumed job writes a new event file there whose first step purges the
steps the previous attempt wrote past its checkpoint, so TensorBoard shows one run whose steps
only increase.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from meshtrain.api import job_dir
from meshtrain.api.spec import tracking as api_tracking
from meshtrain.trainer.telemetry.tracking import backend

FLUSH_SECONDS = 10
"""How often the writer flushes its queue to the event file."""


class TensorBoardFiles:
    """Scalars of every step in ``logDir`` (default ``<checkpoint dir>/tensorboard``)."""

    name = "tensorboard"

    def __init__(self, settings: api_tracking.TensorBoard, context: backend.Context) -> None:
        self.settings = settings
        self.context = context
        self._writer: Any = None

    def directory(self) -> Path:
        """Where the event files go."""
        if self.settings.log_dir:
            return Path(self.settings.log_dir)
        if self.context.home is None:
            raise ValueError(
                "the job has no local checkpoint or log directory: set spec.tracking.tensorboard.logDir"
            )
        return self.context.home / job_dir.TENSORBOARD_SUBDIR

    def start(self) -> None:
        writer_module = importlib.import_module("torch.utils.tensorboard")
        first = self.context.first_step
        self._writer = writer_module.SummaryWriter(
            log_dir=str(self.directory()),
            purge_step=first if first > 1 else None,
            flush_secs=FLUSH_SECONDS,
        )

    def log(self, step: int, values: dict[str, float], wall_time: float) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, global_step=step, walltime=wall_time)

    def finish(self, report: Path | None, finished: bool) -> None:
        self._writer.close()
