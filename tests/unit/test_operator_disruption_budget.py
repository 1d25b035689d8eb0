"""runPolicy.disruptionRestartLimit: disruption restarts are bounded, spaced with jitter, and a node that
disrupts a job twice is left out of its next placement (issue #32 item 5).

The issue measured ``Restarting restarts=501 requeue_after=0`` for a pod the kubelet kept refusing
with UnexpectedAdmissionError under ``backoffLimit: 0``; these tests replay that loop through
``lifecycle.decide``, writing each decision's status back as the API server would.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from meshtrain.api.spec import run_policy
from meshtrain.api.spec import status as api_status
from meshtrain.operator.policy import (
    conditions,
    disruption_budget,
    excluded_nodes,
    job_actions,
    lifecycle,
    pod_state,
    retries,
    stragglers,
)
from tests.builders import JobBuilder
from tests.unit.test_operator_lifecycle import at, job, placed_status, pod, status_of


def spec(**run_policy: Any) -> dict[str, Any]:
    return (
        JobBuilder().layout(data=2, gpus_per_node=1).run_policy(backoffLimit=0, **run_policy).raw()
    )


def refused(index: int, attempt: int, node: str) -> pod_state.PodState:
    """A pod the kubelet refused at admission, as it reports it (phase Failed, its reason)."""
    failed = pod(index, "Failed", attempt=attempt)
    return dataclasses.replace(failed, reason="UnexpectedAdmissionError", node=node)


def placed_on(status: dict[str, Any], nodes: tuple[str, str]) -> dict[str, Any]:
    placement = [{"podIndex": i, "node": n} for i, n in enumerate(nodes)]
    return {**status, "placement": placement, "phase": "Placing"}


def cycle(
    raw: dict[str, Any], status: dict[str, Any], seconds: float, node: str = "n1"
) -> tuple[job_actions.Decision, dict[str, Any]]:
    """One disruption of the placed gang at ``seconds``: pod 1 refused on ``node``."""
    attempt = int(status.get("restarts") or 0)
    state = job(raw, **placed_on(status, ("n0", node)))
    pods = [pod(0, "Running", attempt=attempt), refused(1, attempt, node)]
    decision = lifecycle.decide(state, pods, at(seconds))
    return decision, {**status, **status_of(decision)}


def test_the_first_disruption_restarts_at_once_and_is_recorded():
    decision, status = cycle(spec(), placed_status(), 5)
    assert status["phase"] == "Restarting" and status["restarts"] == 1
    assert decision.requeue_after == 0
    record = status["disruptions"]
    assert record["streak"] == 1 and record["notBefore"] is None
    assert record["nodes"] == [
        {
            "node": "n1",
            "count": 1,
            "reason": "UnexpectedAdmissionError",
            "time": conditions.timestamp(at(5)),
        }
    ]
    assert "excludedNodes" not in status


def test_a_node_that_disrupts_twice_is_excluded_and_the_next_placement_waits():
    _, status = cycle(spec(), placed_status(), 5)
    decision, status = cycle(spec(), status, 6)
    assert status["phase"] == "Restarting" and status["disruptions"]["streak"] == 2
    [excluded] = status["excludedNodes"]
    assert excluded["node"] == "n1" and excluded["reason"] == disruption_budget.REASON
    assert "UnexpectedAdmissionError" in excluded["message"]
    assert excluded_nodes.excluded(status, at(7)) == {"n1"}  # what gang_fit leaves out
    # Never requeue_after=0 for a repeated disruption: the next placement waits 5-7.5 s.
    assert decision.requeue_after is not None
    assert disruption_budget.BACKOFF_BASE_SECONDS <= decision.requeue_after <= 7.5
    note = next(a.message for a in decision.actions if isinstance(a, job_actions.Emit))
    assert "node(s) n1 excluded" in note and "placing the gang again in" in note
    # With the pods gone, the unplaced job waits out the backoff, then places.
    unplaced = job(spec(), **{**status, "placement": []})
    waiting = lifecycle.decide(unplaced, [], at(7))
    assert waiting.actions == () and waiting.requeue_after is not None
    assert 0 < waiting.requeue_after <= 7.5
    later = lifecycle.decide(unplaced, [], at(6 + 9))
    assert [type(a).__name__ for a in later.actions] == ["Place"]


def test_the_budget_spent_fails_the_job_naming_the_nodes_and_the_count():
    raw, status = spec(disruptionRestartLimit=3), placed_status()
    for second, node in ((5, "n1"), (20, "n2"), (60, "n3")):
        _, status = cycle(raw, status, second, node)
        assert status["phase"] == "Restarting"
    decision, status = cycle(raw, status, 200, "n2")
    assert status["phase"] == "Failed"
    failed = conditions.find(status["conditions"], conditions.FAILED)
    assert failed is not None and failed["reason"] == disruption_budget.LIMIT_EXCEEDED
    message = failed["message"]
    assert "3 disruption restart(s) in a row" in message
    assert "disruptionRestartLimit=3" in message
    assert "n2 (2, UnexpectedAdmissionError)" in message and "n1 (1," in message
    assert "DeletePods" in [type(a).__name__ for a in decision.actions]


def test_the_issues_loop_stops_within_the_default_limit_and_spaces_its_restarts():
    """backoffLimit 0, a node refusing every pod: a bounded number of restarts, each later than the last."""
    status: dict[str, Any] = placed_status()
    second, waits = 5.0, []
    for _ in range(50):
        decision, status = cycle(spec(), status, second, node=f"n{len(waits) % 3 + 1}")
        if status["phase"] == "Failed":
            break
        waits.append(decision.requeue_after or 0.0)
        second += (decision.requeue_after or 0.0) + 1
    default = 10
    assert len(waits) == default and status["phase"] == "Failed"
    assert waits[0] == 0 and all(w > 0 for w in waits[1:])
    assert waits[1:] == sorted(waits[1:]) and max(waits) <= 1.5 * 300


def test_a_gang_that_ran_steadily_starts_the_count_again():
    raw = spec(disruptionRestartLimit=1)
    _, status = cycle(raw, placed_status(), 5)
    running = conditions.set(
        status["conditions"], conditions.RUNNING, conditions.TRUE, "AllPodsRunning", "", at(100)
    )
    steady = {**status, "conditions": running}
    # Disrupted soon after it started running: the streak goes on and the limit of 1 is spent.
    _, early = cycle(raw, steady, 100 + disruption_budget.STEADY_SECONDS - 1)
    assert early["phase"] == "Failed"
    # After STEADY_SECONDS of running: a new streak, restarted at once.
    decision, late = cycle(raw, steady, 100 + disruption_budget.STEADY_SECONDS)
    assert late["phase"] == "Restarting" and late["disruptions"]["streak"] == 1
    assert decision.requeue_after == 0


def test_a_job_failure_mixed_with_a_disruption_is_judged_by_the_backoff_limit():
    state = job(spec(), **placed_status())
    crashed = pod(0, "Failed", exit_code=1)
    decision = lifecycle.decide(state, [crashed, refused(1, 0, "n1")], at(5))
    failed = conditions.find(status_of(decision)["conditions"], conditions.FAILED)
    assert failed is not None and failed["reason"] == conditions.BACKOFF_LIMIT_EXCEEDED


def test_a_pod_gone_with_its_deleted_node_is_recorded_against_that_node():
    state = job(spec(), **placed_status())
    decision = lifecycle.decide(state, [pod(0, "Running")], at(5), None, frozenset({"n1"}))
    [entry] = status_of(decision)["disruptions"]["nodes"]
    assert entry["node"] == "n1" and entry["reason"] == "NodeDeleted"


def test_the_nodes_kept_are_bounded():
    raw, status = spec(disruptionRestartLimit=1000), placed_status()
    for i in range(disruption_budget.NODES_KEPT + 8):
        _, status = cycle(raw, status, 5 + i * 1000, node=f"m{i}")
    nodes = status["disruptions"]["nodes"]
    assert len(nodes) == disruption_budget.NODES_KEPT and nodes[-1]["node"] == f"m{i}"


@pytest.mark.parametrize("failures", [1, 2, 5, 40, 10_000])
def test_jittered_waits_stay_between_the_doubling_and_half_as_much_again(failures):
    ceiling = min(2.0 * 2 ** min(failures - 1, 62), 120.0)
    low = retries.jittered(failures, base=2.0, cap=120.0, fraction=0.0)
    high = retries.jittered(failures, base=2.0, cap=120.0, fraction=0.999)
    assert low == ceiling and ceiling < high < ceiling * (1 + retries.JITTER)


def test_retry_after_is_honoured_but_bounded_by_the_cap():
    assert retries.jittered(1, base=2.0, cap=120.0, fraction=0.0, retry_after=30.0) == 30.0
    assert retries.jittered(1, base=2.0, cap=120.0, fraction=0.0, retry_after=1e9) == 120.0
    assert retries.jittered(1, base=2.0, cap=120.0, fraction=0.0, retry_after=float("nan")) == 2.0
    assert retries.jittered(3, base=2.0, cap=120.0, fraction=0.0, retry_after=1.0) == 8.0


def test_the_jitter_of_a_pure_decision_is_fixed_per_key_and_spread_across_keys():
    assert retries.fraction_of("u1/3") == retries.fraction_of("u1/3")
    fractions = [retries.fraction_of(f"u{i}/1") for i in range(100)]
    assert all(0 <= f < 1 for f in fractions)
    assert len({int(f * 10) for f in fractions}) == 10  # every tenth of the range is hit


def test_the_limit_is_bounded_in_the_schema():
    field = run_policy.RunPolicy.model_fields["disruption_restart_limit"]
    assert field.default == 10
    with pytest.raises(ValueError, match="disruption"):
        run_policy.RunPolicy.model_validate({"disruptionRestartLimit": 10_000})


def test_a_limit_of_zero_fails_at_the_first_disruption():
    _, status = cycle(spec(disruptionRestartLimit=0), placed_status(), 5)
    assert status["phase"] == "Failed"
    failed = conditions.find(status["conditions"], conditions.FAILED)
    assert failed is not None and "disruptionRestartLimit=0" in failed["message"]


def test_time_left_is_read_from_the_status_only():
    state = job(spec(), phase="Restarting", restarts=2, disruptions={"notBefore": "garbage"})
    assert [type(a).__name__ for a in lifecycle.decide(state, [], at(0)).actions] == ["Place"]
    later = conditions.timestamp(at(30))
    state = job(spec(), phase="Restarting", restarts=2, disruptions={"notBefore": later})
    assert lifecycle.decide(state, [], at(0)).requeue_after == pytest.approx(30.0)


def test_what_the_restart_writes_is_a_valid_status_of_the_crd():
    _, status = cycle(spec(), placed_status(), 5)
    _, status = cycle(spec(), status, 6)
    written = api_status.TrainingJobStatus.model_validate(status)
    assert written.disruptions is not None and written.disruptions.streak == 2
    assert [n.node for n in written.excluded_nodes] == ["n1"]


def test_a_straggler_exclusion_is_kept_and_an_expired_exclusion_is_renewed():
    straggler = {"node": "n7", "reason": stragglers.REASON, "time": conditions.timestamp(at(0))}
    status = placed_status(excludedNodes=[straggler])
    _, status = cycle(spec(), status, 5)
    _, status = cycle(spec(), status, 6)
    assert [e["node"] for e in status["excludedNodes"]] == ["n7", "n1"]
    # A day later n1 may be used again; disrupting once more excludes it again.
    later = 6 + excluded_nodes.EXCLUSION_SECONDS + 1
    assert excluded_nodes.excluded(status, at(later)) == frozenset()
    _, status = cycle(spec(), status, later)
    assert [e["node"] for e in status["excludedNodes"]] == ["n7", "n1", "n1"]
    assert excluded_nodes.excluded(status, at(later + 1)) == {"n1"}
