"""A trainer's permanent exit code survives the pod's command: a missing dataset fails the job at
once, in its words.

The pod's own command (the built-in trainer's supervisor, with the pod's environment, and
the spec the operator wrote to the job's ConfigMap) runs on this machine; its
exit status and the file it leaves at ``$MESHTRAIN_TERMINATION_LOG`` become
the pod's status, as the kubelet reports them (``terminationMessagePolicy:
FallbackToLogsOnError`` reads that file first).  The operator on the real API
server must then fail the job without a restart, with the trainer's message
in the condition and the Event.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from meshtrain.api import exitcodes
from meshtrain.operator.policy import conditions
from meshtrain.sandbox.controlplane.ports import pick_free_port
from tests.builders import JobBuilder
from tests.integration.operator.cluster import REPO, wait_for

pytestmark = pytest.mark.integration

MISSING = "/nonexistent/meshtrain-tokens.bin"


def _run_pod_command(pod, spec_file: str, termination_log: str) -> subprocess.CompletedProcess:
    container = pod.spec.containers[0]
    env = {e.name: e.value for e in container.env if e.value is not None}
    env.update(
        MASTER_ADDR="127.0.0.1",  # the pod's DNS name resolves only in a cluster
        MASTER_PORT=str(pick_free_port()),
        MESHTRAIN_SPEC_FILE=spec_file,
        MESHTRAIN_TERMINATION_LOG=termination_log,
        MESHTRAIN_DEVICE="cpu",
    )
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container.args or []]
    assert container.command[0] == "python"  # the image's; here this machine's
    return subprocess.run(
        [sys.executable, *container.command[1:], *args],
        env={**os.environ, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_missing_dataset_fails_the_job_at_once_through_the_supervisor(
    cluster, operator, namespace, pool, tmp_path
):
    cluster.add_node(pool, gpus=2)
    job = JobBuilder("nodata", namespace, pool).layout(data=2).gpus(2)
    cluster.apply(job.training(dataset=MISSING, steps=2))
    [pod] = cluster.wait_gang(namespace, "nodata", 1)

    spec_file = tmp_path / "job.yaml"
    configmap = cluster.core.read_namespaced_config_map("nodata-spec", namespace)
    spec_file.write_text(configmap.data["job.yaml"])
    termination_log = tmp_path / "termination-log"
    termination_log.touch()  # the kubelet creates the file the container writes
    ran = _run_pod_command(pod, str(spec_file), str(termination_log))
    # the supervisor passes the worker's permanent code through (torchrun made it 1) ...
    assert ran.returncode == exitcodes.DATA, ran.stderr[-2000:]
    report = exitcodes.read_failure_report(termination_log.read_text())
    assert report is not None and report[0] == exitcodes.DATA  # ... and the report keeps it
    assert MISSING in report[1]

    cluster.set_pod_phase(
        namespace, pod.metadata.name, "Failed", exit_code=ran.returncode,
        message=termination_log.read_text(),
    )  # fmt: skip
    status = cluster.wait_phase(namespace, "nodata", "Failed", timeout=30)
    failed = cluster.condition(namespace, "nodata", conditions.FAILED)
    assert failed["reason"] == conditions.PERMANENT_FAILURE
    assert MISSING in failed["message"] and "code 3" in failed["message"]
    assert status.get("restarts", 0) == 0
    events = wait_for(
        "the PermanentFailure Event",
        lambda: [
            e
            for e in cluster.core.list_namespaced_event(namespace).items
            if e.reason == conditions.PERMANENT_FAILURE
        ],
    )
    assert MISSING in events[0].message
