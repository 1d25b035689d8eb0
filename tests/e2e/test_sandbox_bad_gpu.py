"""A GPU that keeps failing, through the real kubelet: its pod leaves the node for another one.

The example job shrunk to two pods of one "GPU" each (dp2).  Node B is cordoned until both pods
are bound, so both start on node A.  Rank 1's GPU on node A fails with an uncorrectable ECC error
before step 8 in every generation (``MESHTRAIN_FAULT_INJECT=1:8:device``, kept to node A by
``MESHTRAIN_FAULT_NODE``): its worker exits 78, its supervisor recovers it in place, the replayed
step fails again, and the supervisor takes the GPU for bad and exits 79 with its reason in the
termination log.  From what the real kubelet reports then:

- pod 1's trainer container terminated with exit code 79 and the supervisor's words;
- node A goes into ``status.excludedNodes`` (reason ``BadGPU``), with a Warning Event ``BadGPU``
  on the Node itself naming the job and the rank's GPU;
- pod 1 alone is replaced, on node B (the pod tier, cause "a GPU failed twice"); pod 0 is the
  very same pod, still on node A (the exclusion keeps only new placements away);
- the job trains to Succeeded with no gang rebuild and no ``backoffLimit`` spent.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from meshtrain.api import exitcodes
from meshtrain.operator.policy import bad_gpus
from meshtrain.sandbox import example, supervisor
from meshtrain.trainer.guards import faults
from tests.e2e.test_sandbox import _events, _example
from tests.e2e.test_sandbox import sandbox as sandbox  # the module's own sandbox, up once
from tests.e2e.test_sandbox_failures import _apply, _job_events, _until, _watched

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

NODE_A, NODE_B = (spec.name for spec in supervisor.NODES)
FAULT_STEP = 8
NODE_RANK = "meshtrain.io/node-rank"


def _bound(pods: Any, count: int) -> dict[str, dict[str, Any]]:
    """Pod name -> newest version, once ``count`` pods of the job are bound to a node."""
    latest: dict[str, dict[str, Any]] = {}
    for _, pod in pods.seen:
        latest[pod["metadata"]["name"]] = pod
    bound = {n: p for n, p in latest.items() if p["spec"].get("nodeName")}
    return bound if len(bound) >= count else {}


def _wait(what: str, probe: Any, timeout: float) -> Any:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        found = probe()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:.0f}s")


def _left_with(pods: Any, uid: str, code: int) -> dict[str, Any] | None:
    """The trainer container's ``terminated`` state of pod ``uid`` once it exited ``code``."""
    for _, pod in pods.seen:
        if pod["metadata"]["uid"] != uid:
            continue
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            ended = (container.get("state") or {}).get("terminated") or {}
            if container["name"] == "trainer" and ended.get("exitCode") == code:
                return ended
    return None


def test_a_gpu_that_fails_twice_sends_its_pod_to_another_node_and_the_job_succeeds(
    sandbox: tuple[supervisor.Paths, dict[str, Any]],
) -> None:
    paths, _state = sandbox
    name = "bad-gpu"
    env = [
        {"name": faults.ENV, "value": f"1:{FAULT_STEP}:device"},
        {"name": faults.NODE_ENV, "value": NODE_A},
    ]
    job = (
        _example(name, "bad-gpu-checkpoints")
        .layout(data=2, pipeline=1, gpus_per_node=1)
        .training(steps=40)
        .pod_template({"containers": [{"name": "trainer", "env": env}]})
    )
    example.kubectl(paths, "cordon", NODE_B)
    try:
        with _watched(paths, name) as (pods, watched):
            _apply(paths, job)
            first = _wait("both pods bound", lambda: _bound(pods, 2), 300)
            example.kubectl(paths, "uncordon", NODE_B)
            assert {p["spec"]["nodeName"] for p in first.values()} == {NODE_A}, first
            uids = {n: p["metadata"]["uid"] for n, p in first.items()}
            by_rank = {p["metadata"]["labels"][NODE_RANK]: n for n, p in first.items()}
            pod_0, pod_1 = by_rank["0"], by_rank["1"]
            left = _wait(
                "pod 1's trainer exits 79",
                lambda: _left_with(pods, uids[pod_1], exitcodes.DEVICE_SUSPECT),
                600,
            )
            excluded = _until(watched, lambda j: (j.get("status") or {}).get("excludedNodes"), 60)
            final = _until(
                watched,
                lambda j: (j.get("status") or {}).get("phase") in ("Succeeded", "Failed"),
                900,
            )
            seen = {p["metadata"]["uid"]: p for _, p in pods.seen}
    finally:
        example.kubectl(paths, "uncordon", NODE_B, check=False)

    print(f"pod 1's trainer left: {left.get('message')}")
    assert "failed twice" in (left.get("message") or ""), left
    [entry] = excluded["status"]["excludedNodes"]
    assert (entry["node"], entry["reason"]) == (NODE_A, bad_gpus.REASON), entry
    assert "local rank 0" in entry["message"] and "failed twice" in entry["message"], entry

    status = final["status"]
    print(f"status.recovery: {json.dumps(status.get('recovery'), indent=2)}")
    assert status["phase"] == "Succeeded", json.dumps(status, indent=2)
    assert not status.get("restarts"), f"no gang rebuild: {json.dumps(status, indent=2)}"
    assert status["recovery"]["byTier"]["pod"] == 1, status["recovery"]
    assert status["recovery"]["byTier"]["process"] >= 1, "the first failure recovered in place"

    replacements = [
        p for uid, p in seen.items() if uid not in uids.values() and p["metadata"]["name"] != pod_0
    ]
    assert replacements, "pod 1 was replaced"
    assert {p["spec"].get("nodeName") for p in replacements} == {NODE_B}, replacements
    assert not [
        p
        for p in seen.values()
        if p["metadata"]["name"] == pod_0 and p["metadata"]["uid"] != uids[pod_0]
    ], "pod 0 is the very same pod"

    [replaced] = _job_events(paths, name, "PodReplaced")
    assert "a GPU failed twice" in replaced["message"], replaced
    on_node = [
        e
        for e in _events(paths, "default", bad_gpus.REASON)
        if e["involvedObject"].get("kind") == "Node" and e["involvedObject"]["name"] == NODE_A
    ]
    assert [e["type"] for e in on_node] == ["Warning"], on_node
    assert on_node[0]["message"].startswith(f"TrainingJob default/{name}: pod {pod_1}"), on_node
    print(f"the Event on {NODE_A}: {on_node[0]['message']}")
