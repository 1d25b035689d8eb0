"""What a fault cost, read from the trainer's own step log: pure functions for ``bench_faults.py``.

Rank 0 appends one record per completed step to ``steps.jsonl`` (``step``, ``step_seconds``,
``time``: the wall clock at the step's end); a step that a recovery recomputes appears twice.  From
those records and the moment a fault was injected this module derives, per fault, the time to the
next completed step and the steps lost, and over the run the goodput: productive step time over
wall time, where productive time counts each step once (its last record; earlier records of a
step that was done again are lost work).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

STALL_FLOOR_SECONDS = 2.0
"""Idle time between two step records at least this long (and ``STALL_FACTOR`` times the run's
usual idle time between steps) is a stall: the step after it is the first of a recovered run."""
STALL_FACTOR = 5.0
FAULT_STALL_FLOOR_SECONDS = 0.5
"""The floor for the idle time that holds the fault's own instant: a process restarted in place
and restored from memory can run its next step within ``STALL_FLOOR_SECONDS`` (1.4 s measured),
while a step the old run finishes after the fault follows the usual idle time (milliseconds)."""
MAX_LOG_BYTES = 64 * 1024 * 1024
"""Largest step log or recovery log read (a tiny job's run is a few hundred kB)."""


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One line of steps.jsonl, the fields this benchmark reads."""

    step: int
    """The optimizer step completed."""
    end: float
    """Unix time the step ended (the record's ``time``)."""
    seconds: float
    """The step's own duration (``step_seconds``)."""

    @property
    def start(self) -> float:
        """Unix time the step began."""
        return self.end - self.seconds


@dataclasses.dataclass(frozen=True)
class FaultCost:
    """What one injected fault cost the run."""

    injected_at: float
    """Unix time the fault was injected."""
    last_step_before: int
    """The last step rank 0 had logged when the fault was injected."""
    resumed_after: int | None
    """The step training continued after (the first record after the stall is this step + 1)."""
    next_step_at: float | None
    """Unix time the first step after the recovery completed; None: none in the log."""
    steps_lost: int | None
    """Steps done before the fault that were done again (recomputed)."""

    @property
    def seconds_to_next_step(self) -> float | None:
        """From the fault to the next completed step."""
        return None if self.next_step_at is None else self.next_step_at - self.injected_at


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete JSON objects of a JSON-lines file (bounded; a partly written last line skipped)."""
    if not path.exists():
        return []
    with path.open("rb") as handle:
        data = handle.read(MAX_LOG_BYTES)
    out = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            found = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(found, dict):
            out.append(found)
    return out


def step_records(raw: Iterable[dict[str, Any]]) -> list[StepRecord]:
    """The step records in the order they were written."""
    return [
        StepRecord(int(r["step"]), float(r["time"]), float(r.get("step_seconds") or 0.0))
        for r in raw
        if "step" in r and "time" in r
    ]


class Tail:
    """A growing step log read incrementally: each call parses only what was appended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[StepRecord] = []
        self._offset = 0

    def read(self) -> list[StepRecord]:
        """Every complete record so far (a partly written last line waits for the next call)."""
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read(MAX_LOG_BYTES)
        except FileNotFoundError:
            return self.records
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        raw = []
        for line in complete.decode("utf-8", errors="replace").splitlines():
            try:
                raw.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.records += step_records(r for r in raw if isinstance(r, dict))
        return self.records


def usual_gap(records: Sequence[StepRecord]) -> float:
    """Median idle seconds between one step's end and the next step's start (the step's own
    duration left out: a slow step on a loaded machine is no stall)."""
    gaps = [b.start - a.end for a, b in zip(records, records[1:], strict=False) if b.step > a.step]
    return statistics.median(gaps) if gaps else 0.0


def is_stall(
    previous: StepRecord, record: StepRecord, gap: float, floor: float = STALL_FLOOR_SECONDS
) -> bool:
    """Whether ``record`` began after a stall following ``previous`` (or repeats a step)."""
    idle = record.start - previous.end
    return record.step <= previous.step or idle >= max(floor, STALL_FACTOR * gap)


def fault_cost(records: Sequence[StepRecord], injected_at: float, gap: float) -> FaultCost:
    """The cost of a fault injected at ``injected_at``: the first record after it that follows a
    stall (or repeats a step) is the recovered run's first step."""
    before = [r for r in records if r.end <= injected_at]
    last_before = before[-1].step if before else 0
    index = len(before)
    for i in range(max(index, 1), len(records)):
        previous, record = records[i - 1], records[i]
        holds_fault = previous.end <= injected_at <= record.start
        floor = FAULT_STALL_FLOOR_SECONDS if holds_fault else STALL_FLOOR_SECONDS
        if is_stall(previous, record, gap, floor):
            first = records[i]
            done = max(r.step for r in records[:i])
            return FaultCost(
                injected_at=injected_at,
                last_step_before=last_before,
                resumed_after=first.step - 1,
                next_step_at=first.end,
                steps_lost=max(0, done - (first.step - 1)),
            )
    return FaultCost(injected_at, last_before, None, None, None)


def recovery_for(recoveries: Sequence[dict[str, Any]], cost: FaultCost) -> dict[str, Any] | None:
    """The trainer's recovery record (``recoveries.jsonl``) of the fault: the first whose
    detection lies between the fault and the next completed step."""
    if cost.next_step_at is None:
        return None
    for record in recoveries:
        detected = record.get("detectedAt")
        if isinstance(detected, int | float) and cost.injected_at <= detected <= cost.next_step_at:
            return record
    return None


@dataclasses.dataclass(frozen=True)
class Goodput:
    """Productive step time over the wall time of a run."""

    productive_seconds: float
    """Sum of ``step_seconds`` of each step's last record."""
    wall_seconds: float
    """From the first step's start to the last step's end."""
    recomputed_steps: int
    """Records of steps that were done again later."""

    @property
    def ratio(self) -> float:
        return self.productive_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0


def goodput(records: Sequence[StepRecord]) -> Goodput:
    """The run's goodput from its step records."""
    if not records:
        return Goodput(0.0, 0.0, 0)
    last: dict[int, StepRecord] = {}
    for record in records:
        last[record.step] = record
    productive = sum(r.seconds for r in last.values())
    wall = max(r.end for r in records) - min(r.start for r in records)
    return Goodput(productive, wall, len(records) - len(last))


def row(label: str, values: Sequence[object], widths: Sequence[int]) -> str:
    """One line of a plain-text table."""
    cells = [f"{label:<{widths[0]}}"] + [
        f"{'-' if v is None else v!s:>{w}}" for v, w in zip(values, widths[1:], strict=False)
    ]
    return "  ".join(cells)
