"""Devices from ResourceSlices: CEL selectors, free devices per node, coexistence with the
extended resource (the differential test against kube-scheduler is
tests/integration/operator/test_devices_vs_scheduler.py)."""

from __future__ import annotations

from typing import Any

import pytest

from meshtrain import placement
from meshtrain.api import limits, loading
from meshtrain.operator.cluster import device_cache
from meshtrain.operator.policy import builders, capacity, device_cel, devices, feasibility, identity
from tests.builders import JobBuilder

DRIVER = "gpu.sim.meshtrain.io"
CLASS = {
    "metadata": {"name": DRIVER, "creationTimestamp": "2026-01-01T00:00:00Z"},
    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
}


def gpu(
    index: int, clique: str = "c0", root: str | None = None, memory: str = "141Gi"
) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "type": {"string": "gpu"},
        "index": {"int": index},
        "productName": {"string": "NVIDIA H200"},
        "cliqueId": {"string": clique},
        "resource.kubernetes.io/pcieRoot": {"string": root or f"pci000{index // 4}"},
    }
    return {
        "name": f"gpu-{index}",
        "attributes": attributes,
        "capacity": {"memory": {"value": memory}},
    }


def slice_of(
    node: str, gpus: list[dict[str, Any]], generation: int = 1, count: int = 1
) -> dict[str, Any]:
    return {
        "metadata": {"name": f"{node}-{generation}-{len(gpus)}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
            "devices": gpus,
        },
    }


def claim_holding(node: str, *names: str) -> dict[str, Any]:
    results = [{"request": "gpus", "driver": DRIVER, "pool": node, "device": n} for n in names]
    return {
        "metadata": {"name": "held"},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def request(count: int, *selectors: str, match: str | None = None) -> devices.Request:
    return devices.Request(DRIVER, tuple(selectors), count, match)


def device(**attributes: Any) -> dict[str, Any]:
    typed = {
        k: ({"int": v} if isinstance(v, int) else {"string": v}) for k, v in attributes.items()
    }
    return device_cel.activation(DRIVER, {DRIVER: typed}, {DRIVER: {"memory": "80Gi"}})


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        (f'device.driver == "{DRIVER}"', True),
        (f'device.attributes["{DRIVER}"].productName == "NVIDIA H200"', True),
        (f'device.capacity["{DRIVER}"].memory.compareTo(quantity("40Gi")) >= 0', True),
        (f'device.capacity["{DRIVER}"].memory.isGreaterThan(quantity("81920Mi"))', False),
        (f'device.capacity["{DRIVER}"].memory == quantity("81920Mi")', True),
        (f'device.attributes["{DRIVER}"].index < 4', True),
        ('"x" in device.attributes["other.example.com"]', False),  # an unknown domain is empty
        (f'device.attributes["{DRIVER}"].productName.startsWith("NVIDIA")', True),
    ],
)
def test_selectors_evaluate_in_the_dra_environment(expression: str, expected: bool) -> None:
    assert device_cel.evaluate(expression, device(productName="NVIDIA H200", index=2)) is expected


@pytest.mark.parametrize(
    "expression",
    [
        f'device.attributes["{DRIVER}"].missing == "x"',  # a runtime error, as in Kubernetes
        "device.driver ==",  # does not parse
        "noSuchFunction(device.driver)",
        '"not a boolean"',
        "x" * (device_cel.MAX_EXPRESSION_LENGTH + 1),
    ],
)
def test_what_cannot_be_evaluated_is_unknown_with_a_reason(expression: str) -> None:
    verdict = device_cel.evaluate(expression, device(productName="NVIDIA H200"))
    assert isinstance(verdict, device_cel.Unknown)
    assert verdict.reason and len(verdict.describe()) < 400


def test_free_devices_are_published_minus_allocated_and_held() -> None:
    found = devices.inventory(
        [slice_of("n1", [gpu(i) for i in range(8)])],
        [claim_holding("n1", "gpu-0", "gpu-1")],
        [CLASS],
    )
    assert devices.fit(request(2), found, "n1").slots == 3
    assert devices.fit(request(2), found, "n1", held=2).slots == 2
    assert devices.fit(request(2), found, "elsewhere").reason == devices.CANNOT_ALLOCATE
    assert devices.fit(devices.Request("nope", (), 1), found, "n1").reason == (
        "device class nope not found"
    )


def test_a_tainted_device_is_not_free() -> None:
    tainted = {**gpu(0), "taints": [{"key": "example.com/ecc", "effect": "NoSchedule"}]}
    noted = {**gpu(1), "taints": [{"key": "example.com/warm", "effect": "None"}]}
    found = devices.inventory([slice_of("n1", [tainted, noted])], [], [CLASS])
    assert devices.fit(request(1), found, "n1").free == 1


def test_only_the_newest_complete_generation_of_a_pool_counts() -> None:
    old = slice_of("n1", [gpu(i) for i in range(8)], generation=1)
    partial = slice_of("n1", [gpu(i) for i in range(4)], generation=2, count=2)
    assert devices.inventory([old, partial], [], [CLASS]).devices == {}
    newest = slice_of("n1", [gpu(i) for i in range(4)], generation=2)
    assert len(devices.inventory([old, newest], [], [CLASS]).devices["n1"]) == 4


def test_selectors_and_match_attribute_shape_the_slots() -> None:
    gpus = [gpu(i, memory="80Gi" if i < 2 else "141Gi") for i in range(8)]
    found = devices.inventory([slice_of("n1", gpus)], [claim_holding("n1", "gpu-4")], [CLASS])
    big = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("100Gi")) >= 0'
    assert devices.fit(request(1, big), found, "n1").free == 5
    # PCIe roots: gpu-0..3 on pci0000, gpu-4..7 on pci0001 (gpu-4 taken): 4 + 3 devices
    assert devices.fit(request(4, match=devices.PCIE_ROOT), found, "n1").slots == 1
    assert devices.fit(request(3, match=devices.PCIE_ROOT), found, "n1").slots == 2
    assert devices.fit(request(3, match=devices.PCIE_ROOT), found, "n1", held=1).slots == 1


def test_a_selector_this_library_cannot_compile_is_left_to_the_api_server_and_scheduler() -> None:
    found = devices.inventory([slice_of("n1", [gpu(0)])], [], [CLASS])
    fitted = devices.fit(request(1, "device.driver =="), found, "n1")
    assert fitted.deferred and fitted.reason is not None and "does not compile" in fitted.reason
    ask = devices.Ask(found, "nvidia.com/gpu", 1, request(1, "device.driver =="))
    assert devices.judge(ask, "n1", {}, {}) == devices.NodeDevices(None)


def test_an_unevaluable_selector_makes_the_node_unknown_never_a_crash() -> None:
    found = devices.inventory([slice_of("n1", [gpu(0)])], [], [CLASS])
    fitted = devices.fit(request(1, f'device.attributes["{DRIVER}"].nope'), found, "n1")
    assert fitted.slots == 0 and fitted.reason is not None
    assert fitted.reason.startswith("device verdict unknown: selector")


def _node(name: str, gpus: int = 0) -> dict[str, Any]:
    allocatable = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    if gpus:
        allocatable["nvidia.com/gpu"] = str(gpus)
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {
            "allocatable": allocatable,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def _demand(gpus: int = 0) -> feasibility.Demand:
    requests = {"cpu": 1000, **({"nvidia.com/gpu": gpus} if gpus else {})}
    return feasibility.Demand(requests=requests, tolerations=(), node_selector={})


def test_placement_sees_free_devices_and_their_nvlink_domain() -> None:
    found = devices.inventory(
        [slice_of("dra", [gpu(i, clique="nvl72-a.3") for i in range(8)])], [], [CLASS]
    )
    ask = devices.Ask(found, "nvidia.com/gpu", 4, request(4))
    offered, refused = capacity.offered_nodes(
        _demand(), [_node("dra"), _node("plugin", 8)], {}, gpus_per_pod=4, pods_wanted=4, ask=ask
    )
    assert [(n.name, n.allocatable_gpus) for n in offered] == [("dra", 8)]
    assert offered[0].labels[placement.DEVICE_CLIQUE_LABEL] == "nvl72-a.3"
    assert refused == [devices.CANNOT_ALLOCATE]  # a device-plugin node is no DRA capacity


def test_gpus_seen_by_a_device_plugin_and_by_dra_are_counted_once() -> None:
    serving = {**CLASS, "spec": {**CLASS["spec"], "extendedResourceName": "nvidia.com/gpu"}}
    found = devices.inventory(
        [slice_of("both", [gpu(i) for i in range(8)])],
        [claim_holding("both", "gpu-0", "gpu-1")],
        [serving],
    )
    plugin_pods = feasibility.Usage(requested={"nvidia.com/gpu": 4}, pods=1)
    extended = devices.Ask(found, "nvidia.com/gpu", 2)
    node = _node("both", 8)
    # 8 advertised, 4 taken by device-plugin pods, 2 by claims: one 2-GPU pod fits, not two
    assert capacity.verdict(_demand(2), node, plugin_pods, extended) is None
    assert capacity.verdict(_demand(2), node, plugin_pods, extended, count=2) == (
        "Insufficient nvidia.com/gpu"
    )
    dra = devices.Ask(found, "nvidia.com/gpu", 2, request(2))
    assert capacity.verdict(_demand(), node, plugin_pods, dra) is None
    assert capacity.verdict(_demand(), node, plugin_pods, dra, count=2) == devices.CANNOT_ALLOCATE


def test_a_plain_gpu_request_is_served_from_slices_where_a_class_maps_it() -> None:
    serving = {**CLASS, "spec": {**CLASS["spec"], "extendedResourceName": "nvidia.com/gpu"}}
    found = devices.inventory([slice_of("dra", [gpu(i) for i in range(8)])], [], [serving])
    ask = devices.Ask(found, "nvidia.com/gpu", 4)
    offered, _ = capacity.offered_nodes(
        _demand(4), [_node("dra")], {}, gpus_per_pod=4, pods_wanted=4, ask=ask
    )
    assert [(n.name, n.allocatable_gpus) for n in offered] == [("dra", 8)]
    unmapped = devices.Ask(
        devices.inventory([slice_of("dra", [gpu(0)])], [], [CLASS]), "nvidia.com/gpu", 4
    )
    offered, refused = capacity.offered_nodes(
        _demand(4), [_node("dra")], {}, gpus_per_pod=4, pods_wanted=4, ask=unmapped
    )
    assert offered == [] and refused == ["Insufficient nvidia.com/gpu"]


def test_the_operators_gated_pods_hold_devices_until_their_claims_are_allocated() -> None:
    env = [{"name": devices.NPROC_ENV, "value": "4"}]
    pod: dict[str, Any] = {
        "spec": {
            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "j-gpus"}],
            "containers": [{"name": "trainer", "env": env}],
        }
    }
    assert devices.held_by(pod) == 4
    assert devices.held_by({**pod, "spec": {**pod["spec"], "nodeName": "n1"}}) == 0
    assert devices.held_by({"spec": {"containers": [{"name": "t", "env": env}]}}) == 0


def test_devices_alike_in_what_selectors_read_share_one_verdict_and_only_those() -> None:
    big = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("100Gi")) >= 0'
    gpus = [gpu(i, memory="80Gi" if i % 2 else "141Gi") for i in range(8)]
    found = devices.inventory([slice_of("n1", gpus)], [], [CLASS])
    assert devices.fit(request(1, big), found, "n1").free == 4
    assert devices.fit(request(1, big), found, "n1").free == 4  # remembered, the same answer
    counted = f'size(device.attributes["{DRIVER}"]) == 5'  # reads the whole map: every device
    odd = {**gpu(8), "attributes": {**gpu(8)["attributes"], "extra": {"bool": True}}}
    found = devices.inventory([slice_of("n2", [gpu(0), odd])], [], [CLASS])
    assert devices.fit(request(1, counted), found, "n2").free == 1


HOSTILE = "[{0}].all(a, [{0}].all(b, [{0}].all(c, [{0}].all(d, a + b + c + d >= 0))))".format(
    ", ".join(str(i) for i in range(100))
)
"""A selector the API server would refuse by its cost, but that evaluated here would take hours
(10^8 steps): the operator must never run it on its event loop."""


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The expressions ``device_cel.evaluate`` is asked to evaluate, from now on."""
    evaluated: list[str] = []
    evaluate = device_cel.evaluate

    def counted(expression: str, variables: Any) -> device_cel.Verdict:
        evaluated.append(expression)
        return evaluate(expression, variables)

    monkeypatch.setattr(device_cel, "evaluate", counted)
    return evaluated


@pytest.mark.parametrize(
    "hostile",
    [
        HOSTILE,
        f'device.attributes["{DRIVER}"].productName.matches("(a+)+$")',  # backtracking regexp
        f'device.attributes["{DRIVER}"].productName != "x" && ' * 30 + "true",  # too long
    ],
)
def test_a_selector_of_unbounded_cost_is_never_evaluated_but_left_to_the_scheduler(
    hostile: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    evaluated = _counting(monkeypatch)
    found = devices.inventory([slice_of("n1", [gpu(i) for i in range(8)])], [], [CLASS])
    fitted = devices.fit(request(1, hostile), found, "n1")
    assert fitted.deferred and fitted.reason is not None
    assert device_cel.LEFT_TO_SCHEDULER in fitted.reason
    assert evaluated == []
    ask = devices.Ask(found, "nvidia.com/gpu", 1, request(1, hostile))
    assert devices.judge(ask, "n1", {}, {}) == devices.NodeDevices(None)


def test_one_node_s_devices_get_a_bounded_cel_budget_past_which_the_scheduler_judges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Selectors each device evaluates anew (they read its uuid, so no two devices share a
    verdict), on a node of many devices: the evaluation stops at the node's budget."""
    reads_uuid = f'device.attributes["{DRIVER}"].uuid != "{"x" * 400}"'
    selectors = [reads_uuid] * 8  # 8 x ~450 characters: under the request's bound
    gpus = [
        {**gpu(i), "attributes": {**gpu(i)["attributes"], "uuid": {"string": f"GPU-{i}"}}}
        for i in range(128)
    ]
    found = devices.inventory([slice_of("n1", gpus)], [], [CLASS])
    evaluated = _counting(monkeypatch)
    fitted = devices.fit(request(1, *selectors), found, "n1")
    assert fitted.deferred and device_cel.LEFT_TO_SCHEDULER in (fitted.reason or "")
    cost = sum(map(len, [*devices.device_class(CLASS).selectors, *selectors]))
    assert 0 < len(evaluated) <= (limits.MAX_CEL_CHARS_PER_NODE // cost) * (len(selectors) + 1)
    # the same selectors on a node of eight devices are within the budget, and judged here
    few = devices.inventory([slice_of("n2", gpus[:8])], [], [CLASS])
    assert devices.fit(request(1, *selectors), few, "n2").slots == 8


def test_gated_extended_resource_pods_hold_the_devices_a_class_serves_them_from() -> None:
    """KEP-5004: a plain nvidia.com/gpu pod has no claim until kube-scheduler binds it, so the
    operator's gated pods of two gangs planned onto one DRA-only node must not both count its
    free devices; bound, the pod counts through its claim's allocation instead."""
    serving = {**CLASS, "spec": {**CLASS["spec"], "extendedResourceName": "nvidia.com/gpu"}}
    found = devices.inventory([slice_of("dra", [gpu(i) for i in range(8)])], [], [serving])
    spec = loading.parse_spec(JobBuilder().layout(data=4, gpus_per_node=4).raw())
    ref = identity.JobRef(name="first", namespace="ns", uid="u1")
    gated = builders.build_pod(ref, spec, 0, 0, "dra")  # the first gang's, planned onto "dra"
    requests = feasibility.pod_requests(gated)
    used = {**requests, **devices.unbound_extended(gated, requests)}
    usage = feasibility.Usage(requested=used, pods=1)
    extended = devices.Ask(found, "nvidia.com/gpu", 4)
    node = _node("dra")
    assert capacity.verdict(_demand(4), node, usage, extended) is None  # 4 of 8 left
    assert capacity.verdict(_demand(4), node, usage, extended, count=2) == devices.CANNOT_ALLOCATE
    dra = devices.Ask(found, "nvidia.com/gpu", 4, request(4))  # a DRA gang on the same node
    assert capacity.verdict(_demand(), node, usage, dra, count=2) == devices.CANNOT_ALLOCATE
    bound = {**gated, "spec": {**gated["spec"], "nodeName": "dra"}}
    assert devices.unbound_extended(bound, requests) == {}


@pytest.mark.parametrize(
    "sharing",
    [
        {"consumesCounters": [{"counterSet": "gpu-0-set", "counters": {}}]},
        {"allowMultipleAllocations": True},
    ],
)
def test_devices_that_share_counters_or_capacity_are_left_to_the_scheduler(
    sharing: dict[str, Any],
) -> None:
    """Partitionable devices (MIG slices consuming a GPU's counters) and devices of consumable
    capacity are allocated by accounting the operator does not model: it does not count them."""
    raw = slice_of("n1", [gpu(0), {**gpu(1), **sharing}])
    found = devices.inventory([device_cache.trim_slice(raw)], [], [CLASS])
    fitted = devices.fit(request(1), found, "n1")
    assert fitted.deferred and device_cel.LEFT_TO_SCHEDULER in (fitted.reason or "")
    ask = devices.Ask(found, "nvidia.com/gpu", 1, request(1))
    assert devices.judge(ask, "n1", {}, {}) == devices.NodeDevices(None)
