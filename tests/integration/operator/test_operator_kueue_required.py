"""Kueue required for every TrainingJob (the chart's ``kueue.requireQueue: default``), real Kueue.

The operator runs with ``--default-queue default`` (env MESHTRAIN_DEFAULT_QUEUE, as the chart
passes the flag) on a real API server with Kueue v0.17.0 built from its Go module:

- a job that names no LocalQueue is labelled with the namespace's ``default`` before anything
  places it, said by an Event, and Kueue admits it from that LocalQueue's quota;
- in a namespace without a LocalQueue ``default`` the job stays ``Queued`` with Kueue's own
  reason and no pod is ever created: nothing places it around Kueue;
- a job placed before the requirement was turned on keeps its gang and stays unlabelled.
CI tier (``make test``): a real control plane and Kueue suffice, no kubelet.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import kubernetes
import pytest

from meshtrain.operator.policy import kueue_workload, queue_defaulting
from meshtrain.sandbox import controlplane
from meshtrain.sandbox.controlplane import kueue
from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster, OperatorProcess, wait_for

pytestmark = pytest.mark.integration

QUEUED_NS, BARE_NS = "queued-team", "bare-team"
"""A namespace with a LocalQueue ``default``, and one without any."""
DEFAULT_QUEUE = "default"
"""Kueue's convention for a namespace's default LocalQueue (issue #32), not the constant under test."""
API_VERSION = f"{kueue_workload.GROUP}/{kueue_workload.VERSION}"


def _kueue_objects(cluster: Cluster) -> None:
    """One ClusterQueue of 8 GPUs; QUEUED_NS's LocalQueue ``default`` points at it."""
    custom, group, version = cluster.custom, kueue_workload.GROUP, kueue_workload.VERSION
    flavor = {"apiVersion": API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": "plain"}}
    custom.create_cluster_custom_object(group, version, "resourceflavors", flavor)
    quota = {"name": "nvidia.com/gpu", "nominalQuota": 8}
    cluster_queue = {
        "apiVersion": API_VERSION,
        "kind": "ClusterQueue",
        "metadata": {"name": "everyone"},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [
                {
                    "coveredResources": ["nvidia.com/gpu"],
                    "flavors": [{"name": "plain", "resources": [quota]}],
                }
            ],
        },
    }
    custom.create_cluster_custom_object(group, version, "clusterqueues", cluster_queue)
    local = {
        "apiVersion": API_VERSION,
        "kind": "LocalQueue",
        "metadata": {"name": DEFAULT_QUEUE},
        "spec": {"clusterQueue": "everyone"},
    }
    custom.create_namespaced_custom_object(group, version, QUEUED_NS, "localqueues", local)


@pytest.fixture(scope="module")
def required(control_plane_binaries, tmp_path_factory) -> Iterator[tuple[Cluster, OperatorProcess]]:
    work = tmp_path_factory.mktemp("kueue-required")
    with controlplane.ControlPlane(binaries=control_plane_binaries) as plane:
        api = kubernetes.config.new_client_from_config(config_file=str(plane.kubeconfig_path))
        cluster = Cluster(api, str(plane.kubeconfig_path), str(control_plane_binaries.kubectl))
        cluster.install_crds()
        for namespace in (QUEUED_NS, BARE_NS):
            cluster.core.create_namespace({"metadata": {"name": namespace}})
        with kueue.Kueue(plane, work, [kueue_workload.EXTERNAL_FRAMEWORK]):
            _kueue_objects(cluster)
            for _ in range(2):  # room for two gangs; the quota holds one
                cluster.add_node("req", gpus=8)
            process = OperatorProcess(str(plane.kubeconfig_path), str(work / "operator.log"))
            try:
                yield cluster, process
            finally:
                process.stop()
        api.close()


def _job(name: str, namespace: str) -> JobBuilder:
    return JobBuilder(name, namespace, pool="req").layout(data=8).gpus(8)


def _label(cluster: Cluster, namespace: str, name: str) -> str | None:
    labels = ((cluster.job(namespace, name) or {}).get("metadata") or {}).get("labels") or {}
    return labels.get(kueue_workload.QUEUE_LABEL)


def test_every_job_is_queued_in_the_namespaces_default_local_queue(required) -> None:
    cluster, process = required
    # Before the requirement: a job without the label is placed outside Kueue.
    process.start()
    try:
        cluster.apply(_job("legacy", QUEUED_NS))
        wait_for("legacy's gang", lambda: len(cluster.pods(QUEUED_NS, "legacy")) == 1, timeout=60)
    finally:
        process.stop()

    process.env = {"MESHTRAIN_DEFAULT_QUEUE": DEFAULT_QUEUE}
    process.start()
    cluster.apply(_job("plain", QUEUED_NS))
    wait_for(
        "plain labelled with the default LocalQueue",
        lambda: _label(cluster, QUEUED_NS, "plain") == "default",
        timeout=30,
    )
    admitted = wait_for(
        "plain admitted by Kueue from LocalQueue default",
        lambda: (
            (c := cluster.condition(QUEUED_NS, "plain", "Queued")).get("status") == "False" and c
        ),
        timeout=60,
    )
    assert "everyone" in admitted["message"], admitted
    workload = cluster.workload(QUEUED_NS, "plain")
    assert workload is not None and workload["spec"]["queueName"] == "default"
    wait_for("plain's gang", lambda: len(cluster.pods(QUEUED_NS, "plain")) == 1, timeout=60)
    events = cluster.core.list_namespaced_event(QUEUED_NS).items
    said = [e for e in events if e.reason == queue_defaulting.DEFAULTED]
    assert said and said[0].involved_object.name == "plain", [(e.reason, e.message) for e in events]
    assert 'set to "default"' in said[0].message

    # The job placed before the requirement runs on as it was admitted.
    assert _label(cluster, QUEUED_NS, "legacy") is None
    assert len(cluster.pods(QUEUED_NS, "legacy")) == 1
    assert cluster.workload(QUEUED_NS, "legacy") is None


def test_without_a_default_local_queue_the_job_waits_in_kueue_and_says_so(required) -> None:
    cluster, process = required
    if process.process is None:  # run alone: start the operator with the requirement
        process.env = {"MESHTRAIN_DEFAULT_QUEUE": DEFAULT_QUEUE}
        process.start()
    cluster.apply(_job("stray", BARE_NS))
    held = wait_for(
        "stray held by Kueue: no LocalQueue default",
        lambda: (
            (c := cluster.condition(BARE_NS, "stray", "Queued")).get("status") == "True"
            and c.get("reason") not in (None, "WorkloadCreated")
            and c
        ),
        timeout=60,
    )
    assert _label(cluster, BARE_NS, "stray") == "default"
    # Kueue's own words (v0.17.0): the LocalQueue the label names does not exist.
    assert held["reason"] == "Inadmissible", held
    assert "LocalQueue default doesn't exist" in held["message"], held
    wait_for(  # the Event follows the condition: the operator writes the status first
        "an Inadmissible Warning",
        lambda: any(
            e.reason == "Inadmissible" and e.type == "Warning"
            for e in cluster.core.list_namespaced_event(BARE_NS).items
        ),
        timeout=10,
    )
    # A free node is there, yet nothing places the job around Kueue.
    time.sleep(5)
    assert cluster.pods(BARE_NS, "stray") == []
    assert cluster.status(BARE_NS, "stray").get("phase") == "Pending"
    assert not cluster.status(BARE_NS, "stray").get("placement")
