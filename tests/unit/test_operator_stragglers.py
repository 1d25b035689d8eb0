"""runPolicy.stragglerPolicy in the operator: /progress -> status.straggler, and the state machine's reaction."""

from __future__ import annotations

import math
from typing import Any

import pytest

from meshtrain.api import loading
from meshtrain.operator.policy import (
    conditions,
    excluded_nodes,
    job_actions,
    lifecycle,
    placement_status,
    stragglers,
)
from tests.builders import JobBuilder
from tests.unit.test_operator_lifecycle import (
    at,
    condition,
    job,
    kinds,
    placed_status,
    pod,
    running_gang,
    status_of,
)


def spec_raw(action: str = "report", **policy: Any) -> dict[str, Any]:
    # dp4 with 2 GPUs per pod: ranks 0-1 on pod 0 (n0), ranks 2-3 on pod 1 (n1).
    return (
        JobBuilder()
        .layout(data=4, gpus_per_node=2)
        .checkpoint(claimName="ckpt")
        .run_policy(stragglerPolicy={"action": action, **policy})
        .raw()
    )


def report(rank: int | None, slowdown: float = 1.6, since: int = 40) -> dict[str, Any]:
    straggler = None if rank is None else {"rank": rank, "slowdown": slowdown, "since_step": since}
    return {"step": 50, "updated_at": "2026-01-01T12:00:00Z", "straggler": straggler}


def test_the_flagged_rank_is_mapped_to_its_pod_and_the_node_placement_chose():
    spec = loading.parse_spec(spec_raw())
    status = placed_status(phase="Running")
    changes = stragglers.observed(spec, status, report(3), at(5))
    assert changes == {
        "straggler": {
            "rank": 3,
            "podIndex": 1,
            "node": "n1",
            "slowdown": 1.6,
            "sinceStep": 40,
            "since": "2026-01-01T12:00:05Z",
        }
    }
    # Still flagged later: the first time seen is kept, the slowdown follows the report.
    later = stragglers.observed(spec, {**status, **changes}, report(3, 1.7), at(60))
    assert later["straggler"]["since"] == "2026-01-01T12:00:05Z"
    assert later["straggler"]["slowdown"] == 1.7
    # Another rank: a new since.
    other = stragglers.observed(spec, {**status, **changes}, report(0), at(90))
    assert other["straggler"]["node"] == "n0" and other["straggler"]["since"].endswith("01:30Z")
    # Gone: cleared; never there: nothing to write.
    assert stragglers.observed(spec, {**status, **changes}, report(None), at(99)) == {
        "straggler": None
    }
    assert stragglers.observed(spec, status, report(None), at(99)) == {}
    assert stragglers.observed(spec, status, {"step": 3}, at(99)) == {}  # an older trainer


@pytest.mark.parametrize(
    "bad",
    [{"rank": 9, "slowdown": 2.0}, {"rank": -1, "slowdown": 2.0}, {"rank": "1"}, {"rank": 1}],
)
def test_a_malformed_straggler_report_is_dropped(bad):
    spec = loading.parse_spec(spec_raw())
    assert stragglers.observed(spec, placed_status(), {"straggler": bad}, at(0)) == {}


def flagged(**extra: Any) -> dict[str, Any]:
    return placed_status(
        phase="Running",
        lastCheckpointStep=40,
        straggler={"rank": 3, "podIndex": 1, "node": "n1", "slowdown": 1.6, "sinceStep": 40},
        **extra,
    )


def test_report_sets_the_condition_and_emits_one_event_per_straggler():
    state = job(spec_raw("report"), **flagged())
    decision = lifecycle.decide(state, running_gang(), at(10))
    assert "DeletePods" not in kinds(decision)
    found = condition(decision, conditions.STRAGGLER)
    assert found["status"] == "True" and found["reason"] == conditions.STRAGGLER_DETECTED
    assert found["message"] == "rank 3 (pod 1 on node n1) is a straggler"
    [event] = [a for a in decision.actions if isinstance(a, job_actions.Emit)]
    assert event.reason == conditions.STRAGGLER_DETECTED and "1.6x" in event.message
    assert "since step 40" in event.message
    # The same rank on the same node flagged again from a later step (the trainer cleared and
    # re-flagged it between two polls): status follows, but no second Event.
    later = {**flagged(), **status_of(decision)}
    later["straggler"] = {**later["straggler"], "sinceStep": 52}
    again = lifecycle.decide(job(spec_raw("report"), **later), running_gang(), at(15))
    assert not [a for a in again.actions if isinstance(a, job_actions.Emit)]
    # Applied: the next pass (the slowdown moved) changes nothing and emits nothing.
    again = job(
        spec_raw("report"),
        **{**flagged(), **status_of(decision)},
    )
    assert kinds(lifecycle.decide(again, running_gang(), at(20))) == ["PollProgress"]
    # The straggler is gone: the condition turns False.
    cleared = job(spec_raw("report"), **{**flagged(), **status_of(decision), "straggler": None})
    gone = condition(lifecycle.decide(cleared, running_gang(), at(30)), conditions.STRAGGLER)
    assert gone["status"] == "False" and gone["reason"] == conditions.STRAGGLER_GONE


def test_replace_stops_the_gang_excludes_the_node_and_counts_no_restart():
    state = job(spec_raw("replace"), **flagged())
    [replace] = [
        a
        for a in lifecycle.decide(state, running_gang(), at(10)).actions
        if isinstance(a, job_actions.ReplaceStraggler)
    ]
    assert replace.nodes == ("n1",)
    # Nowhere to go without n1 (the reconciler plans it): only reported, the gang keeps running.
    kept = job_actions.Decision(replace.otherwise)
    assert kinds(kept) == ["SetStatus", "Emit"]
    found = condition(kept, conditions.STRAGGLER)
    assert found["status"] == "True" and found["reason"] == conditions.STRAGGLER_NO_REPLACEMENT
    assert "no placement without node n1" in found["message"]
    assert "excludedNodes" not in status_of(kept)
    decision = job_actions.Decision(replace.replaced)  # a placement without n1 fits
    assert kinds(decision)[-1] == "DeletePods"
    [deleted] = [a for a in decision.actions if isinstance(a, job_actions.DeletePods)]
    assert deleted.names == ("j-r0-0", "j-r0-1")
    assert deleted.grace_seconds is None  # the pods' own: time to checkpoint the step they stop at
    status = status_of(decision)
    assert status["phase"] == "Restarting" and status["placement"] == []
    assert status["straggler"] is None and status["stragglerReplacements"] == 1
    [excluded] = status["excludedNodes"]
    assert excluded["node"] == "n1" and excluded["reason"] == "Straggler"
    assert "rank 3" in excluded["message"] and "1.6x" in excluded["message"]
    assert "restarts" not in status
    replaced = condition(decision, conditions.STRAGGLER)
    assert replaced["reason"] == conditions.STRAGGLER_REPLACED
    assert "without node n1" in replaced["message"] and "step 40" in replaced["message"]
    assert condition(decision, conditions.RUNNING)["reason"] == conditions.STRAGGLER_REPLACED
    reasons = [a.reason for a in decision.actions if isinstance(a, job_actions.Emit)]
    assert reasons == [conditions.STRAGGLER_REPLACED]
    # The new gang waits for the old pods, then is placed (the reconciler leaves n1 out).
    after = job(spec_raw("replace"), **{**flagged(), **status})
    assert excluded_nodes.excluded(after.status, at(11)) == {"n1"}
    assert kinds(lifecycle.decide(after, [], at(11))) == ["Place"]


def test_replace_gives_up_after_max_replacements_and_only_reports():
    state = job(
        spec_raw("replace", maxReplacements=1),
        **flagged(stragglerReplacements=1, excludedNodes=[{"node": "n7", "reason": "Straggler"}]),
    )
    decision = lifecycle.decide(state, running_gang(), at(10))
    assert "DeletePods" not in kinds(decision)
    found = condition(decision, conditions.STRAGGLER)
    assert found["status"] == "True" and "maxReplacements=1" in found["message"]


def test_ignore_does_nothing_even_with_a_stale_straggler_in_status():
    decision = lifecycle.decide(job(spec_raw("ignore"), **flagged()), running_gang(), at(10))
    assert kinds(decision) == ["PollProgress"]


def test_a_failed_gang_restarts_without_its_straggler_and_a_stale_one_replaces_nothing():
    failed = [running_gang()[0], pod(1, "Failed", exit_code=1)]
    decision = lifecycle.decide(job(spec_raw("replace"), **flagged()), failed, at(10))
    status = status_of(decision)
    assert status["phase"] == "Restarting" and status["straggler"] is None
    # Every way to a new placement drops it too.
    placed = placement_status.placed(
        job(spec_raw("replace"), **flagged()), ["n2", "n3"], {}, at(11)
    )
    assert placed["straggler"] is None
    assert (
        placement_status.dropped(job(spec_raw(), **flagged()), at(11), "gone")["straggler"] is None
    )
    # An entry naming a node the placed gang is not on was measured on another gang: not acted on.
    moved = flagged(placement=[{"podIndex": 0, "node": "n2"}, {"podIndex": 1, "node": "n3"}])
    decision = lifecycle.decide(job(spec_raw("replace"), **moved), running_gang(), at(12))
    assert "DeletePods" not in kinds(decision) and "ReplaceStraggler" not in kinds(decision)
    assert not condition(decision, conditions.STRAGGLER)


def test_an_excluded_node_is_chosen_again_after_the_exclusion_expires():
    ttl = excluded_nodes.EXCLUSION_SECONDS
    status = {
        "excludedNodes": [
            {"node": "n1", "reason": "Straggler", "time": "2026-01-01T12:00:00Z"},
            {"node": "n2", "reason": "Straggler"},  # no time: stays excluded
        ]
    }
    assert excluded_nodes.excluded(status, at(ttl - 1)) == {"n1", "n2"}
    assert excluded_nodes.returns_in(status, at(ttl - 1)) == {"n1": 1.0, "n2": math.inf}
    assert excluded_nodes.excluded(status, at(ttl)) == {"n2"}
    assert excluded_nodes.returns_in(status, at(ttl)) == {"n2": math.inf}
    # Expired, the node may be replaced again if it is slow again (within maxReplacements).
    state = job(
        spec_raw("replace"),
        **flagged(
            stragglerReplacements=1,
            excludedNodes=[{"node": "n1", "reason": "Straggler", "time": "2026-01-01T12:00:00Z"}],
        ),
    )
    assert "ReplaceStraggler" not in kinds(lifecycle.decide(state, running_gang(), at(10)))
    assert "ReplaceStraggler" in kinds(lifecycle.decide(state, running_gang(), at(ttl + 10)))


def test_a_rank_slow_again_after_its_node_was_replaced_is_not_replaced_again():
    """Rank 3 was moved off n1 and is flagged on n2 too: the cause follows the rank, not the node."""
    state = job(spec_raw("replace", maxReplacements=3), **flagged())
    [replace] = [
        a
        for a in lifecycle.decide(state, running_gang(), at(10)).actions
        if isinstance(a, job_actions.ReplaceStraggler)
    ]
    first = status_of(job_actions.Decision(replace.replaced))
    assert first["excludedNodes"][0]["rank"] == 3
    again = {
        **flagged(),
        **first,
        "phase": "Running",
        "placement": [{"podIndex": 0, "node": "n0"}, {"podIndex": 1, "node": "n2"}],
        "straggler": {"rank": 3, "podIndex": 1, "node": "n2", "slowdown": 1.5, "sinceStep": 90},
    }
    decision = lifecycle.decide(
        job(spec_raw("replace", maxReplacements=3), **again), running_gang(), at(20)
    )
    assert "ReplaceStraggler" not in kinds(decision)
    found = condition(decision, conditions.STRAGGLER)
    assert found["status"] == "True" and found["reason"] == conditions.STRAGGLER_FOLLOWS_RANK
    assert "moved off node(s) n1" in found["message"]
    [event] = [a for a in decision.actions if isinstance(a, job_actions.Emit)]
    assert event.reason == conditions.STRAGGLER_FOLLOWS_RANK and "n2" in event.message
    # Another rank slow on n2 is still a node to replace.
    other = {**again, "straggler": {**again["straggler"], "rank": 2}}
    decision = lifecycle.decide(
        job(spec_raw("replace", maxReplacements=3), **other), running_gang(), at(20)
    )
    assert "ReplaceStraggler" in kinds(decision)


def test_every_flagged_rank_is_reported_and_their_nodes_left_out_in_one_rebuild():
    spec = loading.parse_spec(spec_raw("replace"))
    document = {
        **report(3),
        "stragglers": [
            {"rank": 3, "slowdown": 1.6, "since_step": 40},
            {"rank": 0, "slowdown": 1.4, "since_step": 44},
        ],
    }
    seen = stragglers.observed(spec, placed_status(phase="Running"), document, at(5))["straggler"]
    assert (seen["rank"], seen["node"]) == (3, "n1")
    assert seen["others"] == [{"rank": 0, "podIndex": 0, "node": "n0", "slowdown": 1.4}]
    state = job(spec_raw("replace"), **placed_status(phase="Running", straggler=seen))
    decision = lifecycle.decide(state, running_gang(), at(10))
    [replace] = [a for a in decision.actions if isinstance(a, job_actions.ReplaceStraggler)]
    assert replace.nodes == ("n1", "n0")
    status = status_of(job_actions.Decision(replace.replaced))
    assert [(e["node"], e["rank"]) for e in status["excludedNodes"]] == [("n1", 3), ("n0", 0)]
    assert "1.4x" in status["excludedNodes"][1]["message"]
    assert status["stragglerReplacements"] == 1  # one rebuild
    kept = condition(job_actions.Decision(replace.otherwise), conditions.STRAGGLER)
    assert "also flagged: rank 0 (pod 0 on node n0)" in kept["message"]
    assert "no placement without nodes n1, n0" in kept["message"]
    # maxReplacements caps the nodes one rebuild may take.
    capped = job(
        spec_raw("replace", maxReplacements=1), **placed_status(phase="Running", straggler=seen)
    )
    [one] = [
        a
        for a in lifecycle.decide(capped, running_gang(), at(10)).actions
        if isinstance(a, job_actions.ReplaceStraggler)
    ]
    assert one.nodes == ("n1",)
