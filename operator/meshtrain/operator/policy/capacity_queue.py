"""Which waiting gangs a capacity change wakes, and the reservation that bounds the wait of the
largest.  Pure.

A job whose plan placed nothing waits for capacity.  When GPUs free up or nodes change, only the
waiting jobs that the fleet's free pod slots could now hold are woken (:func:`admissible`): a
count of slots is a necessary condition of any plan, so no job that could start is left asleep,
and none is planned again for a change that cannot admit it.

Small jobs arriving all the time would otherwise take every freed slot before a large gang ever
sees enough of them.  Once a job has waited :data:`RESERVE_AFTER_SECONDS`, the longest-waiting such
job holds a reservation (:func:`holder`): no other job is placed unless the slots it takes leave
the holder's count free (:func:`held_back`), so free capacity only grows until the holder fits.
Its wait is then bounded by the reservation age plus the longest remaining run of the jobs that
hold the GPUs it needs (no backfill by run time: the operator knows no job's run time).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TypeVar

RESERVE_AFTER_SECONDS = 300.0
"""A job waiting this long holds the reservation when it has waited longest of those waiting."""

_K = TypeVar("_K", bound=Hashable)


@dataclasses.dataclass(frozen=True)
class Need:
    """What a waiting job needs of the fleet."""

    shape: Hashable
    """Its pods' demand, as a key: jobs of one shape have the same free slots."""
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


def admissible(
    waiting: Mapping[_K, Need | None], free_slots: Callable[[Hashable], int]
) -> list[_K]:
    """The waiting jobs whose pods fit in the free slots of their shape (None: unknown, woken).

    ``free_slots`` is asked once per shape.
    """
    slots: dict[Hashable, int] = {}
    found = []
    for key, need in waiting.items():
        if need is None:
            found.append(key)
            continue
        if need.shape not in slots:
            slots[need.shape] = free_slots(need.shape)
        if slots[need.shape] >= need.pods:
            found.append(key)
    return found


def holder(waiting: Iterable[Waiting], now: float) -> Waiting | None:
    """The job holding the reservation: the longest waiting, once it has waited long enough."""
    oldest = min(waiting, key=lambda w: (w.since, w.uid), default=None)
    if oldest is None or now - oldest.since < RESERVE_AFTER_SECONDS:
        return None
    return oldest


def slots_taken(job: Need, of: Need) -> int:
    """Slots of ``of``'s shape that ``job``'s pods can take at most (each pod may break one or
    more of them)."""
    return job.pods * max(1, math.ceil(job.gpus_per_pod / max(1, of.gpus_per_pod)))


def held_back(uid: str, need: Need, reserved: Waiting | None, holder_free: int) -> bool:
    """Whether a job must wait for the reservation: another job holds it and placing this one
    could leave fewer than the holder's pods in the holder's free slots (``holder_free``)."""
    if reserved is None or reserved.uid == uid:
        return False
    return holder_free - slots_taken(need, reserved.need) < reserved.need.pods


def message(reserved: Waiting) -> str:
    """Why a held-back job waits (stable while the same job holds the reservation)."""
    return (
        f"GPUs are reserved for the job waiting longest ({reserved.need.pods} pod(s), waiting "
        f"over {RESERVE_AFTER_SECONDS:.0f} s): placed once it starts or the room beside it suffices"
    )
