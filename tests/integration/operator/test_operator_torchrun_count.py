"""A custom trainer's torchrun restart reaches ``status.recovery`` through the real operator and API server.

The operator places a custom DDP job under the torchrun tier; the test plays the kubelet (pods
Running at 127.0.0.1) and runs the pods' containers as the operator built them: two real torchrun
agents on loopback (tests/torchrun_agents.py) running the shipped DDP example, whose global rank
0 serves the progress document on ``trainer.progressPort``.  Global rank 0's worker is SIGKILLed
once: torchrun restarts the worker group, the operator's poll reads the new count and the API
server stores ``status.recovery.byTier.torchrun`` = 1 with an ``InPlaceRestart`` Event, and the
gang is not rebuilt (``status.restarts`` stays 0).
"""

from __future__ import annotations

import os
import signal

import pytest

from meshtrain.operator.policy import recovery_count
from meshtrain.trainer import launch
from tests import torchrun_agents
from tests.builders import JobBuilder
from tests.integration.operator.cluster import wait_for

pytestmark = pytest.mark.integration

STEPS = 1_000_000
"""Far more than the test waits for: the agents are ended once the count is stored."""


def test_a_torchrun_restart_is_counted_in_the_stored_status(
    cluster, operator, namespace, pool, tmp_path
):
    progress_port = launch.free_port()
    builder = (
        JobBuilder("ddp", namespace, pool)
        .layout(data=2, gpus_per_node=1)
        .trainer(
            type="custom",
            command=["torchrun", "-m", "meshtrain.examples.ddp"],
            args=["--steps", str(STEPS), "--progress-port", str(progress_port)],
            progressPort=progress_port,
        )
        .run_policy(recovery={"inPlaceLimit": 2, "torchrunElastic": True})
    )
    cluster.add_node(pool, gpus=8)
    cluster.apply(builder)
    for pod in cluster.wait_gang(namespace, "ddp", 2):
        cluster.set_pod_phase(namespace, pod.metadata.name, "Running", ip="127.0.0.1")
    agents = torchrun_agents.start_gang(
        builder, tmp_path, launch.free_port(), MESHTRAIN_JOB_CHECKPOINT_DIR=str(tmp_path)
    )
    try:
        wait_for(
            "rank 0's progress in the status",
            lambda: (cluster.status(namespace, "ddp").get("progress") or {}).get("step"),
            timeout=120,
        )
        rank0 = torchrun_agents.workers(*(agent.pid for agent in agents))[0]
        os.kill(rank0, signal.SIGKILL)
        wait_for(
            "the torchrun restart in status.recovery",
            lambda: (
                ((cluster.status(namespace, "ddp").get("recovery") or {}).get("byTier") or {}).get(
                    "torchrun"
                )
                == 1
            ),
            timeout=120,
        )
    finally:
        torchrun_agents.end(agents)
    status = cluster.status(namespace, "ddp")
    recovery = status["recovery"]
    assert recovery["inPlaceRestarts"] == 1 and recovery["countedTorchrun"] == 1
    assert recovery["last"]["tier"] == "torchrun"
    assert int(status.get("restarts") or 0) == 0, "no gang rebuild"
    (event,) = cluster.events(namespace, "ddp", recovery_count.RESTARTED)
    assert "torchrun restarted" in event.message
