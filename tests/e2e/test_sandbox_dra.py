"""GPUs through Dynamic Resource Allocation in the sandbox: the simulated driver end to end.

The sandbox runs meshtrain's simulated GPU DRA driver (sandbox/dra-driver) as a kubelet plugin on
both nodes; each publishes 8 devices in a ResourceSlice. The real kube-scheduler allocates the
claims, the kubelet asks the driver to prepare them, and containerd applies the CDI spec the
driver wrote: the container's env names the devices. Every check takes its expectation from
the API server's objects (the slices, the claim's ``status.allocation``), never from the
driver's code.

1. The slices: 8 devices per node with the attributes and capacity the shared names fix.
2. Hand-written pods, each with a claim from a ResourceClaimTemplate (2 devices of the class,
   a CEL selector, all on one PCIe root): they run to Succeeded, and each container's env
   names exactly the devices (and uuids) the scheduler allocated on the pod's node; no device
   is given to two pods.
3. The example TrainingJob with ``resources.dra`` (the class, a productName selector, one PCIe
   root per pod): it succeeds; its pods ran on the nodes of the operator's plan
   (``status.placement``), each with ``gpusPerNode`` devices of that node's slice allocated to
   its claim ``gpus`` from the operator's template, and the env in each running trainer
   container (``kubectl exec``) names exactly those devices; no device serves two pods.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from meshtrain.operator.policy import naming
from meshtrain.sandbox import dra, example, node, supervisor
from tests.e2e.test_sandbox import _example, _written
from tests.e2e.test_sandbox import sandbox as sandbox  # the module's own sandbox, up once

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
RESTRICTED_CONTAINER = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
PRINT_ENV = (
    "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith('MESHTRAIN_SIM_')}))"
)
"""A program that prints the container's simulated-GPU env as one JSON line."""
HOLD_SECONDS = 30
"""How long the hand-written pods run after printing: the claim of a pod that ended is deleted."""


def _get(paths: supervisor.Paths, *args: str) -> Any:
    return json.loads(example.kubectl(paths, "get", *args, "-o", "json"))


def _slices(paths: supervisor.Paths) -> dict[str, dict[str, dict[str, Any]]]:
    """``node -> device name -> {attributes (plain values), capacity}`` of the driver's slices."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for item in _get(paths, "resourceslices")["items"]:
        if item["spec"]["driver"] != dra.DRIVER:
            continue
        assert item["spec"]["pool"]["name"] == item["spec"]["nodeName"]
        for device in item["spec"]["devices"]:
            attributes = {k: next(iter(v.values())) for k, v in device["attributes"].items()}
            found.setdefault(item["spec"]["nodeName"], {})[device["name"]] = {
                **attributes,
                "memory": device["capacity"]["memory"]["value"],
            }
    return found


def _while_running(
    paths: supervisor.Paths, namespace: str, name: str, timeout: float
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, str]]:
    """Once the pod runs and printed its env: (pod, its claim's allocated devices, the env)."""
    deadline = time.monotonic() + timeout
    pod: dict[str, Any] = {}
    while time.monotonic() < deadline:
        pod = _get(paths, "pod", name, "-n", namespace)
        phase = pod["status"].get("phase")
        assert phase in ("Pending", "Running"), f"pod {namespace}/{name} {phase} before it was read"
        shown = example.kubectl(paths, "logs", "-n", namespace, name, check=False).strip()
        if phase == "Running" and shown:
            return pod, allocated(paths, pod, "gpus"), json.loads(shown)
        time.sleep(1)
    described = example.kubectl(paths, "describe", "pod", name, "-n", namespace, check=False)
    raise AssertionError(f"pod {namespace}/{name} did not run in {timeout}s:\n{described}")


def _wait_phase(paths: supervisor.Paths, namespace: str, name: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    phase = ""
    while time.monotonic() < deadline:
        phase = example.kubectl(
            paths, "get", "pod", name, "-n", namespace, "-o", "jsonpath={.status.phase}"
        )
        if phase in ("Succeeded", "Failed"):
            return phase
        time.sleep(1)
    raise AssertionError(f"pod {namespace}/{name} still {phase!r} after {timeout}s")


def allocated(paths: supervisor.Paths, pod: dict[str, Any], claim: str) -> list[dict[str, Any]]:
    """The device results of the pod's claim ``claim`` (its ResourceClaim's ``status.allocation``)."""
    statuses = {s["name"]: s["resourceClaimName"] for s in pod["status"]["resourceClaimStatuses"]}
    namespace = pod["metadata"]["namespace"]
    resource_claim = _get(paths, "resourceclaim", statuses[claim], "-n", namespace)
    results: list[dict[str, Any]] = resource_claim["status"]["allocation"]["devices"]["results"]
    return results


def check_env_names_allocation(
    env: dict[str, str],
    results: list[dict[str, Any]],
    *,
    node_name: str,
    slices: dict[str, dict[str, dict[str, Any]]],
) -> None:
    """The CDI env names exactly the allocated devices of the pod's node, with their slice's uuids."""
    assert {r["driver"] for r in results} == {dra.DRIVER}
    assert {r["pool"] for r in results} == {node_name}, "devices from another node's pool"
    names = [r["device"] for r in results]
    assert env[dra.ENV_GPUS].split(",") == names
    assert env[dra.ENV_UUIDS].split(",") == [slices[node_name][n]["uuid"] for n in names]
    assert env[dra.ENV_NODE] == node_name


def test_each_node_publishes_eight_gpus_with_topology(
    sandbox: tuple[supervisor.Paths, dict[str, Any]],
) -> None:
    paths, _state = sandbox
    slices = _slices(paths)
    assert sorted(slices) == sorted(n.name for n in supervisor.NODES)
    for node_name, devices in slices.items():
        assert sorted(devices) == sorted(f"gpu-{i}" for i in range(dra.GPUS_PER_NODE))
        for name, device in devices.items():
            assert device["type"] == "gpu" and f"gpu-{device['index']}" == name
            assert device["productName"] == dra.PRODUCT and device["memory"] == dra.MEMORY
            assert device["uuid"].startswith("GPU-")
            assert device[PCIE_ROOT].startswith("pci") and device["numaNode"] in (0, 1)
        assert len({d["cliqueId"] for d in devices.values()}) == 1, node_name
        assert len({d["uuid"] for d in devices.values()}) == dra.GPUS_PER_NODE
    cliques = [next(iter(devices.values()))["cliqueId"] for devices in slices.values()]
    assert len(set(cliques)) == len(cliques), "each HGX node is its own NVLink domain"
    device_class = _get(paths, "deviceclass", dra.DRIVER)
    assert dra.DRIVER in device_class["spec"]["selectors"][0]["cel"]["expression"]
    status = example.kubectl(paths, "get", "nodes", "-o", "name")
    assert all(f"node/{n.name}" in status for n in supervisor.NODES)


def _template(namespace: str) -> dict[str, Any]:
    """2 devices of the driver's class, H200s, all on one PCIe root."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "two-gpus", "namespace": namespace},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpus",
                            "exactly": {
                                "deviceClassName": dra.DRIVER,
                                "allocationMode": "ExactCount",
                                "count": 2,
                                "selectors": [
                                    {
                                        "cel": {
                                            "expression": f'device.attributes["{dra.DRIVER}"].productName == "{dra.PRODUCT}"'
                                        }
                                    }
                                ],
                            },
                        }
                    ],
                    "constraints": [{"requests": ["gpus"], "matchAttribute": PCIE_ROOT}],
                }
            }
        },
    }


def _pod(namespace: str, name: str, node_name: str) -> dict[str, Any]:
    _operator, trainer_image, _pause = node.image_names()
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            # The node is picked by name affinity, so that each node's driver prepares a claim.
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {
                                        "key": "metadata.name",
                                        "operator": "In",
                                        "values": [node_name],
                                    }
                                ]
                            }
                        ]
                    }
                }
            },
            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "two-gpus"}],
            "containers": [
                {
                    "name": "main",
                    "image": trainer_image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": [
                        "python",
                        "-c",
                        f"{PRINT_ENV}; import time; time.sleep({HOLD_SECONDS})",
                    ],
                    "resources": {"claims": [{"name": "gpus"}]},
                    "securityContext": RESTRICTED_CONTAINER,
                }
            ],
        },
    }


def test_hand_written_claims_get_the_allocated_devices_in_their_env(
    sandbox: tuple[supervisor.Paths, dict[str, Any]],
) -> None:
    paths, _state = sandbox
    namespace = "dra-hand"
    example.kubectl(paths, "create", "namespace", namespace, check=False)
    example.kubectl(paths, "apply", "-f", "-", stdin=json.dumps(_template(namespace)))
    # Two pods on the first node (disjoint devices there), one on the second.
    placed = [(f"p{i}", n.name) for i, n in enumerate((*supervisor.NODES, supervisor.NODES[0]))]
    for name, node_name in placed:
        example.kubectl(
            paths, "apply", "-f", "-", stdin=json.dumps(_pod(namespace, name, node_name))
        )
    slices = _slices(paths)
    taken: dict[tuple[str, str], str] = {}
    for name, node_name in placed:
        pod, results, env = _while_running(paths, namespace, name, timeout=300)
        assert pod["spec"]["nodeName"] == node_name
        assert len(results) == 2
        roots = {slices[node_name][r["device"]][PCIE_ROOT] for r in results}
        assert len(roots) == 1, f"matchAttribute {PCIE_ROOT} not kept: {roots}"
        check_env_names_allocation(env, results, node_name=node_name, slices=slices)
        for r in results:
            assert (r["pool"], r["device"]) not in taken, f"{r['device']} given twice"
            taken[(r["pool"], r["device"])] = name
    for name, _node_name in placed:
        assert _wait_phase(paths, namespace, name, timeout=120) == "Succeeded"
    example.kubectl(paths, "delete", "namespace", namespace, "--wait=false")


def test_dra_example_job_succeeds_with_the_planned_nodes_devices(
    sandbox: tuple[supervisor.Paths, dict[str, Any]],
) -> None:
    """The example job with ``resources.dra``: the operator's template, the scheduler's allocation
    on each planned node, and the driver's env in each running trainer container agree."""
    paths, _state = sandbox
    name = "sandbox-dra"
    product = f'device.attributes["{dra.DRIVER}"].productName == "{dra.PRODUCT}"'
    job = _example(name, "dra-checkpoints").training(steps=6)
    job = job.dra(dra.DRIVER, product, match_attribute=PCIE_ROOT)
    namespace, _ = example.apply(paths, _written(paths, job))
    seen: dict[str, tuple[dict[str, Any], list[dict[str, Any]], dict[str, str]]] = {}

    def record(line: str) -> None:
        print(line)
        listed = _get(paths, "pods", "-n", namespace, "-l", f"meshtrain.io/job={name}")
        for pod in listed["items"]:
            pod_name = pod["metadata"]["name"]
            if pod_name in seen or pod["status"].get("phase") != "Running":
                continue
            shown = example.kubectl(
                paths,
                "exec",
                "-n",
                namespace,
                pod_name,
                "--",
                "python",
                "-c",
                PRINT_ENV,
                check=False,
            )
            if shown.strip():  # the claim and the env while the pod (and its claim) exist
                seen[pod_name] = (pod, allocated(paths, pod, naming.GPU_CLAIM), json.loads(shown))

    final = example.follow(paths, namespace, name, timeout=900, on_change=record)
    status = final["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=2)
    planned = {p["podIndex"]: p["node"] for p in status["placement"]}
    gpus_per_node = job.manifest()["spec"]["resources"]["gpusPerNode"]
    slices = _slices(paths)
    assert len(seen) == len(planned) == 2, sorted(seen)
    claimed_from = {
        c["resourceClaimTemplateName"]
        for pod, _, _ in seen.values()
        for c in pod["spec"]["resourceClaims"]
        if c["name"] == naming.GPU_CLAIM
    }
    [template_name] = claimed_from  # <job>-gpus-<hash10>: one spec, one template
    assert template_name.startswith(f"{name}-gpus-"), template_name
    template = _get(paths, "resourceclaimtemplate", template_name, "-n", namespace)
    owner = template["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("TrainingJob", name, True)
    for pod_name, (pod, results, env) in seen.items():
        index = int(pod_name.rsplit("-", 1)[1])
        node_name = pod["spec"]["nodeName"]
        assert node_name == planned[index], (pod_name, node_name, planned)
        assert "nvidia.com/gpu" not in json.dumps(pod["spec"]["containers"])
        assert len(results) == gpus_per_node and {r["request"] for r in results} == {"gpus"}
        devices = [slices[node_name][r["device"]] for r in results]
        assert {d["productName"] for d in devices} == {dra.PRODUCT}
        assert len({d[PCIE_ROOT] for d in devices}) == 1, devices
        check_env_names_allocation(env, results, node_name=node_name, slices=slices)
    given = [(r["pool"], r["device"]) for _pod, results, _env in seen.values() for r in results]
    assert len(given) == len(set(given)), f"a device given to two pods: {given}"
