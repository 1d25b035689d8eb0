"""What ``meshtrain run`` shows of the trackers on the user's terminal: their warnings, relayed
from rank 0's log as they come (:class:`Relay`), and where each tracker's run is (:func:`rows`,
for the run summary)."""

from __future__ import annotations

import sys
from pathlib import Path

from meshtrain.api import spec as api_spec
from meshtrain.trainer.telemetry.tracking import backend, runner, tensorboard_files

MARK = runner.WARNING_PREFIX
"""The start of every tracker warning (:func:`runner._warn`, and the trainer side's own)."""
READ_BYTES = 1_048_576
"""Most bytes of rank 0's log read per poll."""
MAX_RELAYED = 20
"""Warnings relayed at most (each tracker warns once; a hostile log is not echoed at length)."""
MAX_LINE_CHARS = 1000
"""Characters of one relayed line at most."""


class Relay:
    """Copies the tracker warnings that appear in rank 0's log to stderr, once each."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self._offset = 0
        self._partial = b""
        self.relayed = 0

    def poll(self) -> None:
        """Relay the warnings written since the last poll (complete lines only)."""
        try:
            with self.log.open("rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read(READ_BYTES)
        except OSError:
            return
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        self._partial = self._partial[-READ_BYTES:]
        for raw in lines:
            text = raw.decode("utf-8", errors="replace").strip()
            if MARK in text and self.relayed < MAX_RELAYED:
                self.relayed += 1
                print(text[text.index(MARK) :][:MAX_LINE_CHARS], file=sys.stderr, flush=True)


def rows(job: api_spec.TrainingJobSpec, home: Path | None) -> list[tuple[str, str]]:
    """The run summary's rows of the trackers ``spec.tracking`` turns on (``home``: the job's
    checkpoint directory, where their run ids are stored)."""
    tracking = job.tracking
    context = backend.Context(job, "", "", home, first_step=1, log_dir=None, local=True)
    out: list[tuple[str, str]] = []
    if tracking.tensorboard is not None:
        try:
            folder = tensorboard_files.TensorBoardFiles(tracking.tensorboard, context).directory()
            out.append(("tensorboard", f"tensorboard --logdir {folder}"))
        except ValueError as err:
            out.append(("tensorboard", str(err)))
    if tracking.mlflow is not None:
        stored = context.stored_id("mlflow")
        if stored.get("attempt_run_id"):
            where = stored.get("tracking_uri") or "MLflow's default store (./mlruns)"
            out.append(
                (
                    "mlflow run",
                    f"{stored['attempt_run_id']} (job run {stored.get('run_id', '?')}) at {where}",
                )
            )
    if tracking.wandb is not None:
        stored = context.stored_id("wandb")
        if stored.get("run_dir"):
            out.append(("wandb run", f"{stored['run_dir']} (group {stored.get('group', '?')})"))
    return out
