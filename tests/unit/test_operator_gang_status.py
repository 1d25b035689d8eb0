"""Conditions read off the observed gang: Placed once every pod exists, the scheduler's refusals as they come."""

from __future__ import annotations

import datetime

from meshtrain.operator.policy import conditions, gang_status, pod_state

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
CLAIM = '0/4 nodes are available: persistentvolumeclaim "ckpt" not found.'


def pod(index: int, *, bound: bool = False, refused: str | None = None) -> pod_state.PodState:
    return pod_state.PodState(
        name=f"j-r0-{index}",
        index=index,
        attempt=0,
        phase="Pending",
        gated=False,
        deleting=False,
        created_at=NOW,
        node=f"n{index}",
        bound=bound,
        unschedulable_message=refused,
    )


def test_placed_only_once_every_pod_exists():
    partial = gang_status.observe([], [pod(0)], expected=2, now=NOW)
    assert conditions.find(partial.conditions, conditions.PLACED) is None
    whole = gang_status.observe([], [pod(0), pod(1)], expected=2, now=NOW)
    assert conditions.find(whole.conditions, conditions.PLACED)["status"] == conditions.TRUE


def test_a_refused_pod_is_reported_with_the_schedulers_message_and_one_event():
    first = gang_status.observe([], [pod(0, bound=True), pod(1, refused=CLAIM)], 2, NOW)
    scheduled = conditions.find(first.conditions, conditions.PODS_SCHEDULED)
    assert scheduled["status"] == conditions.FALSE
    assert scheduled["reason"] == conditions.FAILED_SCHEDULING and CLAIM in scheduled["message"]
    assert [e[1] for e in first.events] == [conditions.FAILED_SCHEDULING]
    again = gang_status.observe(
        first.conditions, [pod(0, bound=True), pod(1, refused=CLAIM)], 2, NOW
    )
    assert again.conditions == first.conditions and not again.events  # no write, no event storm


def test_all_bound_clears_the_refusal():
    refused = gang_status.observe([], [pod(0), pod(1, refused=CLAIM)], 2, NOW).conditions
    bound = gang_status.observe(refused, [pod(0, bound=True), pod(1, bound=True)], 2, NOW)
    scheduled = conditions.find(bound.conditions, conditions.PODS_SCHEDULED)
    assert (
        scheduled["status"] == conditions.TRUE and scheduled["reason"] == conditions.ALL_PODS_BOUND
    )
