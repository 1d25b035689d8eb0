"""Kueue TAS's topologyAssignment bounds meshtrain's plan: decoding, request, restriction, conflicts.

The decoding cases are Kueue v0.17.0's own (pkg/util/tas/tas_assignment_test.go,
``bothWaysTestCases``): the compressed v1beta2 form on one side, the domains Kueue means on the
other.  The placement cases plan with the real planner on the restricted nodes and compare
what lands in each domain with the counts Kueue assigned.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import datetime
import pathlib
from collections import Counter
from typing import Any

import pytest

from meshtrain import placement
from meshtrain.api import loading
from meshtrain.operator.cluster import api_errors, workloads
from meshtrain.operator.policy import (
    builders,
    conditions,
    identity,
    job_actions,
    job_state,
    kueue_reassigned,
    kueue_topology,
    kueue_workload,
    lifecycle,
    placement_outcome,
)
from meshtrain.planner import placement_request
from tests.builders import JobBuilder
from tests.unit import test_operator_lifecycle

NOW = datetime.datetime(2026, 1, 1, 12, tzinfo=datetime.UTC)
RACK, HOST = "network.topology.nvidia.com/leaf", "kubernetes.io/hostname"
BLOCK = "network.topology.nvidia.com/block"
OPERATOR = pathlib.Path(__file__).parents[2] / "operator" / "meshtrain" / "operator"

# Kueue's bothWaysTestCases: (v1beta2 topologyAssignment, [(values, count)]).
KUEUE_CASES = [
    ({"levels": ["a", "b"], "slices": []}, []),
    (
        {
            "levels": ["a", "b"],
            "slices": [
                {
                    "domainCount": 1,
                    "podCounts": {"universal": 1},
                    "valuesPerLevel": [{"universal": "a1"}, {"universal": "b1"}],
                }
            ],
        },
        [(("a1", "b1"), 1)],
    ),
    (
        {
            "levels": ["a", "b"],
            "slices": [
                {
                    "domainCount": 2,
                    "podCounts": {"universal": 1},
                    "valuesPerLevel": [
                        {"individual": {"prefix": "a", "roots": ["1", "2"]}},
                        {"individual": {"prefix": "b", "roots": ["1", "2"]}},
                    ],
                }
            ],
        },
        [(("a1", "b1"), 1), (("a2", "b2"), 1)],
    ),
    (
        {
            "levels": ["a", "b"],
            "slices": [
                {
                    "domainCount": 2,
                    "podCounts": {"individual": [1, 2]},
                    "valuesPerLevel": [
                        {"individual": {"prefix": "p.a", "suffix": ".s", "roots": ["1", "2"]}},
                        {"individual": {"prefix": "p.b", "suffix": ".s", "roots": ["1", "2"]}},
                    ],
                }
            ],
        },
        [(("p.a1.s", "p.b1.s"), 1), (("p.a2.s", "p.b2.s"), 2)],
    ),
    (
        {
            "levels": ["a", "b"],
            "slices": [
                {
                    "domainCount": 2,
                    "podCounts": {"individual": [1, 2]},
                    "valuesPerLevel": [
                        {"universal": "a1"},
                        {"individual": {"roots": ["x", "y"]}},
                    ],
                }
            ],
        },
        [(("a1", "x"), 1), (("a1", "y"), 2)],
    ),
]


def _one_level(level: dict[str, Any], *values: str) -> tuple[dict[str, Any], list[Any]]:
    """A one-level, one-slice case of one pod per domain: ``level``'s values, and the domains."""
    piece = {"domainCount": len(values), "podCounts": {"universal": 1}, "valuesPerLevel": [level]}
    return {"levels": ["a"], "slices": [piece]}, [((value,), 1) for value in values]


# Kueue's bothWaysTestCases (the other five): one level, shrinking prefixes and suffixes.
KUEUE_CASES += [
    _one_level(
        {"individual": {"prefix": "a1", "roots": ["23", "2", "", "3"]}}, "a123", "a12", "a1", "a13"
    ),  # fmt: skip
    _one_level(
        {"individual": {"suffix": "3b", "roots": ["12", "2", "", "1"]}}, "123b", "23b", "3b", "13b"
    ),  # fmt: skip
    _one_level(
        {"individual": {"prefix": "ab", "suffix": "acada", "roots": ["ac", ""]}},
        "abacacada",
        "abacada",
    ),  # fmt: skip
    _one_level({"individual": {"suffix": "aba", "roots": ["ab", ""]}}, "ababa", "aba"),
    _one_level({"individual": {"suffix": "aba", "roots": ["", "ab"]}}, "aba", "ababa"),
]
# Kueue's oneWayTestCases: several slices (forms Kueue reads, though it does not write them yet).
KUEUE_CASES += [
    (
        {
            "levels": ["a", "b"],
            "slices": [
                {
                    "domainCount": 1,
                    "podCounts": {"individual": [1]},
                    "valuesPerLevel": [
                        {"individual": {"roots": ["a"]}},
                        {"individual": {"roots": ["b"]}},
                    ],
                },
                {
                    "domainCount": 2,
                    "podCounts": {"individual": [2, 3]},
                    "valuesPerLevel": [
                        {"individual": {"roots": ["c", "e"]}},
                        {"individual": {"roots": ["d", "f"]}},
                    ],
                },
            ],
        },
        [(("a", "b"), 1), (("c", "d"), 2), (("e", "f"), 3)],
    ),
    (
        {
            "levels": ["a", "b"],
            "slices": [
                {
                    "domainCount": 2,
                    "podCounts": {"individual": [2, 3]},
                    "valuesPerLevel": [
                        {"universal": "a1"},
                        {"individual": {"roots": ["1", "2"], "prefix": "b", "suffix": "-s"}},
                    ],
                },
                {
                    "domainCount": 3,
                    "podCounts": {"universal": 5},
                    "valuesPerLevel": [
                        {"individual": {"roots": ["2", "3", "4"], "prefix": "a"}},
                        {"individual": {"roots": ["x", "y", "z"], "suffix": "-t"}},
                    ],
                },
                {
                    "domainCount": 2,
                    "podCounts": {"universal": 10},
                    "valuesPerLevel": [{"universal": "a10"}, {"universal": "b10"}],
                },
            ],
        },
        [
            (("a1", "b1-s"), 2),
            (("a1", "b2-s"), 3),
            (("a2", "x-t"), 5),
            (("a3", "y-t"), 5),
            (("a4", "z-t"), 5),
            (("a10", "b10"), 10),
            (("a10", "b10"), 10),
        ],
    ),
]


@pytest.mark.parametrize(("compressed", "domains"), KUEUE_CASES)
def test_kueue_s_compressed_assignment_reads_as_kueue_expands_it(
    compressed: dict[str, Any], domains: list[tuple[tuple[str, ...], int]]
) -> None:
    read = kueue_topology.read(compressed)
    assert read is not None and read.levels == tuple(compressed["levels"])
    assert [(d.values, d.count) for d in read.domains] == domains


def test_no_assignment_reads_as_none() -> None:
    assert kueue_topology.read(None) is None
    assert kueue_topology.read({}) is None


def _admitted_workload(assignment: dict[str, Any] | None) -> dict[str, Any]:
    pod_set: dict[str, Any] = {"name": kueue_workload.POD_SET, "count": 4, "flavors": {"nvidia.com/gpu": "tas"}}  # fmt: skip
    if assignment is not None:
        pod_set["topologyAssignment"] = assignment
    return {
        "metadata": {"name": "w"},
        "status": {
            "conditions": [{"type": kueue_workload.ADMITTED, "status": "True"}],
            "admission": {"clusterQueue": "cq", "podSetAssignments": [pod_set]},
        },
    }


def test_an_admitted_workload_carries_its_pod_set_s_topology_assignment() -> None:
    found = kueue_workload.state(_admitted_workload(KUEUE_CASES[3][0]))
    assert isinstance(found, kueue_workload.Admitted)
    assert found.topology is not None and found.topology.total == 3
    plain = kueue_workload.state(_admitted_workload(None))
    assert isinstance(plain, kueue_workload.Admitted) and plain.topology is None


def _spec(**topology: Any) -> Any:
    builder = JobBuilder().layout(data=8, pipeline=2, gpus_per_node=4)
    if topology:
        builder.topology(**topology)
    return loading.parse_spec(builder.raw())


def test_a_required_fabric_level_is_kueue_s_required_level() -> None:
    spec = _spec(levels=[{"label": BLOCK, "mode": "required"}, {"label": RACK}])
    request = kueue_topology.topology_request(spec, (BLOCK, RACK, HOST), 4)
    assert request == {"required": BLOCK}


def test_without_a_required_level_kueue_is_asked_to_prefer_the_lowest_fabric_level() -> None:
    spec = _spec(levels=[{"label": BLOCK}, {"label": RACK}])
    assert kueue_topology.topology_request(spec, (BLOCK, RACK, HOST), 4) == {"preferred": RACK}
    # Levels the Topology lacks are never named (Kueue would refuse the flavor).
    assert kueue_topology.topology_request(spec, (BLOCK, HOST), 4) == {"preferred": BLOCK}
    # Nothing in spec.topology: the Topology's lowest level above the hostname.
    assert kueue_topology.topology_request(_spec(), (BLOCK, RACK, HOST), 4) == {"preferred": RACK}


def test_each_pipeline_stage_is_a_slice_required_in_one_nvlink_domain() -> None:
    clique = "nvidia.com/gpu.clique"
    raw = JobBuilder().layout(data=8, pipeline=2, gpus_per_node=4)  # 2 pods per stage
    spec = loading.parse_spec(raw.topology(nvlinkDomainLabel=clique).raw())
    request = kueue_topology.topology_request(spec, (BLOCK, clique, HOST), 4)
    assert request == {
        "preferred": clique,
        "podSetSliceRequiredTopology": clique,
        "podSetSliceSize": 2,
    }
    # Slices that do not divide the pod set (a spare) are not asked for, nor without the label.
    assert "podSetSliceSize" not in kueue_topology.topology_request(spec, (clique, HOST), 5)
    assert "podSetSliceSize" not in kueue_topology.topology_request(spec, (BLOCK, HOST), 4)


def test_the_slice_is_never_asked_above_the_pod_set_s_level() -> None:
    # Kueue v0.17.0 refuses a podSetSliceRequiredTopology above the pod set's level
    # (tas_flavor_snapshot.go: "podset slice topology X is above the podset topology Y") and
    # never admits the job: with the leaf required, the clique above it is no slice level.
    clique = "nvidia.com/gpu.clique"
    raw = JobBuilder().layout(data=8, pipeline=2, gpus_per_node=4)
    spec = loading.parse_spec(
        raw.topology(nvlinkDomainLabel=clique, levels=[{"label": RACK, "mode": "required"}]).raw()
    )
    request = kueue_topology.topology_request(spec, (BLOCK, clique, RACK, HOST), 4)
    assert request == {"required": RACK}
    # The clique below the required leaf: the slice is asked for.
    below = kueue_topology.topology_request(spec, (BLOCK, RACK, clique, HOST), 4)
    assert below == {
        "required": RACK,
        "podSetSliceRequiredTopology": clique,
        "podSetSliceSize": 2,
    }


def test_the_lowest_level_is_the_topology_s_lowest_whatever_the_spec_s_order() -> None:
    required = _spec(levels=[{"label": RACK, "mode": "required"}, {"label": BLOCK, "mode": "required"}])  # fmt: skip
    assert kueue_topology.topology_request(required, (BLOCK, RACK, HOST), 4) == {"required": RACK}
    preferred = _spec(levels=[{"label": RACK}, {"label": BLOCK}])
    assert kueue_topology.topology_request(preferred, (BLOCK, RACK, HOST), 4) == {"preferred": RACK}


def test_the_workload_asks_for_topology_only_on_a_tas_queue() -> None:
    spec = _spec(levels=[{"label": RACK, "mode": "required"}])
    ref = identity.JobRef("ns", "j", "u1")
    pod = builders.build_pod(ref, spec, 0, 0, "")
    queue = kueue_workload.Queue("q", None)
    priority = kueue_workload.Priority(0)
    plain = kueue_workload.build_workload(ref, spec, queue, pod, priority)
    assert "topologyRequest" not in plain["spec"]["podSets"][0]
    tas = kueue_workload.build_workload(ref, spec, queue, pod, priority, (RACK, HOST))
    assert tas["spec"]["podSets"][0]["topologyRequest"] == {"required": RACK}


def _nodes(racks: int, per_rack: int, gpus: int = 4) -> list[placement.Node]:
    return [
        placement.Node(f"r{r}-n{n}", gpus, {RACK: f"rack{r}", HOST: f"r{r}-n{n}"})
        for r in range(racks)
        for n in range(per_rack)
    ]


def _assignment(levels: tuple[str, ...], domains: dict[tuple[str, ...], int]) -> Any:
    return kueue_topology.Assignment(
        levels, tuple(kueue_topology.Domain(v, c) for v, c in domains.items())
    )


def _per_domain(nodes: tuple[str, ...], offered: list[placement.Node], levels: Any) -> Counter[Any]:
    labels = {n.name: n.labels for n in offered}
    return Counter(tuple(labels[name][level] for level in levels) for name in nodes)


def test_the_plan_fills_each_assigned_rack_with_exactly_its_count() -> None:
    spec = _spec(levels=[{"label": RACK}])  # dp8 x pp2 on 4-GPU pods: 4 pods
    offered = _nodes(racks=3, per_rack=4)
    assignment = _assignment((RACK,), {("rack0",): 1, ("rack2",): 3})
    kept = kueue_topology.restrict(offered, assignment, gpus_per_pod=4)
    plan = placement.plan(placement_request.request_from_spec(spec), kept, [])
    assert isinstance(plan, placement.Placement)
    assert _per_domain(plan.nodes, offered, (RACK,)) == {("rack0",): 1, ("rack2",): 3}


def test_hostname_domains_cap_each_node_at_its_count_and_the_cost_model_orders_the_ranks() -> None:
    # Kueue assigns two nodes of rack0 and two of rack1, listed interleaved; inside that the
    # planner keeps each pipeline stage's data-parallel pods (the all-reduce) in one rack.
    spec = loading.parse_spec(
        JobBuilder()
        .layout(data=8, pipeline=2, gpus_per_node=4)
        .topology(levels=[{"label": RACK}])
        .raw()
    )
    offered = _nodes(racks=2, per_rack=3, gpus=8)
    hosts = {("r0-n0",): 1, ("r1-n1",): 1, ("r0-n2",): 1, ("r1-n2",): 1}
    assignment = _assignment((HOST,), hosts)
    kept = kueue_topology.restrict(offered, assignment, gpus_per_pod=4)
    assert {n.name: n.allocatable_gpus for n in kept} == {n[0]: 4 for n in hosts}
    request = placement_request.request_from_spec(spec)
    plan = placement.plan(request, kept, [])
    assert isinstance(plan, placement.Placement)
    assert _per_domain(plan.nodes, offered, (HOST,)) == hosts
    rack_of = {n.name: n.labels[RACK] for n in offered}
    layout = spec.parallelism.layout
    for stage in range(2):
        pods = [p for p in range(4) if layout.stages_of_pod(p, 4) == [stage]]
        assert len(pods) == 2 and len({rack_of[plan.nodes[p]] for p in pods}) == 1
    in_kueue_order = sorted(kept, key=lambda n: list(hosts).index((n.name,)))
    blind = placement.first_fit(request, in_kueue_order, [])  # pods in Kueue's domain order
    assert isinstance(blind, placement.Placement)
    assert plan.level_bytes[RACK] < blind.level_bytes[RACK]


def _job(spec_raw: dict[str, Any]) -> job_state.JobState:
    body = {"metadata": {"name": "j", "namespace": "ns", "uid": "u1", "generation": 1}, "spec": spec_raw, "status": {}}  # fmt: skip
    return job_state.read(body)


def _placed(nodes: tuple[str, ...]) -> placement_outcome.Placed:
    return placement_outcome.Placed({}, loading.parse_spec(_raw()), nodes, None, "placed")


def _raw() -> dict[str, Any]:
    return (
        JobBuilder()
        .layout(data=8, pipeline=2, gpus_per_node=4)
        .topology(levels=[{"label": RACK, "mode": "required"}])
        .raw()
    )


def test_a_required_level_kueue_split_is_a_conflict_not_a_silent_placement() -> None:
    # Kueue assigned two racks; meshtrain requires the whole gang in one: the planner finds no
    # place inside the assignment, and the job waits with TopologyAssignmentConflict.
    job = _job(_raw())
    offered = _nodes(racks=2, per_rack=4)
    assignment = _assignment((RACK,), {("rack0",): 2, ("rack1",): 2})
    kept = kueue_topology.restrict(offered, assignment, gpus_per_pod=4)
    assert job.spec is not None
    answer = placement.plan(placement_request.request_from_spec(job.spec), kept, [])
    assert isinstance(answer, placement.Unschedulable)
    unplaced = placement_outcome.unplaced(job, answer.reason, answer.message, NOW)
    judged = placement_outcome.within_assignment(unplaced, job, assignment, offered, NOW)
    assert isinstance(judged, placement_outcome.Unplaced)
    assert judged.reason == kueue_topology.CONFLICT
    assert "rack0=2" in judged.message and answer.reason in judged.message
    placed = conditions.find(judged.status["conditions"], conditions.PLACED)
    assert placed is not None and placed["reason"] == kueue_topology.CONFLICT


def test_a_plan_outside_or_short_of_the_assignment_is_a_conflict() -> None:
    job = _job(_raw())
    offered = _nodes(racks=2, per_rack=4)
    assignment = _assignment((RACK,), {("rack0",): 4})
    inside = _placed(("r0-n0", "r0-n1", "r0-n2", "r0-n3"))
    assert placement_outcome.within_assignment(inside, job, assignment, offered, NOW) is inside
    outside = placement_outcome.within_assignment(_placed(("r0-n0", "r0-n1", "r0-n2", "r1-n0")), job, assignment, offered, NOW)  # fmt: skip
    assert isinstance(outside, placement_outcome.Unplaced)
    assert "outside Kueue's assigned domains" in outside.message
    short = placement_outcome.within_assignment(
        _placed(("r0-n0", "r0-n1")), job, assignment, offered, NOW
    )
    assert isinstance(short, placement_outcome.Unplaced) and "exactly" in short.message


def test_gang_pods_are_marked_tas_managed_and_as_pods_of_their_workload() -> None:
    # Kueue finds a Workload's pods on a node only by the kueue.x-k8s.io/workload annotation
    # (v0.17.0 pkg/controller/core/indexer IndexPodWorkloadSliceName), which it sets on its own
    # TAS pods (jobframework/reconciler.go getPodSetsInfoFromStatus) to the Workload's name.
    pod = {"metadata": {"name": "p", "annotations": {"a": "b"}}, "spec": {}}
    marked = kueue_topology.mark(pod, "trainingjob-j")
    assert marked["metadata"]["annotations"] == {
        "a": "b",
        "kueue.x-k8s.io/podset-unconstrained-topology": "true",
        "kueue.x-k8s.io/workload": "trainingjob-j",
    }
    assert pod["metadata"]["annotations"] == {"a": "b"}


def test_a_created_pod_is_marked_under_an_assignment_and_only_then() -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"containers": []}}
    where = kueue_workload.Assignment({"pool": "a"})
    assignment = _assignment((RACK,), {("rack0",): 4})
    under = kueue_workload.gang_pod(pod, where, job="j", topology=assignment)
    assert under["metadata"]["annotations"]["kueue.x-k8s.io/workload"] == (
        kueue_workload.workload_name("j")
    )
    assert under["spec"]["nodeSelector"] == {"pool": "a"}
    plain = kueue_workload.gang_pod(pod, where, job="j", topology=None)
    assert "annotations" not in plain["metadata"]
    assert plain == kueue_workload.assign(pod, where)


# Every path that creates pods (module: the functions that build them) and must pass Kueue's
# assignment on: the gang (Place), crash recovery, spares, lone replacements.
POD_CREATORS = {
    "placing.py": {"_place_gang", "_recreate_missing"},
    "sparing.py": {"_reserve"},
    "replacing.py": {"_pod"},
}


def _calls(tree: ast.AST, module: str, name: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == module
    ]


@pytest.mark.parametrize("module", sorted(POD_CREATORS))
def test_every_pod_creating_path_marks_its_pods_under_an_assignment(module: str) -> None:
    # A pod the operator creates is either a demand template (never created) or goes through
    # kueue_workload.gang_pod with the action's assignment: a lone replacement left unmarked is
    # counted twice by Kueue (TAS usage of the Workload and non-TAS usage of its node).
    tree = ast.parse((OPERATOR / module).read_text())
    functions = {
        node.name: node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    for name in POD_CREATORS[module]:
        created = _calls(functions[name], "kueue_workload", "gang_pod")
        assert created, f"{module}:{name} creates pods without kueue_workload.gang_pod"
        for call in created:
            topology = [k.value for k in call.keywords if k.arg == "topology"]
            assert topology and not (
                isinstance(topology[0], ast.Constant) and topology[0].value is None
            ), f"{module}:{name} drops Kueue's assignment"
        assert not _calls(functions[name], "kueue_topology", "mark")


def test_spares_take_only_what_the_gang_left_of_each_assigned_domain() -> None:
    # Kueue counted 4 gang pods and 2 spares: rack0=3, rack1=3. The gang holds 3 in rack0 and
    # 1 in rack1 (two spares allowed short), a spare already sits in rack1: one spare slot is
    # left, in rack1, whatever room rack0 and rack2 have.
    offered = _nodes(racks=3, per_rack=3)
    labels = {n.name: n.labels for n in offered}
    assignment = _assignment((RACK,), {("rack0",): 3, ("rack1",): 3})
    free = {n.name: 1 for n in offered if n.name != "r1-n0"}
    used = ["r0-n0", "r0-n1", "r0-n2", "r1-n0", "r1-n0"]
    assert kueue_topology.spare_room(free, used, labels, assignment) == {"r1-n1": 1}


def test_the_admitted_assignment_reaches_the_placement_the_state_machine_decides() -> None:
    admitted = kueue_workload.state(_admitted_workload(KUEUE_CASES[3][0]))
    assert isinstance(admitted, kueue_workload.Admitted)
    lifecycle_job, t0 = test_operator_lifecycle.job(), test_operator_lifecycle.T0
    decision = lifecycle.decide(lifecycle_job, [], t0, kueue_workload.Gate(admitted))
    [place] = [a for a in decision.actions if isinstance(a, job_actions.Place)]
    assert place.topology == admitted.topology


def _hosts(*hosts: str) -> kueue_topology.Assignment:
    return kueue_topology.Assignment((HOST,), tuple(kueue_topology.Domain((h,), 1) for h in hosts))


HOST_LABELS = {f"n{i}": {HOST: f"n{i}"} for i in range(4)}


def test_pods_outside_or_beyond_the_assignment_are_misplaced() -> None:
    racks = _assignment((RACK,), {("rack0",): 2, ("rack1",): 1})
    labels = {"a": {RACK: "rack0"}, "b": {RACK: "rack0"}, "c": {RACK: "rack1"}, "d": {RACK: "rack2"}}  # fmt: skip
    # Pod 3 outside; pod 2 the third in rack0 (two assigned): the lower indices keep their slots.
    assert kueue_topology.misplaced({0: "a", 1: "b", 2: "a", 3: "d"}, labels, racks) == (2, 3)
    assert kueue_topology.misplaced({0: "a", 1: "b", 2: "c"}, labels, racks) == ()
    # A node not known here (gone: another rule's) is not judged.
    assert kueue_topology.misplaced({0: "a", 1: "gone"}, labels, racks) == ()


def _running_under(
    assignment: kueue_topology.Assignment, **run_policy: Any
) -> tuple[job_state.JobState, list[Any], kueue_workload.Gate]:
    raw = JobBuilder().layout(data=3, gpus_per_node=1).run_policy(**run_policy).raw()
    status = test_operator_lifecycle.placed_status(
        phase="Running", placement=[{"podIndex": i, "node": f"n{i}"} for i in range(3)]
    )
    job = test_operator_lifecycle.job(raw, **status)
    pods = [
        dataclasses.replace(test_operator_lifecycle.pod(i, "Running"), rejoins=True)
        for i in range(3)
    ]
    gate = kueue_workload.Gate(kueue_workload.Admitted("cq", topology=assignment))
    return job, pods, gate


def test_a_pod_kueue_moved_out_of_the_assignment_is_replaced_alone_inside_the_new_one() -> None:
    # Kueue's TASFailedNodeReplacement rewrote the assignment: n2 -> n3 while pod 2 runs on n2.
    moved = _hosts("n0", "n1", "n3")
    job, pods, gate = _running_under(moved)
    at = test_operator_lifecycle.at(5)
    decision = lifecycle.decide(job, pods, at, gate, node_labels=HOST_LABELS)
    [replace] = [a for a in decision.actions if isinstance(a, job_actions.ReplacePods)]
    assert replace.indices == (2,) and replace.doomed == ("j-r0-2",)
    assert replace.avoid == ("n2",) and replace.topology == moved
    assert [c[2].split(":")[0] for c in replace.causes] == [kueue_reassigned.REASSIGNED]
    # The replacement's room is what the survivors left of the new assignment: n3 only.
    free = {"n2": 1, "n3": 1}
    assert kueue_topology.spare_room(free, ["n0", "n1"], HOST_LABELS, moved) == {"n3": 1}
    # Where no node takes it, the gang is rebuilt (a disruption: not counted in backoffLimit).
    otherwise = test_operator_lifecycle.status_of(job_actions.Decision(replace.otherwise))
    assert otherwise["restarts"] == 1
    # Inside the assignment nothing is replaced.
    kept = lifecycle.decide(job, pods, at, kueue_workload.Gate(kueue_workload.Admitted("cq", topology=_hosts("n0", "n1", "n2"))), node_labels=HOST_LABELS)  # fmt: skip
    assert not [a for a in kept.actions if isinstance(a, job_actions.ReplacePods)]
    assert test_operator_lifecycle.status_of(kept).get("restarts") is None


def test_pod_0_or_a_gang_that_cannot_rejoin_moved_by_kueue_rebuilds_the_gang() -> None:
    at = test_operator_lifecycle.at(5)
    job, pods, gate = _running_under(_hosts("n3", "n1", "n2"))  # pod 0's node left
    decision = lifecycle.decide(job, pods, at, gate, node_labels=HOST_LABELS)
    assert not [a for a in decision.actions if isinstance(a, job_actions.ReplacePods)]
    status = test_operator_lifecycle.status_of(decision)
    assert status["restarts"] == 1 and status["disruptionRestarts"] == 1
    deleted = [a for a in decision.actions if isinstance(a, job_actions.DeletePods)]
    assert deleted and set(deleted[0].names) == {"j-r0-0", "j-r0-1", "j-r0-2"}
    job, pods, gate = _running_under(_hosts("n0", "n1", "n3"), recovery={"inPlace": False})
    decision = lifecycle.decide(job, pods, at, gate, node_labels=HOST_LABELS)
    assert not [a for a in decision.actions if isinstance(a, job_actions.ReplacePods)]
    assert test_operator_lifecycle.status_of(decision)["restarts"] == 1


def test_crash_recovery_does_not_reuse_a_recorded_node_kueue_moved_away_from() -> None:
    job, _, _ = _running_under(_hosts("n0", "n1", "n3"))
    nodes = {f"n{i}": {"metadata": {"name": f"n{i}", "labels": {HOST: f"n{i}"}}} for i in range(4)}
    moved = kueue_reassigned.recorded_outside(job, (1, 2), nodes.get, _hosts("n0", "n1", "n3"))
    assert list(moved) == ["n2"] and "topologyAssignment" in moved["n2"]
    assert kueue_reassigned.recorded_outside(job, (1, 2), nodes.get, _hosts("n0", "n1", "n2")) == {}


def test_a_403_reading_kueue_tas_queues_the_workload_and_warns_the_job() -> None:
    # An install whose RBAC predates TAS: the Workload is created without a topologyRequest,
    # and the job carries a Warning Event saying so (not only the operator's log).
    class _Client:
        created: list[dict[str, Any]] = []

        async def kueue_object(self, **_: Any) -> dict[str, Any]:
            raise api_errors.ApiError(403, "get", "localqueues", "forbidden")

        async def create_workload(self, *, manifest: dict[str, Any]) -> dict[str, Any]:
            self.created.append(manifest)
            return manifest

    warned: list[tuple[str, str]] = []

    async def warn(reason: str, message: str) -> None:
        warned.append((reason, message))

    job = test_operator_lifecycle.job()
    client: Any = _Client()
    action = kueue_workload.CreateWorkload(kueue_workload.Priority(0))
    queue = kueue_workload.Queue("q", None)
    did = asyncio.run(workloads.perform(client, action, job, queue, None, "img", warn))
    assert did and "topologyRequest" not in client.created[0]["spec"]["podSets"][0]
    [(reason, message)] = warned
    assert reason == kueue_topology.UNREAD and "RBAC" in message and "403" in message


def test_a_replacement_never_overfills_a_domain_a_spare_holds() -> None:
    # Kueue counted 3 gang pods and a spare: rack0=2 (pod 0 and the spare), rack1=2 (pods 1, 2).
    # Pod 1 is lost. The spare's GPUs count as free (they are the replacement's), so counting
    # only the survivors would offer a third slot in rack0 (r0-n1): Kueue's count there is 2.
    offered = _nodes(racks=2, per_rack=3)
    labels = {n.name: n.labels for n in offered}
    assignment = _assignment((RACK,), {("rack0",): 2, ("rack1",): 2})
    free = {"r0-n1": 1, "r0-n2": 1, "r1-n1": 1}
    room = kueue_topology.replacement_room(free, ["r0-n0", "r1-n0"], ["r0-n2"], labels, assignment)
    # rack1's lost slot, and the spare's own node (a swap); never r0-n1.
    assert room == {"r0-n2": 1, "r1-n1": 1}
    assert kueue_topology.spare_room(free, ["r0-n0", "r1-n0"], labels, assignment)["r0-n1"] == 1


def test_a_domain_kueue_lists_twice_holds_both_counts() -> None:
    # Kueue's last oneWayTestCase lists (a10, b10) twice, 10 pods each: 20 pods there.
    read = kueue_topology.read(KUEUE_CASES[-1][0])
    assert read is not None and read.counts()[("a10", "b10")] == 20
    labels = {f"n{i}": {"a": "a10", "b": "b10"} for i in range(20)}
    nodes = {i: f"n{i}" for i in range(20)}
    assert kueue_topology.misplaced(nodes, labels, read) == ()
    free = {f"n{i}": 1 for i in range(20)}
    assert len(kueue_topology.spare_room(free, [], labels, read)) == 20


def test_the_request_names_only_levels_every_tas_flavor_s_topology_has() -> None:
    # Kueue may admit the Workload with either TAS flavor of the ClusterQueue, and skips one
    # whose Topology lacks a requested level: only the levels both Topologies have are named.
    flavors = {"a": "fabric", "plain": None, "b": "hosts"}
    topologies = {"fabric": (BLOCK, RACK, HOST), "hosts": (BLOCK, HOST)}

    class _Client:
        async def kueue_object(self, *, plural: str, name: str, **_: Any) -> dict[str, Any]:
            if plural == "localqueues":
                return {"spec": {"clusterQueue": "cq"}}
            if plural == "clusterqueues":
                group = {"flavors": [{"name": f} for f in flavors]}
                return {"spec": {"resourceGroups": [group]}}
            return {"spec": {"levels": [{"nodeLabel": label} for label in topologies[name]]}}

        async def resource_flavor(self, *, name: str) -> dict[str, Any]:
            return {"spec": {"topologyName": flavors[name]} if flavors[name] else {}}

    client: Any = _Client()
    assert asyncio.run(workloads.tas_levels(client, "ns", "q")) == (BLOCK, HOST)


def test_a_status_claiming_more_domains_than_a_gang_can_have_is_read_only_to_the_bound() -> None:
    """``domainCount`` comes from a Workload's status: the decoder stops where no gang reaches."""
    huge = {
        "levels": ["kubernetes.io/hostname"],
        "slices": [
            {
                "domainCount": 10**12,
                "podCounts": {"universal": 1},
                "valuesPerLevel": [{"universal": "node-a"}],
            }
        ],
    }
    read = kueue_topology.read(huge)
    assert read is not None
    assert len(read.domains) == kueue_topology.MAX_DOMAINS


CLIQUE = "nvidia.com/gpu.clique"
CLIQUE_LABELS = {f"n{i}": {HOST: f"n{i}", CLIQUE: f"c{i // 2}"} for i in range(4)}
"""Four 4-GPU hosts in two NVLink domains of two."""


def _sliced() -> kueue_topology.Assignment:
    # what Kueue admits for a pod set of 4 with podSetSliceRequiredTopology=clique, size 2
    compressed = {
        "levels": [HOST],
        "slices": [
            {
                "domainCount": 4,
                "podCounts": {"universal": 1},
                "valuesPerLevel": [{"individual": {"prefix": "n", "roots": ["0", "1", "2", "3"]}}],
            }
        ],
    }
    request = {"preferred": CLIQUE, "podSetSliceRequiredTopology": CLIQUE, "podSetSliceSize": 2}
    found = kueue_topology.read(compressed, request)
    assert found is not None
    return found


def test_the_stage_slice_kueue_admitted_is_read_with_the_assignment() -> None:
    assert _sliced().stage_slice == (CLIQUE, 2)
    workload = _admitted_workload(KUEUE_CASES[3][0])
    request = {"podSetSliceRequiredTopology": CLIQUE, "podSetSliceSize": 2}
    workload["spec"] = {"podSets": [{"name": kueue_workload.POD_SET, "topologyRequest": request}]}
    found = kueue_workload.state(workload)
    assert isinstance(found, kueue_workload.Admitted) and found.topology is not None
    assert found.topology.stage_slice == (CLIQUE, 2)
    unsliced = kueue_topology.read(KUEUE_CASES[3][0], {"preferred": CLIQUE})
    assert unsliced is not None and unsliced.stage_slice is None


def test_a_plan_splitting_a_stage_kueue_admitted_as_a_slice_is_a_conflict() -> None:
    assignment = _sliced()
    # counts kept (one pod per host), but stage 0 (pods 0-1) on n0 and n2: two NVLink domains
    split = kueue_topology.conflict(("n0", "n2", "n1", "n3"), CLIQUE_LABELS, assignment, 0)
    assert split is not None and "pods 0-1 (one pipeline stage) span" in split and "c0, c1" in split
    assert kueue_topology.conflict(("n1", "n0", "n3", "n2"), CLIQUE_LABELS, assignment, 0) is None
    # meshtrain's own plan inside the assignment keeps each stage in one domain
    spec = loading.parse_spec(
        JobBuilder()
        .layout(data=8, pipeline=2, gpus_per_node=4)
        .topology(nvlinkDomainLabel=CLIQUE)
        .raw()
    )
    offered = [placement.Node(name, 4, labels) for name, labels in CLIQUE_LABELS.items()]
    kept = kueue_topology.restrict(offered, assignment, gpus_per_pod=4)
    plan = placement.plan(placement_request.request_from_spec(spec), kept, [])
    assert isinstance(plan, placement.Placement)
    assert kueue_topology.conflict(plan.nodes, CLIQUE_LABELS, assignment, 0) is None


def test_a_required_level_the_topology_lacks_creates_no_workload() -> None:
    zone = "example.com/power-zone"
    spec = _spec(levels=[{"label": RACK}, {"label": zone, "mode": "required"}])
    problem = kueue_topology.unknown_required(spec, (BLOCK, RACK, HOST))
    assert problem is not None
    assert f"spec.topology.levels[1].label '{zone}' is required" in problem and RACK in problem
    # the Topology has it, or the queue has no TAS: nothing to refuse
    assert kueue_topology.unknown_required(spec, (RACK, zone, HOST)) is None
    assert kueue_topology.unknown_required(spec, ()) is None
    preferred = _spec(levels=[{"label": zone}])
    assert kueue_topology.unknown_required(preferred, (BLOCK, RACK, HOST)) is None


def test_a_stage_scoped_level_is_a_slice_of_one_stage_there() -> None:
    # dp8 x pp2 on pods of 4 GPUs: stages of 2 pods, each required in one rack
    spec = _spec(levels=[{"label": BLOCK}, {"label": RACK, "mode": "required", "scope": "stage"}])
    request = kueue_topology.topology_request(spec, (BLOCK, RACK, HOST), 4)
    assert request == {
        "preferred": RACK,
        "podSetSliceRequiredTopology": RACK,
        "podSetSliceSize": 2,
    }
    # the block required per stage, the rack preferred below it: Kueue refuses a slice above the
    # pod set's level, so the pod set prefers the block
    above = _spec(levels=[{"label": BLOCK, "mode": "required", "scope": "stage"}, {"label": RACK}])
    assert kueue_topology.topology_request(above, (BLOCK, RACK, HOST), 4) == {
        "preferred": BLOCK,
        "podSetSliceRequiredTopology": BLOCK,
        "podSetSliceSize": 2,
    }
    # the whole job required in the block, each stage in a rack
    both = _spec(
        levels=[
            {"label": BLOCK, "mode": "required"},
            {"label": RACK, "mode": "required", "scope": "stage"},
        ]
    )
    assert kueue_topology.topology_request(both, (BLOCK, RACK, HOST), 4) == {
        "required": BLOCK,
        "podSetSliceRequiredTopology": RACK,
        "podSetSliceSize": 2,
    }


def test_a_stage_scoped_level_above_the_job_s_required_level_asks_no_slice() -> None:
    spec = _spec(
        levels=[
            {"label": BLOCK, "mode": "required", "scope": "stage"},
            {"label": RACK, "mode": "required"},
        ]
    )
    assert kueue_topology.topology_request(spec, (BLOCK, RACK, HOST), 4) == {"required": RACK}


def test_a_stage_scoped_level_the_topology_lacks_creates_no_workload() -> None:
    spec = _spec(levels=[{"label": RACK, "mode": "required", "scope": "stage"}])
    why = kueue_topology.unknown_required(spec, (BLOCK, HOST))
    assert why is not None and "each pipeline stage" in why and "drop its scope" in why


def test_spares_that_break_the_stage_slices_create_no_workload_rather_than_drop_the_level() -> None:
    # 2 pods per stage, 4 pods: one spare makes a pod set of 5 that Kueue cannot cut into slices
    # of 2, so the request would carry no slice and Kueue could split a stage across racks
    spec = _spec(levels=[{"label": BLOCK}, {"label": RACK, "mode": "required", "scope": "stage"}])
    request = kueue_topology.topology_request(spec, (BLOCK, RACK, HOST), spec.pods + 1)
    assert "podSetSliceRequiredTopology" not in request
    why = kueue_topology.unknown_required(spec, (BLOCK, RACK, HOST), spares=1)
    assert why is not None
    assert "spec.topology.levels[1]" in why and "spareNodes" in why
    assert kueue_topology.unknown_required(spec, (BLOCK, RACK, HOST), spares=2) is None
    sliced = kueue_topology.topology_request(spec, (BLOCK, RACK, HOST), spec.pods + 2)
    assert sliced["podSetSliceRequiredTopology"] == RACK and sliced["podSetSliceSize"] == 2
