"""Recovery records: ``DIR/recoveries.jsonl``, one JSON object per in-place recovery, written by global rank 0.

The one writer and reader of that file (docs/recovery.md).  A record says which ranks failed, how
(``cause``, ``tier``), when each phase of the recovery ended and where training resumed; goodput
accounting turns them, with ``steps.jsonl``, into time lost per phase, and the progress document
carries the recent ones under ``recovery`` for the operator.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from meshtrain.api import limits

FILENAME = "recoveries.jsonl"

TIERS = ("process", "container", "pod", "gang")
"""What was restarted: a process (a spare took its rank), a container (kubelet restart rules), a pod
(re-placed), or the whole gang (the operator's rebuild; never written by the trainer)."""

SOURCES = ("memory", "storage", "none")
"""Where the restored state came from: an in-memory snapshot or a storage checkpoint."""

MAX_READ_BYTES = 1 << 20
"""Most bytes :func:`read` reads from the end of the file: a bounded read of a file a pod writes."""
MAX_RECORDS = 1000
"""Most records :func:`read` returns (the newest)."""
RECENT = 2
"""Records the progress document carries (it must stay under the 4 KiB the operator reads)."""
MAX_RANKS = 16
"""Failed ranks a record lists (the lowest); ``failedRanks`` counts them all."""
MAX_CAUSE = 120
"""Characters of ``cause`` kept."""
MAX_NODES = limits.MAX_RECOVERY_NODES
"""Nodes a record lists (``nodes``), each with at most :data:`MAX_NODE_RANKS` ranks and a name of
at most :data:`MAX_RECORD_NODE_NAME` characters: with :data:`RECENT` records the progress document stays
under its 4 KiB (``tests/unit/test_progress_report.py``); a rank left out has its node found by
the operator from the placement, as before records named nodes."""
MAX_NODE_RANKS = 4
"""Ranks a ``nodes`` entry lists: the operator needs one to find the pod, whose every rank ran there."""
MAX_RECORD_NODE_NAME = 63
"""Longest node name a record carries (cloud providers' names are shorter; a longer one is left out)."""

Tier = Literal["process", "container", "pod", "gang"]
Source = Literal["memory", "storage", "none"]


def source(name: str) -> Source:
    """A restore's source as a record names it (``none``: nothing was restored)."""
    return "memory" if name == "memory" else "storage" if name == "storage" else "none"


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One in-place recovery, as global rank 0 saw it complete (times are unix seconds)."""

    generation: int
    """The rendezvous round training continued in."""
    tier: Tier
    """What was restarted (:data:`TIERS`)."""
    cause: str
    """Why, e.g. ``exit 1``, ``SIGKILL``, ``pod deleted``, ``node lost``."""
    ranks: tuple[int, ...]
    """The global ranks that failed (at most :data:`MAX_RANKS`)."""
    failed_at: float
    """When the failure was first observed."""
    detected_at: float
    """When the new round was started (the generation bumped)."""
    rejoined_at: float
    """When rank 0's process groups of the new round were built."""
    restored_at: float
    """When rank 0's state was loaded."""
    resumed_step: int
    """The step training continues after (0: from the start)."""
    source: Source
    """Where the restored state came from (:data:`SOURCES`)."""
    lost_steps: int
    """Steps done after ``resumed_step`` before the failure, which are computed again."""
    first_step_at: float | None = None
    """When the first step after the recovery completed (None until it did)."""
    nodes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """The nodes the failed ranks ran on, each with its ranks, where their pods' supervisors said
    (at most :data:`MAX_NODES`); the operator charges a device error to the node named here
    rather than to the one the rank's pod runs on when it reads the record (a replacement's)."""

    def to_json(self) -> dict[str, Any]:
        """The record's JSON object (camelCase keys)."""
        return {
            "generation": self.generation,
            "tier": self.tier,
            "cause": self.cause[:MAX_CAUSE],
            "ranks": list(self.ranks[:MAX_RANKS]),
            "failedAt": round(self.failed_at, 3),
            "detectedAt": round(self.detected_at, 3),
            "rejoinedAt": round(self.rejoined_at, 3),
            "restoredAt": round(self.restored_at, 3),
            "resumedStep": self.resumed_step,
            "source": self.source,
            "lostSteps": self.lost_steps,
            "firstStepAt": None if self.first_step_at is None else round(self.first_step_at, 3),
            "nodes": [
                {"node": node, "ranks": list(ranks[:MAX_NODE_RANKS])}
                for node, ranks in self.nodes.items()
                if len(node) <= MAX_RECORD_NODE_NAME
            ][:MAX_NODES],
        }


def append(directory: str | Path, record: Recovery) -> Path:
    """Append ``record`` as one line to ``directory/recoveries.jsonl`` (created if missing); the path."""
    path = Path(directory) / FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(record.to_json(), sort_keys=True) + "\n")
    return path


def read(path: str | Path, *, limit: int = MAX_RECORDS) -> list[dict[str, Any]]:
    """The newest ``limit`` complete records of a recovery log ([] when there is none).

    Reads at most :data:`MAX_READ_BYTES` from the end; a partial first or last line and lines that
    are not JSON objects are skipped.
    """
    try:
        with Path(path).open("rb") as handle:
            size = handle.seek(0, 2)
            start = max(0, size - MAX_READ_BYTES)
            handle.seek(start)
            chunk = handle.read(MAX_READ_BYTES)
    except FileNotFoundError:
        return []
    lines = chunk.split(b"\n")
    if start > 0:
        lines = lines[1:]  # cut mid-line
    records: list[dict[str, Any]] = []
    for line in lines:
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            records.append(value)
    return records[-limit:] if limit > 0 else []
