"""Gang provisioning against a real API server: objects, gates, capacity, competition, crash recovery."""

from __future__ import annotations

import collections
import threading
import time

import kubernetes
import pytest

from tests.builders import JobBuilder
from tests.integration.operator.cluster import OperatorProcess, wait_for

pytestmark = pytest.mark.integration


def _env(pod) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env if e.value is not None}


def test_apply_creates_service_configmap_and_pinned_gated_pods(cluster, operator, namespace, pool):
    nodes = sorted(cluster.add_node(pool, gpus=4) for _ in range(2))
    cluster.apply(JobBuilder("llm", namespace, pool).layout(data=2, pipeline=2, tensor=2).gpus(4))
    pods = cluster.wait_gang(namespace, "llm", 2)
    assert [p.metadata.name for p in pods] == ["llm-r0-0", "llm-r0-1"]
    planned = []
    for index, pod in enumerate(pods):
        term = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms[
            0
        ]
        assert term.match_fields[0].key == "metadata.name"
        planned.append(term.match_fields[0].values[0])
        env = _env(pod)
        assert (
            env["PET_NNODES"] == "2"
            and env["PET_NODE_RANK"] == str(index)
            and env["WORLD_SIZE"] == "8"
        )
        assert env["MASTER_ADDR"] == f"llm-r0-0.llm.{namespace}.svc"
        assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "4"
        assert pod.metadata.owner_references[0].kind == "TrainingJob"
    assert sorted(planned) == nodes
    service = cluster.core.read_namespaced_service("llm", namespace)
    assert service.spec.cluster_ip == "None"
    assert "job.yaml" in cluster.core.read_namespaced_config_map("llm-spec", namespace).data
    status = cluster.status(namespace, "llm")
    assert (
        status["phase"] == "Placing"
        and status["layout"] == "dp2·pp2·tp2"
        and status["worldSize"] == 8
    )
    assert sorted(p["node"] for p in status["placement"]) == nodes


def test_gates_are_lifted_only_after_the_last_pod_exists(
    cluster, operator, namespace, pool, kube_api
):
    for _ in range(4):
        cluster.add_node(pool, gpus=8)
    seen: list[tuple[str, str, bool]] = []
    stop = threading.Event()

    def watch() -> None:
        core = kubernetes.client.CoreV1Api(kube_api)
        stream = kubernetes.watch.Watch()
        for event in stream.stream(core.list_namespaced_pod, namespace, timeout_seconds=60):
            pod = event["object"]
            seen.append((event["type"], pod.metadata.name, bool(pod.spec.scheduling_gates)))
            if stop.is_set():
                stream.stop()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(0.5)
    cluster.apply(JobBuilder("wide", namespace, pool).layout(data=32).gpus(2))
    cluster.wait_gang(namespace, "wide", 16)
    time.sleep(0.5)
    stop.set()
    cluster.core.patch_namespaced_pod(
        "wide-r0-0", namespace, {"metadata": {"labels": {"nudge": "1"}}}
    )  # wake the watch
    watcher.join(timeout=10)
    first_ungated = next(i for i, (_, _, gated) in enumerate(seen) if not gated)
    created_before = {name for kind, name, _ in seen[:first_ungated] if kind == "ADDED"}
    assert len(created_before) == 16, seen[: first_ungated + 1]


def test_job_larger_than_free_capacity_waits_then_places_when_nodes_arrive(
    cluster, operator, namespace, pool
):
    cluster.add_node(pool, gpus=8)
    cluster.apply(JobBuilder("big", namespace, pool).layout(data=32).gpus(8))
    placed = wait_for(
        "Placed=False",
        lambda: (
            cluster.condition(namespace, "big", "Placed").get("status") == "False"
            and cluster.condition(namespace, "big", "Placed")
        ),
    )
    assert placed["reason"] == "InsufficientGPUs" and "32" in placed["message"]
    assert cluster.pods(namespace, "big") == []
    assert cluster.status(namespace, "big")["phase"] == "Pending"
    for _ in range(3):
        cluster.add_node(pool, gpus=8)
    cluster.wait_gang(namespace, "big", 4)
    assert cluster.condition(namespace, "big", "Placed")["status"] == "True"


def test_required_fabric_level_that_cannot_hold_the_job_is_topology_unsatisfiable(
    cluster, operator, namespace, pool
):
    for rack in ("r1", "r1", "r2", "r2"):
        cluster.add_node(pool, gpus=8, labels={"meshtrain.test/rack": f"{pool}-{rack}"})
    job = JobBuilder("racked", namespace, pool).layout(data=24).gpus(8)
    job.topology(levels=[{"label": "meshtrain.test/rack", "mode": "required"}])
    cluster.apply(job)
    placed = wait_for(
        "Placed=False", lambda: cluster.condition(namespace, "racked", "Placed").get("reason")
    )
    assert placed == "TopologyUnsatisfiable"
    assert cluster.pods(namespace, "racked") == []


def test_competing_jobs_never_share_gpus(cluster, operator, namespace, pool):
    for _ in range(4):
        cluster.add_node(pool, gpus=8)
    for name in ("a", "b", "c"):  # 3 x 16 GPUs on 32: exactly two fit
        cluster.apply(JobBuilder(name, namespace, pool).layout(data=16).gpus(4))
    wait_for(
        "two gangs placed and one waiting",
        lambda: (
            sorted(cluster.status(namespace, n).get("phase", "") for n in ("a", "b", "c"))
            == ["Pending", "Placing", "Placing"]
        ),
        timeout=30,
    )
    used: collections.Counter[str] = collections.Counter()
    for pod in cluster.pods(namespace):
        node = (
            pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms[
                0
            ]
            .match_fields[0]
            .values[0]
        )
        used[node] += int(pod.spec.containers[0].resources.limits["nvidia.com/gpu"])
    assert len(cluster.pods(namespace)) == 8
    assert all(gpus <= 8 for gpus in used.values()), used
    waiting = next(n for n in ("a", "b", "c") if cluster.status(namespace, n)["phase"] == "Pending")
    assert cluster.condition(namespace, waiting, "Placed")["reason"] == "InsufficientGPUs"
    placed = [n for n in ("a", "b", "c") if n != waiting]
    cluster.delete_job(namespace, placed[0])  # frees 16 GPUs: the waiting job is placed
    cluster.wait_gang(namespace, waiting, 4)


def test_operator_killed_mid_reconcile_converges_without_duplicates(
    cluster, operator, namespace, pool
):
    for _ in range(8):
        cluster.add_node(pool, gpus=8)
    cluster.apply(JobBuilder("crash", namespace, pool).layout(data=64).gpus(1))
    wait_for("first pods created", lambda: len(cluster.pods(namespace, "crash")) > 0, interval=0.01)
    operator.kill()
    partial = len(cluster.pods(namespace, "crash"))
    operator.start()
    pods = cluster.wait_gang(namespace, "crash", 64, timeout=60)
    names = [p.metadata.name for p in pods]
    assert len(set(names)) == 64 and set(names) == {f"crash-r0-{i}" for i in range(64)}
    assert len(cluster.core.list_namespaced_service(namespace).items) == 1
    assert (
        len(
            cluster.core.list_namespaced_config_map(
                namespace, label_selector="meshtrain.io/job=crash"
            ).items
        )
        == 1
    )
    assert cluster.status(namespace, "crash")["restarts"] == 0
    print(f"killed with {partial}/64 pods created")


def test_namespaced_operator_handles_only_its_namespaces(
    cluster, operator, namespace, pool, control_plane, tmp_path
):
    other = f"{namespace}-x"
    cluster.core.create_namespace({"metadata": {"name": other}})
    cluster.add_node(pool, gpus=8)
    operator.stop()  # the cluster-wide operator would act on both namespaces
    scoped = OperatorProcess(
        str(control_plane.kubeconfig_path),
        str(tmp_path / "scoped.log"),
        scope=("--namespace", namespace),
        lease=f"scoped-{namespace}",
    )
    try:
        scoped.start()
        for ns in (namespace, other):
            cluster.apply(JobBuilder("scoped", ns, pool).layout(data=2).gpus(1))
        cluster.wait_gang(namespace, "scoped", 2)
        time.sleep(2)
        assert cluster.pods(other, "scoped") == [] and cluster.status(other, "scoped") == {}
    finally:
        scoped.stop()
        operator.start()
    cluster.wait_gang(other, "scoped", 2)  # the cluster-wide operator picks it up again
