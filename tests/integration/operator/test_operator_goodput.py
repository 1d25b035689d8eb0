"""status.goodput on a real API server: rank 0's progress ``goodput`` reaches the status whole,
in the CRD's schema (a pruned or refused field would be missing), and a broken one never does.
"""

from __future__ import annotations

import pytest

from tests import hostile_progress
from tests.builders import JobBuilder
from tests.integration.operator.cluster import wait_for

pytestmark = pytest.mark.integration

GOODPUT = {
    "ratio": 0.875,
    "productive_seconds": 3500.0,
    "wall_seconds": 4000.0,
    "lost_seconds": {"detection": 1.5, "restart": 20.25, "reload": 3.5, "recompute": 40.0},
}


def test_progress_goodput_becomes_status_goodput(cluster, operator, namespace, pool):
    answer = {**hostile_progress.GOOD, "goodput": GOODPUT}
    with hostile_progress.Server(hostile_progress.document(answer)) as rank0:
        cluster.add_node(pool, gpus=2)
        cluster.apply(
            JobBuilder("gp", namespace, pool).layout(data=2).gpus(1).metrics(port=rank0.port)
        )
        for pod in cluster.wait_gang(namespace, "gp", 2):
            cluster.set_pod_phase(namespace, pod.metadata.name, "Running", ip="127.0.0.1")
        wait_for(
            "status.goodput",
            lambda: cluster.status(namespace, "gp").get("goodput") is not None,
            timeout=30,
        )
        assert cluster.status(namespace, "gp")["goodput"] == {
            "ratio": 0.875,
            "productiveSeconds": 3500.0,
            "wallSeconds": 4000.0,
            "lostSeconds": {"detection": 1.5, "restart": 20.25, "reload": 3.5, "recompute": 40.0},
        }
        # a ratio above 1 breaks the schema: the field is dropped, the step still arrives
        rank0.answer = hostile_progress.document(
            {**hostile_progress.GOOD, "step": 18, "goodput": {**GOODPUT, "ratio": 2.0}}
        )
        wait_for(
            "the next step",
            lambda: (cluster.status(namespace, "gp").get("progress") or {}).get("step") == 18,
            timeout=30,
        )
        assert cluster.status(namespace, "gp")["goodput"]["ratio"] == 0.875
