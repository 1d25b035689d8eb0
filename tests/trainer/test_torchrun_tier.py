"""The torchrun tier: a custom trainer's torchrun, launched as the operator builds its pods,
restarts every worker of the gang in place when one is SIGKILLed, and gives up past
``inPlaceLimit`` with a code the operator answers with a gang rebuild.

Two torchrun agents play the gang's two pods on loopback (tests/torchrun_agents.py: the
builder's command, arguments and environment, moved to 127.0.0.1) and run the shipped DDP
example, which resumes from its own checkpoint.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from meshtrain.operator.policy import pod_failure, pod_state
from meshtrain.trainer import launch
from tests import torchrun_agents

STEPS = 3000
"""Long enough to SIGKILL a worker twice, short enough to finish in a few seconds."""
DEADLINE_S = 150.0
C10D = re.compile(r"\]\s+rdzv_backend\s+: c10d$", re.MULTILINE)
"""The backend in torchrun's launch configs (torch/distributed/launcher/api.py, at INFO)."""


def _gang(tmp_path: Path, limit: int) -> tuple[list[dict], list[subprocess.Popen[bytes]]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torchrun_agents.shim(bin_dir)
    port = launch.free_port()
    pods = torchrun_agents.pods(torchrun_agents.ddp_example(STEPS, limit))
    agents = []
    for index, pod in enumerate(pods):
        env = torchrun_agents.loopback_env(
            pod, port, bin_dir, MESHTRAIN_JOB_CHECKPOINT_DIR=str(tmp_path), LOGLEVEL="INFO"
        )
        agents.append(torchrun_agents.start(pod, env, tmp_path / f"agent-{index}.log"))
    return pods, agents


def _log(tmp_path: Path, index: int) -> str:
    path = tmp_path / f"agent-{index}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _until(condition, what: str, tmp_path: Path):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"no {what}:\n" + _log(tmp_path, 0)[-3000:] + _log(tmp_path, 1)[-3000:])


def _kill_worker(agent: subprocess.Popen[bytes], tmp_path: Path, after: str) -> int:
    """Once a log says ``after``, SIGKILL the second pod's worker (whichever rank the rendezvous
    gave it); its pid."""
    _until(lambda: after in _log(tmp_path, 0) + _log(tmp_path, 1), after, tmp_path)
    found = _until(lambda: torchrun_agents.workers(agent.pid), "the worker", tmp_path)
    pid = max(found.values())
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow
def test_a_sigkilled_worker_restarts_every_worker_in_place_and_the_run_resumes(tmp_path):
    _, agents = _gang(tmp_path, limit=2)
    try:
        killed = _kill_worker(agents[1], tmp_path, after="saved step 10 ")
        codes = [agent.wait(timeout=DEADLINE_S) for agent in agents]
    finally:
        torchrun_agents.end(agents)
    first, second = _log(tmp_path, 0), _log(tmp_path, 1)
    assert codes == [0, 0], first[-3000:] + second[-3000:]
    for log in (first, second):  # c10d's rendezvous, and a second round after the restart
        assert C10D.search(log), log[-3000:]
        assert log.count("Rendezvous complete for workers") >= 2, log[-3000:]
    assert f"failed (exitcode: -9) local_rank: 0 (pid: {killed})" in second, second[-3000:]
    # Both agents restarted their workers (one after its failure, one after its own failed
    # collective or the waiting node) and neither agent ended: no pod would be replaced.
    restarts = r"will restart worker group"
    assert re.search(restarts, first) and re.search(restarts, second), first + second
    resumed = re.search(r"resumed from \S+ \(step (\d+)\)", first + second)  # global rank 0's
    assert resumed and int(resumed.group(1)) >= 10, first[-3000:] + second[-3000:]
    assert torch.load(tmp_path / "ddp-example.pt")["step"] == STEPS


@pytest.mark.slow
def test_more_failures_than_the_limit_end_torchrun_and_the_operator_rebuilds_the_gang(tmp_path):
    pods, agents = _gang(tmp_path, limit=1)
    try:
        _kill_worker(agents[1], tmp_path, after="saved step 10 ")
        _kill_worker(agents[1], tmp_path, after="resumed from ")
        code = agents[1].wait(timeout=DEADLINE_S)
    finally:
        torchrun_agents.end(agents)  # the operator deletes the gang's other pods
    log = _log(tmp_path, 1)
    assert code == 1, log[-3000:]  # torchrun's ChildFailedError: its workers failed past the limit
    assert log.count("attempts left; will restart worker group") == 1, log[-3000:]
    assert "1/1 attempts left" in log and "ChildFailedError" in log, log[-3000:]
    assert C10D.search(log), "c10d's rendezvous, not static"
    pod = {
        **pods[1],
        "status": {
            "phase": "Failed",
            "containerStatuses": [{"name": "trainer", "state": {"terminated": {"exitCode": code}}}],
        },
    }
    state = pod_state.read(pod)
    assert state is not None
    failure = pod_failure.classify(state)
    assert failure is not None and not failure.permanent and not failure.disruption, failure
