"""Pods of the job still terminating hold their GPUs: a new gang is never pinned onto them."""

from __future__ import annotations

import pytest

from meshtrain.operator.policy import conditions
from tests.builders import JobBuilder
from tests.integration.operator.cluster import wait_for

pytestmark = pytest.mark.integration

HOLD = "meshtrain.test/hold"


def test_restart_waits_for_the_old_gangs_terminating_pod(cluster, operator, namespace, pool):
    for _ in range(2):
        cluster.add_node(pool, gpus=1)
    cluster.apply(JobBuilder("held", namespace, pool).layout(data=2, gpus_per_node=1))
    cluster.wait_gang(namespace, "held", 2)
    cluster.core.patch_namespaced_pod("held-r0-1", namespace, {"metadata": {"finalizers": [HOLD]}})
    try:
        cluster.set_pod_phase(namespace, "held-r0-1", "Running")
        cluster.set_pod_phase(namespace, "held-r0-0", "Failed", exit_code=137)
        wait_for(
            "Placed=False/OldPodsTerminating while held-r0-1 terminates",
            lambda: (
                cluster.condition(namespace, "held", conditions.PLACED).get("reason")
                == conditions.OLD_PODS_TERMINATING
            ),
        )
        assert cluster.status(namespace, "held")["restarts"] == 1
        held = cluster.core.read_namespaced_pod("held-r0-1", namespace)
        assert held.metadata.deletion_timestamp is not None
        assert [p.metadata.name for p in cluster.pods(namespace, "held")] == ["held-r0-1"]
    finally:
        cluster.core.patch_namespaced_pod(
            "held-r0-1", namespace, {"metadata": {"finalizers": None}}
        )
    cluster.wait_gang(namespace, "held", 2, attempt=1, timeout=40)
    assert cluster.status(namespace, "held")["restarts"] == 1
