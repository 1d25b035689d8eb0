"""The kubelet tier of in-place recovery in the sandbox: a trainer container SIGKILLed mid-run is
restarted in place by the real kubelet (its ``restartPolicyRules``), and the job goes on to
Succeeded on the same pods, with no gang rebuild, ``status.recovery`` counting the restart and an
Event naming it.

The example job (dp2·pp2 over two pods on the sandbox's two kubelet nodes), in-place recovery on
(the default).  The container is killed from the host as a crashed process would die
(``_kill_container``: SIGKILL of its init process through containerd).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from meshtrain.operator.policy import recovery_count
from meshtrain.sandbox import example, supervisor
from tests.e2e.test_sandbox import (
    _events,
    _kill_container,
    _pods,
    _run_until_checkpoint,
    _saved_steps,
)
from tests.e2e.test_sandbox import sandbox as sandbox  # the module's own sandbox, up once

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


def _trainer(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["status"]["containerStatuses"] if c["name"] == "trainer")


def _restarted(paths: supervisor.Paths, name: str, pod: str, timeout: float = 300) -> dict:
    """``pod`` once the kubelet reports its trainer container restarted (restartCount >= 1)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = next((p for p in _pods(paths, name) if p["metadata"]["name"] == pod), None)
        if found is not None and _trainer(found).get("restartCount", 0) >= 1:
            return found
        time.sleep(0.5)
    raise AssertionError(f"the kubelet did not restart the trainer container of {pod} in place")


def test_a_killed_trainer_container_is_restarted_in_place_and_the_job_succeeds(
    sandbox: tuple[supervisor.Paths, dict],
) -> None:
    paths, _state = sandbox
    name, steps = "sandbox-in-place", 300
    namespace, checkpoints, saved = _run_until_checkpoint(
        paths, name, "in-place-checkpoints", steps
    )
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in _pods(paths, name)}
    pod = next(
        p
        for p in _pods(paths, name)
        if p["metadata"]["labels"].get("meshtrain.io/node-rank") == "1"
    )
    killed = _kill_container(paths, pod)
    killed_at = time.time()
    print(
        f"killed the trainer container (pid {killed}) of {pod['metadata']['name']} at step {saved}+"
    )

    restarted = _restarted(paths, name, pod["metadata"]["name"])
    print(f"the kubelet restarted it in place {time.time() - killed_at:.1f}s after the kill")
    last = _trainer(restarted)["lastState"]["terminated"]
    assert last["exitCode"] == 137, last  # the kubelet's report of the kill
    assert restarted["metadata"]["uid"] == pod["metadata"]["uid"], "the same pod"

    final = example.follow(paths, namespace, name, timeout=900)
    status = final["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=2)
    assert not status.get("restarts"), f"no gang rebuild: {json.dumps(status, indent=2)}"
    recovery = status["recovery"]
    assert recovery["byTier"]["container"] >= 1 and recovery["inPlaceRestarts"] >= 1, recovery
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in _pods(paths, name)}
    assert after == before, "every pod of the gang is the one placed at the start"
    assert _saved_steps(checkpoints)[-1] == steps, "trained to the last step"
    told = [
        e["message"]
        for e in _events(paths, namespace, recovery_count.RESTARTED)
        if e["involvedObject"]["name"] == name
    ]
    assert any(pod["metadata"]["name"] in m and "SIGKILL" in m for m in told), told
    print(f"status.recovery: {json.dumps(recovery, indent=2)}")
