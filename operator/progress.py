"""Rank 0's training progress report -> TrainingJob status fields.

What it is: :func:`status_changes`, a pure translation of the JSON that the
trainer's exporter serves at ``GET /progress`` (``step``, ``loss``,
``tokens_per_second``, ``last_checkpoint_step``, ``updated_at``) into the
status fields ``progress`` and ``lastCheckpointStep``.  Malformed values are
dropped, never raised.  What it is not: the HTTP request (see ``kube``) or the
polling schedule (see ``reconciler``).
"""

from __future__ import annotations

from typing import Any


def _number(value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return kind(value)


def status_changes(report: dict[str, Any]) -> dict[str, Any]:
    """Status fields from one /progress report (empty when it says nothing usable)."""
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
    if isinstance(report.get("updated_at"), str):
        progress["updatedAt"] = report["updated_at"]
    changes: dict[str, Any] = {"progress": progress}
    checkpoint = _number(report.get("last_checkpoint_step"), int)
    if checkpoint is not None and checkpoint >= 0:
        changes["lastCheckpointStep"] = checkpoint
    return changes
