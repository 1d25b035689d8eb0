"""The state machine's table: its shape, and which row decides a pass."""

from __future__ import annotations

from meshtrain.operator.policy import (
    failure,
    finish,
    job_actions,
    kueue,
    kueue_workload,
    lifecycle,
    running,
    situation,
    startup,
    suspend,
)
from tests.builders import JobBuilder
from tests.unit.test_operator_lifecycle import at, job, placed_status, pod, running_gang


def deciding(seen: situation.Situation) -> situation.Rule:
    return next(
        row for row in lifecycle.RULES if isinstance(row, situation.Rule) and row.when(seen)
    )


def test_every_row_has_its_own_name_and_the_last_rule_always_decides():
    names = [row.name for row in lifecycle.RULES]
    assert len(names) == len(set(names))
    last = lifecycle.RULES[-1]
    assert isinstance(last, situation.Rule) and last is startup.WAITING
    assert last.when(situation.Situation(job(), (), at(0)))


SUSPENDED = JobBuilder().layout(data=2, gpus_per_node=1).run_policy(suspend=True).raw()
CASES = [
    # name, situation, the rule that decides
    ("a new job is placed", situation.Situation(job(), (), at(0)), startup.PLACE),
    (
        "a finished job only cleans up",
        situation.Situation(job(phase="Succeeded"), (), at(0)),
        finish.FINISHED,
    ),
    (
        "a suspended spec stops the gang",
        situation.Situation(job(SUSPENDED, **placed_status()), tuple(running_gang()), at(5)),
        suspend.SUSPEND,
    ),
    (
        "Kueue holds a queued job",
        situation.Situation(job(), (), at(0), kueue_workload.Gate(None)),
        kueue.HELD,
    ),
    (
        "a failed pod restarts the gang",
        situation.Situation(
            job(**placed_status()), (pod(0, "Running"), pod(1, "Failed", exit_code=1)), at(5)
        ),
        failure.GANG_FAILED,
    ),
    (
        "a running gang runs",
        situation.Situation(job(**placed_status()), tuple(running_gang()), at(5)),
        running.RUNNING,
    ),
]


def test_the_first_rule_that_holds_decides():
    for name, seen, rule in CASES:
        assert deciding(seen) is rule, name


def test_notes_owe_their_actions_to_the_decision_below_them():
    # A pod of an earlier attempt is deleted whatever the current gang's rule decides ...
    stale = pod(0, "Running", attempt=0)
    current = job(**placed_status(restarts=1))
    decision = lifecycle.decide(current, [stale], at(5))
    assert isinstance(decision.actions[0], job_actions.DeletePods)
    assert decision.actions[0].names == (stale.name,)
    assert isinstance(decision.actions[-1], job_actions.Place)  # the missing pods of attempt 1
    # ... but the deadline's failure stands alone.
    late = job(
        JobBuilder().layout(data=2, gpus_per_node=1).run_policy(activeDeadlineSeconds=10).raw(),
        **placed_status(restarts=1),
    )
    failed = lifecycle.decide(late, [stale], at(60))
    assert isinstance(failed.actions[0], job_actions.SetStatus)
    assert failed.actions[0].changes["phase"] == "Failed"
    assert all(stale.name not in getattr(a, "names", ()) for a in failed.actions)
