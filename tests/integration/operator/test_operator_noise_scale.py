"""The large-batch warning on a real control plane (apiserver, etcd, kube-scheduler): rank 0's
/progress reports a gradient noise scale far below the job's global batch, and the operator stores
it, sets BatchAboveNoiseScale=True and records one Warning Event; once the measured value is near
the batch the condition turns False.  The test plays the kubelet and the trainer's /progress."""

from __future__ import annotations

import pytest

from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster, wait_for
from tests.integration.operator.test_operator_stragglers import simulated

pytestmark = pytest.mark.integration

NAMESPACE = "noise"


def _condition(cluster: Cluster, status: str) -> dict:
    return wait_for(
        f"BatchAboveNoiseScale={status}",
        lambda: (
            (c := cluster.condition(NAMESPACE, "big", "BatchAboveNoiseScale")).get("status")
            == status
            and c
        ),
        timeout=60,
    )


def test_a_global_batch_far_above_the_measured_noise_scale_is_warned(
    control_plane_binaries, tmp_path
):
    with simulated(control_plane_binaries, NAMESPACE, tmp_path / "operator.log") as sim:
        cluster, progress, operator = sim.cluster, sim.progress, sim.operator
        cluster.add_node("noise", gpus=2, name="noise-n0")
        operator.start()
        document = {
            "step": 30,
            "loss": 4.0,
            "updated_at": "2026-01-01T00:00:10Z",
        }  # past the warm-up
        progress.document = {**document, "gradient_noise_scale": 1.5}
        cluster.apply(
            JobBuilder("big", NAMESPACE, "noise")
            .layout(data=2)
            .parallelism(microBatches=8)
            .training(microBatch=4)  # global batch 4 x 8 x 2 = 64 sequences
            .metrics(port=progress.port)
        )
        far = _condition(cluster, "True")
        assert far["reason"] == "GlobalBatchFarAboveNoiseScale"
        assert "global batch 64 is 43x the measured gradient noise scale 1.5" in far["message"]
        status = cluster.status(NAMESPACE, "big")
        assert status["progress"]["gradientNoiseScale"] == 1.5
        warnings = [
            e
            for e in cluster.core.list_namespaced_event(NAMESPACE).items
            if e.reason == "GlobalBatchFarAboveNoiseScale"
        ]
        assert len(warnings) == 1 and warnings[0].type == "Warning"

        progress.document = {**document, "step": 40, "gradient_noise_scale": 32.0}
        near = _condition(cluster, "False")
        assert near["reason"] == "GlobalBatchNearNoiseScale" and "2x" in near["message"]
