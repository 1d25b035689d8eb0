"""Feasibility edge cases the differential test against kube-scheduler does not draw.

The expectations come from the Kubernetes documentation: the sidecar KEP's
worked example of a pod's effective request, the toleration matching rules of
the taints-and-tolerations page, and the operator's own rule that a NotReady
node takes no gang pod.
"""

from __future__ import annotations

import random

import pytest

from meshtrain.operator.cluster import informer
from meshtrain.operator.policy import capacity, feasibility


def _node(**status_and_spec) -> dict:
    node = {
        "metadata": {"name": "n", "labels": {"pool": "a"}},
        "spec": {"taints": status_and_spec.get("taints", [])},
        "status": {
            "allocatable": status_and_spec.get(
                "allocatable", {"cpu": "8", "memory": "32Gi", "pods": "10", "nvidia.com/gpu": "8"}
            ),
            "conditions": [{"type": "Ready", "status": status_and_spec.get("ready", "True")}],
        },
    }
    if status_and_spec.get("unschedulable"):
        node["spec"]["unschedulable"] = True
    return node


def _container(name: str, cpu: str, **extra) -> dict:
    return {"name": name, "resources": {"requests": {"cpu": cpu}}, **extra}


def test_sidecar_request_follows_the_kep_example():
    # KEP-753: init containers run in order; a sidecar keeps running and adds to everything after it
    pod = {
        "spec": {
            "initContainers": [
                _container("init-1", "1"),
                _container("sidecar", "2", restartPolicy="Always"),
                _container("init-2", "3"),  # runs next to the sidecar: 3 + 2 = 5
            ],
            "containers": [_container("main", "1")],  # main + sidecar = 3
        }
    }
    assert feasibility.pod_requests(pod)["cpu"] == 5000


def test_limits_stand_in_for_missing_requests_and_overhead_is_added():
    pod = {
        "spec": {
            "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "2"}}}],
            "overhead": {"cpu": "250m"},
        }
    }
    assert feasibility.pod_requests(pod) == {"nvidia.com/gpu": 2, "cpu": 250}


@pytest.mark.parametrize(
    ("toleration", "taint", "tolerated"),
    [
        (
            {"key": "k", "operator": "Exists"},
            {"key": "k", "value": "v", "effect": "NoSchedule"},
            True,
        ),
        ({"operator": "Exists"}, {"key": "any", "effect": "NoExecute"}, True),
        ({"key": "k", "value": "v"}, {"key": "k", "value": "w", "effect": "NoSchedule"}, False),
        (
            {"key": "k", "value": "v", "effect": "NoExecute"},
            {"key": "k", "value": "v", "effect": "NoSchedule"},
            False,
        ),
    ],
)
def test_toleration_matching(toleration, taint, tolerated):
    assert feasibility.tolerates(toleration, taint) is tolerated


def test_prefer_no_schedule_taints_do_not_filter():
    demand = feasibility.Demand(requests={"cpu": 1000}, tolerations=(), node_selector={})
    node = _node(taints=[{"key": "spot", "value": "y", "effect": "PreferNoSchedule"}])
    assert feasibility.verdict(demand, node, feasibility.Usage()) is None


def test_a_not_ready_node_is_refused_even_before_it_is_tainted():
    demand = feasibility.Demand(
        requests={}, tolerations=({"operator": "Exists"},), node_selector={}
    )
    assert feasibility.verdict(demand, _node(ready="False"), feasibility.Usage()) == (
        feasibility.NOT_READY
    )


def test_slots_count_pods_together_against_every_resource():
    demand = feasibility.Demand(
        requests={"nvidia.com/gpu": 2, "cpu": 3000}, tolerations=(), node_selector={}
    )
    used = feasibility.Usage(requested={"cpu": 1000}, pods=8)
    # 8 GPUs -> 4, cpu (8 - 1) / 3 -> 2, pod slots 10 - 8 -> 2
    assert feasibility.slots(demand, _node(), used, most=10) == 2
    assert feasibility.shortage(demand, _node(), used, 3) == "Too many pods"


def test_terminal_pods_hold_nothing():
    pods = [
        {"spec": {"containers": [_container("c", "4")]}, "status": {"phase": "Succeeded"}},
        {"spec": {"containers": [_container("c", "1")]}, "status": {"phase": "Running"}},
    ]
    assert feasibility.usage(pods) == feasibility.Usage(requested={"cpu": 1000}, pods=1)


def test_summary_reads_like_the_scheduler():
    text = feasibility.summary(["Insufficient cpu", "Insufficient cpu", "Too many pods"], 5)
    assert text == "2/5 nodes are available: 2 Insufficient cpu, 1 Too many pods."


def test_offered_nodes_judged_once_per_shared_part_equal_slots_node_by_node():
    """capacity.offered_nodes memoises the node-state verdict and allocatable per shared object;
    every node must still get what feasibility.slots and verdict (held equal to the scheduler by
    tests/integration/operator/test_feasibility_vs_scheduler.py) give it alone."""
    rng = random.Random(11)
    cache = informer.Cache()
    for index in range(300):
        taints = rng.choice([[], [], [{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]])
        cache.nodes.upsert(
            {
                "metadata": {
                    "name": f"n{index}",
                    "resourceVersion": "1",
                    "labels": {"pool": rng.choice(["a", "b"])},
                },
                "spec": {"taints": taints, "unschedulable": rng.random() < 0.1},
                "status": {
                    "allocatable": {"nvidia.com/gpu": rng.choice(["4", "8"]), "pods": "110"},
                    "conditions": [
                        {"type": "Ready", "status": rng.choice(["True", "True", "False"])}
                    ],
                },
            }
        )
    nodes = list(cache.nodes.values())
    used = {
        f"n{i}": feasibility.Usage({"nvidia.com/gpu": rng.randrange(0, 9)}, rng.randrange(0, 3))
        for i in range(0, 300, 2)
    }
    for _ in range(20):
        demand = feasibility.Demand(
            requests={"nvidia.com/gpu": rng.choice([1, 2, 4])},
            tolerations=tuple(rng.choice([[], [{"key": "dedicated", "operator": "Exists"}]])),
            node_selector=rng.choice([{}, {"pool": "a"}]),
        )
        offered, refused = capacity.offered_nodes(
            demand, nodes, used, gpus_per_pod=1, pods_wanted=16
        )
        expected = {}
        reasons = []
        for node in nodes:
            taken = used.get(node["metadata"]["name"], capacity.NOTHING)
            slots = feasibility.slots(demand, node, taken, 16)
            if slots:
                expected[node["metadata"]["name"]] = slots
            else:
                reasons.append(feasibility.verdict(demand, node, taken) or "no room")
        assert {n.name: n.allocatable_gpus for n in offered} == expected
        assert sorted(refused) == sorted(reasons)
