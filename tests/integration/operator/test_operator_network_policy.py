"""Each gang's own NetworkPolicy against a real API server (``make test`` tier).

With ``MESHTRAIN_GANG_NETWORK_POLICY_NAMESPACES`` naming the namespace (the chart's
``--gang-network-policy-namespace``), the operator creates, with the gang, a NetworkPolicy
owned by the job whose selectors, evaluated by the API server against the real pods, select
exactly the gang's pods, as targets and as peers, and that admits the operator and Prometheus
the chart names (``MESHTRAIN_GANG_NETWORK_POLICY_*_PEERS``) on their ports alone; it goes with
the job.  Without it none is
created.  Traffic itself needs a kubelet and a policy enforcer: tests/e2e/test_sandbox.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import kubernetes
import pytest

from meshtrain.operator.policy import conditions
from tests.builders import JobBuilder
from tests.integration.operator.cluster import OperatorProcess, wait_for

pytestmark = pytest.mark.integration


def _selector(selector: dict) -> str:
    """A LabelSelector of matchLabels (what the operator writes) as a ``label_selector`` query."""
    assert set(selector) == {"matchLabels"}, selector
    return ",".join(f"{key}={value}" for key, value in selector["matchLabels"].items())


def _selected(cluster, namespace: str, selector: dict) -> set[str]:
    """The pods the API server itself lists for ``selector``."""
    listed = cluster.core.list_namespaced_pod(namespace, label_selector=_selector(selector))
    return {p.metadata.name for p in listed.items}


def _policies(kube_api, namespace: str) -> dict[str, dict]:
    networking = kubernetes.client.NetworkingV1Api(kube_api)
    listed = networking.list_namespaced_network_policy(namespace)
    return {
        p.metadata.name: kube_api.sanitize_for_serialization(p)
        for p in listed.items
        if p.metadata.deletion_timestamp is None
    }


OPERATOR = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "meshtrain-system"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "meshtrain"}},
}
"""The operator's pods, as the chart names them to the operator."""
PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
"""The Prometheus the chart's values name."""


def _isolating_operator(cluster, namespace: str, tmp_path, isolated: str = "") -> OperatorProcess:
    """An operator of this namespace alone that isolates the gangs of ``isolated`` (default: of
    this namespace; not started)."""
    return OperatorProcess(
        cluster.kubeconfig,
        str(tmp_path / f"operator-{isolated or 'isolating'}.log"),
        scope=("--namespace", namespace),
        lease=f"isolating-{isolated or 'own'}-{namespace}",
        env={
            "MESHTRAIN_GANG_NETWORK_POLICY_NAMESPACES": isolated or f"elsewhere,{namespace}",
            "MESHTRAIN_GANG_NETWORK_POLICY_OPERATOR_PEERS": json.dumps([OPERATOR]),
            "MESHTRAIN_GANG_NETWORK_POLICY_METRICS_PEERS": json.dumps([PROMETHEUS]),
        },
    )


@pytest.fixture
def isolating(cluster, operator, namespace, tmp_path) -> Iterator[OperatorProcess]:
    """An operator of this namespace alone that isolates its gangs (the session's stopped)."""
    with _isolating_operator(cluster, namespace, tmp_path).instead_of(operator) as own:
        yield own


def test_each_gang_gets_a_policy_admitting_only_its_own_pods_deleted_with_the_job(
    cluster, isolating, namespace, pool, kube_api
):
    cluster.add_node(pool, gpus=4)
    llm = cluster.apply(JobBuilder("llm", namespace, pool).layout(data=2).gpus(1))
    cluster.apply(JobBuilder("other", namespace, pool).layout(data=2).gpus(1))
    gang = {p.metadata.name for p in cluster.wait_gang(namespace, "llm", 2, timeout=60)}
    theirs = {p.metadata.name for p in cluster.wait_gang(namespace, "other", 2, timeout=60)}
    policies = _policies(kube_api, namespace)
    assert set(policies) == {"llm-gang", "other-gang"}
    policy = policies["llm-gang"]
    [owner] = policy["metadata"]["ownerReferences"]
    assert owner["uid"] == llm["metadata"]["uid"] and owner["controller"] is True
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    # Self-contained: the operator (its /progress on rank 0's exporter port) and Prometheus
    # (every local rank's exporter) get in without the chart's trainer policy; the rendezvous
    # port (torchrun's unauthenticated TCPStore) is the gang's alone.
    rule, operator_rule, scraper_rule = policy["spec"]["ingress"]
    container = cluster.core.read_namespaced_pod(sorted(gang)[0], namespace).spec.containers[0]
    ports = {p.name: p.container_port for p in container.ports}
    assert operator_rule == {
        "from": [OPERATOR],
        "ports": [{"port": ports["metrics-0"], "protocol": "TCP"}],
    }
    assert scraper_rule["from"] == [PROMETHEUS]
    [scraped] = scraper_rule["ports"]  # gpusPerNode 1: one exporter
    assert scraped == {"port": ports["metrics-0"], "protocol": "TCP"}
    assert set(ports) == {"metrics-0", "rendezvous"}
    assert "ports" not in rule, "rendezvous and collectives use any port"
    [peer] = rule["from"]
    assert set(peer) == {"podSelector"}, "peers of the policy's own namespace only"
    assert _selected(cluster, namespace, policy["spec"]["podSelector"]) == gang
    assert _selected(cluster, namespace, peer["podSelector"]) == gang
    assert not gang & theirs

    cluster.delete_job(namespace, "llm")
    wait_for("llm's policy deleted", lambda: "llm-gang" not in _policies(kube_api, namespace))
    assert set(_policies(kube_api, namespace)) == {"other-gang"}


def test_a_policy_of_the_same_name_owned_by_someone_else_is_a_name_conflict(
    cluster, isolating, namespace, pool, kube_api
):
    cluster.add_node(pool, gpus=1)
    networking = kubernetes.client.NetworkingV1Api(kube_api)
    theirs = networking.create_namespaced_network_policy(
        namespace, {"metadata": {"name": "web-gang"}, "spec": {"podSelector": {}}}
    )
    cluster.apply(JobBuilder("web", namespace, pool))
    placed = wait_for(
        "NameConflict",
        lambda: (
            (c := cluster.condition(namespace, "web", conditions.PLACED)).get("reason")
            == conditions.NAME_CONFLICT
            and c
        ),
        timeout=30,
    )
    assert f"NetworkPolicy {namespace}/web-gang already exists" in placed["message"]
    assert cluster.pods(namespace, "web") == []
    cluster.delete_job(namespace, "web")
    wait_for("job deleted", lambda: cluster.job(namespace, "web") is None)
    after = networking.read_namespaced_network_policy("web-gang", namespace)
    assert after.metadata.uid == theirs.metadata.uid  # neither patched nor deleted
    assert after.metadata.resource_version == theirs.metadata.resource_version


def test_no_policy_where_the_namespace_is_not_named(cluster, operator, namespace, pool, kube_api):
    cluster.add_node(pool, gpus=1)
    cluster.apply(JobBuilder("open", namespace, pool))
    cluster.wait_gang(namespace, "open", 1, timeout=60)
    assert _policies(kube_api, namespace) == {}


def test_a_policy_the_job_owns_is_brought_up_to_date_when_its_gang_is_ensured_again(
    cluster, isolating, namespace, pool, kube_api
):
    cluster.add_node(pool, gpus=2)
    cluster.apply(JobBuilder("llm", namespace, pool).layout(data=2).gpus(1))
    gang = cluster.wait_gang(namespace, "llm", 2, timeout=60)
    networking = kubernetes.client.NetworkingV1Api(kube_api)
    own = {"podSelector": {"matchLabels": {"meshtrain.io/job": "llm"}}}
    stale = {"spec": {"ingress": [{"from": [own]}]}}  # as an older operator left it
    networking.patch_namespaced_network_policy("llm-gang", namespace, stale)
    cluster.core.delete_namespaced_pod(gang[0].metadata.name, namespace, grace_period_seconds=0)
    policy = wait_for(
        "the policy admits the operator and Prometheus again",
        lambda: (
            len((p := _policies(kube_api, namespace)["llm-gang"])["spec"]["ingress"]) == 3 and p
        ),
        timeout=60,
    )
    assert [rule["from"] for rule in policy["spec"]["ingress"]] == [[own], [OPERATOR], [PROMETHEUS]]


def test_isolation_turned_on_while_gangs_run_gives_them_policies_and_off_removes_only_its_own(
    cluster, operator, namespace, pool, kube_api, tmp_path
):
    cluster.add_node(pool, gpus=4)
    llm = cluster.apply(JobBuilder("llm", namespace, pool).layout(data=2).gpus(1))
    cluster.apply(JobBuilder("other", namespace, pool).layout(data=2).gpus(1))
    cluster.wait_gang(namespace, "llm", 2, timeout=60)
    cluster.wait_gang(namespace, "other", 2, timeout=60)
    assert _policies(kube_api, namespace) == {}  # the session's operator isolates no namespace
    networking = kubernetes.client.NetworkingV1Api(kube_api)
    theirs = networking.create_namespaced_network_policy(
        namespace, {"metadata": {"name": "other-gang"}, "spec": {"podSelector": {}}}
    )

    with _isolating_operator(cluster, namespace, tmp_path).instead_of(operator):
        policy = wait_for(
            "the running gang's policy",
            lambda: _policies(kube_api, namespace).get("llm-gang"),
            timeout=30,
        )
        [owner] = policy["metadata"]["ownerReferences"]
        assert owner["uid"] == llm["metadata"]["uid"]
        assert len(policy["spec"]["ingress"]) == 3  # its own pods, the operator, Prometheus

    # The namespace dropped from the isolated ones: the job's own policy goes, not a foreign one.
    with _isolating_operator(cluster, namespace, tmp_path, "elsewhere").instead_of(operator):
        wait_for("llm's policy removed", lambda: "llm-gang" not in _policies(kube_api, namespace))
    after = networking.read_namespaced_network_policy("other-gang", namespace)
    assert after.metadata.uid == theirs.metadata.uid  # neither patched nor deleted
    assert after.metadata.resource_version == theirs.metadata.resource_version
