"""TrainingJobs queued by a real Kueue (its controller manager, CRDs and webhooks) on a real API server.

One ClusterQueue holds 8 GPUs. A job that fits is admitted and gets its gang; a second
waits with Kueue's own message; a higher-priority job preempts the first, whose gang is
stopped without counting a failure and whose quota goes back; when the preemptor
finishes, the preempted job's own Workload is admitted again, with no restart counted.  Jobs without the queue label do not wait.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshtrain.api import loading
from meshtrain.operator.policy import builders, identity, kueue_workload
from meshtrain.sandbox import controlplane
from meshtrain.sandbox.controlplane import kueue
from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster, OperatorProcess, wait_for

pytestmark = pytest.mark.integration

NS = "ml-team"
QUEUE = "team-queue"


def _kueue_object(cluster: Cluster, body: dict[str, Any]) -> None:
    cluster.create_kueue_object(body, NS)


@contextlib.contextmanager
def _kueue_cluster(
    binaries: Any, work: Any, gpus: int, config: dict[str, Any] | None = None
) -> Iterator[tuple[Cluster, OperatorProcess]]:
    """A control plane, Kueue (with ``config``) and one ClusterQueue of ``gpus`` GPUs; the operator."""
    with controlplane.ControlPlane(binaries=binaries) as plane:
        api = kubernetes.config.new_client_from_config(config_file=str(plane.kubeconfig_path))
        cluster = Cluster(api, str(plane.kubeconfig_path), str(binaries.kubectl))
        cluster.install_crds()
        cluster.core.create_namespace({"metadata": {"name": NS}})
        with kueue.Kueue(plane, work, [kueue_workload.EXTERNAL_FRAMEWORK], config):
            api_version = f"{kueue_workload.GROUP}/{kueue_workload.VERSION}"
            for body in (
                {"kind": "ResourceFlavor", "metadata": {"name": "gpus"}},
                {
                    "kind": "ClusterQueue",
                    "metadata": {"name": "research"},
                    "spec": {
                        "namespaceSelector": {},
                        "preemption": {"withinClusterQueue": "LowerPriority"},
                        "resourceGroups": [
                            {
                                "coveredResources": ["nvidia.com/gpu"],
                                "flavors": [
                                    {
                                        "name": "gpus",
                                        "resources": [{"name": "nvidia.com/gpu", "nominalQuota": gpus}],
                                    }
                                ],
                            }
                        ],
                    },
                },
                {"kind": "LocalQueue", "metadata": {"name": QUEUE}, "spec": {"clusterQueue": "research"}},
                {"kind": "WorkloadPriorityClass", "metadata": {"name": "low"}, "value": 10},
                {"kind": "WorkloadPriorityClass", "metadata": {"name": "high"}, "value": 1000},
            ):  # fmt: skip
                _kueue_object(cluster, {"apiVersion": api_version, **body})
            for _ in range(3):  # room for every job below: only Kueue's quota limits them
                cluster.add_node("kq", gpus=8)
            process = OperatorProcess(str(plane.kubeconfig_path), str(work / "operator.log"))
            process.start()
            try:
                yield cluster, process
            finally:
                process.stop()
        api.close()


@pytest.fixture(scope="module")
def queued(control_plane_binaries, tmp_path_factory) -> Iterator[tuple[Cluster, OperatorProcess]]:
    with _kueue_cluster(control_plane_binaries, tmp_path_factory.mktemp("kueue"), gpus=8) as up:
        yield up


PODS_READY_TIMEOUT = 20
"""Kueue's waitForPodsReady timeout in the cluster below (seconds)."""


@pytest.fixture(scope="module")
def ready_checked(
    control_plane_binaries, tmp_path_factory
) -> Iterator[tuple[Cluster, OperatorProcess]]:
    """Kueue evicts an admitted workload whose PodsReady stays False past the timeout."""
    config = {"waitForPodsReady": {"timeout": f"{PODS_READY_TIMEOUT}s"}}
    work = tmp_path_factory.mktemp("kueue-ready")
    with _kueue_cluster(control_plane_binaries, work, gpus=16, config=config) as up:
        yield up


def _queued_job(name: str, priority: str) -> dict[str, Any]:
    body = JobBuilder(name, NS, pool="kq").layout(data=8).gpus(8).manifest()
    body["metadata"]["labels"] = {
        kueue_workload.QUEUE_LABEL: QUEUE,
        kueue_workload.PRIORITY_CLASS_LABEL: priority,
    }
    return body


def _apply(cluster: Cluster, body: dict[str, Any]) -> None:
    cluster.custom.create_namespaced_custom_object(
        "meshtrain.io", "v1alpha1", NS, "trainingjobs", body
    )


def _workload(cluster: Cluster, job: str) -> dict[str, Any] | None:
    return cluster.workload(NS, job)


def _queued_condition(cluster: Cluster, job: str) -> dict[str, Any]:
    return cluster.condition(NS, job, "Queued")


def test_kueue_admits_queues_preempts_and_readmits_training_jobs(queued) -> None:
    cluster, _operator = queued

    _apply(cluster, _queued_job("first", "low"))
    admitted = wait_for(
        "first admitted by Kueue",
        lambda: (c := _queued_condition(cluster, "first")).get("status") == "False" and c,
        timeout=60,
    )
    assert admitted["reason"] == "Admitted" and "research" in admitted["message"]
    workload = _workload(cluster, "first")
    assert workload is not None
    owner = workload["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "TrainingJob" and owner["name"] == "first" and owner["controller"]
    [pod_set] = workload["spec"]["podSets"]
    assert pod_set["count"] == 1
    assert pod_set["template"]["spec"]["containers"][0]["resources"]["requests"] == {
        "nvidia.com/gpu": "8"
    }
    assert workload["spec"]["priority"] == 10
    wait_for("first's gang", lambda: len(cluster.pods(NS, "first")) == 1, timeout=60)

    _apply(cluster, _queued_job("second", "low"))
    waiting = wait_for(
        "second held by Kueue with its reason",
        lambda: (
            (c := _queued_condition(cluster, "second")).get("status") == "True"
            and c.get("reason") != "WorkloadCreated"
            and c
        ),
        timeout=60,
    )
    assert "insufficient" in waiting["message"] or "quota" in waiting["message"], waiting
    assert cluster.status(NS, "second").get("phase") == "Pending"
    assert cluster.pods(NS, "second") == []

    # A higher-priority job preempts the admitted low one (Kueue's decision).
    preempted_workload = _workload(cluster, "first")["metadata"]["uid"]
    _apply(cluster, _queued_job("urgent", "high"))
    evicted = wait_for(
        "first evicted by Kueue",
        lambda: (c := _queued_condition(cluster, "first")).get("status") == "True" and c,
        timeout=60,
    )
    assert evicted["reason"] in ("Preempted", "Evicted"), evicted
    wait_for("first's gang stopped", lambda: cluster.pods(NS, "first") == [], timeout=60)
    wait_for(
        "urgent admitted once first's quota is back",
        lambda: _queued_condition(cluster, "urgent").get("status") == "False",
        timeout=60,
    )
    wait_for("urgent's gang", lambda: len(cluster.pods(NS, "urgent")) == 1, timeout=60)
    first = cluster.status(NS, "first")
    assert first.get("restarts", 0) == 0, "a preemption is not a failure"
    assert first.get("phase") == "Pending"
    assert _workload(cluster, "first")["status"].get("admission") is None

    # Only the preempted job may take the quota back: second (same priority, possibly the same
    # creation second, so Kueue's FIFO could pick either) leaves the queue until first is back.
    cluster.delete_job(NS, "second")
    wait_for("second's Workload gone", lambda: _workload(cluster, "second") is None, timeout=60)
    wait_for("second gone", lambda: cluster.job(NS, "second") is None, timeout=60)

    # urgent succeeds (what a kubelet would report): its workload is finished, its quota freed,
    # and the preempted job's own Workload is admitted again and gets its gang.
    [pod] = cluster.pods(NS, "urgent")
    cluster.set_pod_phase(NS, pod.metadata.name, "Succeeded")
    cluster.wait_phase(NS, "urgent", "Succeeded", timeout=60)
    wait_for(
        "urgent's workload finished",
        lambda: any(
            c["type"] == "Finished" and c["status"] == "True"
            for c in (_workload(cluster, "urgent") or {}).get("status", {}).get("conditions", [])
        ),
        timeout=60,
    )
    readmitted = wait_for(
        "first admitted again",
        lambda: (c := _queued_condition(cluster, "first")).get("status") == "False" and c,
        timeout=90,
    )
    assert readmitted["reason"] == "Admitted", readmitted
    wait_for("first's gang again", lambda: len(cluster.pods(NS, "first")) == 1, timeout=60)
    workload = _workload(cluster, "first")
    assert workload["metadata"]["uid"] == preempted_workload, "its own Workload, not a new one"
    assert workload["status"].get("admission") is not None
    first = cluster.status(NS, "first")
    assert first.get("restarts", 0) == 0, "a preemption is not counted as a failure"
    assert first.get("phase") != "Failed"

    # The next test needs a waiting job beside the admitted one.
    _apply(cluster, _queued_job("second", "low"))
    wait_for(
        "second held again",
        lambda: (
            (c := _queued_condition(cluster, "second")).get("status") == "True"
            and c.get("reason") != "WorkloadCreated"
        ),
        timeout=60,
    )


def test_a_suspended_job_frees_its_quota_and_a_changed_spec_is_queued_again(queued) -> None:
    cluster, _operator = queued
    # After the test above one of first/second holds the whole quota and the other waits.
    running = next(j for j in ("first", "second") if cluster.pods(NS, j))
    waiting = "second" if running == "first" else "first"
    assert _queued_condition(cluster, waiting).get("status") == "True"

    cluster.patch_job(NS, running, {"runPolicy": {"suspend": True}})
    wait_for(f"{running}'s Workload gone", lambda: _workload(cluster, running) is None, timeout=90)
    wait_for(
        f"{waiting} admitted with the quota {running} gave back",
        lambda: (
            _queued_condition(cluster, waiting).get("status") == "False"
            and cluster.pods(NS, waiting)
        ),
        timeout=90,
    )
    assert cluster.pods(NS, running) == []

    # A spec change after admission: the old Workload (and its quota) no longer describes the job.
    before = _workload(cluster, waiting)
    assert before is not None
    cluster.patch_job(NS, waiting, {"training": {"steps": 7}})
    wait_for(
        "the Workload replaced for the new spec",
        lambda: (
            (w := _workload(cluster, waiting)) is not None
            and w["metadata"]["uid"] != before["metadata"]["uid"]
        ),
        timeout=90,
    )
    wait_for(
        "the job's WorkloadOutdated Event",
        lambda: any(
            e.reason == "WorkloadOutdated"
            for e in cluster.core.list_namespaced_event(
                NS, field_selector=f"involvedObject.name={waiting}"
            ).items
        ),
        timeout=30,
    )
    assert cluster.status(NS, waiting).get("restarts", 0) == 0


HOLD = "meshtrain.test/hold"
"""A finalizer of another controller, keeping a pod object after it was deleted."""


def _pod_object(cluster: Cluster, name: str) -> Any | None:
    try:
        return cluster.core.read_namespaced_pod(name, NS)
    except kubernetes.client.ApiException as err:
        if err.status == 404:
            return None
        raise


def _reconciles(operator: OperatorProcess) -> float:
    """How many reconcile passes the operator finished (any job, in any namespace)."""
    counts = [
        sample.value
        for family in text_string_to_metric_families(operator.metrics())
        for sample in family.samples
        if sample.name == "meshtrain_operator_reconcile_duration_seconds_count"
    ]
    if not counts:
        raise AssertionError(
            "the operator exports no meshtrain_operator_reconcile_duration_seconds"
        )
    return sum(counts)


def _after_passes_of_every_job(cluster: Cluster, operator: OperatorProcess, what: str) -> None:
    """Wait until the operator ended two passes per TrainingJob, plus one, after now.

    The count is the operator's, not per job; each job is resynced every 2 s, so by then a pass
    of the job under test began after the change just made.
    """
    jobs = cluster.custom.list_namespaced_custom_object(
        "meshtrain.io", "v1alpha1", NS, "trainingjobs"
    )
    passes = 2 * len(jobs["items"]) + 1
    before = _reconciles(operator)
    wait_for(
        f"{passes} reconcile passes after {what}",
        lambda: _reconciles(operator) >= before + passes,
        timeout=60,
    )


def test_an_ended_pod_kept_by_a_finalizer_holds_a_suspended_jobs_quota_until_it_is_gone(
    queued,
) -> None:
    """Suspending an admitted job: the re-admitted gang would reuse the pod names, so an ended
    pod object another controller's finalizer keeps holds the quota until it is gone."""
    cluster, operator = queued
    others = [j for j in ("first", "second") if cluster.job(NS, j) is not None]
    for other in others:  # the whole quota for this test's job, whatever the tests above left
        cluster.patch_job(NS, other, {"runPolicy": {"suspend": True}})
    for other in others:
        wait_for(f"{other}'s Workload gone", lambda o=other: _workload(cluster, o) is None, 90)
    _apply(cluster, _queued_job("kept", "low"))
    [pod] = cluster.wait_gang(NS, "kept", 1, timeout=90)
    name = pod.metadata.name
    cluster.core.patch_namespaced_pod(name, NS, {"metadata": {"finalizers": [HOLD]}})
    try:
        cluster.set_pod_phase(NS, name, "Running")
        cluster.patch_job(NS, "kept", {"runPolicy": {"suspend": True}})
        wait_for(
            f"{name} deleted by the suspend",
            lambda: (p := _pod_object(cluster, name)) is not None and p.metadata.deletion_timestamp,
            timeout=60,
        )
        _after_passes_of_every_job(cluster, operator, f"{name}'s deletion")
        assert _workload(cluster, "kept") is not None, "quota given back while the ranks still run"
        cluster.set_pod_phase(NS, name, "Failed", exit_code=143)  # the ranks stopped on SIGTERM
        _after_passes_of_every_job(cluster, operator, f"{name} ended")
        assert _pod_object(cluster, name) is not None, "the finalizer no longer held the pod"
        assert _workload(cluster, "kept") is not None, (
            f"quota given back while the ended {name}, kept by a finalizer, still takes the name "
            "the re-admitted gang needs"
        )
    finally:
        cluster.core.patch_namespaced_pod(name, NS, {"metadata": {"finalizers": None}})
    wait_for(
        f"kept's Workload deleted once {name} is gone",
        lambda: _pod_object(cluster, name) is None and _workload(cluster, "kept") is None,
        timeout=60,
    )
    assert cluster.status(NS, "kept").get("restarts", 0) == 0


def test_a_job_naming_a_queue_that_does_not_exist_waits_and_says_so(queued) -> None:
    cluster, _operator = queued
    body = _queued_job("lost", "low")
    body["metadata"]["labels"][kueue_workload.QUEUE_LABEL] = "no-such-queue"
    _apply(cluster, body)
    held = wait_for(
        "Kueue's verdict on the missing LocalQueue",
        lambda: (c := _queued_condition(cluster, "lost")).get("reason") == "Inadmissible" and c,
        timeout=60,
    )
    assert "LocalQueue no-such-queue doesn't exist" in held["message"]
    assert cluster.pods(NS, "lost") == []
    wait_for(
        "a Warning Event naming the missing queue (recorded after the condition)",
        lambda: any(
            e.type == "Warning" and "no-such-queue" in (e.message or "")
            for e in cluster.core.list_namespaced_event(
                NS, field_selector="involvedObject.name=lost"
            ).items
        ),
        timeout=30,
    )


def test_a_job_without_the_queue_label_is_not_held(queued) -> None:
    cluster, _operator = queued
    body = JobBuilder("unqueued", NS, pool="kq").layout(data=8).gpus(8).manifest()
    _apply(cluster, body)
    wait_for("unqueued gang", lambda: len(cluster.pods(NS, "unqueued")) == 1, timeout=60)
    assert _workload(cluster, "unqueued") is None
    assert _queued_condition(cluster, "unqueued") == {}


def test_a_job_naming_a_priority_class_that_does_not_exist_waits_and_says_so(queued) -> None:
    cluster, _operator = queued
    _apply(cluster, _queued_job("unranked", "no-such-priority"))
    held = wait_for(
        "the missing WorkloadPriorityClass named in Queued",
        lambda: (
            (c := _queued_condition(cluster, "unranked")).get("reason")
            == kueue_workload.PRIORITY_CLASS_NOT_FOUND
            and c
        ),
        timeout=60,
    )
    assert held["status"] == "True"
    assert (
        kueue_workload.PRIORITY_CLASS_LABEL in held["message"]
        and "no-such-priority" in held["message"]
    )
    assert _workload(cluster, "unranked") is None and cluster.pods(NS, "unranked") == []
    # Once the class exists the job is queued with its value (within one resync).
    _kueue_object(
        cluster,
        {
            "apiVersion": f"{kueue_workload.GROUP}/{kueue_workload.VERSION}",
            "kind": "WorkloadPriorityClass",
            "metadata": {"name": "no-such-priority"},
            "value": 5,
        },
    )
    workload = wait_for("its Workload", lambda: _workload(cluster, "unranked"), timeout=60)
    assert workload["spec"]["priority"] == 5


def test_an_admitted_gang_that_runs_is_not_evicted_by_the_pods_ready_timeout(
    ready_checked,
) -> None:
    cluster, _operator = ready_checked
    _apply(cluster, _queued_job("steady", "low"))
    _apply(cluster, _queued_job("stuck", "low"))
    [pod] = cluster.wait_gang(NS, "steady", 1, timeout=60)
    cluster.set_pod_phase(NS, pod.metadata.name, "Running")
    wait_for(
        "Kueue reads the gang's PodsReady",
        lambda: any(
            c["type"] == "PodsReady" and c["status"] == "True"
            for c in (_workload(cluster, "steady") or {}).get("status", {}).get("conditions", [])
        ),
        timeout=60,
    )
    # stuck's pods never run: Kueue evicts it at the timeout, which shows the timeout is live.
    evicted = wait_for(
        "stuck evicted by Kueue's PodsReady timeout",
        lambda: (
            (c := _queued_condition(cluster, "stuck")).get("reason") == "PodsReadyTimeout" and c
        ),
        timeout=60,
    )
    assert evicted["status"] == "True"
    assert cluster.status(NS, "stuck").get("restarts", 0) == 0
    time.sleep(PODS_READY_TIMEOUT)
    workload = _workload(cluster, "steady")
    assert workload is not None
    assert not any(
        c["type"] == "Evicted" and c["status"] == "True" for c in workload["status"]["conditions"]
    ), workload["status"]["conditions"]
    assert _queued_condition(cluster, "steady").get("status") == "False"
    assert [p.metadata.name for p in cluster.pods(NS, "steady")] == [pod.metadata.name]


def test_a_workload_of_the_jobs_name_owned_by_another_object_is_neither_read_nor_changed(
    queued,
) -> None:
    cluster, _operator = queued
    owner = cluster.core.create_namespaced_config_map(NS, {"metadata": {"name": "other-owner"}})
    foreign = {
        "apiVersion": f"{kueue_workload.GROUP}/{kueue_workload.VERSION}",
        "kind": "Workload",
        "metadata": {
            "name": kueue_workload.workload_name("namesake"),
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "name": "other-owner",
                    "uid": owner.metadata.uid,
                    "controller": True,
                }
            ],
        },
        "spec": {
            "queueName": QUEUE,
            "podSets": [
                {
                    "name": "main",
                    "count": 1,
                    "template": {
                        "spec": {
                            "restartPolicy": "Never",
                            "containers": [
                                {"name": "c", "image": "x", "resources": {"requests": {"cpu": "1"}}}
                            ],
                        }
                    },
                }
            ],
        },
    }
    cluster.custom.create_namespaced_custom_object(
        kueue_workload.GROUP, kueue_workload.VERSION, NS, kueue_workload.PLURAL, foreign
    )
    _apply(cluster, _queued_job("namesake", "low"))
    held = wait_for(
        "namesake held: the Workload of its name is not its own",
        lambda: (
            (c := _queued_condition(cluster, "namesake")).get("reason") == kueue_workload.NAME_TAKEN
            and c
        ),
        timeout=60,
    )
    assert "ConfigMap/other-owner" in held["message"]
    assert cluster.pods(NS, "namesake") == []
    kept = _workload(cluster, "namesake")
    assert kept["metadata"]["ownerReferences"][0]["uid"] == owner.metadata.uid
    assert not any(
        c["type"] == "Finished" for c in (kept.get("status") or {}).get("conditions") or []
    )
    # Once it is gone, the job's own Workload is created.
    cluster.custom.delete_namespaced_custom_object(
        kueue_workload.GROUP,
        kueue_workload.VERSION,
        NS,
        kueue_workload.PLURAL,
        kueue_workload.workload_name("namesake"),
    )
    own = wait_for(
        "namesake's own Workload",
        lambda: (
            (w := _workload(cluster, "namesake"))
            and w["metadata"]["ownerReferences"][0]["kind"] == "TrainingJob"
            and w
        ),
        timeout=60,
    )
    assert own["metadata"]["ownerReferences"][0]["name"] == "namesake"


def _dry_run_workload(cluster: Cluster, name: str, override: dict[str, Any]) -> dict[str, Any]:
    """The pod set template of the Workload of job ``name`` with ``override``, as Kueue's schema
    and webhooks keep it (server-side dry run: no quota taken)."""
    spec = loading.parse_spec(
        JobBuilder(name, NS, pool="kq").layout(data=8).gpus(8).pod_template(override).raw()
    )
    ref = identity.JobRef(name, NS, "00000000-0000-0000-0000-000000000001")
    template = builders.build_pod(ref, spec, 0, 0, "")
    body = kueue_workload.build_workload(
        ref, spec, kueue_workload.Queue(QUEUE, None), template, kueue_workload.Priority(0)
    )
    stored = cluster.custom.create_namespaced_custom_object(
        kueue_workload.GROUP, kueue_workload.VERSION, NS, kueue_workload.PLURAL, body, dry_run="All"
    )
    pod_set: dict[str, Any] = stored["spec"]["podSets"][0]["template"]["spec"]
    return pod_set


def test_a_workload_counting_an_overrides_sidecar_and_containers_is_accepted_by_kueue(
    queued,
) -> None:
    """The Workload of a job whose podTemplateOverride adds a native sidecar and a container without
    requests passes Kueue's schema and webhooks (server-side dry run: no quota taken)."""
    cluster, _operator = queued
    override = {
        "initContainers": [
            {
                "name": "ship-logs",
                "image": "fluent-bit:3",
                "restartPolicy": "Always",
                "resources": {"requests": {"cpu": "100m"}},
            }
        ],
        "containers": [{"name": "exporter", "image": "exporter:1"}],
    }
    pod_set = _dry_run_workload(cluster, "sidecars", override)
    assert [c["name"] for c in pod_set["initContainers"]] == ["ship-logs"]
    assert pod_set["initContainers"][0]["restartPolicy"] == "Always"
    assert [c["name"] for c in pod_set["containers"]] == ["trainer", "exporter"]


def test_a_workload_carrying_an_overrides_required_terms_and_overhead_is_accepted_by_kueue(
    queued,
) -> None:
    """The Workload keeps the override's required node terms (less the pin), pod-level resources
    and overhead through Kueue's schema and webhooks (server-side dry run: no quota taken)."""
    cluster, _operator = queued
    gpu = {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
    required = {"nodeSelectorTerms": [gpu]}
    override = {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}},
        "resources": {"requests": {"cpu": "8", "memory": "16Gi"}},
        "overhead": {"memory": "1Gi"},
    }
    pod_set = _dry_run_workload(cluster, "affine", override)
    assert pod_set["affinity"] == override["affinity"]
    assert pod_set["overhead"] == {"memory": "1Gi"}
    assert pod_set["resources"] == {"requests": {"cpu": "8", "memory": "16Gi"}}
