"""A run's attempts as ``meshtrain report`` shows them: where each restarted and what it recomputed.

Built from the step records of each attempt (:func:`.steplog.attempts`); pure.  An attempt
resumes from a checkpoint, so the steps it trains up to its predecessors' last step are trained
again: they are its recomputed steps, and the run's trained steps count them each time.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One start of a run's processes and the steps it trained."""

    number: int
    """1 for the first attempt."""
    first_step: int
    """Its first step recorded (an attempt after the first: the step after its checkpoint)."""
    last_step: int
    """Its last step recorded."""
    recorded: int
    """Step records it wrote: the steps it trained."""
    recomputed: int
    """Of those, steps an earlier attempt had trained already."""


def of(records: list[list[dict[str, Any]]]) -> list[Attempt]:
    """The attempts of step ``records`` (one list per attempt, oldest first)."""
    out: list[Attempt] = []
    reached = 0  # the highest step any earlier attempt trained
    for number, attempt in enumerate(records, 1):
        steps = [int(record["step"]) for record in attempt]
        out.append(
            Attempt(
                number=number,
                first_step=steps[0],
                last_step=steps[-1],
                recorded=len(steps),
                recomputed=sum(1 for step in steps if step <= reached),
            )
        )
        reached = max(reached, max(steps))
    return out


def summary_rows(attempts: list[Attempt]) -> list[tuple[str, str]]:
    """(what, value) rows for the report's table: none for a run of one attempt."""
    if len(attempts) < 2:
        return []
    restarts = ", ".join(str(a.first_step) for a in attempts[1:])
    trained = sum(a.recorded for a in attempts)
    recomputed = sum(a.recomputed for a in attempts)
    return [
        ("attempts", f"{len(attempts)} (restarted at step {restarts})"),
        ("steps trained, all attempts", f"{trained} ({recomputed} recomputed after a restart)"),
    ]


def table(attempts: list[Attempt]) -> list[list[str]]:
    """One row per attempt: number, steps, recorded, recomputed."""
    return [
        [str(a.number), f"{a.first_step} .. {a.last_step}", str(a.recorded), str(a.recomputed)]
        for a in attempts
    ]


COLUMNS = ("attempt", "steps", "trained", "recomputed")
"""The columns of :func:`table`."""
