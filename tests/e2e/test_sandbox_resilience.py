"""Stragglers and lost nodes in the sandbox: real kubelet nodes, containers, the operator from the chart.

1. ``stragglerPolicy: replace``: a dp2 job (two pods of one GPU) is placed on one node (the
   other cordoned, then uncordoned); rank 1's pod is throttled through its CPU cgroup (a
   throttling GPU's stand-in: its compute, not its waits, gets slower); the trainer flags it,
   the operator stops the gang with a checkpoint and places it again on the other node
   (``status.excludedNodes``), and training resumes from the saved step.
2. ``runPolicy.elastic``: a dp2·tp2 job (one pod per node) loses a node (the Node object
   deleted: the pod garbage collector removes its pods); the gang resumes at dp1 with the same
   global batch; the Node comes back (re-created; its kubelet, still running, reports it
   Ready again) and, once the room has lasted ``growStableSeconds`` and
   ``minResizeIntervalSeconds`` has passed, the gang grows back to dp2 and trains on.

Each test records what it measured in ``benchmarks/results/sandbox_resilience-<host>.json``.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from meshtrain.operator.policy import conditions
from meshtrain.sandbox import example, nodeconfig, supervisor
from tests.e2e.test_sandbox import (
    _events,
    _example,
    _gang_logs,
    _pods,
    _resumes,
    _saved_steps,
    _written,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

SLOW_NODE, OTHER_NODE = (spec.name for spec in supervisor.NODES)
RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MEASURED: dict[str, Any] = {}
THROTTLE = 0.02
"""CPU share the slow rank's pod is limited to: well under one process's share of this 2-core
machine even when it is loaded (a load of 25 leaves each about 0.08)."""


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[supervisor.Paths, dict]]:
    paths = supervisor.Paths(tmp_path_factory.mktemp("sandbox"))
    paths.root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    state = supervisor.up(paths)
    MEASURED["sandbox_up_seconds"] = round(time.monotonic() - started, 1)
    MEASURED["sandbox_timings_seconds"] = state.get("timings")
    try:
        yield paths, state
    finally:
        leftovers = supervisor.down(paths)
        _write_results()
        assert leftovers == [], f"processes left behind after down: {leftovers}"


def _write_results() -> None:
    uname = platform.uname()
    RESULTS.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": "sandbox_resilience",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "host": uname.node,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "command": "nice .venv/bin/pytest -m e2e tests/e2e/test_sandbox_resilience.py -s --durations=0",
        "results": MEASURED,
    }
    path = RESULTS / f"sandbox_resilience-{uname.node}.json"
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")


def _wait(what: str, probe: Callable[[], Any], timeout: float, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def _status(paths: supervisor.Paths, namespace: str, name: str) -> dict:
    return (example.job(paths, namespace, name) or {}).get("status") or {}


def _live_pods(paths: supervisor.Paths, name: str) -> list[dict]:
    return [p for p in _pods(paths, name) if not p["metadata"].get("deletionTimestamp")]


def _running_on(paths: supervisor.Paths, namespace: str, name: str, pods: int) -> dict | None:
    """The job's status once it is Running with ``pods`` live pods, all Running; else None."""
    status = _status(paths, namespace, name)
    assert status.get("phase") not in ("Succeeded", "Failed"), json.dumps(status, indent=2)
    live = _live_pods(paths, name)
    running = [p for p in live if (p.get("status") or {}).get("phase") == "Running"]
    if status.get("phase") == "Running" and len(live) == len(running) == pods:
        return status
    return None


def _logged(step_log: pathlib.Path) -> list[dict]:
    if not step_log.exists():
        return []
    out = []
    for line in step_log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _pod_cpu_cgroups(node_state: dict, pod_uid: str) -> list[pathlib.Path]:
    """The pod's cgroup directories with a CPU quota file (v1 ``cpu``, or v2 ``cpu.max``)."""
    found = []
    for hierarchy in pathlib.Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / node_state["cgroup_root"].lstrip("/")
        if not top.is_dir():
            continue
        for directory in top.rglob("*"):
            name = directory.name.replace("_", "-")
            quota = (directory / "cpu.cfs_quota_us").exists() or (directory / "cpu.max").exists()
            if name.startswith("pod") and name.endswith(pod_uid) and quota:
                found.append(directory)
    return found


def _throttle(directory: pathlib.Path, share: float | None) -> None:
    """Limit the cgroup to ``share`` of one CPU (None: no limit)."""
    period = 100_000
    quota = -1 if share is None else int(share * period)
    if (directory / "cpu.max").exists():
        (directory / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {period}")
    else:
        (directory / "cpu.cfs_period_us").write_text(str(period))
        (directory / "cpu.cfs_quota_us").write_text(str(quota))


def test_replace_moves_a_slow_ranks_pod_off_its_node(
    sandbox: tuple[supervisor.Paths, dict],
) -> None:
    paths, state = sandbox
    name, claim = "sandbox-straggler", "straggler-checkpoints"
    example.kubectl(paths, "cordon", OTHER_NODE)  # the gang starts on SLOW_NODE
    try:
        job = (
            _example(name, claim)
            .parallelism(data=2, pipeline=1, tensor=1, microBatches=2)
            .resources(gpusPerNode=1)
            .training(steps=400)
            .checkpoint(intervalSteps=5, keep=3)
            .run_policy(
                stragglerPolicy={"action": "replace", "threshold": 1.5, "window": 8},
                terminationGracePeriodSeconds=60,
            )
        )
        manifest = _written(paths, job)
        namespace, _ = example.apply(paths, manifest)
        status = _wait("the gang Running", lambda: _running_on(paths, namespace, name, 2), 600)
        assert {p["node"] for p in status["placement"]} == {SLOW_NODE}
    finally:
        example.kubectl(paths, "uncordon", OTHER_NODE)
    checkpoints = paths.root / "volumes" / namespace / claim / namespace / name
    step_log = checkpoints / "logs" / "steps.jsonl"
    _wait("10 steps", lambda: len(_logged(step_log)) >= 10, 300)
    slow_pod = next(
        p for p in _pods(paths, name) if p["metadata"]["labels"]["meshtrain.io/node-rank"] == "1"
    )
    node_state = next(n for n in supervisor.node_states(state) if n["name"] == SLOW_NODE)
    cgroups = _pod_cpu_cgroups(node_state, slow_pod["metadata"]["uid"])
    assert cgroups, f"no CPU cgroup of pod {slow_pod['metadata']['uid']} under {node_state}"
    throttled_at = _logged(step_log)[-1]["step"]
    started = time.monotonic()
    for directory in cgroups:
        _throttle(directory, THROTTLE)
    print(f"throttled rank 1's pod to {THROTTLE} CPU after step {throttled_at}: {cgroups}")
    try:
        status = _wait(
            "the straggler replaced",
            lambda: (s := _status(paths, namespace, name)).get("stragglerReplacements") and s,
            600,
        )
    finally:  # the stopped gang's ranks checkpoint the step they stop at: at full speed
        for directory in cgroups:
            if directory.exists():
                _throttle(directory, None)
    replaced_after = time.monotonic() - started
    [excluded] = status["excludedNodes"]
    assert excluded["node"] == SLOW_NODE and excluded["reason"] == "Straggler"
    assert excluded["message"].startswith("rank 1 "), excluded  # the throttled rank, not noise
    replaced = _events(paths, namespace, conditions.STRAGGLER_REPLACED)
    assert any(e["involvedObject"]["name"] == name for e in replaced), replaced
    status = _wait("the new gang Running", lambda: _running_on(paths, namespace, name, 2), 600)
    assert {p["node"] for p in status["placement"]} == {OTHER_NODE}
    assert {p["spec"]["nodeName"] for p in _live_pods(paths, name)} == {OTHER_NODE}
    resumed_from = max(_saved_steps(checkpoints))
    _wait("the new gang training", lambda: _logged(step_log)[-1]["step"] > resumed_from, 600)
    logs = _gang_logs(paths, namespace, name, int(status.get("restarts") or 0))
    restored = {step for _, step, _ in _resumes(logs)}
    assert len(restored) == 1, f"the new gang's ranks restored {restored}: {logs[-2000:]}"
    [restored_step] = restored
    assert restored_step >= throttled_at, (restored_step, throttled_at)
    # Rank 0 logs each step once: the old gang's records end at the step it checkpointed as it
    # stopped, and the new gang's first record is the step after it (none replayed, none skipped).
    steps = [r["step"] for r in _logged(step_log)]
    since_throttle = steps[steps.index(throttled_at) :]
    assert since_throttle == list(range(throttled_at, throttled_at + len(since_throttle))), steps
    assert since_throttle.count(restored_step + 1) == 1, (restored_step, since_throttle)
    node_events = json.loads(
        example.kubectl(paths, "get", "events", "-n", "default", "-o", "json")
    )["items"]
    assert any(
        e["involvedObject"].get("kind") == "Node"
        and e["involvedObject"]["name"] == SLOW_NODE
        and e["reason"] == conditions.STRAGGLER_REPLACED
        for e in node_events
    )
    since = re.search(r"since step (\d+)", excluded["message"])
    MEASURED["straggler_replace"] = {
        "job": "dp2·pp1·tp1, two pods of one GPU, stragglerPolicy replace threshold 1.5 window 8",
        "fault": f"rank 1's pod cgroup limited to {THROTTLE} CPU",
        "throttled_after_step": throttled_at,
        "flagged_since_step": int(since.group(1)) if since else None,
        "seconds_from_throttle_to_replacement": round(replaced_after, 1),
        "excluded": excluded,
        "new_gang_nodes": sorted({p["node"] for p in status["placement"]}),
    }
    example.kubectl(paths, "delete", "tj", name, "-n", namespace, "--wait=false")
    _wait("the job's pods gone", lambda: not _pods(paths, name), 300)


def _node_ready(paths: supervisor.Paths, node: str) -> bool:
    out = example.kubectl(paths, "get", "node", node, "-o", "json", check=False)
    if not out:
        return False
    conds = json.loads(out)["status"].get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def test_elastic_job_shrinks_when_a_node_goes_away_and_grows_back(
    sandbox: tuple[supervisor.Paths, dict],
) -> None:
    paths, _state = sandbox
    name, claim = "sandbox-elastic", "elastic-checkpoints"
    stable, interval = 20, 40
    job = (
        _example(name, claim)
        .parallelism(data=2, pipeline=1, tensor=2, microBatches=2)  # gpusPerNode stays 2
        .training(steps=5000)
        .checkpoint(intervalSteps=10, keep=3)
        .run_policy(
            elastic={
                "minData": 1,
                "maxData": 2,
                "growStableSeconds": stable,
                "minResizeIntervalSeconds": interval,
            },
            terminationGracePeriodSeconds=20,
        )
    )
    manifest = _written(paths, job)
    namespace, _ = example.apply(paths, manifest)
    status = _wait("the dp2 gang Running", lambda: _running_on(paths, namespace, name, 2), 600)
    assert {p["node"] for p in status["placement"]} == {SLOW_NODE, OTHER_NODE}
    checkpoints = paths.root / "volumes" / namespace / claim / namespace / name
    step_log = checkpoints / "logs" / "steps.jsonl"
    _wait("a checkpoint", lambda: _saved_steps(checkpoints), 600)
    declared_batch = _logged(step_log)[-1]["global_batch"]

    node = json.loads(example.kubectl(paths, "get", "node", OTHER_NODE, "-o", "json"))
    lost = time.monotonic()
    example.kubectl(paths, "delete", "node", OTHER_NODE)
    print(f"deleted node {OTHER_NODE} after step {_logged(step_log)[-1]['step']}")
    status = _wait(
        "the dp1 gang Running",
        lambda: (s := _running_on(paths, namespace, name, 1)) and s["elastic"]["data"] == 1 and s,
        900,
    )
    shrunk_after = time.monotonic() - lost
    assert status["layout"] == "dp1·pp1·tp2"
    assert status["elastic"]["globalBatch"] == declared_batch
    assert status["elastic"]["microBatches"] == 4
    assert cluster_condition(status, "Resized")["reason"] == conditions.ELASTIC_SHRUNK
    shrink_step = max(_saved_steps(checkpoints))
    _wait(
        "the dp1 gang training",
        lambda: (
            (r := _logged(step_log))
            and r[-1]["step"] > shrink_step
            and r[-1]["layout"] == "dp1·pp1·tp2"
        ),
        600,
    )
    first_dp1 = next(r for r in _logged(step_log) if r["layout"] == "dp1·pp1·tp2")
    assert first_dp1["global_batch"] == declared_batch
    assert "global batch kept" in first_dp1["batch_change"]["message"]

    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": OTHER_NODE, "labels": node["metadata"]["labels"]},
    }
    example.kubectl(paths, "create", "-f", "-", stdin=json.dumps(body))
    _wait(f"{OTHER_NODE} Ready again", lambda: _node_ready(paths, OTHER_NODE), 300)
    patch = json.dumps(nodeconfig.gpu_capacity_patch(2))
    example.kubectl(
        paths, "patch", "node", OTHER_NODE, "--subresource=status", "--type=json", "-p", patch
    )
    back = time.monotonic()
    print(f"node {OTHER_NODE} back after step {_logged(step_log)[-1]['step']}")
    status = _wait(
        "the dp2 gang Running again",
        lambda: (s := _running_on(paths, namespace, name, 2)) and s["elastic"]["data"] == 2 and s,
        900,
    )
    grown_after = time.monotonic() - back
    assert {p["node"] for p in status["placement"]} == {SLOW_NODE, OTHER_NODE}
    [growing] = _events(paths, namespace, conditions.ELASTIC_GROWING)
    [pending] = _events(paths, namespace, conditions.ELASTIC_GROW_PENDING)
    grew_at = conditions.parse_time(growing["firstTimestamp"] or growing["eventTime"])
    room_at = conditions.parse_time(pending["firstTimestamp"] or pending["eventTime"])
    shrunk_at = conditions.parse_time(
        next(e for e in _events(paths, namespace, conditions.ELASTIC_SHRUNK))["firstTimestamp"]
    )
    assert grew_at and room_at and shrunk_at
    assert (grew_at - room_at).total_seconds() >= stable - 1  # Event stamps are whole seconds
    assert (grew_at - shrunk_at).total_seconds() >= interval - 1
    grow_step = max(_saved_steps(checkpoints))
    _wait(
        "the dp2 gang training again",
        lambda: (
            (r := _logged(step_log))
            and r[-1]["step"] > grow_step
            and r[-1]["layout"] == "dp2·pp1·tp2"
        ),
        600,
    )
    status = _status(paths, namespace, name)
    MEASURED["elastic"] = {
        "job": "dp2·pp1·tp2, one pod of two GPUs per node, elastic minData 1 maxData 2, "
        f"growStableSeconds {stable}, minResizeIntervalSeconds {interval}",
        "seconds_from_node_deleted_to_dp1_running": round(shrunk_after, 1),
        "seconds_from_node_back_to_dp2_running": round(grown_after, 1),
        "shrink_resumed_step": shrink_step,
        "grow_resumed_step": grow_step,
        "global_batch": declared_batch,
        "first_dp1_step_batch_change": first_dp1["batch_change"],
        "restarts": status.get("restarts"),
        "disruption_restarts": status.get("disruptionRestarts"),
        "events": {
            "shrunk": str(shrunk_at),
            "grow_pending": str(room_at),
            "growing": str(grew_at),
        },
    }
    example.kubectl(paths, "delete", "tj", name, "-n", namespace, "--wait=false")
    _wait("the job's pods gone", lambda: not _pods(paths, name), 300)


def cluster_condition(status: dict, type_: str) -> dict:
    return next(c for c in status.get("conditions") or [] if c["type"] == type_)
