"""In-place restarts on the real API server (Kubernetes 1.36).

1. The gang's pods as the operator builds them carry the kubelet tier (the trainer container's
   ``restartPolicy: Never`` and ``restartPolicyRules``; not pod 0, whose supervisor hosts the
   rendezvous store), the operator uses the rules where the API server accepts them (its version,
   asked once), and the API server takes the pods as built, a
   pod template override's sidecars and init containers included; a rule the server's validation
   refuses is refused (the rules are judged, not dropped); an override of the trainer's rules
   fails the job naming the field.
2. A running gang whose pod reports (through the status subresource, as a kubelet writes it) a
   trainer container restarted in place is not rebuilt: ``status.recovery`` counts it with its
   cause, an Event names it, and once in-place restarts pass ``inPlaceLimit`` the gang is rebuilt.
3. A custom trainer's pods but pod 0 carry KEP-5532's ``RestartAllContainers`` action (the whole
   pod restarts in place when torchrun's agent is killed), used where the API server accepts it,
   and stored as built; a misspelt action is refused.
That the kubelet restarts the container by these rules is the sandbox's test
(tests/e2e/test_sandbox_in_place.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import kubernetes
import pytest

from meshtrain.api import loading
from meshtrain.operator import reconciler
from meshtrain.operator.cluster import kube
from meshtrain.operator.policy import (
    builders,
    conditions,
    identity,
    kubelet_tier,
    naming,
    recovery_count,
)
from tests.builders import JobBuilder
from tests.integration.operator.cluster import wait_for
from tests.integration.operator.test_operator_pod_template import OVERRIDE

pytestmark = pytest.mark.integration

REF = identity.JobRef(
    name="inplace", namespace="unused", uid="0b6c1f5e-6f8e-4c7a-9a43-3f1e2d4c5b6a"
)


def _stored(cluster, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
    """``pod`` created with ``dryRun=All``: as the API server would store it (validated, defaulted)."""
    pod = {**pod, "metadata": {**pod["metadata"], "namespace": namespace}}
    created = cluster.core.create_namespaced_pod(namespace, pod, dry_run="All")
    return cluster.core.api_client.sanitize_for_serialization(created)


def _trainer(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == naming.CONTAINER)


def test_the_pods_as_built_are_accepted_with_their_restart_rules(cluster, namespace):
    job = JobBuilder().layout(data=6).gpus(2).pod_template(OVERRIDE)
    spec = loading.parse_spec(job.raw())
    first, *others = builders.build_pods(REF, spec, 0, ["n0", "n1", "n2"])
    stored = _stored(cluster, namespace, first)
    assert "restartPolicyRules" not in _trainer(stored), "pod 0 hosts the store: a gang rebuild"
    assert "restartPolicy" not in _trainer(stored)
    for pod in others:
        stored = _stored(cluster, namespace, pod)
        trainer = _trainer(stored)
        assert trainer["command"] == list(kubelet_tier.SUPERVISOR_COMMAND)
        assert trainer["restartPolicy"] == "Never"
        assert trainer["restartPolicyRules"] == _trainer(pod)["restartPolicyRules"]
        assert trainer["restartPolicyRules"][0]["exitCodes"]["values"] == list(
            kubelet_tier.RESTART_CODES
        )
        assert stored["spec"]["restartPolicy"] == "Never"
        assert [c["name"] for c in stored["spec"]["initContainers"]] == ["warm-cache", "ship-logs"]
    custom = loading.parse_spec(JobBuilder().trainer(type="custom", command=["torchrun"]).raw())
    stored = _stored(cluster, namespace, builders.build_pod(REF, custom, 0, 0, "n0"))
    assert "restartPolicyRules" not in _trainer(stored), "a custom trainer keeps the gang rebuild"


def test_the_api_server_judges_the_rules_it_is_given(cluster, namespace):
    spec = loading.parse_spec(JobBuilder().layout(data=2).gpus(1).raw())
    pod = builders.build_pod(REF, spec, 0, 1, "n0")
    del _trainer(pod)["restartPolicy"]  # rules without the container's own policy
    with pytest.raises(kubernetes.client.ApiException) as refused:
        _stored(cluster, namespace, pod)
    assert refused.value.status == 422
    assert "restartPolicy" in refused.value.body and "restart rules" in refused.value.body


def _resolved(cluster, settings: reconciler.Settings) -> reconciler.Settings:
    async def resolve() -> reconciler.Settings:
        client = await kube.Client.connect(kubeconfig=cluster.kubeconfig)
        try:
            return await reconciler.resolved(client, settings)
        finally:
            await client.close()

    return asyncio.run(resolve())


def test_the_operator_uses_restart_rules_where_the_api_server_accepts_them(cluster, namespace):
    spec = loading.parse_spec(JobBuilder().layout(data=2).gpus(1).raw())
    try:  # the source of truth: does this API server take a pod with the rules?
        _stored(cluster, namespace, builders.build_pod(REF, spec, 0, 1, "n1"))
        accepted = True
    except kubernetes.client.ApiException as refused:
        assert refused.status == 422 and "restartPolicy" in refused.body
        accepted = False
    detected = _resolved(cluster, reconciler.Settings())
    assert detected.container_restart_rules is accepted
    told = reconciler.Settings(container_restart_rules=not accepted, restart_all_containers="on")
    assert _resolved(cluster, told) == told, "explicit flags are not asked"
    told = reconciler.Settings(container_restart_rules=not accepted)  # restart-all: auto, asked
    assert _resolved(cluster, told).container_restart_rules is (not accepted)
    for pod in builders.build_pods(REF, spec, 0, ["n0", "n1"], restart_rules=False):
        trainer = _trainer(_stored(cluster, namespace, pod))  # accepted by any API server
        assert "restartPolicy" not in trainer and "restartPolicyRules" not in trainer


def test_an_override_of_the_trainers_restart_rules_fails_the_job_naming_it(
    cluster, operator, namespace, pool
):
    cluster.add_node(pool, gpus=8)
    rules = [{"action": "Restart", "exitCodes": {"operator": "NotIn", "values": [0]}}]
    override = {"containers": [{"name": naming.CONTAINER, "restartPolicyRules": rules}]}
    job = JobBuilder("rules", namespace, pool).layout(data=2).pod_template(override)
    cluster.apply(job)
    cluster.wait_phase(namespace, "rules", "Failed")
    failed = cluster.condition(namespace, "rules", "Failed")
    assert failed["reason"] == conditions.INVALID_SPEC
    assert "spec.podTemplateOverride.spec.containers[0].restartPolicyRules" in failed["message"]
    assert not cluster.pods(namespace, "rules")


def _restarted(cluster, namespace: str, pod: str, count: int, exit_code: int = 137) -> None:
    """What the kubelet writes once it restarted the trainer container in place ``count`` times."""
    trainer = {
        "name": naming.CONTAINER,
        "ready": True,
        "restartCount": count,
        "image": "trainer",
        "imageID": "",
        "state": {"running": {"startedAt": "2026-01-01T00:02:00Z"}},
        "lastState": {
            "terminated": {
                "exitCode": exit_code,
                "reason": "Error",
                "startedAt": "2026-01-01T00:00:00Z",
                "finishedAt": "2026-01-01T00:01:00Z",
            }
        },
    }
    cluster.core.patch_namespaced_pod_status(
        pod, namespace, {"status": {"phase": "Running", "containerStatuses": [trainer]}}
    )


def test_a_container_restarted_in_place_is_counted_and_past_the_budget_the_gang_rebuilt(
    cluster, operator, namespace, pool
):
    cluster.add_node(pool, gpus=8)
    job = JobBuilder("inplace", namespace, pool).layout(data=2).gpus(1)
    cluster.apply(job.run_policy(recovery={"inPlaceLimit": 2}))
    pods = cluster.wait_gang(namespace, "inplace", 2)
    uids = {p.metadata.name: p.metadata.uid for p in pods}
    for i, pod in enumerate(pods):
        cluster.set_pod_phase(namespace, pod.metadata.name, "Running", ip=f"10.9.0.{i + 1}")
    cluster.wait_phase(namespace, "inplace", "Running")

    _restarted(cluster, namespace, "inplace-r0-1", 1)
    wait_for(
        "the in-place restart counted",
        lambda: (
            (cluster.status(namespace, "inplace").get("recovery") or {}).get("inPlaceRestarts") == 1
        ),
    )
    status = cluster.status(namespace, "inplace")
    recovery = status["recovery"]
    assert recovery["byTier"] == {"process": 0, "container": 1, "pod": 0}
    assert recovery["last"]["cause"] == "SIGKILL" and recovery["last"]["pod"] == "inplace-r0-1"
    assert status.get("restarts", 0) == 0 and status["phase"] == "Running"
    assert {p.metadata.name: p.metadata.uid for p in cluster.pods(namespace, "inplace")} == uids
    [event] = cluster.events(namespace, "inplace", recovery_count.RESTARTED)
    assert "inplace-r0-1" in event.message and "SIGKILL" in event.message

    # the same restart seen again counts nothing; two more pass inPlaceLimit=2
    _restarted(cluster, namespace, "inplace-r0-1", 1)
    _restarted(cluster, namespace, "inplace-r0-0", 2, exit_code=1)
    cluster.wait_gang(namespace, "inplace", 2, attempt=1)
    status = cluster.status(namespace, "inplace")
    assert status["restarts"] == 1, status
    assert status["recovery"]["inPlaceRestarts"] == 3
    assert status["recovery"]["byTier"]["container"] == 3
    rebuilt = cluster.events(namespace, "inplace", recovery_count.EXHAUSTED)
    assert rebuilt and "inPlaceLimit=2" in rebuilt[0].message


def _custom_pods(restart_all: bool) -> list[dict[str, Any]]:
    job = (
        JobBuilder()
        .layout(data=3)
        .gpus(1)
        .trainer(type="custom", command=["torchrun", "/app/train.py"])
        .run_policy(recovery={"torchrunElastic": True})
        .pod_template(OVERRIDE)
    )
    spec = loading.parse_spec(job.raw())
    return builders.build_pods(REF, spec, 0, ["n0", "n1", "n2"], restart_all=restart_all)


def test_a_custom_trainers_pods_restart_whole_in_place_where_the_api_server_serves_it(
    cluster, namespace
):
    """KEP-5532: the ``RestartAllContainers`` action, stored as built (judged, not dropped)."""
    first, *others = _custom_pods(restart_all=True)
    assert "restartPolicyRules" not in _trainer(_stored(cluster, namespace, first))
    for pod in others:
        stored = _stored(cluster, namespace, pod)
        trainer = _trainer(stored)
        assert trainer["command"] == ["torchrun", "/app/train.py"]
        assert trainer["restartPolicy"] == "Never"
        assert trainer["restartPolicyRules"] == [
            {
                "action": "RestartAllContainers",
                "exitCodes": {"operator": "In", "values": list(kubelet_tier.POD_RESTART_CODES)},
            }
        ]
        assert 1 not in trainer["restartPolicyRules"][0]["exitCodes"]["values"]
        assert [c["name"] for c in stored["spec"]["initContainers"]] == ["warm-cache", "ship-logs"]
    misspelt = others[0]
    _trainer(misspelt)["restartPolicyRules"][0]["action"] = "RestartAll"
    with pytest.raises(kubernetes.client.ApiException) as refused:
        _stored(cluster, namespace, misspelt)
    assert refused.value.status == 422 and "RestartAllContainers" in refused.value.body


def test_the_operator_restarts_whole_pods_where_the_api_server_accepts_it(cluster, namespace):
    try:  # the source of truth: does this API server take a pod with the action?
        _stored(cluster, namespace, _custom_pods(restart_all=True)[1])
        accepted = True
    except kubernetes.client.ApiException as refused:
        assert refused.status == 422 and "RestartAllContainers" in refused.body
        accepted = False
    resolved = _resolved(cluster, reconciler.Settings()).restart_all_containers
    assert resolved == ("auto" if accepted else "off")  # auto: the nodes decide
    for pod in _custom_pods(restart_all=False):  # accepted by any API server
        trainer = _trainer(_stored(cluster, namespace, pod))
        assert "restartPolicy" not in trainer and "restartPolicyRules" not in trainer


def test_a_node_declares_restart_all_containers_where_the_api_server_keeps_the_field(
    cluster, namespace
):
    """The field and feature names as the API server stores a Node (``status.declaredFeatures``,
    kept from 1.36 on, where the NodeDeclaredFeatures gate is on by default)."""
    code = kubernetes.client.VersionApi(cluster.core.api_client).get_code()
    served = kubelet_tier.all_containers_served({"major": code.major, "minor": code.minor})
    stored = []
    for name, features in (("declaring", [kubelet_tier.NODE_FEATURE]), ("older", None)):
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"{namespace}-{name}"}}
        if features is not None:
            node["status"] = {"declaredFeatures": features}
        created = cluster.core.create_node(node, dry_run="All", _preload_content=False)
        stored.append(json.loads(created.data))
    assert kubelet_tier.declares(stored[0]) is served
    assert not kubelet_tier.declares(stored[1])
    assert kubelet_tier.declares_all("auto", stored) is False, "none of the gang"
