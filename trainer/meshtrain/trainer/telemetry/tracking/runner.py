"""One tracker on a thread of its own (in the trackers' process, :mod:`.child`): the reader of
the trainer's lines only enqueues.

A backend that raises (server down, bad URI, missing package) is reported once on stderr and
dropped: the run goes on without it.  The queue is bounded (a stalled backend drops steps rather
than memory), and the end waits a bounded time for what is queued.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
from pathlib import Path

from meshtrain.trainer.telemetry.tracking import backend

MAX_PENDING = 10_000
"""Steps queued for one tracker at most; more are dropped (and said once)."""
CLOSE_SECONDS = 120.0
"""How long the end of the run waits for a tracker to send what is queued and close its run."""
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
        """Send the end and wait up to ``timeout`` seconds for the thread to finish it."""
        if self.failed is None:
            try:
                self._queue.put(_End(report, finished), timeout=timeout)
            except queue.Full:
                pass
        self._thread.join(timeout)
        if self._thread.is_alive() and self.failed is None:
            _warn(self.tracker.name, f"it did not finish within {timeout:g} s; left behind")

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
    print(f"WARNING: experiment tracker {tracker}: {message}", file=sys.stderr, flush=True)
