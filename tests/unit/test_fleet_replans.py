"""The churn benchmark's own check of the re-plan target (``benchmarks/fleet/replans``): the
operator's plan lines read back from kopf's text format, and each re-plan judged against the
changes the benchmark saw.  The operator's real log is read back in
``tests/integration/operator/test_operator_capacity_wait.py``."""

from __future__ import annotations

import logging

import kopf

from benchmarks.fleet import replans
from meshtrain.operator import placing

T0 = 1_790_000_000.0


def _line(at: float, message: str, level: int = logging.INFO) -> str:
    """One line as ``meshtrain operator --log-format=text`` writes it (kopf's FULL format)."""
    record = logging.LogRecord("meshtrain.operator", level, __file__, 1, message, None, None)
    record.created, record.msecs = at, (at % 1) * 1000
    return logging.Formatter(kopf.LogFormat.FULL.value).format(record)


def test_the_operators_plan_lines_are_read_back_at_their_times_and_nothing_else() -> None:
    lines = [
        _line(T0, f"jobs/a: {placing.WAITS}"),
        _line(T0 + 0.25, f"other/a: {placing.PLANNED_AGAIN}"),  # another namespace
        _line(T0 + 0.5, "jobs/a unschedulable: InsufficientGPUs: ..."),
        _line(T0 + 2.5, f"jobs/a: {placing.PLANNED_AGAIN}", logging.WARNING),  # not the line
        _line(T0 + 1.75, f"jobs/a: {placing.PLANNED_AGAIN}"),
    ]
    plans = replans.read_log(lines, "jobs")
    assert [(p.job, p.again) for p in plans] == [("a", False), ("a", True)]
    assert [p.at for p in plans] == [T0, T0 + 1.75]  # milliseconds kept


def _plans(*rows: tuple[float, str, bool]) -> list[replans.Plan]:
    return [replans.Plan(T0 + at, job, again) for at, job, again in rows]


def test_a_second_replan_after_one_admitting_change_is_unexplained() -> None:
    plans = _plans((0, "a", False), (10, "a", True), (12, "a", True))
    judged = replans.judge(plans, {"a": 64}, [(T0 + 9.5, 64)], releases=[], holders=[])
    assert (judged["by_capacity"], judged["unexplained"]) == (1, 1)
    assert judged["most_replans_per_admitting_change"] == 2.0
    assert judged["target_met_outside_holders"] is False


def test_a_change_too_small_for_the_job_explains_nothing_and_a_reservations_end_does() -> None:
    plans = _plans((0, "a", False), (10, "a", True), (20, "a", True))
    changes = [(T0 + 9.0, 32)]  # freed, but 32 < 64: it could not admit a
    judged = replans.judge(plans, {"a": 64}, changes, releases=[T0 + 19.0], holders=[])
    assert (judged["by_capacity"], judged["by_release"], judged["unexplained"]) == (0, 1, 1)


def test_a_change_heard_just_after_the_plan_explains_it_and_a_holders_replan_is_set_apart() -> None:
    plans = _plans((0, "a", False), (10, "a", True), (0, "h", False), (30, "h", True))
    changes = [(T0 + 10 + replans.SLACK_SECONDS / 2, 64)]  # the benchmark's watch heard it later
    judged = replans.judge(plans, {"a": 64, "h": 4096}, changes, releases=[], holders=["h"])
    assert (judged["by_capacity"], judged["unexplained"]) == (1, 1)
    assert judged["unexplained_of_holders"] == 1  # owed to its clear time: no watch sees that
    assert judged["target_met_outside_holders"] is True


def test_replans_before_the_job_was_seen_to_wait_are_not_judged() -> None:
    plans = _plans((5, "a", True), (6, "a", True))  # the log began after its first plan
    judged = replans.judge(plans, {"a": 8}, [], releases=[], holders=[])
    assert judged["replans"] == 1 and judged["unexplained"] == 1


def test_a_reservation_ends_when_its_holder_ran_or_the_next_took_over() -> None:
    held = {
        "h1": [{"until": 50.0, "all_running": 40.0}],
        "h2": [{"until": 90.0, "all_running": None}],
    }
    assert sorted(replans.releases_of(held, T0)) == [T0 + 40.0, T0 + 90.0]
