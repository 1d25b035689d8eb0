"""Goodput: productive step time over wall time, and the time each failure cost, by phase.

Reads rank 0's ``steps.jsonl`` (every record has ``step``, ``step_seconds`` and ``time``, the
unix time the step ended) and ``recoveries.jsonl`` (one record per recovery, docs/telemetry.md,
"Goodput").  A step counts as productive in its last run only: when a restore goes back to an
earlier step, the runs of the steps after it are lost (``recompute``), as is the part of a step
a failure interrupted.  A recovery record splits the rest of a failure's cost into
``detection`` (failedAt -> detectedAt), ``restart`` (-> rejoinedAt) and ``reload``
(-> restoredAt); a step log that goes back without a record is a restart nobody recorded, its
gap counted as ``restart``.  What is neither productive nor lost (start-up, checkpoint stalls,
evaluation) is the rest of the wall time.

:class:`Accountant` takes the records one at a time (the trainer feeds it live);
:func:`account_of` replays a log directory (``meshtrain report``).  Both files are a tenant's
and read as hostile: bounded lines and bytes, every field checked, a bad record skipped.
"""

from __future__ import annotations

import array
import bisect
import collections
import dataclasses
import json
import math
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from meshtrain.api import limits
from meshtrain.trainer.telemetry import steplog

RECOVERIES = "recoveries.jsonl"
"""The recovery log next to ``steps.jsonl`` (gp-sup's recovery records; the gang record here)."""

PHASES = ("detection", "restart", "reload", "recompute")
"""How a failure's lost time is split, in order."""

TIERS = ("process", "container", "pod", "gang", "unrecorded")
"""Where a failure was recovered; ``unrecorded``: the step log went back without a record."""

MAX_FAILURES = 64
"""Failures an account keeps in detail (the newest); totals count every one."""

MAX_RECOVERY_LINE = 64 * 1024
"""Longest recovery record read; a longer line is skipped."""

MAX_RECOVERY_BYTES = 8 * 2**20
"""Most bytes of ``recoveries.jsonl`` read (its end: the newest records)."""

MAX_STEP_LINE = 32 * 2**20
"""Longest step record read (per-rank slowdowns of a large world make long lines)."""

MAX_TIME = 1e11
"""Latest unix time a record may carry (year 5138): beyond it the field is refused."""

CAUSE = re.compile(r"[A-Za-z0-9 _.:/+-]{1,40}")
"""A cause this module keeps as written (metric label values stay short); others read ``other``."""


@dataclasses.dataclass(frozen=True)
class Failure:
    """One failure and what it cost."""

    tier: str
    """Where it was recovered (:data:`TIERS`)."""
    cause: str
    """Why, as recorded (``unknown`` when unrecorded)."""
    failed_at: float
    """Unix time of the failure (the last step before it where unrecorded)."""
    resumed_step: int
    """Step training continued after."""
    lost_steps: int
    """Steps done since ``resumed_step`` and done again."""
    seconds: Mapping[str, float]
    """Lost seconds by phase (:data:`PHASES`)."""

    @property
    def lost_seconds(self) -> float:
        """Every phase together."""
        return sum(self.seconds.values())


@dataclasses.dataclass(frozen=True)
class Account:
    """Goodput of a run so far."""

    productive_seconds: float
    """Step time of every step's last run."""
    wall_seconds: float
    """From the start of the first step to the last record (or now, live)."""
    lost_seconds: Mapping[str, float]
    """Seconds lost to failures by phase (:data:`PHASES`)."""
    failures: tuple[Failure, ...]
    """The newest failures (at most :data:`MAX_FAILURES`), oldest first."""
    failure_count: int
    """Every failure seen."""

    @property
    def ratio(self) -> float | None:
        """Productive over wall time (None before a step)."""
        if self.wall_seconds <= 0:
            return None
        return min(1.0, max(0.0, self.productive_seconds / self.wall_seconds))

    @property
    def other_seconds(self) -> float:
        """Wall time neither productive nor lost to a failure (start-up, checkpoints, evaluation)."""
        return max(
            0.0, self.wall_seconds - self.productive_seconds - sum(self.lost_seconds.values())
        )

    def progress(self) -> dict[str, Any]:
        """The progress document's ``goodput`` field (the trainer's snake_case names)."""
        return {
            "ratio": None if self.ratio is None else round(self.ratio, 6),
            "productive_seconds": round(self.productive_seconds, 3),
            "wall_seconds": round(self.wall_seconds, 3),
            "lost_seconds": {phase: round(self.lost_seconds[phase], 3) for phase in PHASES},
        }


@dataclasses.dataclass(frozen=True)
class Recovery:
    """The fields of a recovery record this module reads (the rest is gp-sup's)."""

    tier: str
    """``process`` | ``container`` | ``pod`` | ``gang`` (anything else reads ``unrecorded``)."""
    cause: str
    """Why, bounded (:data:`CAUSE`)."""
    failed_at: float
    """Unix time the failure was first observed."""
    detected_at: float | None
    """Unix time it was detected (None: not recorded)."""
    rejoined_at: float | None
    """Unix time the process groups were ready again."""
    restored_at: float | None
    """Unix time the state was loaded."""
    resumed_step: int | None
    """Step training continues after (None: not recorded)."""


def _time(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) and 0 <= number <= MAX_TIME else None


def _step(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limits.MAX_STEPS:
        return value
    return None


def parse_recovery(record: Any) -> Recovery | None:
    """A recovery record's fields, checked (None: not a recovery record with a failure time)."""
    if not isinstance(record, dict):
        return None
    failed_at = _time(record.get("failedAt"))
    if failed_at is None:
        return None
    tier = record.get("tier")
    cause = record.get("cause")
    return Recovery(
        tier=tier if tier in TIERS[:-1] else "unrecorded",
        cause=cause if isinstance(cause, str) and CAUSE.fullmatch(cause) else "other",
        failed_at=failed_at,
        detected_at=_time(record.get("detectedAt")),
        rejoined_at=_time(record.get("rejoinedAt")),
        restored_at=_time(record.get("restoredAt")),
        resumed_step=_step(record.get("resumedStep")),
    )


def _span(start: float | None, end: float | None) -> float:
    """``end - start``, 0 when either is unknown or the clock went back."""
    if start is None or end is None:
        return 0.0
    return min(max(0.0, end - start), float(limits.MAX_SECONDS))


class Accountant:
    """Goodput built record by record: steps (:meth:`step`) and recoveries (:meth:`recovery`) in time order."""

    def __init__(self) -> None:
        self._steps = array.array("q")  # the alive runs' steps, increasing
        self._cumulative = array.array("d")  # their step seconds, summed up to each
        self._first_start: float | None = None
        self._last_time: float | None = None
        self._lost = dict.fromkeys(PHASES, 0.0)
        self._failures: collections.deque[Failure] = collections.deque(maxlen=MAX_FAILURES)
        self._count = 0

    def _drop_after(self, step: int) -> tuple[float, int]:
        """Forget the runs of steps after ``step``: their seconds and count."""
        keep = bisect.bisect_right(self._steps, step)
        dropped = len(self._steps) - keep
        if not dropped:
            return 0.0, 0
        before = self._cumulative[keep - 1] if keep else 0.0
        seconds = self._cumulative[-1] - before
        del self._steps[keep:]
        del self._cumulative[keep:]
        return seconds, dropped

    def _seen(self, at: float) -> None:
        self._last_time = at if self._last_time is None else max(self._last_time, at)

    def _add(self, failure: Failure) -> Failure:
        for phase in PHASES:
            self._lost[phase] += failure.seconds[phase]
        self._failures.append(failure)
        self._count += 1
        return failure

    def step(self, step: int, seconds: float, at: float) -> Failure | None:
        """A step ended at unix time ``at`` after ``seconds``; the unrecorded failure it reveals, if any."""
        started = at - seconds
        if self._first_start is None:
            self._first_start = started
        found = None
        if self._steps and step <= self._steps[-1]:  # back to an earlier step with no record
            recomputed, count = self._drop_after(step - 1)
            last = self._last_time if self._last_time is not None else started
            spans = {"detection": 0.0, "restart": _span(last, started), "reload": 0.0}
            found = self._add(
                Failure(
                    "unrecorded",
                    "unknown",
                    last,
                    step - 1,
                    count,
                    spans | {"recompute": recomputed},
                )
            )
        total = self._cumulative[-1] if self._cumulative else 0.0
        self._steps.append(step)
        self._cumulative.append(total + max(0.0, seconds))
        self._seen(at)
        return found

    def recovery(self, record: Recovery) -> Failure:
        """A recovery: the steps after its resumed step are lost, and its phases' time."""
        recomputed, count = (
            self._drop_after(record.resumed_step) if record.resumed_step is not None else (0.0, 0)
        )
        interrupted = _span(self._last_time, record.failed_at)  # the step the failure cut short
        detected = record.detected_at if record.detected_at is not None else record.failed_at
        seconds = {
            "detection": _span(record.failed_at, record.detected_at),
            "restart": _span(detected, record.rejoined_at),
            "reload": _span(record.rejoined_at, record.restored_at),
            "recompute": recomputed + interrupted,
        }
        for stamp in (record.failed_at, record.detected_at, record.rejoined_at, record.restored_at):
            if stamp is not None:
                self._seen(stamp)
        resumed = record.resumed_step if record.resumed_step is not None else 0
        return self._add(
            Failure(record.tier, record.cause, record.failed_at, resumed, count, seconds)
        )

    def account(self, now: float | None = None) -> Account:
        """The account so far; ``now`` (live) ends the wall time instead of the last record."""
        end = self._last_time if now is None else now
        wall = _span(self._first_start, end)
        return Account(
            productive_seconds=self._cumulative[-1] if self._cumulative else 0.0,
            wall_seconds=wall,
            lost_seconds=dict(self._lost),
            failures=tuple(self._failures),
            failure_count=self._count,
        )


# ------------------------------------------------------------------------------ reading the logs


def _lines(path: Path, *, line_limit: int, tail_bytes: int | None = None) -> Iterator[bytes]:
    """Complete lines of ``path`` of at most ``line_limit`` bytes (a longer one is skipped);
    with ``tail_bytes``, only those in its last ``tail_bytes`` bytes."""
    try:
        handle = path.open("rb")
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return
    with handle:
        if tail_bytes is not None:
            size = handle.seek(0, 2)
            handle.seek(max(0, size - tail_bytes))
            if size > tail_bytes:
                handle.readline(line_limit + 1)  # a partial first line
        while True:
            line = handle.readline(line_limit + 1)
            if not line:
                return
            if not line.endswith(b"\n"):
                if len(line) > line_limit:  # too long: skip to its end
                    while line and not line.endswith(b"\n"):
                        line = handle.readline(line_limit + 1)
                continue  # (or the partly written last line)
            yield line


def _json(line: bytes) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def read_recoveries(log_dir: str | Path) -> list[Recovery]:
    """The readable recovery records of a log directory (its newest :data:`MAX_RECOVERY_BYTES`)."""
    found = (
        parse_recovery(_json(line))
        for line in _lines(
            Path(log_dir) / RECOVERIES, line_limit=MAX_RECOVERY_LINE, tail_bytes=MAX_RECOVERY_BYTES
        )
    )
    return [r for r in found if r is not None]


def read_steps(
    log_dir: str | Path, *, tail_bytes: int | None = None
) -> Iterator[tuple[int, float, float]]:
    """(step, step_seconds, time) of every readable step record, in the log's order (with
    ``tail_bytes``: of those in its last ``tail_bytes`` bytes)."""
    path = Path(log_dir) / steplog.FILENAME
    for line in _lines(path, line_limit=MAX_STEP_LINE, tail_bytes=tail_bytes):
        record = _json(line)
        if not isinstance(record, dict):
            continue
        step, at = _step(record.get("step")), _time(record.get("time"))
        seconds = _time(record.get("step_seconds"))
        if step is not None and at is not None and seconds is not None:
            yield step, seconds, at


def replay(log_dir: str | Path) -> Accountant:
    """An accountant fed a log directory's steps and recoveries in time order.

    A recovery goes after the steps that ended by its failure and before the later ones.
    """
    accountant = Accountant()
    pending = collections.deque(sorted(read_recoveries(log_dir), key=lambda r: r.failed_at))
    for step, seconds, at in read_steps(log_dir):
        while pending and pending[0].failed_at < at - seconds:
            accountant.recovery(pending.popleft())
        accountant.step(step, seconds, at)
    for record in pending:
        accountant.recovery(record)
    return accountant


def account_of(log_dir: str | Path) -> Account:
    """The goodput of the run in ``log_dir``."""
    return replay(log_dir).account()


# ------------------------------------------------------------------------------ the gang record


def last_step(log_dir: str | Path) -> tuple[int, float] | None:
    """(step, time) of the step log's last readable record, or None."""
    last = None
    for tail in (2**20, 2 * MAX_STEP_LINE):  # the end of the log, not all of it: start-up waits
        for step, _, at in read_steps(log_dir, tail_bytes=tail):
            last = (step, at)
        if last is not None:
            return last
    return last


def gang_record(
    log_dir: str | Path, restored: int | None, *, rejoined_at: float, restored_at: float
) -> dict[str, Any] | None:
    """The ``gang`` recovery record of a trainer that starts where the step log went further.

    A full gang rebuild leaves no in-place record: the new gang's rank 0 writes one at start-up
    when ``steps.jsonl`` has records past the step it restored (``restored``; None: none).
    failedAt is the last record's time (the failure came after it); detection is the operator's
    and not seen here, so detectedAt stays null and the time up to the rejoin is ``restart``.
    None when the log does not go further, or a record of this restore is already there.
    """
    last = last_step(log_dir)
    resumed = restored or 0
    if last is None or last[0] <= resumed:
        return None
    step, failed_at = last
    if any(
        r.resumed_step == resumed and r.failed_at >= failed_at for r in read_recoveries(log_dir)
    ):
        return None
    return {
        "generation": 0,
        "tier": "gang",
        "cause": "gang restart",
        "ranks": [],
        "failedAt": failed_at,
        "detectedAt": None,
        "rejoinedAt": rejoined_at,
        "restoredAt": restored_at,
        "resumedStep": resumed,
        "source": "storage",
        "lostSteps": step - resumed,
        "firstStepAt": None,
    }


def note_gang_restart(
    log_dir: str | Path | None, restored: int | None, *, rejoined_at: float
) -> dict[str, Any] | None:
    """Append :func:`gang_record` (restoredAt: now) to ``recoveries.jsonl``; the record, or None.

    Global rank 0 calls it once after the first restore of a process (not after an in-place
    recovery, which gp-sup's supervisor records).
    """
    if log_dir is None:
        return None
    record = gang_record(log_dir, restored, rejoined_at=rejoined_at, restored_at=time.time())
    if record is not None:
        with (Path(log_dir) / RECOVERIES).open("a", encoding="utf-8") as out:
            out.write(json.dumps(record, sort_keys=True) + "\n")
    return record


# ------------------------------------------------------------------------------ live, on rank 0


class Tracker:
    """Rank 0's live account: the log directory's history, then each step and new recovery record."""

    def __init__(self, log_dir: str | Path) -> None:
        self.accountant = replay(log_dir)
        """The account so far."""
        self._path = Path(log_dir) / RECOVERIES
        try:
            self._offset = self._path.stat().st_size  # what replay read; new records come after
        except OSError:
            self._offset = 0

    def _new_recoveries(self) -> list[Recovery]:
        """Recovery records appended since the last call (at most :data:`MAX_RECOVERY_BYTES`)."""
        try:
            with self._path.open("rb") as handle:
                if handle.seek(0, 2) < self._offset:  # truncated: read it again from the start
                    self._offset = 0
                handle.seek(self._offset)
                chunk = handle.read(MAX_RECOVERY_BYTES)
        except OSError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        if not complete and len(chunk) == MAX_RECOVERY_BYTES:  # one line longer than the chunk
            complete = chunk
        self._offset += len(complete)
        found = (
            parse_recovery(_json(line))
            for line in complete.splitlines()
            if len(line) <= MAX_RECOVERY_LINE
        )
        return [r for r in found if r is not None]

    def step(self, step: int, seconds: float, at: float) -> list[Failure]:
        """A step ended: the failures recorded or revealed since the last one."""
        found = [self.accountant.recovery(r) for r in self._new_recoveries()]
        unrecorded = self.accountant.step(step, seconds, at)
        return found + ([unrecorded] if unrecorded is not None else [])
