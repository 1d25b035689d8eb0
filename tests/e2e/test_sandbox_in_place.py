"""The kubelet tier of in-place recovery in the sandbox: a trainer container SIGKILLed mid-run is
restarted in place by the real kubelet (its ``restartPolicyRules``), and the job goes on to
Succeeded on the same pods, with no gang rebuild, ``status.recovery`` counting the restart and an
Event naming it.

The example job (dp2·pp2 over two pods on the sandbox's two kubelet nodes), in-place recovery on
(the default).  The container is killed from the host as a crashed process would die
(``_kill_container``: SIGKILL of its init process through containerd).
"""

from __future__ import annotations

import datetime
import json
import pathlib
import signal
import time
from typing import Any

import pytest
import yaml

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


def _named(paths: supervisor.Paths, name: str, pod: str) -> dict[str, Any]:
    """The job's pod ``pod`` as the API server has it now."""
    return next(p for p in _pods(paths, name) if p["metadata"]["name"] == pod)


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
    assert recovery["byTier"]["container"] == 1, f"the one container killed: {recovery}"
    assert recovery["inPlaceRestarts"] >= 1, recovery
    pods = _pods(paths, name)
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
    assert after == before, "every pod of the gang is the one placed at the start"
    others = {
        p["metadata"]["name"]: _trainer(p).get("restartCount", 0)
        for p in pods
        if p["metadata"]["name"] != pod["metadata"]["name"]
    }
    assert others and all(count == 0 for count in others.values()), (
        f"the healthy pods kept their containers: {others}"
    )
    assert _saved_steps(checkpoints)[-1] == steps, "trained to the last step"
    told = [
        e["message"]
        for e in _events(paths, namespace, recovery_count.RESTARTED)
        if e["involvedObject"]["name"] == name
    ]
    assert any(pod["metadata"]["name"] in m and "SIGKILL" in m for m in told), told
    print(f"status.recovery: {json.dumps(recovery, indent=2)}")
    last = recovery["last"]
    if last.get("failedAt") and last.get("firstStepAt"):
        seconds = last["firstStepAt"] - last["failedAt"]
        print(f"pod 1's restarted container's report to the next step: {seconds:.1f}s")


def _stamped(paths: supervisor.Paths, namespace: str, pod: str) -> list[tuple[float, str]]:
    """``kubectl logs --timestamps`` of ``pod``'s trainer container: (Unix time, line) each."""
    out = example.kubectl(
        paths, "logs", "-n", namespace, pod, "-c", "trainer", "--timestamps", "--tail=-1"
    )
    lines = []
    for line in out.splitlines():
        stamp, _, text = line.partition(" ")
        when = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        lines.append((when.timestamp(), text))
    return lines


def test_a_custom_trainers_torchrun_killed_by_a_signal_restarts_its_pod_in_place(
    sandbox: tuple[supervisor.Paths, dict], tmp_path: pathlib.Path
) -> None:
    """KEP-5532 on the sandbox's real kubelets: the custom DDP example with ``torchrunElastic``;
    pod 1's torchrun dies by SIGABRT (134: torchrun itself crashed), the kubelet restarts every
    container of that pod in place (``RestartAllContainers``), its agent joins pod 0's next
    rendezvous round, and the job goes on to Succeeded with no gang rebuild.  Measured: the kill
    to the first step after the resume, from the pods' log timestamps.

    ``shareProcessNamespace`` makes torchrun a plain process of the pod (the pause container is
    its init): as the init of its own PID namespace it would ignore a SIGABRT sent from outside
    (signals without a handler reach a namespace's init only when the kernel forces them, as a
    real crash does)."""
    paths, _state = sandbox
    document = yaml.safe_load((example.DEFAULT_EXAMPLE.parent / "custom-ddp.yaml").read_text())
    name, steps, every = "sandbox-pod-restart", 4000, 100
    document["metadata"]["name"] = name
    spec = document["spec"]
    spec["trainer"]["args"] = ["--steps", str(steps), "--checkpoint-every", str(every)]
    spec["checkpoint"]["claimName"] = "pod-restart-checkpoints"
    # no gang rebuild allowed: one would fail the job
    spec["runPolicy"].update(backoffLimit=0, recovery={"torchrunElastic": True})
    spec["podTemplateOverride"] = {"spec": {"shareProcessNamespace": True}}
    manifest = tmp_path / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump(document))
    namespace, _ = example.apply(paths, manifest)

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        pods = _pods(paths, name)
        if len(pods) == 2 and all(p["status"].get("phase") == "Running" for p in pods):
            zero = next(p for p in pods if p["metadata"]["labels"]["meshtrain.io/node-rank"] == "0")
            saved = [t for _, t in _stamped(paths, namespace, zero["metadata"]["name"])]
            if any(line.startswith(f"saved step {every} ") for line in saved):
                break
        time.sleep(0.5)
    else:
        pytest.fail(f"no first checkpoint of {name} within 600 s")
    pod = next(p for p in pods if p["metadata"]["labels"]["meshtrain.io/node-rank"] == "1")
    [rule] = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer").get(
        "restartPolicyRules"
    ) or [None]
    nodes = json.loads(example.kubectl(paths, "get", "nodes", "-o", "json"))["items"]
    features = {n["metadata"]["name"]: n["status"].get("declaredFeatures") for n in nodes}
    assert rule is not None and rule["action"] == "RestartAllContainers", (
        f"pod 1 carries no RestartAllContainers rule; the nodes declare {features}"
    )
    killed = _kill_container(paths, pod, signal.SIGABRT)
    killed_at = time.time()
    print(f"SIGABRT to torchrun (pid {killed}) of {pod['metadata']['name']}")

    restarted = _restarted(paths, name, pod["metadata"]["name"])
    print(
        f"the kubelet restarted the pod's containers {time.time() - killed_at:.1f}s after the kill"
    )
    assert restarted["metadata"]["uid"] == pod["metadata"]["uid"], "the same pod"
    print(f"its trainer's last state: {_trainer(restarted).get('lastState')}")

    final = example.follow(paths, namespace, name, timeout=900)
    status = final["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=2)
    assert not status.get("restarts"), f"no gang rebuild: {json.dumps(status, indent=2)}"
    recovery = status.get("recovery") or {}
    assert recovery.get("inPlaceRestarts", 0) >= 1, recovery
    assert recovery["byTier"]["container"] == 1, recovery
    # the kubelet reports 137 for every container of a pod restarted whole, whatever the signal
    assert recovery["last"]["cause"] == "pod restarted in place (RestartAllContainers)", recovery
    zero = next(
        p for p in _pods(paths, name) if p["metadata"]["labels"]["meshtrain.io/node-rank"] == "0"
    )
    logged = _stamped(paths, namespace, zero["metadata"]["name"])
    resumed = next(i for i, (when, t) in enumerate(logged) if when > killed_at and "resumed" in t)
    first_step = next(when for when, t in logged[resumed:] if t.startswith("step "))
    print(
        f"status.recovery: {json.dumps(recovery)}; "
        f"{logged[resumed][1]}; first step {first_step - killed_at:.1f}s after the kill"
    )
    root = paths.root / "volumes" / namespace / spec["checkpoint"]["claimName"]
    import torch  # noqa: PLC0415 - only these tests read a torch file

    assert torch.load(root / namespace / name / "ddp-example.pt")["step"] == steps


def test_with_a_store_pod_pod_0_s_killed_trainer_container_restarts_in_place(
    sandbox: tuple[supervisor.Paths, dict],
) -> None:
    """``rendezvousStore: dedicated``: the store runs in a pod of its own, so pod 0's trainer
    container SIGKILLed is restarted in place by the kubelet like any other pod's (with pod 0
    hosting the store it would rebuild the gang), and the job succeeds on the same pods, the store
    pod's among them, which leaves with 0 once every pod left."""
    paths, _state = sandbox
    name, steps = "sandbox-store-pod", 300
    recovery = {"recovery": {"rendezvousStore": "dedicated"}}
    namespace, checkpoints, saved = _run_until_checkpoint(
        paths, name, "store-pod-checkpoints", steps, run_policy=recovery
    )
    pods = _pods(paths, name)
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
    store = next(p for p in pods if "meshtrain.io/rendezvous-store" in p["metadata"]["labels"])
    assert store["metadata"]["name"] == f"{name}-r0-store" and store["status"]["phase"] == "Running"
    pod0 = next(p for p in pods if p["metadata"]["labels"].get("meshtrain.io/node-rank") == "0")
    assert _trainer(pod0)["restartCount"] == 0
    killed = _kill_container(paths, pod0)
    print(f"killed pod 0's trainer container (pid {killed}) at step {saved}+")

    restarted = _restarted(paths, name, pod0["metadata"]["name"])
    assert restarted["metadata"]["uid"] == pod0["metadata"]["uid"], "the same pod"
    final = example.follow(paths, namespace, name, timeout=900)
    status = final["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=2)
    assert not status.get("restarts"), f"no gang rebuild: {json.dumps(status, indent=2)}"
    assert status["recovery"]["byTier"]["container"] == 1, status["recovery"]
    last = status["recovery"]["last"]
    assert last["tier"] == "container" and last["ranks"] == [0, 1], last  # pod 0's ranks
    print(f"status.recovery.last: {json.dumps(last)}")
    if last.get("failedAt") and last.get("firstStepAt"):
        seconds = last["firstStepAt"] - last["failedAt"]
        print(f"pod 0's restarted container's report to the next step: {seconds:.1f}s")
    after = _pods(paths, name)
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in after} == before
    deadline = time.monotonic() + 60  # it leaves a moment after the last pod said it left
    while (ended := _named(paths, name, store["metadata"]["name"]))["status"]["phase"] == "Running":
        assert time.monotonic() < deadline, ended["status"]
        time.sleep(0.5)
    assert ended["status"]["phase"] == "Succeeded", ended["status"]
    log = example.kubectl(paths, "logs", "-n", namespace, store["metadata"]["name"])
    assert "meshtrain store: exit 0: rank 0 finished" in log, log
    assert _saved_steps(checkpoints)[-1] == steps, "trained to the last step"
