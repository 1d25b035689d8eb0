"""Goodput: productive step time over wall time, and the time each failure cost, by phase.

Reads rank 0's ``steps.jsonl`` (every record has ``step``, ``step_seconds`` and ``time``, the
unix time the step ended) and ``recoveries.jsonl`` (one record per recovery, docs/telemetry.md,
"Goodput").  A step counts as productive in its last run only: when a restore goes back to an
earlier step, the runs of the steps after it are lost (``recompute``), as is the part of a step
a failure interrupted.  A recovery record splits the rest of a failure's cost into
``detection`` (failedAt -> detectedAt), ``restart`` (-> rejoinedAt) and ``reload``
(-> restoredAt); a step log that goes back without a record is a restart nobody recorded, its
gap counted as ``restart``.  What is neither productive nor lost (start-up, checkpoint stalls,
evaluation) is the rest of the wall time.  Wall time starts at the job's start when the trainer
knows it (``$MESHTRAIN_JOB_STARTED_AT``, :func:`job_started`), else at the first step; the time
from the job's start to its first step is ``startup``.

:class:`Accountant` takes the records one at a time (the trainer feeds it live,
:mod:`.goodput_live`);
:func:`account_of` replays a log directory (``meshtrain report``).  Both files are a tenant's
and read as hostile: bounded lines and bytes, every field checked, a bad record skipped.
"""

from __future__ import annotations

import array
import bisect
import collections
import dataclasses
import datetime
import json
import math
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from meshtrain.api import limits
from meshtrain.trainer.telemetry import recoveries, steplog

RECOVERIES = recoveries.FILENAME
"""The recovery log next to ``steps.jsonl`` (the supervised session's records, `telemetry/recoveries.py`; the gang record here)."""

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

JOB_STARTED_ENV = "MESHTRAIN_JOB_STARTED_AT"
"""When the job started (unix seconds, or RFC 3339 as Kubernetes writes times): the start of the
wall time.  The supervisor sets it to its own start when the pod's environment has none."""

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
    """From the job's start (else the start of the first step) to the last record (or now, live)."""
    lost_seconds: Mapping[str, float]
    """Seconds lost to failures by phase (:data:`PHASES`)."""
    failures: tuple[Failure, ...]
    """The newest failures (at most :data:`MAX_FAILURES`), oldest first."""
    failure_count: int
    """Every failure seen."""
    startup_seconds: float = 0.0
    """From the job's start to the start of its first step (0 when the start is not known)."""

    @property
    def ratio(self) -> float | None:
        """Productive over wall time (None before a step)."""
        if self.wall_seconds <= 0:
            return None
        return min(1.0, max(0.0, self.productive_seconds / self.wall_seconds))

    @property
    def other_seconds(self) -> float:
        """Wall time neither productive nor lost to a failure (start-up, checkpoints, evaluation)."""
        lost = sum(self.lost_seconds.values()) + self.startup_seconds
        return max(0.0, self.wall_seconds - self.productive_seconds - lost)

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
    """The fields of a recovery record this module reads (the rest is `telemetry/recoveries.py`'s)."""

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


def _checked(value: Any) -> float:
    """A summary's number of seconds (ValueError when it is not one)."""
    number = _time(value)
    if number is None:
        raise ValueError(f"not a number of seconds: {str(value)[:40]}")
    return number


def _failure(value: Any) -> Failure:
    """A failure as :meth:`Accountant.state` wrote it (ValueError when it is not one)."""
    if not isinstance(value, dict) or not isinstance(value.get("seconds"), dict):
        raise ValueError("failure")
    tier, cause = value.get("tier"), value.get("cause")
    resumed, lost = _step(value.get("resumed_step")), _step(value.get("lost_steps"))
    if tier not in TIERS or not isinstance(cause, str) or resumed is None or lost is None:
        raise ValueError("failure fields")
    seconds = {phase: _checked(value["seconds"].get(phase)) for phase in PHASES}
    return Failure(
        tier,
        cause if CAUSE.fullmatch(cause) or cause in ("other", "unknown") else "other",
        _checked(value.get("failed_at")),
        resumed,
        lost,
        seconds,
    )


def _span(start: float | None, end: float | None) -> float:
    """``end - start``, 0 when either is unknown or the clock went back."""
    if start is None or end is None:
        return 0.0
    return min(max(0.0, end - start), float(limits.MAX_SECONDS))


class Accountant:
    """Goodput built record by record: steps (:meth:`step`) and recoveries (:meth:`recovery`) in time order."""

    def __init__(self, started_at: float | None = None) -> None:
        self._started_at = started_at  # the job's start (None: not known)
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

    def fold(self, step: int) -> None:
        """Keep the runs up to ``step`` (a published checkpoint's: no restore goes before it) as
        one entry: their seconds still count, the arrays stay as long as the steps since."""
        keep = bisect.bisect_right(self._steps, step)
        if keep > 1:
            del self._steps[: keep - 1]
            del self._cumulative[: keep - 1]

    def state(self) -> dict[str, Any]:
        """The account as JSON (:meth:`from_state`): a summary that spares a restart the replay."""
        return {
            "startedAt": self._started_at,
            "firstStart": self._first_start,
            "lastTime": self._last_time,
            "lost": dict(self._lost),
            "count": self._count,
            "steps": list(self._steps),
            "cumulative": list(self._cumulative),
            "failures": [
                dataclasses.asdict(f) | {"seconds": dict(f.seconds)} for f in self._failures
            ],
        }

    @staticmethod
    def from_state(state: Any, started_at: float | None) -> Accountant:
        """The accountant :meth:`state` described; ValueError when a field is not as written."""
        if not isinstance(state, dict):
            raise ValueError("not an object")
        made = Accountant(started_at if started_at is not None else _time(state.get("startedAt")))
        made._first_start = _time(state.get("firstStart"))
        made._last_time = _time(state.get("lastTime"))
        lost, count = state.get("lost"), _step(state.get("count"))
        if not isinstance(lost, dict) or count is None:
            raise ValueError("lost or count")
        for phase in PHASES:
            made._lost[phase] = _checked(lost.get(phase))
        made._count = count
        steps, cumulative = state.get("steps"), state.get("cumulative")
        if not isinstance(steps, list) or not isinstance(cumulative, list):
            raise ValueError("steps")
        if len(steps) != len(cumulative) or len(steps) > limits.MAX_STEPS:
            raise ValueError("steps and cumulative differ")
        for value in steps:
            step = _step(value)
            if step is None or (made._steps and step <= made._steps[-1]):
                raise ValueError("steps not increasing")
            made._steps.append(step)
        made._cumulative.extend(_checked(c) for c in cumulative)
        failures = state.get("failures")
        if not isinstance(failures, list):
            raise ValueError("failures")
        made._failures.extend(_failure(f) for f in failures[-MAX_FAILURES:])
        return made

    def account(self, now: float | None = None) -> Account:
        """The account so far; ``now`` (live) ends the wall time instead of the last record."""
        end = self._last_time if now is None else now
        start, startup = self._first_start, 0.0
        if self._started_at is not None and self._first_start is not None:
            start = min(self._started_at, self._first_start)
            startup = _span(self._started_at, self._first_start)
        wall = _span(start, end)
        return Account(
            startup_seconds=startup,
            productive_seconds=self._cumulative[-1] if self._cumulative else 0.0,
            wall_seconds=wall,
            lost_seconds=dict(self._lost),
            failures=tuple(self._failures),
            failure_count=self._count,
        )


# ------------------------------------------------------------------------------ reading the logs


def _lines(
    path: Path, *, line_limit: int, tail_bytes: int | None = None, start: int = 0
) -> Iterator[bytes]:
    """Complete lines of ``path`` of at most ``line_limit`` bytes (a longer one is skipped) from
    byte ``start`` (a line's start); with ``tail_bytes``, only those in its last ``tail_bytes``."""
    try:
        handle = path.open("rb")
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return
    with handle:
        size = handle.seek(0, 2)
        begin = start if tail_bytes is None else max(start, size - tail_bytes)
        handle.seek(begin)
        if begin > start:
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


def json_line(line: bytes) -> Any:
    """A line's JSON value, or None."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def read_recoveries(log_dir: str | Path, *, start: int = 0) -> list[Recovery]:
    """The readable recovery records of a log directory from byte ``start`` (its newest
    :data:`MAX_RECOVERY_BYTES`)."""
    found = (
        parse_recovery(json_line(line))
        for line in _lines(
            Path(log_dir) / RECOVERIES,
            line_limit=MAX_RECOVERY_LINE,
            tail_bytes=MAX_RECOVERY_BYTES,
            start=start,
        )
    )
    return [r for r in found if r is not None]


def read_steps(
    log_dir: str | Path, *, tail_bytes: int | None = None, start: int = 0
) -> Iterator[tuple[int, float, float]]:
    """(step, step_seconds, time) of every readable step record from byte ``start``, in the log's
    order (with ``tail_bytes``: of those in its last ``tail_bytes`` bytes)."""
    path = Path(log_dir) / steplog.FILENAME
    for line in _lines(path, line_limit=MAX_STEP_LINE, tail_bytes=tail_bytes, start=start):
        record = json_line(line)
        if not isinstance(record, dict):
            continue
        step, at = _step(record.get("step")), _time(record.get("time"))
        seconds = _time(record.get("step_seconds"))
        if step is not None and at is not None and seconds is not None:
            yield step, seconds, at


def job_started(environ: Mapping[str, str]) -> float | None:
    """The job's start from :data:`JOB_STARTED_ENV` (None: unset or unreadable)."""
    raw = environ.get(JOB_STARTED_ENV, "").strip()[:64]
    try:
        return _time(float(raw))
    except ValueError:
        pass
    try:
        parsed = datetime.datetime.fromisoformat(raw)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return _time(parsed.timestamp())


def replay(log_dir: str | Path, started_at: float | None = None) -> Accountant:
    """An accountant fed a log directory's steps and recoveries in time order (wall time from
    ``started_at`` when given).

    A recovery goes after the steps that ended by its failure and before the later ones.
    """
    accountant = Accountant(started_at)
    feed(accountant, read_steps(log_dir), read_recoveries(log_dir))
    return accountant


def feed(
    accountant: Accountant,
    steps: Iterator[tuple[int, float, float]],
    records: list[Recovery],
) -> None:
    """Give ``accountant`` the steps and recovery records in time order (:func:`replay`)."""
    pending = collections.deque(sorted(records, key=lambda r: r.failed_at))
    for step, seconds, at in steps:
        while pending and pending[0].failed_at < at - seconds:
            accountant.recovery(pending.popleft())
        accountant.step(step, seconds, at)
    for record in pending:
        accountant.recovery(record)


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
        "nodes": [],  # which ranks failed where is the operator's to say (status.deviceErrors)
    }


def note_gang_restart(
    log_dir: str | Path | None, restored: int | None, *, rejoined_at: float
) -> dict[str, Any] | None:
    """Append :func:`gang_record` (restoredAt: now) to ``recoveries.jsonl``; the record, or None.

    Global rank 0 calls it once after the first restore of a process (not after an in-place
    recovery, which the supervised session records).
    """
    if log_dir is None:
        return None
    record = gang_record(log_dir, restored, rejoined_at=rejoined_at, restored_at=time.time())
    if record is not None:
        with (Path(log_dir) / RECOVERIES).open("a", encoding="utf-8") as out:
            out.write(json.dumps(record, sort_keys=True) + "\n")
    return record
