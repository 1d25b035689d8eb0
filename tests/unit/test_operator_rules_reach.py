"""Every row of the state machine's table acts on some situation, and its sections mean what they say.

A seeded generator draws jobs (spec and status), pods of this and earlier attempts, times and
Kueue's answer around each stage of a job's life, the way the table was shown equal to the
ladder it replaced.  Every rule decides for one of them and every note adds to one; a section,
once the walk reaches it covering the situation, is left only with a decision of its own rows.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import random
from collections.abc import Iterator
from typing import Any

from meshtrain.api import elastic, exitcodes
from meshtrain.operator.policy import (
    conditions,
    identity,
    job_state,
    kueue_topology,
    kueue_workload,
    lifecycle,
    pod_state,
    resizing,
    situation,
)
from tests.builders import JobBuilder

SEED = 38
CASES = 4000
T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
REFUSED = (
    "0/3 nodes are available: 1 Insufficient nvidia.com/gpu, 2 node(s) had untolerated taint(s)."
)


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def _spec(r: random.Random, running: bool) -> tuple[dict[str, Any], int]:
    """A spec (invalid now and then) and how many pods its declared size has."""
    if not running and r.random() < 0.04:
        return JobBuilder().layout(data=3, gpus_per_node=2).raw(), 2  # world 3 on 2-GPU pods
    data = r.choice([1, 2, 2, 3, 4])
    builder = JobBuilder().layout(data=data, gpus_per_node=1).parallelism(microBatches=3)
    policy: dict[str, Any] = {}
    if not running and r.random() < 0.1:
        policy["suspend"] = True
    if r.random() < 0.15:
        policy["activeDeadlineSeconds"] = r.choice([10, 1000])
    if r.random() < 0.4:
        policy["startupTimeoutSeconds"] = r.choice([5, 60, 600])
    if r.random() < 0.4:
        policy["backoffLimit"] = r.choice([0, 1, 3])
    if r.random() < 0.3:
        policy["ttlSecondsAfterFinished"] = r.choice([0, 100])
    if data >= 2 and r.random() < 0.35:
        action = r.choice(["ignore", "report", "replace", "replace"])
        policy["stragglerPolicy"] = {"action": action, "maxReplacements": r.choice([0, 3, 3])}
        builder.checkpoint(claimName="ckpt")
    if data >= 2 and r.random() < 0.3:
        policy["elastic"] = {
            "minData": 1,
            "maxData": data + r.choice([0, 1]),
            "growStableSeconds": 0,
            "minResizeIntervalSeconds": 0,
        }
        builder.checkpoint(claimName="ckpt")
    return builder.run_policy(**policy).raw(), data


def _conditions(r: random.Random) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for type_, reasons in (
        (conditions.PLACED, [conditions.GANG_PLACED, conditions.OLD_PODS_TERMINATING]),
        (conditions.QUEUED, ["Pending", conditions.ADMITTED]),
        (conditions.RUNNING, [conditions.ALL_PODS_RUNNING]),
        (conditions.STRAGGLER, [conditions.STRAGGLER_DETECTED]),
    ):
        if r.random() < 0.3:
            status = r.choice([conditions.TRUE, conditions.FALSE])
            found = conditions.set(found, type_, status, r.choice(reasons), "m", at(-50))
    return found


def _status(r: random.Random, spec: dict[str, Any], pods: int, running: bool) -> dict[str, Any]:
    status: dict[str, Any] = {"restarts": r.choice([0, 0, 1, 2])}
    phase = r.choice(
        [None, "Pending", "Placing", "Running", "Restarting", "Suspended"] * 2
        + ["Succeeded", "Failed"]
    )
    if running:
        phase = r.choice(["Placing", "Running"])
    if phase:
        status["phase"] = phase
    if status["restarts"] and r.random() < 0.3:
        status["disruptionRestarts"] = 1
    placement = "full" if running else r.choice(["absent", "empty", "full", "full", "partial"])
    if placement == "empty":
        status["placement"] = []
    elif placement == "full" or (placement == "partial" and pods == 1):
        status["placement"] = [{"podIndex": i, "node": f"n{i}"} for i in range(pods)]
    elif placement == "partial":
        status["placement"] = [{"podIndex": i, "node": f"n{i}"} for i in range(pods - 1)]
    status["specHash"] = "same" if running else r.choice(["same", "same", "other", None])
    status["conditions"] = _conditions(r)
    if r.random() < 0.6:
        status["startTime"] = conditions.timestamp(at(r.choice([-200, 0])))
    if r.random() < 0.5:
        status["completionTime"] = conditions.timestamp(at(r.choice([-100, 0])))
    if r.random() < 0.3:
        status["lastCheckpointStep"] = r.choice([10, 40])
    run_policy = spec.get("runPolicy") or {}
    if run_policy.get("stragglerPolicy") and r.random() < 0.6:
        rank = r.randrange(pods)
        status["straggler"] = {"rank": rank, "podIndex": rank, "node": f"n{rank}", "slowdown": 1.6}
    if r.random() < 0.1:
        status["excludedNodes"] = [
            {"node": "n0", "reason": "Straggler", "time": conditions.timestamp(at(-100))}
        ]
    if run_policy.get("elastic") and r.random() < 0.6:
        status["elastic"] = {"data": r.randint(1, run_policy["elastic"]["maxData"])}
        status["lastCheckpointStep"] = r.choice([5, 50, 50])
        status["checkpointStep"] = r.choice([None, 10, 10])
    if status.get("disruptionRestarts") and status["restarts"] == 2:  # no draw: the stream stays
        status["disruptions"] = {"streak": 2, "notBefore": conditions.timestamp(at(30))}
    return status


def _pod(r: random.Random, index: int, attempt: int) -> pod_state.PodState:
    phase = r.choices(
        ["Pending", "Running", "Succeeded", "Failed", "Unknown"], [25, 45, 12, 14, 4]
    )[0]
    refused = phase == "Pending" and r.random() < 0.35
    return pod_state.PodState(
        name=f"j-r{attempt}-{index}",
        index=index,
        attempt=attempt,
        phase=phase,
        gated=r.random() < (0.45 if phase == "Pending" else 0.03),
        deleting=r.random() < 0.12,
        created_at=at(r.choice([-100, -20, 0, 10])),
        node=r.choice([f"n{index}", f"n{index}", None]),
        ip=f"10.0.0.{index + 1}" if phase == "Running" else None,
        exit_code=r.choice([None, 1, 2, 137]) if phase == "Failed" else None,
        reason=r.choice([None, "Evicted"]) if phase == "Failed" else None,
        disrupted=r.random() < 0.05,
        bound=r.random() < (0.9 if phase != "Pending" else 0.4),
        unschedulable_message=REFUSED if refused else None,
        unschedulable_since=at(r.choice([-30, 5])) if refused else None,
    )


def _pods(r: random.Random, pods: int, attempt: int, running: bool) -> list[pod_state.PodState]:
    gang = (
        [_pod(r, i, attempt) for i in range(pods) if r.random() < 0.85] if r.random() < 0.8 else []
    )
    if running or (gang and r.random() < 0.5):  # a gang alike: every pod as one, or all running
        one = r.choice(gang) if gang else _pod(r, 0, attempt)
        if not running and r.random() < 0.2:  # released, and refused by the scheduler
            one = dataclasses.replace(
                one,
                phase="Pending",
                gated=False,
                deleting=False,
                disrupted=False,
                bound=False,
                unschedulable_message=REFUSED,
                unschedulable_since=at(r.choice([-30, 5])),
            )
        elif running or r.random() < 0.5:
            done = not running and r.random() < 0.25
            one = dataclasses.replace(
                one,
                phase="Succeeded" if done else "Running",
                gated=False,
                deleting=False,
                disrupted=False,
                bound=True,
                unschedulable_message=None,
            )
        gang = [
            dataclasses.replace(
                one, name=f"j-r{attempt}-{i}", index=i, node=f"n{i}", ip=f"10.0.0.{i + 1}"
            )
            for i in range(pods)
        ]
        if running and pods > 1 and r.random() < 0.3:  # a gang that rejoins loses its last pod
            gang = [dataclasses.replace(p, rejoins=True) for p in gang]
            gang[-1] = dataclasses.replace(gang[-1], deleting=True)
        elif running and pods > 1 and r.random() < 0.15:  # the others gave up; pod 0 still runs
            code = exitcodes.GANG_RESTART
            gang[1:] = [
                dataclasses.replace(
                    p,
                    phase="Failed",
                    exit_code=code,
                    reported=(code, "halted"),
                    finished_at=at(r.choice([-60, 0])),
                )
                for p in gang[1:]
            ]
    stale = [_pod(r, r.randrange(pods), attempt - 1) for _ in range(r.choice([0, 0, 1])) if attempt]
    return gang + stale


def _kueue(r: random.Random, running: bool) -> kueue_workload.Gate | None:
    if r.random() < 0.5:
        return None
    if running:
        return kueue_workload.Gate(kueue_workload.Admitted("cq"))
    state = r.choice(
        [
            None,
            kueue_workload.Waiting("Pending", "m"),
            kueue_workload.Admitted("cq"),
            kueue_workload.Admitted("cq", (conditions.TRUE, kueue_workload.STARTED), ("f1",)),
            kueue_workload.Admitted("cq", (conditions.FALSE, kueue_workload.WAIT_FOR_START)),
            kueue_workload.Evicted("Preempted", "m", holds_quota=r.random() < 0.5),
            kueue_workload.Finished(),
            kueue_workload.Outdated("WorkloadOutdated", "m"),
        ]
    )
    return kueue_workload.Gate(state, move_to="q2" if r.random() < 0.1 else None)


def _job(r: random.Random, running: bool) -> tuple[job_state.JobState, int]:
    spec, pods = _spec(r, running)
    status = _status(r, spec, pods, running)
    body = {
        "metadata": {"name": "j", "namespace": "ns", "uid": "u1", "generation": 3},
        "spec": spec,
        "status": status,
    }
    declared = job_state.read(body).declared
    if declared is not None and "elastic" in status:  # a gang placed at one of its sizes
        size = elastic.size_at(declared, status["elastic"]["data"])
        checkpoint = status.pop("checkpointStep")
        status["elastic"] = {
            **resizing.placed_fields(declared, size, {}, T0)["elastic"],
            "checkpointStep": checkpoint,
        }
        pods = size.data
        if status.get("placement"):
            status["placement"] = [{"podIndex": i, "node": f"n{i}"} for i in range(pods)]
    job = job_state.read(body)
    built_from = status.pop("specHash")
    if job.spec is not None and built_from is not None:
        status["specHash"] = identity.spec_hash(job.spec) if built_from == "same" else "other"
    return job_state.read(body), pods


def _restarted(side: random.Random, gang: list[pod_state.PodState]) -> list[pod_state.PodState]:
    """Now and then a running pod whose trainer container the kubelet restarted in place (once,
    or past the default inPlaceLimit); drawn from ``side``, so the main stream stays."""
    if side.random() >= 0.15:
        return gang
    last = pod_state.LastExit(137, "Error", None, at(-5))
    return [
        dataclasses.replace(p, uid=f"u-{p.name}", restarts=side.choice([1, 12]), last_exit=last)
        if p.phase == "Running" and side.random() < 0.5
        else p
        for p in gang
    ]


def _tas(
    tas: random.Random, gate: kueue_workload.Gate | None, pods: int
) -> tuple[kueue_workload.Gate | None, dict[str, dict[str, str]]]:
    """Now and then Kueue TAS's assignment (one pod per hostname domain, node n<i> for pod i)
    on an admitted gang, and the nodes' labels; half the time Kueue moved the last pod's domain
    elsewhere.  Drawn from ``tas``, so the main stream stays."""
    if gate is None or not isinstance(gate.state, kueue_workload.Admitted) or tas.random() >= 0.3:
        return gate, {}
    host = "kubernetes.io/hostname"
    hosts = [f"n{i}" for i in range(pods)]
    if hosts and tas.random() < 0.5:
        hosts[-1] = "elsewhere"
    domains = tuple(kueue_topology.Domain((h,), 1) for h in hosts)
    state = dataclasses.replace(gate.state, topology=kueue_topology.Assignment((host,), domains))
    labels = {f"n{i}": {host: f"n{i}"} for i in range(pods)}
    return dataclasses.replace(gate, state=state), labels


def situations(seed: int, count: int) -> Iterator[situation.Situation]:
    r, side, tas = random.Random(seed), random.Random(seed + 1), random.Random(seed + 2)
    for _ in range(count):
        running = r.random() < 0.2  # a running gang now and then: the last rows need one
        job, pods = _job(r, running)
        attempt = int(job.status.get("restarts") or 0)
        gang = _restarted(side, _pods(r, pods, attempt, running))
        gone = frozenset(f"n{i}" for i in range(pods) if r.random() < 0.05)
        now = at(r.choice([0, 5, 11, 61, 400, 1200]))
        gate, labels = _tas(tas, _kueue(r, running), pods)
        yield situation.Situation(job, tuple(gang), now, gate, gone, node_labels=labels)


def deciding(seen: situation.Situation) -> int:
    """The index in the table of the rule that decides ``seen``."""
    return next(
        i
        for i, row in enumerate(lifecycle.RULES)
        if isinstance(row, situation.Rule) and row.when(seen)
    )


def sections() -> list[situation.Section]:
    found: list[situation.Section] = []
    for row in lifecycle.RULES:
        section = row.section
        while section is not None and section not in found:
            found.append(section)
            section = section.within
    return found


def within(section: situation.Section | None, outer: situation.Section) -> bool:
    while section is not None:
        if section is outer:
            return True
        section = section.within
    return False


def test_every_rule_decides_and_every_note_adds_for_some_situation():
    decided: collections.Counter[str] = collections.Counter()
    added: collections.Counter[str] = collections.Counter()
    for seen in situations(SEED, CASES):
        for row in lifecycle.RULES:
            if isinstance(row, situation.Note):
                added[row.name] += bool(row.adds(seen))
            elif row.when(seen):
                row.then(seen)
                decided[row.name] += 1
                break
    never = [
        row.name
        for row in lifecycle.RULES
        if not (added if isinstance(row, situation.Note) else decided)[row.name]
    ]
    assert never == []


def test_a_section_once_reached_covering_the_situation_is_left_only_by_its_own_decision():
    first = {}
    for i, row in enumerate(lifecycle.RULES):
        for section in sections():
            if within(row.section, section):
                first.setdefault(section.name, i)
    for seen in situations(SEED, CASES):
        decided = deciding(seen)
        for section in sections():
            if first[section.name] <= decided and section.covers(seen):
                assert within(lifecycle.RULES[decided].section, section), (section.name, seen)


def test_each_section_is_one_block_of_the_table_inside_the_block_around_it():
    for section in sections():
        rows = [i for i, row in enumerate(lifecycle.RULES) if within(row.section, section)]
        assert rows == list(range(rows[0], rows[-1] + 1)), section.name
