"""The startup policy's rows, table-driven: from no placement to a released gang."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from meshtrain.operator.policy import (
    conditions,
    job_actions,
    job_state,
    lifecycle,
    placement_outcome,
    pod_state,
    situation,
    startup,
)
from tests.builders import JobBuilder

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
REFUSED = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def job(**status: Any) -> job_state.JobState:
    body = {
        "metadata": {"name": "j", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": JobBuilder().layout(data=2, gpus_per_node=1).raw(),
        "status": status,
    }
    return job_state.read(body)


PLACED = {
    "phase": "Placing",
    "placement": [{"podIndex": 0, "node": "n0"}, {"podIndex": 1, "node": "n1"}],
}


def pod(index: int, phase: str = "Pending", attempt: int = 0, **fields: Any) -> pod_state.PodState:
    return pod_state.PodState(
        **{
            "name": f"j-r{attempt}-{index}",
            "index": index,
            "attempt": attempt,
            "phase": phase,
            "gated": False,
            "deleting": False,
            "created_at": T0,
            "node": f"n{index}",
            **fields,
        }
    )


def refused(index: int, since: float) -> pod_state.PodState:
    return pod(index, unschedulable_message=REFUSED, unschedulable_since=at(since))


CASES = [
    # name, job, pods, now, the rule that decides, action kinds, requeue_after
    ("no placement, no pod: the gang is placed", job(), [], 0, startup.PLACE, ["Place"], None),
    (
        "an earlier attempt's pod is deleted, and the gang placed",
        job(restarts=1),
        [pod(0, "Running")],
        0,
        startup.PLACE,
        ["DeletePods", "Place"],
        None,
    ),
    (
        "no placement, a pod of the attempt still runs: deleted, and waited for",
        job(),
        [pod(0, "Running")],
        0,
        startup.OLD_PODS_LEAVING,
        ["DeletePods", "SetStatus"],
        situation.LEAVING_RECHECK_SECONDS,
    ),
    (
        "no placement, a pod of the attempt terminating: waited for",
        job(),
        [pod(0, "Running", deleting=True)],
        0,
        startup.OLD_PODS_LEAVING,
        ["SetStatus"],
        situation.LEAVING_RECHECK_SECONDS,
    ),
    (
        "a pod missing from the still-gated gang is re-created",
        job(**PLACED),
        [pod(0, gated=True)],
        0,
        startup.RECREATE_MISSING,
        ["Place"],
        None,
    ),
    (
        "the whole gang exists, gated: Placed=True, gates lifted",
        job(**PLACED),
        [pod(0, gated=True), pod(1, gated=True)],
        0,
        startup.WAITING,
        ["SetStatus", "LiftGates"],
        600.0,  # startupTimeoutSeconds after the first pod
    ),
    (
        "a released pod refused long enough: FailedScheduling, placed again",
        job(**PLACED),
        [pod(0, "Running", bound=True), refused(1, since=-60)],
        0,
        startup.SCHEDULER_REFUSED,
        ["Emit", "SetStatus", "ReplaceRefused"],
        None,
    ),
    (
        "a released pod refused just now: FailedScheduling, looked at again when it lasted",
        job(**PLACED),
        [pod(0, "Running", bound=True), refused(1, since=-4)],
        0,
        startup.WAITING,
        ["Emit", "SetStatus"],
        6.0,
    ),
    (
        "released pods still pending: looked at again at the startup timeout",
        job(**PLACED),
        [pod(0, "Running", bound=True), pod(1, bound=True)],
        100,
        startup.WAITING,
        ["SetStatus"],
        500.0,
    ),
]


@pytest.mark.parametrize(
    ("name", "state", "pods", "now", "rule", "kinds", "requeue"), CASES, ids=[c[0] for c in CASES]
)
def test_startup_rows(name, state, pods, now, rule, kinds, requeue):
    seen = situation.Situation(state, tuple(pods), at(now))
    decides = next(r for r in lifecycle.RULES if isinstance(r, situation.Rule) and r.when(seen))
    assert decides is rule
    decision = lifecycle.decide(state, pods, at(now))
    assert [type(a).__name__ for a in decision.actions] == kinds
    assert decision.requeue_after == requeue


def test_a_missing_pod_is_recreated_on_its_recorded_node_only_while_the_gang_is_gated():
    [recreate] = lifecycle.decide(job(**PLACED), [pod(0, gated=True)], T0).actions
    assert isinstance(recreate, job_actions.Place) and recreate.missing == (1,)
    released = lifecycle.decide(job(**PLACED), [pod(0, "Running")], T0)
    [restart] = [a for a in released.actions if isinstance(a, job_actions.SetStatus)]
    assert restart.changes["phase"] == "Restarting"  # a failure, not a re-creation


def test_the_wait_for_a_previous_gang_names_each_pod_and_is_said_once():
    pods = [pod(1, "Failed", deleting=True), pod(0, "Running", deleting=True, bound=True)]
    waiting = placement_outcome.old_gang_leaving(job(), pods, T0)
    assert waiting.reason == conditions.OLD_PODS_TERMINATING and waiting.news
    assert waiting.message.endswith(": j-r0-0 (terminating on n0), j-r0-1 (Failed)")
    said = job(**waiting.status)
    assert not placement_outcome.old_gang_leaving(said, pods, at(5)).news
    assert lifecycle.decide(said, pods, at(5)).actions == ()  # the row says it once too
