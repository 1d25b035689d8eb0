"""Refused children on the real API server: a clear condition and Event, a capped backoff, nothing foreign touched."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from kubernetes import client, watch

from meshtrain.operator.policy import conditions
from tests.builders import JobBuilder
from tests.integration.operator.cluster import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def restricted(cluster) -> Iterator[str]:
    name = f"r-{uuid.uuid4().hex[:8]}"
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    cluster.core.create_namespace({"metadata": {"name": name, "labels": labels}})
    yield name
    cluster.core.delete_namespace(name)


def _placed(cluster, namespace: str, name: str, reason: str) -> dict:
    return wait_for(
        f"Placed=False/{reason}",
        lambda: (
            (c := cluster.condition(namespace, name, conditions.PLACED)).get("reason") == reason
            and c
        ),
        timeout=30,
    )


def _events(cluster, namespace: str, reason: str) -> list:
    """The job's Events of ``reason`` (recorded just after the condition: waited for)."""
    return wait_for(
        f"a {reason} Event",
        lambda: [
            e for e in cluster.core.list_namespaced_event(namespace).items if e.reason == reason
        ],
    )


def test_a_create_refused_by_pod_security_is_reported_and_retried_with_backoff(
    cluster, operator, restricted, pool
):
    cluster.add_node(pool, gpus=2)
    job = (
        JobBuilder("rdma", restricted, pool).layout(data=2).gpus(2).pod(rdma=True, rdmaResource="")
    )
    cluster.apply(job)
    placed = _placed(cluster, restricted, "rdma", conditions.CREATE_REJECTED)
    assert placed["status"] == "False"
    assert 'violates PodSecurity "restricted' in placed["message"]
    assert "IPC_LOCK" in placed["message"]  # the API server's own words name what is refused
    events = _events(cluster, restricted, conditions.CREATE_REJECTED)
    assert "violates PodSecurity" in events[0].message
    assert cluster.status(restricted, "rdma").get("phase") == "Pending"

    def tries() -> int:
        """The try count of the last refusal (0 while a new try is creating its pods)."""
        message = cluster.condition(restricted, "rdma", conditions.PLACED)["message"]
        found = re.search(r"try (\d+)", message)
        return int(found.group(1)) if found else 0

    started = time.monotonic()
    wait_for("a second try", lambda: tries() >= 2, timeout=30)
    time.sleep(6)  # tries at 0, 2, 6, 14 s...: a handful in this time, never a hot loop
    elapsed = time.monotonic() - started
    assert tries() <= 2 + elapsed / 2, (tries(), elapsed)
    assert cluster.pods(restricted, "rdma") == []


@pytest.fixture
def services_refused(cluster, namespace) -> Iterator[Callable[[], None]]:
    """A ValidatingAdmissionPolicy refusing every Service created in ``namespace``; call to lift it."""
    admission = client.AdmissionregistrationV1Api(cluster.core.api_client)
    name = f"no-services-{namespace}"
    admission.create_validating_admission_policy(
        {
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["services"],
                        }
                    ]
                },
                "validations": [{"expression": "false", "message": "services are frozen here"}],
            },
        }
    )
    admission.create_validating_admission_policy_binding(
        {
            "metadata": {"name": name},
            "spec": {
                "policyName": name,
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
                },
            },
        }
    )

    def refused() -> bool:
        probe = {"metadata": {"name": "probe"}, "spec": {"ports": [{"port": 80}]}}
        try:
            cluster.core.create_namespaced_service(namespace, probe, dry_run="All")
        except client.ApiException as err:
            return "frozen" in (err.body or "")  # 422: the policy's denial
        return False

    wait_for("the policy in force", refused)  # the API server loads policies asynchronously
    lifted = False

    def lift() -> None:
        nonlocal lifted
        if not lifted:
            admission.delete_validating_admission_policy_binding(name)
            wait_for("the policy lifted", lambda: not refused())
            lifted = True

    yield lift
    lift()
    admission.delete_validating_admission_policy(name)


def test_no_pod_is_created_before_its_service_and_the_gang_places_once_it_is_allowed(
    cluster, operator, namespace, pool, services_refused
):
    """A refused Service stops the placement before any pod: no gang runs without its DNS names.

    A watch from the resourceVersion before the job was applied sees every pod ever
    created in the namespace.
    """
    cluster.add_node(pool, gpus=2)
    since = cluster.core.list_namespaced_pod(namespace).metadata.resource_version
    cluster.apply(JobBuilder("dns", namespace, pool).layout(data=2).gpus(1))
    placed = _placed(cluster, namespace, "dns", conditions.CREATE_REJECTED)
    assert f"Service {namespace}/dns" in placed["message"], placed["message"]
    assert "services are frozen here" in placed["message"], placed["message"]
    created = [
        event["object"].metadata.name
        for event in watch.Watch().stream(
            cluster.core.list_namespaced_pod,
            namespace,
            resource_version=since,
            timeout_seconds=2,
        )
        if event["type"] == "ADDED"
    ]
    assert created == []
    services_refused()
    pods = cluster.wait_gang(namespace, "dns", 2, timeout=60)
    assert len(pods) == 2
    assert cluster.core.read_namespaced_service("dns", namespace).spec.cluster_ip == "None"


def test_a_service_of_the_same_name_owned_by_someone_else_is_a_name_conflict(
    cluster, operator, namespace, pool
):
    cluster.add_node(pool, gpus=1)
    theirs = cluster.core.create_namespaced_service(
        namespace,
        {
            "metadata": {"name": "web", "labels": {"team": "frontend"}},
            "spec": {"ports": [{"port": 80}], "selector": {"app": "web"}},
        },
    )
    cluster.apply(JobBuilder("web", namespace, pool))
    placed = _placed(cluster, namespace, "web", conditions.NAME_CONFLICT)
    assert f"Service {namespace}/web already exists" in placed["message"]
    assert "already exists" in _events(cluster, namespace, conditions.NAME_CONFLICT)[0].message
    assert cluster.pods(namespace, "web") == []
    cluster.delete_job(namespace, "web")
    wait_for("job deleted", lambda: cluster.job(namespace, "web") is None)
    after = cluster.core.read_namespaced_service("web", namespace)
    assert after.metadata.uid == theirs.metadata.uid  # neither patched nor deleted
    assert after.metadata.resource_version == theirs.metadata.resource_version
    assert after.spec.selector == {"app": "web"}


def test_pods_of_an_earlier_job_of_the_same_name_are_neither_adopted_nor_deleted(
    cluster, operator, namespace, pool
):
    """A job re-applied while its predecessor's pod still terminates waits for it, then runs."""
    cluster.add_node(pool, gpus=1)
    earlier = {
        "metadata": {
            "name": "again-r0-0",
            "labels": {
                "meshtrain.io/job": "again",
                "meshtrain.io/attempt": "0",
                "meshtrain.io/node-rank": "0",
            },
            "ownerReferences": [
                {
                    "apiVersion": "meshtrain.io/v1alpha1",
                    "kind": "TrainingJob",
                    "name": "again",
                    "uid": str(uuid.uuid4()),
                    "controller": True,
                }
            ],
            "finalizers": ["meshtrain.test/hold"],
        },
        "spec": {"containers": [{"name": "trainer", "image": "pause"}]},
    }
    cluster.core.create_namespaced_pod(namespace, earlier)
    cluster.core.delete_namespaced_pod(
        "again-r0-0", namespace
    )  # terminating: held by the finalizer
    cluster.apply(JobBuilder("again", namespace, pool))
    placed = _placed(cluster, namespace, "again", conditions.NAME_CONFLICT)
    assert f"Pod {namespace}/again-r0-0 already exists" in placed["message"]
    held = cluster.core.read_namespaced_pod("again-r0-0", namespace)
    assert held.spec.containers[0].image == "pause"  # not ours: untouched
    cluster.core.patch_namespaced_pod("again-r0-0", namespace, {"metadata": {"finalizers": None}})
    [pod] = cluster.wait_gang(namespace, "again", 1, timeout=40)
    assert (
        pod.metadata.owner_references[0].uid == cluster.job(namespace, "again")["metadata"]["uid"]
    )


def test_a_namesake_created_after_a_refused_job_is_placed_without_its_backoff(
    cluster, operator, restricted, pool
):
    cluster.add_node(pool, gpus=2)
    refused = JobBuilder("same", restricted, pool).layout(data=2).gpus(2)
    cluster.apply(refused.pod(rdma=True, rdmaResource=""))
    wait_for(
        "a third refused try (next one 8 s later)",
        lambda: (
            "(try 3;" in cluster.condition(restricted, "same", conditions.PLACED).get("message", "")
        ),
        timeout=30,
    )
    cluster.delete_job(restricted, "same")
    wait_for("job deleted", lambda: cluster.job(restricted, "same") is None)
    cluster.apply(JobBuilder("same", restricted, pool).layout(data=2).gpus(2))
    cluster.wait_gang(restricted, "same", 1, timeout=5)  # the earlier job's backoff is not its
