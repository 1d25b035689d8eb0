"""Gang backends against the real schedulers: scheduler-plugins' Coscheduling plugin, run as a
second scheduler beside kube-scheduler, and no gang scheduler at all (``none``).

The window the operator's own re-check cannot close — a planned node filled after the gates are
lifted — is opened on purpose: with ``coscheduling`` the second scheduler binds no pod of the gang
until all fit, then binds them all (its Scheduled events say who bound them); with ``none``
kube-scheduler binds half the gang and it holds its GPUs.  A gang that fits binds whole through
the operator's own passes, and an operator process keeps a running gang's spare, replaces a lost
pod onto it and rebuilds the gang (a new PodGroup of the new attempt) through the same scheduler.

Needs scheduler-plugins' scheduler from the full bootstrap; ``make test-gang-backends``.
"""

from __future__ import annotations

import pathlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from meshtrain.operator import reconciler
from meshtrain.operator.policy import gang_backend
from meshtrain.sandbox.controlplane import binaries, coscheduling
from tests.builders import JobBuilder
from tests.integration.operator.cluster import (
    Cluster,
    OperatorProcess,
    reconcile_passes,
    wait_for,
)
from tests.integration.operator.test_operator_chaos import Kubelet

pytestmark = [pytest.mark.integration, pytest.mark.gang_backends]

SCHEDULER = coscheduling.SCHEDULER_NAME
COSCHEDULING = gang_backend.GangBackend(
    kind="coscheduling", scheduler_name=SCHEDULER, schedule_timeout_seconds=10
)
OPERATED = "operated"
"""The namespace the operator process watches (the other tests run passes in this process)."""


@pytest.fixture(scope="module")
def cluster(control_plane_binaries, tmp_path_factory) -> Iterator[Cluster]:
    """A private control plane (kube-scheduler included) with scheduler-plugins' scheduler."""
    try:
        coscheduling.locate()
    except binaries.BinariesMissingError as missing:
        pytest.fail(str(missing), pytrace=False)
    with Cluster.private(control_plane_binaries) as found:
        work = tmp_path_factory.mktemp("second-scheduler")
        kubeconfig, kubectl = pathlib.Path(found.kubeconfig), pathlib.Path(found.kubectl_path)
        with coscheduling.SecondScheduler(kubeconfig, kubectl, work, permit_seconds=10) as second:
            yield found
            print(second.tail())


@pytest.fixture
def namespace(cluster) -> str:
    name = f"g-{uuid.uuid4().hex[:6]}"
    cluster.core.create_namespace({"metadata": {"name": name}})
    return name


def _settings(backend: gang_backend.GangBackend) -> reconciler.Settings:
    return reconciler.Settings(gang=backend)


def _bound(cluster: Cluster, namespace: str, job: str) -> dict[str, str | None]:
    return {p.metadata.name: p.spec.node_name for p in cluster.pods(namespace, job)}


def _binder(cluster: Cluster, namespace: str, pod: str) -> str | None:
    """Who bound ``pod``: the component of its Scheduled event (None: not bound yet)."""
    events = cluster.core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={pod},reason=Scheduled"
    ).items
    for event in events:
        return str(event.reporting_component or (event.source and event.source.component))
    return None


def _refused_by(cluster: Cluster, namespace: str, job: str) -> bool:
    """Whether the second scheduler reported a FailedScheduling of a pod of ``job``."""
    events = cluster.core.list_namespaced_event(
        namespace, field_selector="involvedObject.kind=Pod,reason=FailedScheduling"
    ).items
    return any(
        e.involved_object.name.startswith(f"{job}-")
        and (e.reporting_component or (e.source and e.source.component)) == SCHEDULER
        for e in events
    )


def _pod_group(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = cluster.custom.get_namespaced_custom_object(
        "scheduling.x-k8s.io", "v1alpha1", namespace, "podgroups", name
    )
    return found


def _node_taken_after_the_check(
    cluster: Cluster, namespace: str, pool: str, backend: gang_backend.GangBackend
) -> list[str]:
    """Two 2-GPU nodes, a 2-pod gang placed on them by the operator (``backend``); then a foreign
    pod takes the second node and the gates are lifted; the nodes."""
    nodes = [cluster.add_node(pool, gpus=2) for _ in range(2)]
    cluster.apply(JobBuilder("pair", namespace, pool).layout(data=4).gpus(2))
    reconcile_passes(
        cluster, namespace, "pair", settings=_settings(backend), stop_before_gates=True
    )
    pods = cluster.pods(namespace, "pair")
    assert len(pods) == 2 and all(p.spec.scheduling_gates for p in pods)
    taken = next(p.spec.affinity for p in pods if p.metadata.name == "pair-r0-1")
    node = taken.node_affinity.required_during_scheduling_ignored_during_execution
    second = node.node_selector_terms[0].match_fields[0].values[0]
    limits = {"limits": {"nvidia.com/gpu": "2"}}
    cluster.core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": "intruder"},
            "spec": {
                "nodeName": second,
                "containers": [{"name": "c", "image": "pause", "resources": limits}],
            },
        },
    )

    for pod in pods:  # the moment after the operator's check, before a scheduler binds
        remove = [{"op": "remove", "path": "/spec/schedulingGates"}]
        cluster.core.patch_namespaced_pod(pod.metadata.name, namespace, remove)
    return nodes


def test_coscheduling_never_binds_half_a_gang_and_binds_it_whole_once_it_fits(cluster, namespace):
    _node_taken_after_the_check(cluster, namespace, f"c{uuid.uuid4().hex[:5]}", COSCHEDULING)
    pods = cluster.pods(namespace, "pair")
    group = pods[0].metadata.labels[gang_backend.COSCHEDULING_LABEL]
    assert {p.metadata.labels[gang_backend.COSCHEDULING_LABEL] for p in pods} == {group}
    assert {p.spec.scheduler_name for p in pods} == {SCHEDULER}
    found = _pod_group(cluster, namespace, group)  # the real CRD's validation took it
    assert found["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 10}
    assert (
        found["metadata"]["ownerReferences"][0]["uid"]
        == cluster.job(namespace, "pair")["metadata"]["uid"]
    )
    # the second scheduler has tried the gang (one node is free, one is not) and bound nothing
    wait_for("the second scheduler's refusal", lambda: _refused_by(cluster, namespace, "pair"), 60)
    assert _bound(cluster, namespace, "pair") == {"pair-r0-0": None, "pair-r0-1": None}
    cluster.core.delete_namespaced_pod("intruder", namespace, grace_period_seconds=0)
    wait_for("the whole gang bound", lambda: all(_bound(cluster, namespace, "pair").values()), 90)
    assert {_binder(cluster, namespace, p) for p in ("pair-r0-0", "pair-r0-1")} == {SCHEDULER}


def test_without_a_gang_backend_the_same_gang_binds_half(cluster, namespace):
    nodes = _node_taken_after_the_check(
        cluster, namespace, f"n{uuid.uuid4().hex[:5]}", gang_backend.GangBackend(kind="none")
    )
    pods = cluster.pods(namespace, "pair")
    assert all(p.spec.scheduler_name == "default-scheduler" for p in pods)
    assert all(gang_backend.COSCHEDULING_LABEL not in p.metadata.labels for p in pods)
    wait_for(
        "pod 0 bound", lambda: _bound(cluster, namespace, "pair")["pair-r0-0"] in nodes, timeout=30
    )
    time.sleep(2)
    assert _bound(cluster, namespace, "pair")["pair-r0-1"] is None  # half a gang holds a node
    assert _binder(cluster, namespace, "pair-r0-0") == "default-scheduler"


def test_a_gang_that_fits_binds_whole_through_the_operators_own_passes(cluster, namespace):
    pool = f"f{uuid.uuid4().hex[:5]}"
    nodes = {cluster.add_node(pool, gpus=2) for _ in range(4)}
    cluster.apply(JobBuilder("fits", namespace, pool).layout(data=8).gpus(2))
    reconcile_passes(cluster, namespace, "fits", passes=3, settings=_settings(COSCHEDULING))
    pods = cluster.wait_gang(namespace, "fits", 4)  # the operator lifted the gates
    wait_for("the gang bound", lambda: all(_bound(cluster, namespace, "fits").values()), 90)
    assert set(_bound(cluster, namespace, "fits").values()) == nodes
    assert {_binder(cluster, namespace, p.metadata.name) for p in pods} == {SCHEDULER}


def test_native_where_the_api_is_not_served_is_refused_naming_the_feature_gates(cluster, namespace):
    pool = f"x{uuid.uuid4().hex[:5]}"
    cluster.add_node(pool, gpus=2)
    cluster.apply(JobBuilder("solo", namespace, pool).layout(data=2).gpus(2))
    native = gang_backend.GangBackend(kind="native")
    reconcile_passes(cluster, namespace, "solo", settings=_settings(native))
    (event, *_) = cluster.events(namespace, "solo", "CreateRejected")
    assert "PodGroup" in event.message and "GenericWorkload and GangScheduling" in event.message
    assert cluster.pods(namespace, "solo") == []  # no pod without its gang's PodGroup


@pytest.fixture(scope="module")
def operated(cluster, tmp_path_factory) -> Iterator[OperatorProcess]:
    """An operator process with ``--gang-backend coscheduling`` (from its env, as the chart sets
    it) watching :data:`OPERATED`, and a stand-in kubelet there."""
    cluster.core.create_namespace({"metadata": {"name": OPERATED}})
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    env = {
        "MESHTRAIN_GANG_BACKEND": "coscheduling",
        "MESHTRAIN_GANG_SCHEDULER_NAME": SCHEDULER,
        "MESHTRAIN_GANG_SCHEDULE_TIMEOUT_SECONDS": "10",
    }
    operator = OperatorProcess(
        cluster.kubeconfig, str(log), scope=("--namespace", OPERATED), env=env
    )
    with Kubelet(cluster, namespace=OPERATED):
        operator.start()
        try:
            yield operator
        finally:
            operator.stop()


def _bound_pod(cluster: Cluster, name: str) -> Any:
    def bound() -> Any:
        try:
            pod = cluster.core.read_namespaced_pod(name, OPERATED)
        except kubernetes.client.ApiException as err:
            if err.status == 404:
                return None
            raise
        return pod if pod.spec.node_name else None

    return wait_for(f"{name} bound", bound, 90)


def test_spares_replacements_and_a_rebuilt_gang_go_through_the_second_scheduler(cluster, operated):
    pool = f"o{uuid.uuid4().hex[:5]}"
    nodes = {cluster.add_node(pool, gpus=2) for _ in range(5)}
    job = JobBuilder("keep", OPERATED, pool).layout(data=6).gpus(2)
    job.run_policy(recovery={"spareNodes": 1})
    cluster.apply(job)
    gang = cluster.wait_gang(OPERATED, "keep", 3, timeout=60)
    first = gang[0].metadata.labels[gang_backend.COSCHEDULING_LABEL]
    assert _pod_group(cluster, OPERATED, first)["spec"]["minMember"] == 3
    for pod in gang:
        assert _bound_pod(cluster, pod.metadata.name).spec.scheduler_name == SCHEDULER
        assert _binder(cluster, OPERATED, pod.metadata.name) == SCHEDULER
    cluster.wait_phase(OPERATED, "keep", "Running", timeout=60)
    (spare,) = wait_for(
        "a spare reserved", lambda: cluster.status(OPERATED, "keep").get("spares"), 60
    )
    held = _bound_pod(cluster, spare["pod"])  # no PodGroup: the spare binds alone
    assert gang_backend.COSCHEDULING_LABEL not in held.metadata.labels
    assert _binder(cluster, OPERATED, spare["pod"]) == SCHEDULER
    cluster.core.delete_namespaced_pod("keep-r0-1", OPERATED)  # the kubelet confirms it
    replaced = _bound_pod(cluster, "keep-r0-1-p1")
    assert replaced.spec.node_name == spare["node"] and replaced.spec.scheduler_name == SCHEDULER
    assert _binder(cluster, OPERATED, "keep-r0-1-p1") == SCHEDULER
    assert cluster.status(OPERATED, "keep").get("restarts", 0) == 0
    cluster.core.delete_namespaced_pod("keep-r0-0", OPERATED)  # pod 0 lost: the gang is rebuilt
    rebuilt = cluster.wait_gang(OPERATED, "keep", 3, timeout=90, attempt=1)
    second = rebuilt[0].metadata.labels[gang_backend.COSCHEDULING_LABEL]
    assert second != first and "-r1-" in second
    assert {p.metadata.labels[gang_backend.COSCHEDULING_LABEL] for p in rebuilt} == {second}
    group = _pod_group(cluster, OPERATED, second)
    assert group["spec"]["minMember"] == 3
    assert group["metadata"]["ownerReferences"][0]["kind"] == "TrainingJob"
    assert {_bound_pod(cluster, p.metadata.name).spec.node_name for p in rebuilt} <= nodes
    assert {_binder(cluster, OPERATED, p.metadata.name) for p in rebuilt} == {SCHEDULER}
    assert cluster.status(OPERATED, "keep")["restarts"] == 1
