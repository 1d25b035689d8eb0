"""Which waiting gangs a capacity change wakes, and the reservation that bounds the wait of the
largest.  Pure.

A job whose plan placed nothing waits for capacity.  When GPUs free up or nodes change, only the
waiting jobs that the fleet's free pod slots could now hold are woken (:func:`admissible`): a
count of slots is a necessary condition of any plan, so no job that could start is left asleep.
Where the count is not known to be necessary (DRA claims, slices, a job re-placing beside its
own pods, too many distinct shapes) the shape is unknown (None) and the job is always woken.

Small jobs arriving all the time would otherwise take every freed slot before a large gang ever
sees enough of them.  Once a job has waited :data:`RESERVE_AFTER_SECONDS`, the longest-waiting
job that may hold (:func:`holder`: a known shape, room for it on an empty fleet, fewer than
:data:`PASS_ON_AFTER` plans that found enough slots yet placed nothing) holds a reservation: no
other job is placed if the slots it could take on nodes the holder can use would leave the
holder's count short (:func:`held_back`).  The reservation counts slots, not nodes: it keeps a
slot count, not a topology domain, free for the holder (see docs/operator.md, "Under churn").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TypeVar

RESERVE_AFTER_SECONDS = 300.0
"""A job waiting this long holds the reservation when it has waited longest of those waiting."""
PASS_ON_AFTER = 3
"""Plans that found the holder's slot count free yet placed nothing (its topology, not the count,
refuses it) after which it passes the reservation on to the next-longest waiting job."""

_K = TypeVar("_K", bound=Hashable)


@dataclasses.dataclass(frozen=True)
class Need:
    """What a waiting job needs of the fleet."""

    shape: Hashable | None
    """Its pods' demand, as a key: jobs of one shape have the same free slots (None: unknown,
    always woken, never holds the reservation)."""
    gpus_per_pod: int
    """GPUs (of its resource) each pod asks."""
    pods: int
    """Pods of its smallest allowed gang."""


@dataclasses.dataclass(frozen=True)
class Waiting:
    """A job waiting for capacity."""

    uid: str
    """The job's UID."""
    need: Need
    """What it waits for."""
    since: float
    """Monotonic time its first plan in this operator process placed nothing."""
    fits_drained: bool = True
    """Whether its pods fit the nodes it may use with nothing running there (else it never holds)."""
    misses: int = 0
    """Plans while it held the reservation that found its slot count free yet placed nothing."""


def admissible(
    waiting: Mapping[_K, Need | None], free_slots: Callable[[Hashable], int]
) -> list[_K]:
    """The waiting jobs whose pods fit in the free slots of their shape (None: unknown, woken).

    ``free_slots`` is asked once per shape.
    """
    slots: dict[Hashable, int] = {}
    found = []
    for key, need in waiting.items():
        if need is None or need.shape is None:
            found.append(key)
            continue
        if need.shape not in slots:
            slots[need.shape] = free_slots(need.shape)
        if slots[need.shape] >= need.pods:
            found.append(key)
    return found


def holder(waiting: Iterable[Waiting], now: float) -> Waiting | None:
    """The job holding the reservation: the longest waiting of those that may hold, once it has
    waited long enough."""
    eligible = (
        w
        for w in waiting
        if w.need.shape is not None and w.fits_drained and w.misses < PASS_ON_AFTER
    )
    oldest = min(eligible, key=lambda w: (w.since, w.uid), default=None)
    if oldest is None or now - oldest.since < RESERVE_AFTER_SECONDS:
        return None
    return oldest


def slots_taken(job: Need, of: Need) -> int:
    """Slots of ``of``'s shape that ``job``'s pods can take at most (each pod may break one or
    more of them)."""
    return job.pods * max(1, math.ceil(job.gpus_per_pod / max(1, of.gpus_per_pod)))


def held_back(
    uid: str, need: Need, reserved: Waiting | None, holder_free: int, reachable: int | None = None
) -> bool:
    """Whether a job must wait for the reservation: another job holds it and placing this one
    could leave fewer than the holder's pods in the holder's free slots (``holder_free``).

    ``reachable``: the holder's free slots on nodes this job's pods may also use; it takes no more
    (None: all of ``holder_free``).
    """
    if reserved is None or reserved.uid == uid:
        return False
    taken = slots_taken(need, reserved.need)
    if reachable is not None:
        taken = min(taken, reachable)
    return taken > 0 and holder_free - taken < reserved.need.pods


def message(reserved: Waiting) -> str:
    """Why a held-back job waits (stable while the same job holds the reservation)."""
    return (
        f"GPUs are reserved for the job waiting longest ({reserved.need.pods} pod(s), waiting "
        f"over {RESERVE_AFTER_SECONDS:.0f} s): placed once it starts or the room beside it suffices"
    )
