"""How long a preferred fabric level holds a waiting gang for one domain
(``spec.topology.levels[].waitSeconds``).  Pure.

A preferred level is weighed per byte: the planner places across its domains when no one domain
has room now.  Under churn that splits gangs that one domain would have held a minute later, and
a split gang pays cross-domain bytes at every step for the rest of its run.  ``waitSeconds`` trades
start time for those bytes, as Slurm's ``--switches=N@max-time`` does: while the job has waited
less than that for placement (its ``Placed=False`` condition's age, ``reservation.since_of``),
the level is required of the whole gang; after that it is preferred again.  A level none of
whose domains holds the gang even with every node empty is never held: waiting could not help.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections import Counter
from collections.abc import Iterable

from meshtrain import placement
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import job_state, reservation, resizing


@dataclasses.dataclass(frozen=True)
class Hold:
    """The levels held for one plan, and until when."""

    labels: frozenset[str]
    """Labels of the levels required of the whole gang for this plan."""
    until: datetime.datetime
    """When the first of them stops holding (the job is planned again then)."""
    note: str
    """What the job's ``Placed=False`` message adds (stable for the whole hold: no new Event per plan)."""


def hold(
    spec: api_spec.TrainingJobSpec,
    since: datetime.datetime,
    now: datetime.datetime,
    nodes: Iterable[placement.Node],
) -> Hold | None:
    """The levels of ``spec`` that hold a gang waiting since ``since`` at ``now`` (None: none).

    ``nodes``: every node the gang may use, busy or not; a level holds only where one of its
    domains has slots for the gang's smallest allowed size on them.
    """
    waited = (now - since).total_seconds()
    running = [
        (index, level)
        for index, level in enumerate(spec.topology.levels)
        if level.mode == "preferred" and level.wait_seconds > waited
    ]
    if not running:
        return None
    pods = min((candidate.pods for _, candidate in resizing.candidates(spec)), default=spec.pods)
    room = _largest_domains(spec, nodes, {level.label for _, level in running})
    kept = [(index, level) for index, level in running if room.get(level.label, 0) >= pods]
    if not kept:
        return None
    until = min(since + datetime.timedelta(seconds=level.wait_seconds) for _, level in kept)
    stamp = until.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    named = ", ".join(
        f"spec.topology.levels[{index}] ({level.label}, waitSeconds {level.wait_seconds})"
        for index, level in kept
    )
    note = (
        f"; held inside one domain of {named} until {stamp} at the latest, then placed across "
        "domains if need be"
    )
    return Hold(frozenset(level.label for _, level in kept), until, note)


def _largest_domains(
    spec: api_spec.TrainingJobSpec, nodes: Iterable[placement.Node], labels: set[str]
) -> dict[str, int]:
    """Per label, the pod slots of its largest domain on the nodes the gang may use, all empty."""
    per_pod = spec.resources.gpus_per_node
    selector = spec.resources.node_selector.items()
    slots: dict[str, Counter[str]] = {label: Counter() for label in labels}
    for node in nodes:
        if node.unschedulable or any(node.labels.get(k) != v for k, v in selector):
            continue
        for label in labels:
            if (value := node.labels.get(label)) is not None:
                slots[label][value] += node.allocatable_gpus // per_pod
    return {label: max(counts.values(), default=0) for label, counts in slots.items()}


def of_job(
    job: job_state.JobState, nodes: Iterable[placement.Node], now: datetime.datetime
) -> Hold | None:
    """The levels that hold ``job``'s gang at ``now``, as its status says how long it waited."""
    declared = job.declared or job.spec
    assert declared is not None
    # whole seconds, as the condition's lastTransitionTime records it: the first plan (no
    # condition yet) and the next say the same "until", so the message is news once
    began = math.floor(reservation.since_of(job.status, now))
    return hold(declared, datetime.datetime.fromtimestamp(began, datetime.UTC), now, nodes)
