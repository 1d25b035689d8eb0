"""Per waiting job: its plans and the capacity changes that could admit it (:class:`Counts`).

The target of issue #36 is that no waiting job is planned more than once per capacity change
that could admit it.  Each job waiting for capacity counts the wake-ups the wake-up rule gave it
(``waiting.Queue.wake``'s admissions, and the changes of time alone it admits: a hold for one
domain ended, an avoided node came back) and the plans made of it while it waited; the ratio
(plans / max(1, admissions)) is exported without a per-job label: the largest any job reached
(a gauge, read at each plan) and, once the job stops waiting, a histogram of the ratios.
"""

from __future__ import annotations

import dataclasses

from meshtrain.operator.cluster import metrics

Key = tuple[str, str]
"""(namespace, name) of a job."""


@dataclasses.dataclass
class Tally:
    """What one waiting job has seen."""

    admissions: int = 0
    """Changes the wake-up rule said could admit it: of capacity, or of time alone."""
    plans: int = 0
    """Plans made of it while it waited."""
    admitted_since_plan: bool = False
    """Whether an admission was counted since its last plan (a change of time then adds none)."""

    def ratio(self) -> float:
        """Plans per admitting capacity change (a plan with none counts as one change's)."""
        return self.plans / max(1, self.admissions)


class Counts:
    """The tallies of the jobs waiting now, and the largest ratio any job reached."""

    def __init__(self) -> None:
        self.jobs: dict[Key, Tally] = {}
        """Waiting jobs (and jobs planned while waiting) by key."""
        self.most = 0.0
        """The largest ratio reached so far (``metrics.REPLANS_PER_ADMISSION_MAX``)."""

    def admitted(self, key: Key) -> None:
        """A capacity change the wake-up rule says could admit the waiting job ``key``."""
        tally = self.jobs.setdefault(key, Tally())
        tally.admissions += 1
        tally.admitted_since_plan = True
        metrics.REPLAN_ADMISSIONS.inc()

    def owed_to_time(self, key: Key) -> None:
        """The nodes waiting job ``key`` may use changed with time alone (a hold for one domain
        ended, an avoided node came back) and the wake-up rule admits it: an admission, unless a
        capacity change's was counted since its last plan (that plan answers both)."""
        tally = self.jobs.setdefault(key, Tally())
        if not tally.admitted_since_plan:
            self.admitted(key)

    def planned(self, key: Key) -> None:
        """A plan of the job ``key`` made while it waited."""
        tally = self.jobs.setdefault(key, Tally())
        tally.plans += 1
        tally.admitted_since_plan = False
        if tally.ratio() > self.most:
            self.most = tally.ratio()
            metrics.REPLANS_PER_ADMISSION_MAX.set(self.most)

    def settled(self, key: Key) -> None:
        """The job waits no more (placed, gone, suspended): its ratio joins the histogram."""
        tally = self.jobs.pop(key, None)
        if tally is not None and tally.plans:
            metrics.REPLANS_PER_ADMISSION.observe(tally.ratio())
