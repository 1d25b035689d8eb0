"""Kueue as a platform team runs it, on a real API server and a real Kueue, with the chart's RBAC.

The operator runs as the chart's ServiceAccount (manifests/rbac/rbac.yaml, a token from the
TokenRequest API) on an API server with OwnerReferencesPermissionEnforcement, as OpenShift
runs it: every child it creates names its job with blockOwnerDeletion, which that plugin
allows only to who may update trainingjobs/finalizers.

- quota goes back only once the gang's pods are gone, whether the job ended or was deleted;
- the pods' PriorityClass is the Workload's priority, by which Kueue preempts;
- the gang runs on the nodes of the ResourceFlavor Kueue admitted it with, with its tolerations;
- the queue label follows Kueue's rules: locked while admitted (the chart's admission policy),
  a new queue moves a waiting Workload, a removed label takes a waiting job out of Kueue.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
import yaml

from meshtrain.operator.policy import kueue_workload
from meshtrain.sandbox import controlplane
from meshtrain.sandbox.controlplane import kueue
from tests.builders import JobBuilder
from tests.integration.operator.cluster import (
    REPO,
    Cluster,
    OperatorProcess,
    log_lines,
    wait_for,
)

pytestmark = pytest.mark.integration

RBAC = pathlib.Path(REPO) / "manifests" / "rbac" / "rbac.yaml"
DEPLOYMENT = pathlib.Path(REPO) / "manifests" / "operator" / "operator.yaml"
OPERATOR_NAMESPACE, SERVICE_ACCOUNT = "meshtrain-system", "meshtrain"
API_VERSION = f"{kueue_workload.GROUP}/{kueue_workload.VERSION}"
SOLO_NS, SOLO_QUEUE, SPARE_QUEUE = "solo-team", "solo", "spare"
RESYNC_PASSES = 3.0
"""Seconds in which the operator (resync 2 s, woken by every pod event) has decided again."""


def _create(cluster: Cluster, body: dict[str, Any], namespace: str | None = None) -> None:
    plural = body["kind"].lower() + "s"
    body = {"apiVersion": API_VERSION, **body}
    if namespace is None:
        cluster.custom.create_cluster_custom_object(
            kueue_workload.GROUP, kueue_workload.VERSION, plural, body
        )
    else:
        cluster.custom.create_namespaced_custom_object(
            kueue_workload.GROUP, kueue_workload.VERSION, namespace, plural, body
        )


def _cluster_queue(name: str, flavors: list[tuple[str, int]]) -> dict[str, Any]:
    return {
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [
                {
                    "coveredResources": ["nvidia.com/gpu"],
                    "flavors": [
                        {"name": f, "resources": [{"name": "nvidia.com/gpu", "nominalQuota": q}]}
                        for f, q in flavors
                    ],
                }
            ],
        },
    }


TIER_NS, TIER_QUEUE, TIER_LABEL = "tier-team", "tiered", "meshtrain.test/tier"
TIER_B_TAINT = {"key": "meshtrain.test/tier-b", "value": "reserved", "effect": "NoSchedule"}


def _tiers(cluster: Cluster) -> None:
    """Two flavors of one ClusterQueue: tier-a (two nodes) first, then tier-b (one tainted node)."""
    toleration = {**TIER_B_TAINT, "operator": "Equal"}
    for tier, tolerations in (("a", []), ("b", [toleration])):
        _create(
            cluster,
            {
                "kind": "ResourceFlavor",
                "metadata": {"name": f"tier-{tier}"},
                "spec": {"nodeLabels": {TIER_LABEL: tier}, "tolerations": tolerations},
            },
        )
    _create(cluster, _cluster_queue("tiered", [("tier-a", 8), ("tier-b", 8)]))
    cluster.core.create_namespace({"metadata": {"name": TIER_NS}})
    _create(
        cluster,
        {
            "kind": "LocalQueue",
            "metadata": {"name": TIER_QUEUE},
            "spec": {"clusterQueue": "tiered"},
        },
        TIER_NS,
    )
    for _ in range(2):
        cluster.add_node("tier", gpus=8, labels={TIER_LABEL: "a"})
    cluster.add_node("tier", gpus=8, labels={TIER_LABEL: "b"}, taints=[TIER_B_TAINT])


def _chart_template(cluster: Cluster, found: Any, template: str) -> None:
    """Apply one template of the chart as ``helm install`` renders it with default values."""
    chart = pathlib.Path(REPO) / "charts" / "meshtrain"
    rendered = subprocess.run(
        [str(found.helm), "template", "meshtrain", str(chart), "--namespace", OPERATOR_NAMESPACE,
         "--show-only", f"templates/{template}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    applied = cluster.kubectl("apply", "-f", "-", stdin=rendered)
    assert applied.returncode == 0, applied.stderr


def _service_account_kubeconfig(plane: controlplane.ControlPlane, cluster: Cluster) -> str:
    """A kubeconfig holding a token of the chart's ServiceAccount (installed from manifests/rbac)."""
    cluster.core.create_namespace({"metadata": {"name": OPERATOR_NAMESPACE}})
    applied = cluster.kubectl("apply", "-f", str(RBAC))
    assert applied.returncode == 0, applied.stderr
    token = cluster.core.create_namespaced_service_account_token(
        SERVICE_ACCOUNT, OPERATOR_NAMESPACE, {"spec": {"expirationSeconds": 3600}}
    ).status.token
    admin = yaml.safe_load(plane.kubeconfig_path.read_text())
    admin["users"] = [{"name": SERVICE_ACCOUNT, "user": {"token": token}}]
    for context in admin["contexts"]:
        context["context"]["user"] = SERVICE_ACCOUNT
    path = plane.data_dir / "operator-sa.kubeconfig"
    path.write_text(yaml.safe_dump(admin))
    return str(path)


def _chart_lease() -> str:
    """The Lease the chart's Deployment elects on (its ``--lease=`` argument)."""
    text = DEPLOYMENT.read_text()
    [name] = re.findall(r"--lease=([\w.-]+)", text)
    return name


OPERATOR_LOG: dict[str, str] = {}
"""``path``: the module's operator log (a test that times out quotes it)."""


@pytest.fixture(scope="module")
def fit(control_plane_binaries, tmp_path_factory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("kueue-fit")
    with controlplane.ControlPlane(
        binaries=control_plane_binaries,
        extra_apiserver_args=["--enable-admission-plugins=OwnerReferencesPermissionEnforcement"],
    ) as plane:
        api = kubernetes.config.new_client_from_config(config_file=str(plane.kubeconfig_path))
        cluster = Cluster(api, str(plane.kubeconfig_path), str(control_plane_binaries.kubectl))
        cluster.install_crds()
        with kueue.Kueue(plane, work, [kueue_workload.EXTERNAL_FRAMEWORK]):
            _create(cluster, {"kind": "ResourceFlavor", "metadata": {"name": "plain"}})
            cluster.core.create_namespace({"metadata": {"name": SOLO_NS}})
            for queue in (SOLO_QUEUE, SPARE_QUEUE):
                _create(cluster, _cluster_queue(queue, [("plain", 8)]))
                _create(
                    cluster,
                    {
                        "kind": "LocalQueue",
                        "metadata": {"name": queue},
                        "spec": {"clusterQueue": queue},
                    },
                    SOLO_NS,
                )
            _chart_template(cluster, control_plane_binaries, "kueue-queue-policy.yaml")
            for _ in range(2):  # room for two gangs: only Kueue's quota limits them
                cluster.add_node("solo", gpus=8)
            _tiers(cluster)
            OPERATOR_LOG["path"] = str(work / "operator.log")
            process = OperatorProcess(
                _service_account_kubeconfig(plane, cluster),
                OPERATOR_LOG["path"],
                lease=_chart_lease(),  # the RBAC grants get/update on that Lease only
                lease_namespace=OPERATOR_NAMESPACE,
            )
            process.start()
            try:
                yield cluster
            finally:
                process.stop()
        api.close()


def _job(name: str, namespace: str, queue: str, pool: str) -> dict[str, Any]:
    body = JobBuilder(name, namespace, pool=pool).layout(data=8).gpus(8).manifest()
    body["metadata"]["labels"] = {kueue_workload.QUEUE_LABEL: queue}
    return body


def _apply(cluster: Cluster, body: dict[str, Any]) -> None:
    cluster.custom.create_namespaced_custom_object(
        "meshtrain.io", "v1alpha1", body["metadata"]["namespace"], "trainingjobs", body
    )


def _workload(cluster: Cluster, namespace: str, job: str) -> dict[str, Any] | None:
    return cluster.workload(namespace, job)


def _admitted(cluster: Cluster, namespace: str, job: str) -> bool:
    return cluster.condition(namespace, job, "Queued").get("status") == "False"


def _running_gang(cluster: Cluster, namespace: str, job: str) -> Any:
    """Wait for the job's one pod; bind it to its planned node and mark it Running (a kubelet's part)."""
    [pod] = cluster.wait_gang(namespace, job, 1, timeout=60)
    node = cluster.status(namespace, job)["placement"][0]["node"]
    binding = {"metadata": {"name": pod.metadata.name}, "target": {"kind": "Node", "name": node}}
    cluster.core.create_namespaced_pod_binding(
        pod.metadata.name, namespace, binding, _preload_content=False
    )
    cluster.set_pod_phase(namespace, pod.metadata.name, "Running")
    return pod


def _terminating(cluster: Cluster, namespace: str, pod: Any) -> bool:
    """Deleted, and (bound, with a grace period, no kubelet here) still there: its GPUs in use."""
    return bool(
        cluster.core.read_namespaced_pod(pod.metadata.name, namespace).metadata.deletion_timestamp
    )


def _release(cluster: Cluster, namespace: str, pod: Any) -> None:
    """What the kubelet does once the container stopped: the pod goes (if it is not gone yet)."""
    try:
        cluster.core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
    except kubernetes.client.ApiException as err:
        if err.status != 404:
            raise


def _finished(workload: dict[str, Any] | None) -> bool:
    return any(
        c["type"] == "Finished" and c["status"] == "True"
        for c in ((workload or {}).get("status") or {}).get("conditions") or []
    )


def test_quota_goes_back_only_once_the_gangs_pods_are_gone(fit) -> None:
    cluster = fit
    _apply(cluster, _job("ender", SOLO_NS, SOLO_QUEUE, "solo"))
    pod = _running_gang(cluster, SOLO_NS, "ender")
    owner = pod.metadata.owner_references[0]
    assert owner.block_owner_deletion and owner.kind == "TrainingJob"
    _apply(cluster, _job("after", SOLO_NS, SOLO_QUEUE, "solo"))
    wait_for("after queued", lambda: _workload(cluster, SOLO_NS, "after"), timeout=60)

    # ender fails (its deadline passes): its pod is deleted but still stopping.
    cluster.patch_job(SOLO_NS, "ender", {"runPolicy": {"activeDeadlineSeconds": 1}})
    cluster.wait_phase(SOLO_NS, "ender", "Failed", timeout=60)
    wait_for("ender's pod terminating", lambda: _terminating(cluster, SOLO_NS, pod), timeout=30)
    time.sleep(RESYNC_PASSES)
    assert not _finished(_workload(cluster, SOLO_NS, "ender")), "quota freed under a running pod"
    assert not _admitted(cluster, SOLO_NS, "after") and cluster.pods(SOLO_NS, "after") == []

    _release(cluster, SOLO_NS, pod)
    wait_for(
        "ender's Workload finished",
        lambda: _finished(_workload(cluster, SOLO_NS, "ender")),
        timeout=60,
    )
    wait_for(
        "after admitted on the freed quota",
        lambda: _admitted(cluster, SOLO_NS, "after"),
        timeout=60,
    )

    # after is deleted while its pod still stops: the Workload (and its quota) outlives the job
    # until the pod is gone.
    running = _running_gang(cluster, SOLO_NS, "after")
    _apply(cluster, _job("third", SOLO_NS, SOLO_QUEUE, "solo"))
    wait_for("third queued", lambda: _workload(cluster, SOLO_NS, "third"), timeout=60)
    cluster.delete_job(SOLO_NS, "after")
    wait_for("after's pod terminating", lambda: _terminating(cluster, SOLO_NS, running), timeout=30)
    time.sleep(RESYNC_PASSES)
    # A cluster's garbage collector (none runs here) deletes the Workload with the job: the
    # job must outlive its pods.
    assert cluster.job(SOLO_NS, "after") is not None
    assert _workload(cluster, SOLO_NS, "after") is not None
    assert not _admitted(cluster, SOLO_NS, "third")
    _release(cluster, SOLO_NS, running)
    wait_for(
        "after's Workload gone", lambda: _workload(cluster, SOLO_NS, "after") is None, timeout=60
    )
    wait_for("third admitted", lambda: _admitted(cluster, SOLO_NS, "third"), timeout=60)
    wait_for("after gone", lambda: cluster.job(SOLO_NS, "after") is None, timeout=30)
    _delete(cluster, SOLO_NS, "third")


def _delete(cluster: Cluster, namespace: str, job: str) -> None:
    """Delete a job; each pod the operator deletes goes at once (the kubelet's part); all must go.

    A pod of the job nobody deletes (one a placement cancelled by the deletion created
    behind the operator's cache) would hold its GPUs for good: no garbage collector runs here.
    """
    cluster.delete_job(namespace, job)

    def gone() -> bool:
        pods = cluster.pods(namespace, job)
        for pod in pods:
            if pod.metadata.deletion_timestamp:
                _release(cluster, namespace, pod)
        return not pods and cluster.job(namespace, job) is None

    wait_for(f"{job} and every pod of it deleted", gone, timeout=60)
    wait_for(
        f"{job}'s Workload gone", lambda: _workload(cluster, namespace, job) is None, timeout=60
    )


def test_the_pods_priority_class_ranks_the_workload_and_kueue_preempts_by_it(fit) -> None:
    cluster = fit
    for name, value in (("team-low", 100), ("team-high", 1000)):
        cluster.custom.create_cluster_custom_object(
            "scheduling.k8s.io",
            "v1",
            "priorityclasses",
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": name},
                "value": value,
            },
        )
    low = _job("lowpc", SOLO_NS, SOLO_QUEUE, "solo")
    low["spec"]["pod"] = {"priorityClassName": "team-low"}
    _apply(cluster, low)
    wait_for("lowpc admitted", lambda: _admitted(cluster, SOLO_NS, "lowpc"), timeout=60)
    workload = _workload(cluster, SOLO_NS, "lowpc")
    assert workload["spec"]["priority"] == 100
    assert workload["spec"]["priorityClassRef"] == {
        "group": "scheduling.k8s.io",
        "kind": "PriorityClass",
        "name": "team-low",
    }

    high = _job("highpc", SOLO_NS, SOLO_QUEUE, "solo")
    high["spec"]["pod"] = {"priorityClassName": "team-high"}
    _apply(cluster, high)
    # Kueue preempts the lower-priority Workload within the ClusterQueue (its own decision).
    evicted = wait_for(
        "lowpc preempted",
        lambda: (c := cluster.condition(SOLO_NS, "lowpc", "Queued")).get("status") == "True" and c,
        timeout=60,
    )
    assert evicted["reason"] in ("Preempted", "Evicted"), evicted
    wait_for("highpc admitted", lambda: _admitted(cluster, SOLO_NS, "highpc"), timeout=60)
    [pod] = cluster.wait_gang(SOLO_NS, "highpc", 1, timeout=60)
    assert pod.spec.priority_class_name == "team-high" and pod.spec.priority == 1000

    # A PriorityClass that does not exist holds the job and names the field.
    lost = _job("nopc", SOLO_NS, SOLO_QUEUE, "solo")
    lost["spec"]["pod"] = {"priorityClassName": "no-such-class"}
    _apply(cluster, lost)
    held = wait_for(
        "nopc held",
        lambda: (
            (c := cluster.condition(SOLO_NS, "nopc", "Queued")).get("reason")
            == kueue_workload.POD_PRIORITY_CLASS_NOT_FOUND
            and c
        ),
        timeout=60,
    )
    assert "spec.pod.priorityClassName" in held["message"] and "no-such-class" in held["message"]
    assert _workload(cluster, SOLO_NS, "nopc") is None
    for job in ("nopc", "highpc", "lowpc"):
        _delete(cluster, SOLO_NS, job)


def test_the_gang_runs_where_the_admitted_flavor_says(fit) -> None:
    cluster = fit
    _apply(cluster, _job("on-a", TIER_NS, TIER_QUEUE, "tier"))
    [first] = cluster.wait_gang(TIER_NS, "on-a", 1, timeout=60)
    assert first.spec.node_selector[TIER_LABEL] == "a"
    # tier-a's quota is spent: Kueue admits the next job with tier-b, although a tier-a node
    # is still free; only the tier-b node (tainted, tolerated by the flavor) may take it.
    _apply(cluster, _job("on-b", TIER_NS, TIER_QUEUE, "tier"))
    [pod] = cluster.wait_gang(TIER_NS, "on-b", 1, timeout=60)
    flavors = _workload(cluster, TIER_NS, "on-b")["status"]["admission"]["podSetAssignments"][0]
    assert flavors["flavors"] == {"nvidia.com/gpu": "tier-b"}
    node = cluster.core.read_node(cluster.status(TIER_NS, "on-b")["placement"][0]["node"])
    assert node.metadata.labels[TIER_LABEL] == "b"
    assert pod.spec.node_selector[TIER_LABEL] == "b"
    assert any(t.key == TIER_B_TAINT["key"] for t in pod.spec.tolerations or [])
    for job in ("on-b", "on-a"):
        _delete(cluster, TIER_NS, job)


def _label(cluster: Cluster, namespace: str, job: str, queue: str | None) -> None:
    cluster.custom.patch_namespaced_custom_object(
        "meshtrain.io", "v1alpha1", namespace, "trainingjobs", job,
        {"metadata": {"labels": {kueue_workload.QUEUE_LABEL: queue}}},
    )  # fmt: skip


LOADED = 180
"""Seconds this test waits for Kueue and the operator: generous, CI shares two cores."""


def test_the_queue_label_follows_kueues_rules(fit) -> None:
    cluster = fit
    cluster.add_node("solo", gpus=8)  # room for a job that leaves Kueue
    _apply(cluster, _job("holder", SOLO_NS, SOLO_QUEUE, "solo"))
    wait_for("holder admitted", lambda: _admitted(cluster, SOLO_NS, "holder"), timeout=LOADED)
    _apply(cluster, _job("mover", SOLO_NS, SOLO_QUEUE, "solo"))
    waiting = wait_for(
        "mover's Workload", lambda: _workload(cluster, SOLO_NS, "mover"), timeout=LOADED
    )

    def refused() -> Any:
        """The admitted job's label change, refused (the policy may take a moment to be live)."""
        try:
            _label(cluster, SOLO_NS, "holder", SPARE_QUEUE)
        except kubernetes.client.ApiException as err:
            return err
        _label(cluster, SOLO_NS, "holder", SOLO_QUEUE)
        return None

    error = wait_for("the admission policy refusing holder's new queue", refused, timeout=LOADED)
    message = json.loads(error.body)["message"]
    assert (
        'metadata.labels["kueue.x-k8s.io/queue-name"] cannot change from solo to spare' in message
    )
    with pytest.raises(kubernetes.client.ApiException, match="suspend it first"):
        _label(cluster, SOLO_NS, "holder", None)

    # mover waits: its Workload (the same object) moves to the spare queue and is admitted there.
    _label(cluster, SOLO_NS, "mover", SPARE_QUEUE)
    wait_for(
        "mover admitted by spare", lambda: _admitted(cluster, SOLO_NS, "mover"), timeout=LOADED
    )
    moved = _workload(cluster, SOLO_NS, "mover")
    assert moved["metadata"]["uid"] == waiting["metadata"]["uid"]
    assert moved["spec"]["queueName"] == SPARE_QUEUE
    assert moved["status"]["admission"]["clusterQueue"] == SPARE_QUEUE

    # leaver waits behind holder; without its label it leaves Kueue and is placed at once.
    _apply(cluster, _job("leaver", SOLO_NS, SOLO_QUEUE, "solo"))
    wait_for("leaver's Workload", lambda: _workload(cluster, SOLO_NS, "leaver"), timeout=LOADED)
    assert cluster.pods(SOLO_NS, "leaver") == []
    _label(cluster, SOLO_NS, "leaver", None)
    # the operator deletes it; Kueue's resource-in-use finalizer may keep it a while longer
    wait_for(
        "leaver's Workload deleted",
        lambda: (
            (w := _workload(cluster, SOLO_NS, "leaver")) is None
            or bool(w["metadata"].get("deletionTimestamp"))
        ),
        timeout=LOADED,
        explain=lambda: log_lines(OPERATOR_LOG["path"], "leaver", "lease", "leader", "Error"),
    )
    cluster.wait_gang(SOLO_NS, "leaver", 1, timeout=LOADED)
    assert cluster.condition(SOLO_NS, "leaver", "Queued") == {}
    for job in ("leaver", "mover", "holder"):
        _delete(cluster, SOLO_NS, job)
