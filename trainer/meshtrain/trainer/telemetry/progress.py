"""What global rank 0 tells the operator: the progress document and its final copy.

:class:`Progress` keeps the document the exporter serves at ``GET /progress``;
:func:`write_termination_log` writes it once more at the end of a successful run to
``$MESHTRAIN_TERMINATION_LOG``, which the kubelet reports as the container's termination message
(docs/telemetry.md, "Exporter: one HTTP server per rank").  A refused rank writes its exit code
there instead (:func:`write_failure`).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from meshtrain.api import exitcodes
from meshtrain.trainer.guards import stragglers
from meshtrain.trainer.telemetry import context, recording, recoveries, stepstats

log = logging.getLogger(__name__)

TERMINATION_LOG_ENV = "MESHTRAIN_TERMINATION_LOG"
"""Environment variable naming the file for the final progress document (unset: none is written)."""

FIELDS = (
    "step",
    "loss",
    "tokens_per_second",
    "last_checkpoint_step",
    "updated_at",
    "eval_loss",
    "skipped_updates",
    "straggler",
    "stragglers",
    "gradient_noise_scale",
    "resumed_from_uid",
    "goodput",
)
"""Keys of the progress document, in order; after an in-place recovery it also has
:data:`RECOVERY` (absent before: the schema of older operators knows only these)."""

RECOVERY = "recovery"
"""Key of the newest recovery records (:meth:`Progress.recovered`), present after the first one."""
RECOVERY_COUNTS = "recovery_counts"
"""Key of the in-place recoveries by tier the job's store counted (``{process, container, pod}``):
cumulative, so the operator counts every one however few records it saw."""

MAX_STRAGGLERS = 16
"""Most flagged ranks the document lists (the slowest): the operator reads at most 16, and the
whole document must stay under the 4 KiB it reads of it."""


class Progress:
    """The progress document of global rank 0, updated at every step and every published checkpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._doc: dict[str, Any] = {
            "step": 0,
            "loss": None,
            "tokens_per_second": None,
            "last_checkpoint_step": None,
            "updated_at": None,
            "eval_loss": None,
            "skipped_updates": 0,
            "straggler": None,
            "stragglers": [],
            "gradient_noise_scale": None,
            "resumed_from_uid": None,
            "goodput": None,
        }

    def update(self, **fields: Any) -> None:
        """Set fields and stamp ``updated_at`` (RFC 3339, UTC)."""
        now = (
            datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        )
        with self._lock:
            self._doc.update(fields, updated_at=now)

    def document(self) -> dict[str, Any]:
        """A copy of the current JSON document."""
        with self._lock:
            return dict(self._doc)

    # -- Sink ----------------------------------------------------------------

    def publish(
        self,
        stats: stepstats.StepStats,
        events: Sequence[recording.Event],
        start: float,
        memory: context.MemorySample | None,
    ) -> None:
        self.update(step=stats.step, loss=stats.loss, tokens_per_second=stats.tokens_per_second)

    def checkpoint_saved(self, step: int) -> None:
        """A published checkpoint of ``step`` (a resumed run reports the one it loaded)."""
        with self._lock:
            done = max(
                self._doc["step"] or 0, step
            )  # a checkpoint of step S means S steps are done
        self.update(last_checkpoint_step=step, step=done)

    def health(
        self,
        step: int,
        *,
        eval_loss: float | None,
        skipped: str,
        noise_scale: float | None = None,
        epoch: int | None = None,
    ) -> None:
        with self._lock:
            skips = self._doc["skipped_updates"] + (1 if skipped else 0)
        fields: dict[str, Any] = {"skipped_updates": skips}
        if eval_loss is not None:
            fields["eval_loss"] = eval_loss
        if noise_scale is not None:
            fields["gradient_noise_scale"] = noise_scale
        self.update(**fields)

    def straggler_verdict(self, verdict: stragglers.Verdict) -> None:
        """The flagged ranks as ``{rank, slowdown, since_step}``, slowest first (``stragglers``, at
        most :data:`MAX_STRAGGLERS`), and the slowest alone (``straggler``, None when none is flagged)."""
        flagged = [
            {"rank": f.rank, "slowdown": round(f.slowdown, 4), "since_step": f.since_step}
            for f in verdict.flagged[:MAX_STRAGGLERS]
        ]
        with self._lock:
            self._doc["straggler"] = flagged[0] if flagged else None
            self._doc["stragglers"] = flagged

    def recovered(self, record: Mapping[str, Any], counts: Mapping[str, int] | None = None) -> None:
        """An in-place recovery's record (:mod:`.recoveries`, JSON form): ``recovery`` keeps the
        newest :data:`.recoveries.RECENT`, oldest first; ``counts``: the store's
        (:data:`RECOVERY_COUNTS`)."""
        with self._lock:
            recent = [*self._doc.get(RECOVERY, []), dict(record)][-recoveries.RECENT :]
        more = {RECOVERY_COUNTS: dict(counts)} if counts is not None else {}
        self.update(**{RECOVERY: recent}, **more)

    def close(self) -> None:
        """Nothing to release."""


def write_termination_log(document: Mapping[str, Any]) -> Path | None:
    """Write ``document`` as one JSON line to ``$MESHTRAIN_TERMINATION_LOG``; the path, or None.

    Unset variable: nothing is written.  A write error is logged as a
    warning and swallowed: the run itself succeeded.
    """
    return _write_termination_log(json.dumps({key: document.get(key) for key in FIELDS}) + "\n")


def write_failure(code: int, message: str, device_error_ranks: tuple[int, ...] = ()) -> Path | None:
    """Leave the exit code and message of a failed rank in ``$MESHTRAIN_TERMINATION_LOG``.

    The pod's exit code is torchrun's (1 for any failed worker); this report
    keeps the trainer's own code class (:mod:`meshtrain.api.exitcodes`), and the ranks whose GPU
    failed just before, where a supervisor knows them.
    """
    return _write_termination_log(exitcodes.failure_report(code, message, device_error_ranks))


def _write_termination_log(text: str) -> Path | None:
    target = os.environ.get(TERMINATION_LOG_ENV)
    if not target:
        return None
    path = Path(target)
    try:
        # A plain write, not write-and-rename: /dev/termination-log is a bind-mounted file.
        with path.open("w", encoding="utf-8") as out:
            out.write(text)
    except OSError as err:
        log.warning("could not write %s=%s: %s", TERMINATION_LOG_ENV, target, err)
        return None
    return path
