"""Rank 0's training progress report -> TrainingJob status fields (``progress``, ``lastCheckpointStep``,
the trainer's in-place recoveries in ``recovery``).

From the JSON the trainer's exporter serves at ``GET /progress``, polled while the job runs, and
from the final copy rank 0 writes to its termination message at the end of a successful run, so
a finished job's status shows its last step although the last poll came before it.  Both pass
:mod:`progress_report`'s schema first: what breaks it is dropped, never raised.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import device_errors, progress_report, recovery_count


def _number(value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return kind(value)


def status_changes(report: dict[str, Any]) -> dict[str, Any]:
    """Status fields from one /progress report (empty when it says nothing usable).

    ``updated_at: null`` is the trainer's "nothing yet" document (rank 0 is up
    but has neither finished a step nor loaded a checkpoint): its step 0 would
    wipe the progress of a gang that is about to resume.
    """
    if "updated_at" in report and report["updated_at"] is None:
        return {}
    step = _number(report.get("step"), int)
    if step is None or step < 0:
        return {}
    progress: dict[str, Any] = {"step": step}
    loss = _number(report.get("loss"), float)
    if loss is not None:
        progress["loss"] = loss
    rate = _number(report.get("tokens_per_second"), float)
    if rate is not None:
        progress["tokensPerSecond"] = rate
    eval_loss = _number(report.get("eval_loss"), float)
    if eval_loss is not None:
        progress["evalLoss"] = eval_loss
    noise = _number(report.get("gradient_noise_scale"), float)
    if noise is not None and noise > 0:
        progress["gradientNoiseScale"] = noise
    skipped = _number(report.get("skipped_updates"), int)
    if skipped:
        progress["skippedUpdates"] = skipped
    if isinstance(report.get("resumed_from_uid"), str):
        progress["resumedFromUid"] = report["resumed_from_uid"]
    if isinstance(report.get("updated_at"), str):
        progress["updatedAt"] = report["updated_at"]
    changes: dict[str, Any] = {"progress": progress}
    if isinstance(report.get("goodput"), dict):  # checked by progress_report: every number bounded
        changes["goodput"] = goodput_status(report["goodput"])
    checkpoint = _number(report.get("last_checkpoint_step"), int)
    if checkpoint is not None and checkpoint >= 0:
        changes["lastCheckpointStep"] = checkpoint
    return changes


def goodput_status(goodput: dict[str, Any]) -> dict[str, Any]:
    """``status.goodput`` from the report's checked ``goodput`` field (camelCase names)."""
    return {
        "ratio": goodput["ratio"],
        "productiveSeconds": goodput["productive_seconds"],
        "wallSeconds": goodput["wall_seconds"],
        "lostSeconds": dict(goodput["lost_seconds"]),
    }


def polled_changes(report: dict[str, Any]) -> dict[str, Any]:
    """:func:`status_changes` of a poll, with an explicit null for an estimate the report lacks.

    A merge patch without the key would keep the estimate of a gang placed before (restart, resize).
    """
    changes = status_changes(report)
    if "progress" in changes:
        changes["progress"].setdefault("gradientNoiseScale", None)
    return changes


def recovery_changes(
    status: Mapping[str, Any],
    report: Mapping[str, Any],
    spec: api_spec.TrainingJobSpec,
    now: datetime.datetime | None = None,
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``status.recovery`` with the trainer's in-place records of ``report`` not counted yet
    (tiers process and pod; :mod:`recovery_count`), and the message of an Event for each (reason
    ``recovery_count.RESTARTED``); empty when none is new.  ``status.deviceErrors`` too when a
    new record's rank failed with a device error (:mod:`device_errors`)."""
    attempt = int(status.get("restarts") or 0)
    records, counts = report.get("recovery"), report.get("recovery_counts")
    counted = recovery_count.from_report(status, attempt, records, spec, now, counts)
    if counted.recovery is None:
        return {}, ()
    changes: dict[str, Any] = {"recovery": counted.recovery}
    if spec.trainer.type != "builtin" or now is None:  # a custom program's records are its own say
        return changes, counted.events
    added = device_errors.from_records(status, spec, counted.named, now)
    errors = device_errors.recorded(status, added, now)
    if errors is not None:  # a second one on a node is judged at the next rebuild (failure)
        changes["deviceErrors"] = errors
    return changes, counted.events


def _document(text: str) -> dict[str, Any] | None:
    return progress_report.parse(text.encode("utf-8", "replace")).document


def from_termination_message(message: str | None) -> dict[str, Any]:
    """Status fields from rank 0's termination message (empty when absent or not a progress document).

    The message is the JSON document itself; with ``FallbackToLogsOnError``
    a failed container's message is the end of its log instead, so the last
    line that is a JSON object is taken, and anything else is ignored.
    """
    if not message or not message.strip():
        return {}
    found = _document(message.strip())
    if found is None:
        lines = [line.strip() for line in message.splitlines() if line.strip().startswith("{")]
        found = next(
            (doc for doc in (_document(line) for line in reversed(lines)) if doc is not None), None
        )
    return status_changes(found) if found is not None else {}
