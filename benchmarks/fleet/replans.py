"""Issue #36's re-plan target judged from outside the operator's own count.

The target: no waiting job is planned again more than once per capacity change that could admit
it.  The operator counts that itself (``meshtrain_operator_replans_per_admission_max``), by its
own wake-up rule.  This module checks it with what the benchmark saw: every plan of a waiting job
the operator logged (``placing.WAITS`` when a job starts to wait, ``placing.PLANNED_AGAIN`` at
each plan after) against the capacity changes the benchmark's own pod watch settled
(``observe.CapacityChange``) and the ends of reservations it watched (``observe.holds``).

A re-plan is *explained* when, since the job's previous plan, the fleet's free GPUs after a
change covered the job's (a change that could admit it), or a reservation ended (its nodes went
back to everyone).  Both are looser than the operator's rule (free pod slots of the job's shape
outside reserved nodes), which implies the first, so an operator keeping its rule shows no
unexplained re-plan, except a holder's: the job holding the reservation is planned again when its
nodes are due to clear, a change of time alone that no watch sees.  Two re-plans after one
change: the second is unexplained.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from meshtrain.operator import placing

SLACK_SECONDS = 1.0
"""A change first seen by the benchmark up to this long after a plan still explains it: both
watch the same API server, either may hear of a pod's end first."""

_LINE = re.compile(
    r"^\[(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] \S+\s+\[INFO\s*\] "
    rf"(?P<namespace>[^/\s]+)/(?P<name>[^:\s]+): (?P<what>{re.escape(placing.WAITS)}|"
    rf"{re.escape(placing.PLANNED_AGAIN)})$"
)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One plan of a waiting job, from the operator's log."""

    at: float
    """Epoch seconds of the log line (the operator's text format: local time, milliseconds)."""
    job: str
    """The job's name."""
    again: bool
    """A plan of a job already waiting (False: the plan that made it wait)."""


def read_log(lines: Iterable[str], namespace: str) -> list[Plan]:
    """The plans of waiting jobs of ``namespace`` the operator logged, oldest first."""
    found = []
    for line in lines:
        matched = _LINE.match(line.rstrip("\n"))
        if matched is None or matched["namespace"] != namespace:
            continue
        stamp = datetime.datetime.strptime(matched["at"], "%Y-%m-%d %H:%M:%S,%f")
        again = matched["what"] == placing.PLANNED_AGAIN
        found.append(Plan(stamp.timestamp(), matched["name"], again))
    return sorted(found, key=lambda p: p.at)


def judge(
    plans: Sequence[Plan],
    gpus: Mapping[str, int],
    changes: Sequence[tuple[float, int]],
    releases: Sequence[float],
    holders: Iterable[str],
) -> dict[str, Any]:
    """Each re-plan explained or not (module docstring).

    ``gpus``: the GPUs each job asks; ``changes``: (epoch seconds first seen, free GPUs once
    settled) of each capacity change; ``releases``: epoch seconds a reservation ended;
    ``holders``: jobs that ever held the reservation.  A job's re-plans before the line that made
    it wait (a log cut at the start) are not judged.
    """
    holding = set(holders)
    previous: dict[str, float] = {}
    tally = {"replans": 0, "by_capacity": 0, "by_release": 0, "unexplained": 0}
    unexplained_holders = 0
    per_job: dict[str, list[int]] = {}  # job -> [re-plans, changes that could admit it]
    for plan in plans:
        if not plan.again or plan.job not in previous:
            previous[plan.job] = plan.at
            continue
        since, until = previous[plan.job], plan.at + SLACK_SECONDS
        need = gpus.get(plan.job)
        admitting = sum(
            1 for at, free in changes if since < at <= until and need is not None and free >= need
        )
        released = any(since < at <= until for at in releases)
        counted = per_job.setdefault(plan.job, [0, 0])
        counted[0] += 1
        counted[1] += admitting
        tally["replans"] += 1
        if admitting:
            tally["by_capacity"] += 1
        elif released:
            tally["by_release"] += 1
        else:
            tally["unexplained"] += 1
            unexplained_holders += plan.job in holding
        previous[plan.job] = plan.at
    ratios = {job: n / max(1, changes_seen) for job, (n, changes_seen) in per_job.items()}
    worst = max(ratios, key=lambda job: ratios[job], default=None)
    return {
        **tally,
        "unexplained_of_holders": unexplained_holders,
        "jobs_planned_again": len(per_job),
        "most_replans_per_admitting_change": None if worst is None else round(ratios[worst], 3),
        "most_of_job": worst,
        "target_met_outside_holders": tally["unexplained"] == unexplained_holders,
        "slack_seconds": SLACK_SECONDS,
    }


def releases_of(held: Mapping[str, Sequence[Mapping[str, Any]]], origin: float) -> list[float]:
    """Epoch seconds each period of holding ended (``observe.holds``' rows, seconds after
    ``origin``): when its holder ran, else when the next holder took over or the run ended."""
    ended = []
    for periods in held.values():
        for row in periods:
            ran = row.get("all_running")
            ended.append(origin + (row["until"] if ran is None else min(ran, row["until"])))
    return ended
