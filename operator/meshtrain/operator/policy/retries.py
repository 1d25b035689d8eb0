"""Refused tries of a job, for one spec generation: how many in a row, and when the next may go.

The reconciler keeps one :class:`Backoff` per kind of refusal (the children's creates, the Kueue
Workload's), keyed by job UID: a namesake created again is a new job.  A new spec generation
tries again at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Tries:
    """Refusals in a row of one job."""

    failures: int
    """How many, for this generation of the spec."""
    not_before: float
    """Time before which no new try is made."""
    generation: int
    """The spec generation they were made for."""
    why: str = ""
    """The last refusal's message."""


class Backoff:
    """Tries per job UID; ``delay(n)`` is the wait after ``n`` refusals in a row.

    The caller passes the time, ``time.monotonic()``.
    """

    def __init__(self, delay: Callable[[int], float]) -> None:
        self._delay = delay
        self._tries: dict[str, Tries] = {}

    def current(self, uid: str, generation: int) -> Tries | None:
        """The job's refusals for ``generation`` (None: none, or only for an earlier spec)."""
        found = self._tries.get(uid)
        return found if found is not None and found.generation == generation else None

    def refused(self, uid: str, generation: int, now: float, why: str = "") -> Tries:
        """Record one more refusal at ``now``."""
        previous = self.current(uid, generation)
        failures = previous.failures + 1 if previous is not None else 1
        tries = Tries(failures, now + self._delay(failures), generation, why)
        self._tries[uid] = tries
        return tries

    def wait(self, uid: str, generation: int, now: float) -> float | None:
        """Seconds before the next try (None: now)."""
        found = self.current(uid, generation)
        left = found.not_before - now if found is not None else 0.0
        return left if left > 0 else None

    def forget(self, uid: str) -> None:
        self._tries.pop(uid, None)
