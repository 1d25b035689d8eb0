"""Kubelet admission refusals in the sandbox: bounded, spaced and steered off the node (e2e tier).

A node whose device plugin breaks stops advertising its GPUs: here the node's
``status.capacity[nvidia.com/gpu]`` drops to 0 (the sandbox advertises GPUs by patching node
status, ``nodeconfig.gpu_capacity_patch``) while a one-GPU job's pod runs on it, and its kubelet
restarts.  A restarted kubelet admits every pod bound to it again (``HandlePodAdditions``), and
refuses this one itself: phase Failed, reason ``OutOfnvidia.com/gpu``, ``Pod was rejected: ...``.
The job (``backoffLimit: 0``, ``disruptionRestartLimit: 2``) is refused on node A twice (the
other node cordoned), then on node B:

- each refusal is a disruption, not a restart against ``backoffLimit``;
- after the second refusal node A is in ``status.excludedNodes`` (reason ``Disrupted``), the
  next placement waits its backoff and lands on B;
- the third refusal spends the budget: Failed, ``DisruptionLimitExceeded``, naming both nodes;
- the operator restarted the gang twice in all and its own pod never restarted.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

from meshtrain.operator.policy import conditions, disruption_budget
from meshtrain.sandbox import example, nodeconfig, supervisor
from tests.e2e.test_sandbox import sandbox as sandbox  # the module's own sandbox, up once
from tests.e2e.test_sandbox_failures import _apply, _condition, _one_pod, _until, _watched

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

NODE_A, NODE_B = (spec.name for spec in supervisor.NODES)
GPUS = {spec.name: spec.gpus for spec in supervisor.NODES}
REFUSED = "OutOfnvidia.com/gpu"
"""``status.reason`` the kubelet writes on a pod it refuses for lack of GPUs (lifecycle/predicate.go)."""


def _wait(what: str, probe: Callable[[], Any], timeout: float) -> Any:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        found = probe()
        if found:
            return found
        time.sleep(1.0)
    raise AssertionError(f"{what}: not within {timeout:.0f}s")


def _advertise(paths: supervisor.Paths, node: str, gpus: int) -> None:
    patch = json.dumps(nodeconfig.gpu_capacity_patch(gpus))
    example.kubectl(
        paths, "patch", "node", node, "--subresource=status", "--type=json", "-p", patch
    )


def _restart_kubelet(
    paths: supervisor.Paths, node: str, started: dict[str, subprocess.Popen[bytes]]
) -> None:
    """Stop ``node``'s kubelet and start it again with the same command line and environment."""
    slot = [spec.name for spec in supervisor.NODES].index(node)
    name = "kubelet" if slot == 0 else f"kubelet-{slot}"
    state = supervisor.read_state(paths) or {}
    [netns] = [n["netns"] for n in supervisor.node_states(state) if n["name"] == node]
    mine = started.pop(node, None)
    pid = mine.pid if mine else state["groups"][name]
    proc = pathlib.Path(f"/proc/{pid}")
    # nsenter executed the kubelet: its command line is the kubelet's own, outside the namespace.
    own = proc.joinpath("cmdline").read_bytes().decode().split("\0")[:-1]
    argv = ["nsenter", f"--net=/run/netns/{netns}", "--", *own]
    env = dict(
        line.split("=", 1)
        for line in proc.joinpath("environ").read_bytes().decode().split("\0")
        if "=" in line
    )
    os.killpg(pid, signal.SIGTERM)
    if mine:
        mine.wait(timeout=60)
    _wait(f"{name} stopped", lambda: not supervisor.group_members(pid), 60)
    # Its log continues the supervisor's; the supervisor sees its own child exit and records it.
    with open(paths.logs / f"{name}.log", "ab") as out:
        started[node] = subprocess.Popen(
            argv, stdout=out, stderr=out, env=env, start_new_session=True
        )


def _live_pod(pods: Any, node: str) -> dict[str, Any] | None:
    """The newest version of a pod of the job running on ``node``."""
    latest: dict[str, dict[str, Any]] = {}
    for _, pod in pods.seen:
        latest[pod["metadata"]["uid"]] = pod
    for pod in latest.values():
        running = (pod.get("status") or {}).get("phase") == "Running"
        gone = pod["metadata"].get("deletionTimestamp")
        if running and not gone and pod["spec"].get("nodeName") == node:
            return pod
    return None


def _refused(pods: Any, uid: str) -> dict[str, Any] | None:
    for _, pod in pods.seen:
        status = pod.get("status") or {}
        if pod["metadata"]["uid"] == uid and status.get("phase") == "Failed":
            return status
    return None


def _refuse(
    paths: supervisor.Paths, pods: Any, node: str, started: dict[str, subprocess.Popen[bytes]]
) -> dict[str, Any]:
    """The job's pod running on ``node`` refused by the node's kubelet; its status."""
    pod = _wait(f"a pod of the job Running on {node}", lambda: _live_pod(pods, node), 300)
    _advertise(paths, node, 0)
    _restart_kubelet(paths, node, started)
    status: dict[str, Any] = _wait(
        "the kubelet's refusal", lambda: _refused(pods, pod["metadata"]["uid"]), 180
    )
    _advertise(paths, node, GPUS[node])
    print(
        f"{node} refused {pod['metadata']['name']}: {status.get('reason')}: {status.get('message')}"
    )
    return status


def _operator_restarts(paths: supervisor.Paths) -> int:
    listed = json.loads(
        example.kubectl(
            paths, "get", "pods", "-A", "-l", "app.kubernetes.io/component=operator", "-o", "json"
        )
    )
    assert listed["items"], "the operator's pod"
    return sum(
        c.get("restartCount", 0)
        for p in listed["items"]
        for c in p["status"].get("containerStatuses") or []
    )


def test_kubelet_refusals_are_disruptions_spaced_excluded_and_bounded(
    sandbox: tuple[supervisor.Paths, dict[str, Any]],
) -> None:
    paths, _state = sandbox
    name = "refused"
    operator_restarts = _operator_restarts(paths)
    started: dict[str, subprocess.Popen[bytes]] = {}
    job = _one_pod(name).run_policy(backoffLimit=0, disruptionRestartLimit=2)
    example.kubectl(paths, "cordon", NODE_B)
    try:
        with _watched(paths, name) as (pods, watched):
            _apply(paths, job)
            refusals = [_refuse(paths, pods, NODE_A, started)]
            first = _until(
                watched, lambda j: (j.get("status") or {}).get("disruptionRestarts") == 1, 60
            )
            assert not first["status"].get("excludedNodes"), json.dumps(first["status"], indent=2)
            refusals.append(_refuse(paths, pods, NODE_A, started))
            second = _until(watched, lambda j: (j.get("status") or {}).get("excludedNodes"), 60)
            example.kubectl(paths, "uncordon", NODE_B)
            refusals.append(_refuse(paths, pods, NODE_B, started))
            on_b = next(p for _, p in pods.seen if p["spec"].get("nodeName") == NODE_B)
            final = _until(watched, lambda j: (j.get("status") or {}).get("phase") == "Failed", 120)
    finally:
        example.kubectl(paths, "uncordon", NODE_B, check=False)
        for node, gpus in GPUS.items():
            _advertise(paths, node, gpus)
        for proc in started.values():
            proc.terminate()
            proc.wait(timeout=60)

    for refusal in refusals:
        assert refusal["reason"] == REFUSED, refusal
        assert refusal["message"].startswith("Pod was rejected: "), refusal
        assert "nvidia.com/gpu" in refusal["message"], refusal
    [entry] = second["status"]["excludedNodes"]
    assert entry["node"] == NODE_A and entry["reason"] == disruption_budget.REASON, entry
    assert second["status"]["disruptions"]["notBefore"], "the third placement waits its backoff"
    # The third placement waited its backoff: created no earlier than notBefore (whole seconds).
    not_before = conditions.parse_time(second["status"]["disruptions"]["notBefore"])
    created = conditions.parse_time(on_b["metadata"]["creationTimestamp"])
    assert not_before is not None and created is not None
    assert (created - not_before).total_seconds() >= -1.0, (created, not_before)
    status = final["status"]
    assert status["restarts"] == 2 and status["disruptionRestarts"] == 2, json.dumps(
        status, indent=2
    )
    failed = _condition(final, conditions.FAILED)
    print(f"excluded: {entry}; notBefore {not_before}, pod on {NODE_B} created {created}")
    print(f"{failed['reason']}: {failed['message']}")
    assert failed["reason"] == disruption_budget.LIMIT_EXCEEDED, failed
    assert "disruptionRestartLimit=2" in failed["message"], failed
    # Named by the kubelet's own words, not by the exit code of the container it killed.
    assert f"{NODE_B}: {REFUSED}: {refusals[-1]['message']}" in failed["message"], failed
    assert f"{NODE_A} (2, {REFUSED})" in failed["message"], failed
    assert f"{NODE_B} (1, {REFUSED})" in failed["message"], failed
    assert _operator_restarts(paths) == operator_restarts, "the operator never restarted"
