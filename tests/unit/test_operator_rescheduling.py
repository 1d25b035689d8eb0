"""Re-placement after kube-scheduler refused released pods: which refusals, how often, which nodes."""

from __future__ import annotations

import datetime

import pytest

from meshtrain.operator.policy import pod_state, rescheduling

TAINT = (
    "0/3 nodes are available: 1 node(s) had untolerated taint(s), "
    "2 node(s) didn't match Pod's node affinity/selector. preemption: 0/3 nodes are available: "
    "3 Preemption is not helpful for scheduling."
)
CLAIM = (
    '0/3 nodes are available: persistentvolumeclaim "c" not found. preemption: '
    "0/3 nodes are available: 3 Preemption is not helpful for scheduling."
)


NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
LONG_AGO = NOW - datetime.timedelta(seconds=rescheduling.PERSISTS_SECONDS + 1)


def pod(
    name: str,
    node: str,
    message: str | None,
    since: datetime.datetime = LONG_AGO,
    nominated: str | None = None,
    **facts: bool,
) -> pod_state.PodState:
    return pod_state.PodState(
        name=name,
        index=int(name[-1]),
        attempt=0,
        phase="Pending",
        gated=facts.get("gated", False),
        deleting=facts.get("deleting", False),
        created_at=None,
        node=node,
        bound=facts.get("bound", False),
        unschedulable_message=message,
        unschedulable_since=since,
        nominated=nominated,
    )


@pytest.mark.parametrize(
    ("message", "node_by_node"),
    [
        (TAINT, True),
        ("0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) didn't match", True),
        (CLAIM, False),
        ("0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims.", False),
    ],
)
def test_only_refusals_judged_node_by_node_count(message, node_by_node):
    assert rescheduling.about_the_node(message) is node_by_node


def test_refused_lists_released_unbound_pods_refused_node_by_node():
    pods = [
        pod("p0", "a", TAINT),
        pod("p1", "b", TAINT, gated=True),
        pod("p2", "c", TAINT, bound=True),
        pod("p3", "d", TAINT, deleting=True),
        pod("p4", "e", CLAIM),
        pod("p5", "f", None),
    ]
    assert rescheduling.refused(pods, NOW) == rescheduling.Refusals({"a": TAINT}, None)


def test_a_refusal_counts_once_it_lasted_and_never_while_preempting_on_the_planned_node():
    young = NOW - datetime.timedelta(seconds=4)
    pods = [
        pod("p0", "a", TAINT, since=young),
        pod("p1", "b", TAINT, nominated="b"),  # kube-scheduler preempts pods on b for it
        pod("p2", "c", TAINT, nominated="x"),  # nominated elsewhere: its planned node refused it
    ]
    found = rescheduling.refused(pods, NOW)
    assert found.nodes == {"c": TAINT}
    assert found.recheck_after == pytest.approx(rescheduling.PERSISTS_SECONDS - 4)


def test_re_placements_are_spaced_and_refused_nodes_left_out_for_a_while():
    first = rescheduling.replaced(None, ["a"], now=100.0)
    assert rescheduling.wait(first, 100.0) == rescheduling.SPACING_SECONDS
    assert rescheduling.wait(first, 100.0 + rescheduling.SPACING_SECONDS) is None
    assert rescheduling.excluded(first, 101.0) == {"a"}
    second = rescheduling.replaced(first, ["b"], now=110.0)
    assert rescheduling.wait(second, 110.0) == 2 * rescheduling.SPACING_SECONDS
    assert rescheduling.excluded(second, 111.0) == {"a", "b"}
    later = 100.0 + rescheduling.EXCLUDED_SECONDS
    assert rescheduling.returns_in(second, 111.0) == {"a": later - 111.0, "b": later - 101.0}
    assert rescheduling.excluded(second, later) == {"b"}
    assert rescheduling.returns_in(second, later) == {"b": 10.0}  # excluded at 110
    assert rescheduling.returns_in(second, later + 10.0) == {}
    assert rescheduling.returns_in(None, later) == {}
    many = second
    for _ in range(20):
        many = rescheduling.replaced(many, ["b"], now=later)
    assert rescheduling.wait(many, later) == rescheduling.SPACING_CAP_SECONDS
