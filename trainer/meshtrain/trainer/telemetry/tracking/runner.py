"""One tracker on a thread of its own (in the trackers' process, :mod:`.child`): the reader of
the trainer's lines only enqueues.

A backend that raises (server down, bad URI, missing package) is reported once on stderr and
dropped: the run goes on without it.  The queue is bounded (a stalled backend drops steps rather
than memory), and the end waits for all of them against one deadline (:func:`close_all`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import sys
import threading
import time
from pathlib import Path

from meshtrain.trainer.telemetry.tracking import backend

MAX_PENDING = 10_000
"""Steps queued for one tracker at most; more are dropped (and said once)."""
CLOSE_SECONDS = 120.0
"""How long the end of the run waits for the trackers, all together, to send what is queued and
close their runs (:data:`CLOSE_ENV` may change it)."""
CLOSE_ENV = "MESHTRAIN_TRACKERS_CLOSE_SECONDS"
"""The environment's override of :data:`CLOSE_SECONDS` (seconds, 1 to :data:`MAX_CLOSE_SECONDS`)."""
MAX_CLOSE_SECONDS = 3600.0
"""The longest end wait :data:`CLOSE_ENV` may ask for."""
END_POLL_SECONDS = 0.05
"""How often the end retries a tracker whose queue is full."""
WARNING_PREFIX = "WARNING: experiment tracker"
"""How every tracker warning starts (``meshtrain run`` relays such lines to the terminal)."""
MAX_MESSAGE = 500
"""Characters of a failure's message quoted (a server may answer with a whole page)."""


@dataclasses.dataclass(frozen=True)
class _Step:
    step: int
    values: dict[str, float]
    wall_time: float


@dataclasses.dataclass(frozen=True)
class _End:
    report: Path | None
    finished: bool


class Runner:
    """Drives one backend on a daemon thread."""

    def __init__(self, tracker: backend.Backend) -> None:
        self.tracker = tracker
        self.failed: str | None = None
        """Why the tracker is off (None: it works)."""
        self._queue: queue.Queue[_Step | _End] = queue.Queue(maxsize=MAX_PENDING)
        self._dropped = False
        self._thread = threading.Thread(
            target=self._work, name=f"meshtrain-tracker-{tracker.name}", daemon=True
        )
        self._thread.start()

    def log(self, step: int, values: dict[str, float], wall_time: float) -> None:
        """Queue one step (never blocks)."""
        if self.failed is not None:
            return
        try:
            self._queue.put_nowait(_Step(step, values, wall_time))
        except queue.Full:
            if not self._dropped:
                self._dropped = True
                _warn(
                    self.tracker.name,
                    f"it fell {MAX_PENDING} steps behind; steps are dropped until it catches up",
                )

    def close(self, report: Path | None, finished: bool, timeout: float = CLOSE_SECONDS) -> None:
        """End this tracker alone and wait up to ``timeout`` seconds (:func:`close_all` for several)."""
        close_all([self], report, finished, time.monotonic() + timeout)

    def end(self, report: Path | None, finished: bool) -> bool:
        """Queue the end without waiting; False: the queue is full (try again)."""
        if self.failed is not None:
            return True
        try:
            self._queue.put_nowait(_End(report, finished))
        except queue.Full:
            return False
        return True

    def wait(self, deadline: float, budget: float) -> None:
        """Wait until ``deadline`` (``time.monotonic``) for the end; warn if the tracker is not done
        (``budget``: the seconds the end was given, for the warning)."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive() and self.failed is None:
            _warn(self.tracker.name, f"it did not finish within {budget:g} s; left behind")

    def _work(self) -> None:
        try:
            self.tracker.start()
            while True:
                item = self._queue.get()
                if isinstance(item, _End):
                    self.tracker.finish(item.report, item.finished)
                    return
                self.tracker.log(item.step, item.values, item.wall_time)
        except Exception as err:  # noqa: BLE001 - any failure of a tracker turns only it off
            self.failed = f"{type(err).__name__}: {str(err)[:MAX_MESSAGE]}"
            _warn(self.tracker.name, f"{self.failed}; training goes on without it")


def _warn(tracker: str, message: str) -> None:
    print(f"{WARNING_PREFIX} {tracker}: {message}", file=sys.stderr, flush=True)


def close_all(runners: list[Runner], report: Path | None, finished: bool, deadline: float) -> None:
    """End every tracker at once and wait for all of them against one ``deadline``."""
    budget = max(0.0, deadline - time.monotonic())
    end_all(runners, report, finished, deadline)
    wait_all(runners, deadline, budget)


def end_all(runners: list[Runner], report: Path | None, finished: bool, deadline: float) -> None:
    """Queue the end for every tracker; a full queue is retried (its steps go first) until ``deadline``."""
    behind = [one for one in runners if not one.end(report, finished)]
    while behind and time.monotonic() < deadline:
        time.sleep(END_POLL_SECONDS)
        behind = [one for one in behind if not one.end(report, finished)]


def wait_all(runners: list[Runner], deadline: float, budget: float) -> None:
    """Wait for every tracker's end until ``deadline`` (``budget``: the seconds given, for warnings)."""
    for one in runners:
        one.wait(deadline, budget)


def close_seconds() -> float:
    """:data:`CLOSE_SECONDS`, or :data:`CLOSE_ENV`'s value when it is a number in range."""
    try:
        wanted = float(os.environ.get(CLOSE_ENV, ""))
    except ValueError:
        return CLOSE_SECONDS
    return min(max(wanted, 1.0), MAX_CLOSE_SECONDS) if math.isfinite(wanted) else CLOSE_SECONDS
