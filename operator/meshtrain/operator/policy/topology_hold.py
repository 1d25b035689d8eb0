"""How long a preferred fabric level holds a gang's first placement for one domain
(``spec.topology.levels[].waitSeconds``).  Pure.

A preferred level is weighed per byte: the planner places across its domains when no one domain
has room now.  Under churn that splits gangs that one domain would have held a minute later, and
a split gang pays cross-domain bytes at every step for the rest of its run.  ``waitSeconds`` trades
start time for those bytes, as Slurm's ``--switches=N@max-time`` does: while the job has waited
less than that for placement (its ``Placed=False`` condition's age, ``queue_order.since_of``),
the level is required of the whole gang; after that it is preferred again.

Only a job's first placement is held: a gang that ran once (``status.startTime``) is re-placed at
once after a failure, a straggler's replacement, a spec change or a grow, on its freed nodes or
across domains.  Not held either: a job Kueue admits (its quota would sit idle, and Kueue TAS
chooses domains itself), an elastic job (it would shrink into one domain now and grow across
domains later: two rebuilds), and a level none of whose domains has slots for the gang's pods
on its nodes with nothing running there (waiting could not help; a DRA job's devices are not in
node allocatable, so it is never held).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections import Counter
from collections.abc import Iterable, Mapping

from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import conditions, job_state, queue_order
from meshtrain.placement import topology

EmptySlots = Iterable[tuple[str, Mapping[str, str], int]]
"""(name, labels, pod slots) of each node the gang may use (for a hold: with nothing running)."""


@dataclasses.dataclass(frozen=True)
class Hold:
    """The levels held for one plan, and until when."""

    labels: frozenset[str]
    """Labels of the levels required of the whole gang for this plan."""
    until: datetime.datetime
    """When the first of them stops holding (the job is planned again then)."""
    note: str
    """What the job's ``Placed=False`` message adds: each held level and when it stops holding."""


def hold(
    spec: api_spec.TrainingJobSpec,
    since: datetime.datetime,
    now: datetime.datetime,
    empty_slots: EmptySlots,
) -> Hold | None:
    """The levels of ``spec`` that hold a gang waiting since ``since`` at ``now`` (None: none).

    A level holds only where one of its domains has, in ``empty_slots``, room for all the gang's
    pods.
    """
    waited = (now - since).total_seconds()
    running = [
        (index, level)
        for index, level in enumerate(spec.topology.levels)
        if level.mode == "preferred" and level.wait_seconds > waited
    ]
    if not running:
        return None
    room = largest_domains(empty_slots, {level.label for _, level in running})
    kept = [(index, level) for index, level in running if room[level.label] >= spec.pods]
    if not kept:
        return None
    ends = {index: since + datetime.timedelta(seconds=level.wait_seconds) for index, level in kept}
    held = ", ".join(
        f"spec.topology.levels[{index}] ({level.label}, waitSeconds {level.wait_seconds}) "
        f"until {conditions.timestamp(ends[index])}"
        for index, level in kept
    )
    note = f"; held inside one domain of {held}; then placed across domains if need be"
    return Hold(frozenset(level.label for _, level in kept), min(ends.values()), note)


def may_hold(job: job_state.JobState, kueue: bool) -> bool:
    """Whether a level may hold ``job``'s placement at all (see the module's docstring), before
    its nodes are counted.  ``kueue``: Kueue admits the job."""
    declared = job.declared or job.spec
    if declared is None or kueue or job.status.get("startTime"):
        return False
    if declared.run_policy.elastic is not None:
        return False
    return any(level.wait_seconds > 0 for level in declared.topology.levels)


def of_job(job: job_state.JobState, empty_slots: EmptySlots, now: datetime.datetime) -> Hold | None:
    """The levels that hold ``job``'s gang at ``now`` (:func:`may_hold` it), as its status says
    how long it waited (None: none)."""
    declared = job.declared or job.spec
    assert declared is not None
    # whole seconds, as the condition's lastTransitionTime records it: the first plan (no
    # condition yet) and the next say the same times
    began = math.floor(queue_order.since_of(job.status, now, job.generation))
    return hold(declared, datetime.datetime.fromtimestamp(began, datetime.UTC), now, empty_slots)


def largest_domains(slots: EmptySlots, labels: Iterable[str]) -> dict[str, int]:
    """Per label, the pod slots of its fullest domain (a node without the label is a domain of
    its own, as the planner counts it: ``placement.topology.domain_of``)."""
    per_domain: dict[str, Counter[str]] = {label: Counter() for label in labels}
    for name, node_labels, count in slots:
        for label, counts in per_domain.items():
            counts[topology.domain_of(name, node_labels, label)] += count
    return {label: max(counts.values(), default=0) for label, counts in per_domain.items()}
