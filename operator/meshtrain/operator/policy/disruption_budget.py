"""runPolicy.disruptionRestartLimit: gang restarts caused by disruptions, bounded, spaced and steered.

A disruption (node lost, eviction, preemption, a pod the kubelet refused: ``pod_failure``) does
not use ``backoffLimit``, so without a budget of its own a node with a broken device plugin
restarted a job hundreds of times a minute.  :func:`judge` counts the disruption restarts in a
row (a gang that ran for :data:`STEADY_SECONDS` starts the count again), fails the job once they
pass the limit, spaces the next placement after a repeated one (:data:`WAITING`), and excludes
a node that disrupted the job twice the way a straggler's node is (``status.excludedNodes``,
left out of the job's placements for ``excluded_nodes.EXCLUSION_SECONDS``).  A preemption
(:data:`PREEMPTIONS`: the cluster took the pods back for other work, from a healthy node) is
spaced the same way but spends no budget and excludes no node.
Pure: the jitter comes from the job's UID and attempt, so a decision repeated waits the same.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.operator.policy import (
    conditions,
    container_reasons,
    device_errors,
    excluded_nodes,
    job_actions,
    pod_failure,
    pod_state,
    retries,
    situation,
)

REASON = "Disrupted"
"""``excludedNodes[].reason`` of a node that disrupted the job :data:`EXCLUDED_AFTER` times."""
LIMIT_EXCEEDED = "DisruptionLimitExceeded"
"""Failed condition's reason once the disruption restarts in a row pass the limit."""
EXCLUDED_AFTER = 2
"""Disruptions by one node after which the job is placed without it."""
STEADY_SECONDS = conditions.STEADY_SECONDS
"""A gang that ran (every pod Running) this long before a disruption starts the count again: a long
job that loses a node every few hours must not fail for it."""
BACKOFF_BASE_SECONDS = 5.0
"""Wait before placing again after the second disruption in a row; doubled for each further one.
The first is placed again at once (a lost node is no reason to wait)."""
BACKOFF_CAP_SECONDS = 300.0
"""Longest wait between two placements of a job that keeps being disrupted (before jitter)."""
NODES_KEPT = 32
"""Nodes remembered in ``status.disruptions.nodes`` (most recent): the status stays bounded."""
PREEMPTIONS = frozenset({"PreemptionByScheduler", "EvictionByEvictionAPI", "Preempting"})
"""Reasons (of the ``DisruptionTarget`` condition, or the pod's ``status.reason``) of a disruption
that says nothing against the node: kube-scheduler preempting for a pod of higher priority, an
Eviction API call (``kubectl drain``, the cluster autoscaler's scale-down, a descheduler), the
kubelet preempting to admit a critical pod.  Node-caused reasons (``TerminationByKubelet`` under
node pressure or shutdown, ``DeletionByTaintManager`` for a NoExecute taint such as
``unreachable``, ``DeletionByPodGC`` for a node gone, a node lost, a kubelet admission
rejection) count against the limit and exclude the node; these do neither: a rolling drain or a
busy priority class must not fail a job or leave healthy nodes out of it for a day."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What one more disruption restart means for the job."""

    status: dict[str, Any]
    """Status fields the restart writes too: ``disruptions``, and ``excludedNodes`` when a node is excluded."""
    wait: float
    """Seconds before the gang is placed again (0: at once)."""
    note: str
    """What the restart's condition and Event add: the count, the exclusion, the wait."""
    exceeded: str | None
    """The Failed message when the limit is spent (None: restart)."""


def _whole(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _record(status: Mapping[str, Any]) -> Mapping[str, Any]:
    record = status.get("disruptions")
    return record if isinstance(record, Mapping) else {}


def _reason(pod: pod_state.PodState) -> str:
    """What disrupted ``pod``: its ``status.reason`` (``Evicted``, ``UnexpectedAdmissionError``), else
    its ``DisruptionTarget`` condition's (``PreemptionByScheduler``, ``DeletionByTaintManager``)."""
    if pod.phase == "Unknown":
        return "NodeLost"
    if pod.runtime_lost:
        return container_reasons.RUNTIME_LOST_REASON
    if pod.left_bad_gpu:
        return conditions.BAD_GPU
    return (
        pod.reason
        or pod.disruption_reason
        or ("DisruptionTarget" if pod.disrupted else "Disrupted")
    )


def preempted(pod: pod_state.PodState) -> bool:
    """Whether ``pod`` was disrupted for other work, not by its node (:data:`PREEMPTIONS`)."""
    return pod.disruption_reason in PREEMPTIONS or pod.reason in PREEMPTIONS


def _failed_pods(
    seen: situation.Situation, failures: Sequence[pod_failure.Failure]
) -> list[pod_state.PodState | None]:
    by_name = {p.name: p for p in seen.current}
    return [by_name.get(f.pod) for f in failures]


def only_preempted(seen: situation.Situation, failures: Sequence[pod_failure.Failure]) -> bool:
    """Whether every failed pod of ``failures`` was preempted (:func:`preempted`)."""
    pods = _failed_pods(seen, failures)
    return bool(pods) and all(p is not None and preempted(p) for p in pods)


def disrupting_nodes(
    seen: situation.Situation, failures: Sequence[pod_failure.Failure]
) -> dict[str, str]:
    """The nodes the disrupted pods of the gang were on -> the disruption's reason; a preempted
    pod's node is not among them.

    A pod gone with its node (``pod_failure.of_gang``) is found through ``status.placement``.
    """
    found: dict[str, str] = {}
    for pod in _failed_pods(seen, failures):
        if pod is not None and pod.device_error_ranks:  # the node of the failed GPU, not its own
            named = device_errors.ranks_by_node(
                pod.device_error_ranks, seen.spec, seen.job.status, seen.current
            )
            found.update(dict.fromkeys(named, device_errors.REASON))
        elif pod is not None and pod.node and not preempted(pod):
            found.setdefault(pod.node, _reason(pod))
    if not found:
        for entry in seen.job.status.get("placement") or []:
            if not isinstance(entry, Mapping):
                continue
            node = entry.get("node")
            if entry.get("podIndex") in seen.missing and node in seen.nodes_gone:
                found.setdefault(str(node), "NodeDeleted")
    return found


def _steady(seen: situation.Situation) -> bool:
    """Whether the gang has run (every pod Running) for :data:`STEADY_SECONDS`."""
    return conditions.steady(seen.job.status, seen.now)


def streak(seen: situation.Situation) -> int:
    """Disruption restarts in a row before this one: none once the gang ran :data:`STEADY_SECONDS`."""
    return 0 if _steady(seen) else _whole(_record(seen.job.status).get("streak"))


def preemptions(seen: situation.Situation) -> int:
    """Preemption restarts in a row before this one (not in :func:`streak`), likewise."""
    return 0 if _steady(seen) else _whole(_record(seen.job.status).get("preemptions"))


def _nodes_after(
    previous: Any, hit: Mapping[str, str], now: datetime.datetime
) -> list[dict[str, Any]]:
    """``status.disruptions.nodes`` with one more disruption by each node of ``hit``, most recent last."""
    by_node: dict[str, dict[str, Any]] = {}
    for entry in previous if isinstance(previous, list) else []:
        if isinstance(entry, Mapping) and isinstance(entry.get("node"), str):
            by_node[entry["node"]] = dict(entry)
    for node, reason in hit.items():
        count = _whole(by_node.pop(node, {}).get("count")) + 1
        by_node[node] = {
            "node": node,
            "count": count,
            "reason": reason,
            "time": conditions.timestamp(now),
        }
    return list(by_node.values())[-NODES_KEPT:]


def _exclusions(
    nodes: Sequence[Mapping[str, Any]], hit: Mapping[str, str], now: datetime.datetime
) -> list[dict[str, Any]]:
    """``excludedNodes`` entries for the nodes of ``hit`` that have now disrupted the job
    :data:`EXCLUDED_AFTER` times or more (again after an earlier exclusion ran out: a new entry)."""
    return [
        {
            "node": entry["node"],
            "reason": REASON,
            "message": f"disrupted the job {entry['count']} times, last: {entry['reason']}",
            "time": conditions.timestamp(now),
        }
        for entry in nodes
        if entry["node"] in hit and entry["count"] >= EXCLUDED_AFTER
    ]


def describe(nodes: Sequence[Mapping[str, Any]]) -> str:
    """The nodes, most disruptions first: ``n1 (2, UnexpectedAdmissionError), n2 (1, NodeLost)``."""
    ranked = sorted(nodes, key=lambda e: -int(e["count"]))[:5]
    said = ", ".join(f"{e['node']} ({e['count']}, {e['reason']})" for e in ranked)
    more = len(nodes) - len(ranked)
    return said + (f" and {more} more" if more > 0 else "")


def _spacing(seen: situation.Situation, before: int) -> tuple[float, str | None]:
    """The wait after ``before`` disruption restarts in a row (none after the first) and
    ``disruptions.notBefore`` for it."""
    if before <= 0:
        return 0.0, None
    fraction = retries.fraction_of(f"{seen.job.ref.uid}/{seen.attempt}")
    wait = retries.jittered(
        before, base=BACKOFF_BASE_SECONDS, cap=BACKOFF_CAP_SECONDS, fraction=fraction
    )
    return wait, conditions.timestamp(seen.now + datetime.timedelta(seconds=math.ceil(wait)))


def _preemption(seen: situation.Situation, failures: Sequence[pod_failure.Failure]) -> Verdict:
    """One more preemption restart: spaced, not counted, no node excluded."""
    record, before, earlier = _record(seen.job.status), streak(seen), preemptions(seen)
    wait, not_before = _spacing(seen, before + earlier)
    reasons = sorted({_reason(p) for p in _failed_pods(seen, failures) if p is not None})
    changes = {
        "disruptions": {
            "streak": before,
            "preemptions": earlier + 1,
            "notBefore": not_before,
            "nodes": _nodes_after(record.get("nodes"), {}, seen.now),
        }
    }
    limit = seen.spec.run_policy.disruption_restart_limit
    note = (
        f"a preemption ({', '.join(reasons)}): not counted against "
        f"disruptionRestartLimit={limit}, no node excluded"
    )
    if wait:
        note += f"; placing the gang again in {math.ceil(wait)} s"
    return Verdict(changes, wait, note, None)


def judge(
    seen: situation.Situation, failures: Sequence[pod_failure.Failure], message: str
) -> Verdict:
    """One more disruption restart of ``seen``'s gang (``message``: what failed)."""
    if only_preempted(seen, failures):
        return _preemption(seen, failures)
    status, limit = seen.job.status, seen.spec.run_policy.disruption_restart_limit
    before = streak(seen)
    hit = disrupting_nodes(seen, failures)
    nodes = _nodes_after(_record(status).get("nodes"), hit, seen.now)
    if before >= limit:
        exceeded = (
            f"{message}; {before} disruption restart(s) in a row already "
            f"(runPolicy.disruptionRestartLimit={limit}); disrupted by node(s) {describe(nodes)}"
        )
        return Verdict({}, 0.0, "", exceeded)
    earlier = preemptions(seen)
    wait, not_before = _spacing(seen, before + earlier)
    record = {
        "streak": before + 1,
        "preemptions": earlier,
        "notBefore": not_before,
        "nodes": nodes,
    }
    excluded = _exclusions(nodes, hit, seen.now)
    changes: dict[str, Any] = {"disruptions": record}
    note = f"disruption restart {before + 1} of {limit} in a row"
    if excluded:
        changes["excludedNodes"] = excluded_nodes.excluded_after(status, excluded, REASON)
        gone = ", ".join(e["node"] for e in excluded)
        note += f"; node(s) {gone} excluded: each disrupted the job {EXCLUDED_AFTER} times"
    if wait:
        note += f"; placing the gang again in {math.ceil(wait)} s"
    return Verdict(changes, wait, note, None)


def _left(seen: situation.Situation) -> float:
    """Seconds before the gang may be placed again (0 or less: now)."""
    value = _record(seen.job.status).get("notBefore")
    try:
        not_before = conditions.parse_time(value if isinstance(value, str) else None)
    except ValueError:  # not written by this operator: no wait
        return 0.0
    return 0.0 if not_before is None else (not_before - seen.now).total_seconds()


WAITING = situation.UNPLACED.rule(
    "a repeated disruption's backoff not over: wait before placing the gang",
    lambda seen: not seen.current and _left(seen) > 0,
    lambda seen: job_actions.Decision((), requeue_after=_left(seen)),
)
