"""Waits between tries: the jittered exponential backoff, and refused tries of a job per spec generation.

:func:`jittered` is the one backoff of the operator's retries after 429/5xx answers (and of
disruption restarts): doubling up to a cap, stretched at random so that many jobs or replicas
that failed together do not retry together, and never sooner than the server's ``Retry-After``.
The reconciler keeps one :class:`Backoff` per kind of refusal (the children's creates, the Kueue
Workload's), keyed by job UID: a namesake created again is a new job.  A new spec generation
tries again at once.  Pure: the caller passes the time and the random fraction.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable

JITTER = 0.5
"""Share of the exponential wait added at random (0 to 50 % more).

Jitter above the wait, not "full jitter" below it: a retry is never sooner than the doubling
says, so a throttled or failing server gets the spacing the docs promise (2 s, 4 s, 8 s, ...)
while the retries of jobs that failed together spread over half as much again."""


def jittered(
    failures: int,
    *,
    base: float,
    cap: float,
    fraction: float,
    retry_after: float | None = None,
) -> float:
    """Seconds to wait after ``failures`` failed tries in a row (at least 1).

    ``base`` doubled per failure after the first, at most ``cap``, times ``1 + JITTER *
    fraction`` (``fraction`` in [0, 1): ``random.random()``, or :func:`fraction_of` where the
    decision must be pure).  A server's ``retry_after`` is honoured, bounded by ``cap`` so that
    a hostile or broken answer cannot park the operator.
    """
    doublings = min(max(failures - 1, 0), 62)  # 2**62 * base is past any cap
    ceiling = min(base * float(2**doublings), cap)
    wait = ceiling * (1.0 + JITTER * min(max(fraction, 0.0), 1.0))
    if retry_after is not None and math.isfinite(retry_after):
        wait = max(wait, min(max(retry_after, 0.0), cap))
    return wait


def fraction_of(key: str) -> float:
    """A fraction in [0, 1) fixed by ``key`` (e.g. a job UID and its attempt): jitter for a pure decision.

    Different jobs get different fractions, the same job the same one at every pass, so a
    decision repeated (after a crash, on another replica) waits the same time.
    """
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


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
