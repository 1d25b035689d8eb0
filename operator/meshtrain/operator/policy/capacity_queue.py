"""Which waiting gangs a capacity change wakes, and who holds the reservation that bounds the
wait of the largest.  Pure.

A job whose plan placed nothing waits for capacity.  When GPUs free up or nodes change, only the
waiting jobs that the fleet's free pod slots could now hold are woken (:func:`admissible`): a
count of slots is a necessary condition of any plan, so no job that could start is left asleep.
Where the count is not known to be necessary (DRA claims, slices, a job re-placing beside its
own pods, too many distinct shapes) the shape is unknown (None) and the job is always woken.

Small jobs arriving all the time would otherwise take every freed GPU before a large gang ever
sees enough of them.  Of the jobs that have waited :data:`RESERVE_AFTER_SECONDS` (counted from
their ``Placed=False`` condition's transition, so an operator restart keeps it), the one of the
highest priority, then the longest waiting, that may hold (:func:`holder`: a known shape, room
for it on an empty fleet, fewer than :data:`PASS_ON_AFTER` plans that found its reserved nodes
free yet placed nothing) holds the reservation: a node set kept for it
(``policy.reservation``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TypeVar

RESERVE_AFTER_SECONDS = 300.0
"""A job waiting this long may hold the reservation (the default of ``--reserve-after-seconds``)."""
PASS_ON_AFTER = 3
"""Plans that found the holder's reserved nodes free (before they are planned: its slot count)
yet placed nothing after which it passes the reservation on to the next job in line."""

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
    """When it began to wait, in seconds since the epoch (``queue_order.since_of``)."""
    fits_drained: bool = True
    """Whether its pods fit the nodes it may use with nothing running there (else it never holds)."""
    misses: int = 0
    """Plans while it held the reservation that found its nodes free yet placed nothing."""
    priority: int = 0
    """Its pods' PriorityClass value (0 without a class): the highest holds first."""


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


def holder(
    waiting: Iterable[Waiting], now: float, after: float = RESERVE_AFTER_SECONDS
) -> Waiting | None:
    """The job holding the reservation: of those that may hold and have waited ``after``
    seconds by ``now`` (seconds since the epoch), the highest priority, then the longest waiting."""
    eligible = (
        w
        for w in waiting
        if w.need.shape is not None
        and w.fits_drained
        and w.misses < PASS_ON_AFTER
        and now - w.since >= after
    )
    return min(eligible, key=lambda w: (-w.priority, w.since, w.uid), default=None)
