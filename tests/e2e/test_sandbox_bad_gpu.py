"""A GPU that keeps failing, through the real kubelet: its pod leaves the node for another one.

The example job shrunk to two pods of one "GPU" each (dp2).  Node B is cordoned until both pods
are bound, so both start on node A.  Rank 1's GPU on node A fails with an uncorrectable ECC error
before step 8 in every generation (``MESHTRAIN_FAULT_INJECT=1:8:device``, kept to node A by
``MESHTRAIN_FAULT_NODE``): its worker exits 78, its supervisor recovers it in place, the replayed
step fails again, and the supervisor takes the GPU for bad and exits 79 with its reason in the
termination log.  From what the real kubelet reports then:

- pod 1's trainer container terminated with exit code 79 and the supervisor's words;
- node A goes into ``status.excludedNodes`` (reason ``BadGPU``), with a Warning Event ``BadGPU``
  on the Node itself naming the job, the pod and the rank;
- pod 1 alone is replaced, on node B (the pod tier, cause "a GPU taken for bad"); pod 0 is the
  very same pod, still on node A (the exclusion keeps only new placements away);
- the job trains to Succeeded with no gang rebuild and no ``backoffLimit`` spent.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest

from meshtrain.api import exitcodes
from meshtrain.operator.policy import bad_gpus, naming
from meshtrain.sandbox import example, supervisor
from meshtrain.trainer.guards import faults
from tests.e2e.test_sandbox import _events, _example
from tests.e2e.test_sandbox import sandbox as sandbox  # the module's own sandbox, up once
from tests.e2e.test_sandbox_disruptions import _wait
from tests.e2e.test_sandbox_failures import _apply, _job_events, _until, _watched

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

NODE_A, NODE_B = (spec.name for spec in supervisor.NODES)
FAULT_STEP = 8
NODE_RANK = "meshtrain.io/node-rank"


def _drilled(name: str, steps: int) -> Any:
    """The example job as two pods of one "GPU" each (dp2), its checkpoints on a claim of its
    own, rank 1's GPU failing on node A before step :data:`FAULT_STEP` in every generation."""
    drill = [
        {"name": faults.ENV, "value": f"1:{FAULT_STEP}:device"},
        {"name": faults.NODE_ENV, "value": NODE_A},
    ]
    return (
        _example(name, f"{name}-checkpoints")
        .layout(data=2, pipeline=1, gpus_per_node=1)
        .training(steps=steps)
        .pod(env=drill)
    )


def _bound(pods: Any, count: int) -> dict[str, dict[str, Any]]:
    """Pod name -> newest version, once ``count`` pods of the job are bound to a node."""
    latest: dict[str, dict[str, Any]] = {}
    for _, pod in pods.seen:
        latest[pod["metadata"]["name"]] = pod
    bound = {n: p for n, p in latest.items() if p["spec"].get("nodeName")}
    return bound if len(bound) >= count else {}


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
    job = _drilled(name, steps=40)
    example.kubectl(paths, "cordon", NODE_B)
    try:
        with _watched(paths, name) as (pods, watched):
            _apply(paths, job)
            first = _wait("both pods bound", lambda: _bound(pods, 2), 300)
            example.kubectl(paths, "uncordon", NODE_B)
            assert {p["spec"]["nodeName"] for p in first.values()} == {NODE_A}, first
            by_rank = {p["metadata"]["labels"][NODE_RANK]: p for p in first.values()}
            pod_0, pod_1 = by_rank["0"]["metadata"], by_rank["1"]["metadata"]
            left = _wait(
                "pod 1's trainer exits 79",
                lambda: _left_with(pods, pod_1["uid"], exitcodes.DEVICE_SUSPECT),
                600,
            )
            excluded = _until(watched, lambda j: (j.get("status") or {}).get("excludedNodes"), 60)
            # the first failure was recovered in place (a new worker process in the same pod)
            _until(watched, lambda j: _tier(j, "process") >= 1, 300)
            final = _until(watched, lambda j: (j.get("status") or {}).get("phase") in _ENDED, 600)
            seen = list(pods.seen)
    finally:
        example.kubectl(paths, "uncordon", NODE_B, check=False)

    print(f"pod 1's trainer left: {left.get('message')}")
    assert "failed twice" in (left.get("message") or ""), left
    [entry] = excluded["status"]["excludedNodes"]
    assert (entry["node"], entry["reason"]) == (NODE_A, bad_gpus.REASON), entry
    assert "rank 1's GPU (local rank 0) failed twice" in entry["message"], entry

    status = final["status"]
    print(f"status.recovery: {json.dumps(status.get('recovery'), indent=2)}")
    assert status["phase"] == "Succeeded", json.dumps(status, indent=2)
    assert not status.get("restarts"), f"no gang rebuild: {json.dumps(status, indent=2)}"
    assert _tier(final, "pod") == 1, status["recovery"]

    # pod 1 alone replaced, on node B; pod 0 the very same pod, on node A to the end
    newest = {p["metadata"]["uid"]: p for _, p in seen}  # each pod's last version seen
    created = newest.keys() - {pod_0["uid"], pod_1["uid"]}
    assert [newest[u]["metadata"]["name"] for u in created] == [
        naming.replacement_pod_name(name, 0, 1, 1)
    ], created
    [replacement] = [newest[u] for u in created]
    assert replacement["spec"]["nodeName"] == NODE_B, replacement["spec"]
    assert replacement["metadata"]["labels"][NODE_RANK] == "1"
    kept = newest[pod_0["uid"]]
    assert kept["spec"]["nodeName"] == NODE_A and kept["status"]["phase"] == "Succeeded", kept
    assert not any(
        p["metadata"].get("deletionTimestamp")
        for _, p in seen
        if p["metadata"]["uid"] == pod_0["uid"] and p["status"].get("phase") != "Succeeded"
    ), "pod 0 was never deleted while it trained"

    [replaced] = _job_events(paths, name, "PodReplaced")
    assert "a GPU taken for bad" in replaced["message"], replaced
    on_node = [
        e
        for e in _events(paths, "default", bad_gpus.REASON)
        if e["involvedObject"].get("kind") == "Node"
        and e["involvedObject"]["name"] == NODE_A
        and name in e["message"]
    ]
    assert [e["type"] for e in on_node] == ["Warning"], on_node
    assert on_node[0]["message"].startswith(f"TrainingJob default/{name}: pod {pod_1['name']}")
    print(f"the Event on {NODE_A}: {on_node[0]['message']}")


_ENDED = ("Succeeded", "Failed")


def _tier(job: dict[str, Any], tier: str) -> int:
    """``status.recovery.byTier[tier]`` of a version of the job (0 when absent)."""
    recovery = (job.get("status") or {}).get("recovery") or {}
    return int((recovery.get("byTier") or {}).get(tier) or 0)


def _bound_of(pods: Any, attempt: int) -> dict[str, dict[str, Any]]:
    """Pod name -> newest version, once both pods of gang ``attempt`` are bound to a node."""
    latest: dict[str, dict[str, Any]] = {}
    for _, pod in pods.seen:
        if pod["metadata"]["labels"].get(naming.LABEL_ATTEMPT) == str(attempt):
            latest[pod["metadata"]["name"]] = pod
    bound = {n: p for n, p in latest.items() if p["spec"].get("nodeName")}
    return bound if len(bound) >= 2 else {}


def _told(pod: dict[str, Any]) -> str | None:
    """The trainer container's ``exitcodes.DEVICE_ERROR_AT_ENV`` (None: the pod was told nothing)."""
    [trainer] = [c for c in pod["spec"]["containers"] if c["name"] == naming.CONTAINER]
    return next(
        (
            e.get("value")
            for e in trainer.get("env") or []
            if e["name"] == exitcodes.DEVICE_ERROR_AT_ENV
        ),
        None,
    )


def test_without_in_place_recovery_a_device_error_outlives_the_gang_and_the_second_excludes_the_node(
    sandbox: tuple[supervisor.Paths, dict[str, Any]],
) -> None:
    """``runPolicy.recovery.inPlace: false`` and ``backoffLimit: 0``: every failure rebuilds the
    gang, so no supervisor lives to see a GPU fail twice.  Rank 1's GPU on node A fails before
    step 8 in every generation; node B stays cordoned until the second gang is bound, so both
    gangs start on node A.  From what the real kubelet and API server report:

    - gang 0: rank 1's worker exits 78, its supervisor exits 75 naming rank 1 (as does pod 0's,
      from the halt); the operator rebuilds the gang as a disruption (no ``backoffLimit`` spent)
      and keeps node A's error in ``status.deviceErrors``;
    - gang 1: pod 1, again on node A, is told the time (``MESHTRAIN_DEVICE_ERROR_AT``; pod 0 on
      node A too, since the error is the node's); at rank 1's next device error its supervisor
      exits 79 at once, saying the job had one on the node before; node A is excluded;
    - gang 2 runs on node B and the job succeeds, with two disruption restarts and none counted.
    """
    paths, _state = sandbox
    name = "bad-gpu-rebuilt"
    job = _drilled(name, steps=30).run_policy(backoffLimit=0, recovery={"inPlace": False})
    example.kubectl(paths, "cordon", NODE_B)
    try:
        with _watched(paths, name) as (pods, watched):
            _apply(paths, job)
            first = _wait("gang 0 bound", lambda: _bound_of(pods, 0), 300)
            kept = _until(watched, lambda j: (j.get("status") or {}).get("deviceErrors"), 600)
            second = _wait("gang 1 bound", lambda: _bound_of(pods, 1), 600)
            example.kubectl(paths, "uncordon", NODE_B)
            excluded = _until(watched, lambda j: (j.get("status") or {}).get("excludedNodes"), 600)
            final = _until(watched, lambda j: (j.get("status") or {}).get("phase") in _ENDED, 900)
            third = _bound_of(pods, 2)
            seen = list(pods.seen)
    finally:
        example.kubectl(paths, "uncordon", NODE_B, check=False)

    assert {p["spec"]["nodeName"] for p in first.values()} == {NODE_A}, first
    assert all(_told(p) is None for p in first.values()), "gang 0 was told of no earlier error"
    [error] = kept["status"]["deviceErrors"]
    print(f"status.deviceErrors after gang 0: {error}")
    assert (error["node"], error["ranks"]) == (NODE_A, [1]), error
    assert kept["status"].get("disruptionRestarts") == 1, kept["status"]

    assert {p["spec"]["nodeName"] for p in second.values()} == {NODE_A}, second
    at = {p["metadata"]["labels"][NODE_RANK]: _told(p) for p in second.values()}
    said = int(datetime.datetime.fromisoformat(error["time"].replace("Z", "+00:00")).timestamp())
    assert at == {"0": str(said), "1": str(said)}, at
    by_rank = {p["metadata"]["labels"][NODE_RANK]: p for p in second.values()}
    left = _left_with(pods, by_rank["1"]["metadata"]["uid"], exitcodes.DEVICE_SUSPECT)
    assert left is not None, "gang 1's pod 1 left with 79"
    print(f"gang 1's pod 1 left: {left.get('message')}")
    assert "before this pod started" in (left.get("message") or ""), left

    # node A is excluded for its bad GPU (and, having disrupted the gang twice, as a disruptor)
    entries = excluded["status"]["excludedNodes"]
    assert {e["node"] for e in entries} == {NODE_A}, entries
    [bad] = [e for e in entries if e["reason"] == bad_gpus.REASON]
    assert "before this pod started" in bad["message"], bad
    status = final["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=2)
    assert status["restarts"] == 2 and status["disruptionRestarts"] == 2, status
    assert third and {p["spec"]["nodeName"] for p in third.values()} == {NODE_B}, third
    assert len({p["metadata"]["uid"] for _, p in seen}) == 6, "three gangs of two pods"
