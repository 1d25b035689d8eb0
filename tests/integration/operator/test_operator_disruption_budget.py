"""runPolicy.disruptionRestartLimit against a real API server with the operator running (make test tier).

A node whose device plugin has fewer GPUs than it advertises: the kubelet admits the pod, its device
manager cannot allocate, and it writes the pod's status as Failed, ``UnexpectedAdmissionError``
(kubernetes pkg/kubelet/kubelet.go ``rejectPod``: phase, reason and message, no container ran).
No kubelet runs here, so the test writes that status shape itself.  The issue measured
``Restarting restarts=501 requeue_after=0`` for such a node under ``backoffLimit: 0``.
"""

from __future__ import annotations

import time

import pytest

from meshtrain.operator.policy import disruption_budget
from tests.builders import JobBuilder
from tests.integration.operator.cluster import wait_for

pytestmark = pytest.mark.integration

REJECTED = (
    "Allocate failed due to requested number of devices unavailable for nvidia.com/gpu. "
    "Requested: 1, Available: 0, which is unexpected"
)


def _refused_by_the_kubelet(cluster, namespace: str, pod: str) -> None:
    """What the kubelet writes on a pod its device manager cannot admit."""
    status = {"phase": "Failed", "reason": "UnexpectedAdmissionError", "message": REJECTED}
    cluster.core.patch_namespaced_pod_status(pod, namespace, {"status": status})


def test_kubelet_refusals_are_spaced_steered_off_the_node_and_bounded(
    cluster, operator, namespace, pool
):
    nodes = {cluster.add_node(pool, gpus=1), cluster.add_node(pool, gpus=1)}
    job = JobBuilder("refused", namespace, pool).layout(data=1).gpus(1)
    cluster.apply(job.run_policy(backoffLimit=0, disruptionRestartLimit=3))
    counts: dict[str, int] = {}
    waited: list[float] = []
    for attempt in range(4):
        started = time.monotonic()
        [pod] = cluster.wait_gang(namespace, "refused", 1, attempt=attempt, timeout=60)
        waited.append(time.monotonic() - started)
        status = cluster.status(namespace, "refused")
        [where] = [p["node"] for p in status["placement"]]
        excluded = {e["node"] for e in status.get("excludedNodes") or []}
        assert where not in excluded, status
        # A node is excluded exactly when it disrupted the job twice.
        assert excluded == {n for n, c in counts.items() if c >= 2}, (counts, status)
        assert all(
            e["reason"] == disruption_budget.REASON for e in status.get("excludedNodes") or []
        )
        _refused_by_the_kubelet(cluster, namespace, pod.metadata.name)
        counts[where] = counts.get(where, 0) + 1
    # Three restarts (none counted against backoffLimit 0), the fourth refusal spends the budget.
    status = cluster.wait_phase(namespace, "refused", "Failed", timeout=30)
    assert status["restarts"] == 3 and status["disruptionRestarts"] == 3, status
    failed = cluster.condition(namespace, "refused", "Failed")
    assert failed["reason"] == disruption_budget.LIMIT_EXCEEDED
    assert "3 disruption restart(s) in a row" in failed["message"]
    assert "disruptionRestartLimit=3" in failed["message"]
    for node, count in counts.items():
        assert node in nodes and f"{node} ({count}, UnexpectedAdmissionError)" in failed["message"]
    # Two nodes, four refusals: one node disrupted twice and was left out after.
    assert max(counts.values()) == 2
    # The first restart at once; the repeated ones waited their backoff (5 s, then 10 s at least).
    assert waited[2] >= disruption_budget.BACKOFF_BASE_SECONDS, waited
    assert waited[3] >= 2 * disruption_budget.BACKOFF_BASE_SECONDS, waited
    wait_for(
        "the DisruptionLimitExceeded Event",
        lambda: [
            e
            for e in cluster.core.list_namespaced_event(namespace).items
            if e.reason == disruption_budget.LIMIT_EXCEEDED
        ],
    )
