"""``status.deviceErrors``: the device errors of the job's GPUs, by node, kept across its gangs.

A supervisor takes a GPU for bad at its second device error within
``exitcodes.DEVICE_SUSPECT_WINDOW_S`` (``meshtrain.trainer.recovery.device_fault``), but it
counts in its own memory, which a gang rebuild or a replaced pod starts again: a GPU that fails
once per attempt was never taken for bad, and with in-place recovery off, where every failure
rebuilds the gang, no GPU ever was.  So the operator keeps each device error it learns of here,
with its node: from the trainer's in-place recovery records (cause
``exitcodes.DEVICE_ERROR_CAUSE``; the node the record names for the rank, which its pod's
supervisor reported, else the rank's pod by the layout and its node by ``status.placement``)
and from the failure reports of a gang rebuilt after one (``exitcodes.reported_device_error_ranks``,
every pod's alike: the rendezvous store names the ranks beside the halt).  Each pod placed on a node with one newer than the
window is told its time (``exitcodes.DEVICE_ERROR_AT_ENV``, :func:`newest_by_node`); its
supervisor counts it as the node's first strike, so one more device error there sends the pod
away and excludes the node (``bad_gpus``).  Two kept on one node within the window exclude it
at the gang's next rebuild too (:func:`twice_within`), whichever way the second came (a pod
created before the first was known): an operator-side second strike by node, stricter than the
supervisor's by GPU within one pod's life.  The unit is the node: a new pod's
GPUs need not be the ones that failed, and two uncorrectable errors on one node within an hour
are the node's as much as a GPU's.  Only the built-in trainer's reports count (a custom
program's report is its own say: ``situation``).  Pure.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from meshtrain.api import exitcodes
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import conditions, excluded_nodes, pod_state, replacement

REASON = "DeviceError"
"""What disrupted the gang, in ``status.disruptions.nodes``, when a device error made it rebuild."""
KEPT = 32
"""Entries kept (the newest): the status stays bounded however often GPUs fail."""
MAX_RANKS = 8
"""Ranks one entry lists."""


def _pod_nodes(
    status: Mapping[str, Any], pods: Sequence[pod_state.PodState] = ()
) -> dict[int, str]:
    """Pod index -> its node: the pods' own where they have one, else ``status.placement``'s."""
    nodes = {i: str(e["node"]) for i, e in replacement.entries(status).items() if e.get("node")}
    return {**nodes, **{p.index: p.node for p in pods if p.node}}


def ranks_by_node(
    ranks: Iterable[int],
    spec: api_spec.TrainingJobSpec,
    status: Mapping[str, Any],
    pods: Sequence[pod_state.PodState] = (),
) -> dict[str, list[int]]:
    """The nodes of ``ranks`` (by the layout's pod of each, and that pod's node), each with its
    ranks; a rank whose pod has no known node is left out."""
    nodes, gpus = _pod_nodes(status, pods), spec.resources.gpus_per_node
    found: dict[str, list[int]] = {}
    for rank in ranks:
        if node := nodes.get(spec.parallelism.layout.pod_of(rank, gpus)):
            found.setdefault(node, []).append(rank)
    return found


def _entry(node: str, at: datetime.datetime, ranks: Iterable[int], said: str) -> dict[str, Any]:
    return {
        "node": node,
        "time": conditions.timestamp(at),
        "ranks": sorted(ranks)[:MAX_RANKS],
        "message": said,
    }


def _device_error_only(cause: Any) -> bool:
    """Whether a record's cause names device errors alone.  A round that recovered several
    failures joins their causes and ranks (``rendezvous.summary``): mixed with others, which rank
    failed how is lost, and no node is charged."""
    causes = [c.strip() for c in cause.split(",")] if isinstance(cause, str) else []
    return bool(causes) and all(c == exitcodes.DEVICE_ERROR_CAUSE for c in causes)


def from_records(
    status: Mapping[str, Any],
    spec: api_spec.TrainingJobSpec,
    records: Sequence[Mapping[str, Any]],
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """The entries of the trainer's newly counted in-place records whose cause is a device error
    (``recovery_count.Counted.named``), one per record and node; a time ahead of ``now`` (a node
    clock running fast) is taken as ``now``."""
    added: list[dict[str, Any]] = []
    for record in records:
        failed_at, ranks = record.get("failedAt"), record.get("ranks")
        if not _device_error_only(record.get("cause")) or not isinstance(failed_at, (int, float)):
            continue
        try:
            at = min(datetime.datetime.fromtimestamp(failed_at, datetime.UTC), now)
        except (OverflowError, OSError, ValueError):  # a time no clock reads
            continue
        valid = [r for r in ranks or [] if isinstance(r, int) and not isinstance(r, bool)]
        said = f"recovered in place after a device error (round {record.get('generation')})"
        added.extend(
            _entry(node, at, on_node, said)
            for node, on_node in _record_ranks_by_node(record, valid, spec, status).items()
        )
    return added


def _record_ranks_by_node(
    record: Mapping[str, Any],
    ranks: Sequence[int],
    spec: api_spec.TrainingJobSpec,
    status: Mapping[str, Any],
) -> dict[str, list[int]]:
    """The nodes of a record's failed ``ranks``.

    A record names the node of each pod whose supervisor reported its own ranks' failure; every
    rank of that pod ran there.  The name is the tenant's program's word, so it counts only where
    that pod index was held: its node in ``status.placement`` or the one its last replacement
    took over from (``previousNode``).  A pod named elsewhere (replaced twice before this read, a
    CRD that dropped ``previousNode``, or a false name) charges no node: its current one is the
    one it did not fail on.  Only a pod the record does not name goes by its node now."""
    gpus, layout = spec.resources.gpus_per_node, spec.parallelism.layout
    held: dict[int, set[str]] = {}
    for index, entry in replacement.entries(status).items():
        held[index] = {str(entry[k]) for k in ("node", "previousNode") if entry.get(k)}
    named: dict[int, dict[str, set[int]]] = {}  # pod -> believed node -> the ranks it lists
    said: set[int] = set()  # pods the record names at all
    for entry in record.get("nodes") or []:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("ranks"), list):
            continue
        for rank in entry["ranks"]:
            if not isinstance(rank, int):
                continue
            pod = layout.pod_of(rank, gpus)
            said.add(pod)
            if entry.get("node") in held.get(pod, set()):
                named.setdefault(pod, {}).setdefault(entry["node"], set()).add(rank)
    found: dict[str, list[int]] = {}
    unnamed = []
    for rank in ranks:
        pod = layout.pod_of(rank, gpus)
        nodes = named.get(pod, {})
        # two nodes for one pod (replaced mid-round): each for the ranks its entry lists
        where = list(nodes) if len(nodes) == 1 else sorted(n for n, r in nodes.items() if rank in r)
        for node in where:
            found.setdefault(node, []).append(rank)
        if pod not in said:
            unnamed.append(rank)
    for node, on_node in ranks_by_node(unnamed, spec, status).items():
        found.setdefault(node, []).extend(on_node)
    return found


def reported_ranks(pods: Sequence[pod_state.PodState]) -> set[int]:
    """The ranks the pods' failure reports name as failed with a device error."""
    return {rank for pod in pods for rank in pod.device_error_ranks}


def from_pods(
    status: Mapping[str, Any],
    spec: api_spec.TrainingJobSpec,
    pods: Sequence[pod_state.PodState],
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """The entries of the ranks the gang's failure reports name as failed with a device error (a
    gang rebuilt after one), at the first reporting pod's end where known (its node's clock)."""
    reporters = [p for p in pods if p.device_error_ranks]
    if not reporters:
        return []
    at = min((p.finished_at for p in reporters if p.finished_at), default=now)
    at = min(at, now)  # a node clock running fast: never a time to come
    said = "the gang was rebuilt after a device error"
    named = ranks_by_node(sorted(reported_ranks(reporters)), spec, status, pods)
    return [_entry(node, at, ranks, said) for node, ranks in named.items()]


def _time(entry: Any) -> datetime.datetime | None:
    """An entry's time, None when unreadable or without a zone."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("node"), str):
        return None
    try:
        at = conditions.parse_time(entry.get("time"))
    except (TypeError, ValueError):
        return None
    return at if at is not None and at.tzinfo is not None else None


def _recent(entry: Any, now: datetime.datetime) -> datetime.datetime | None:
    """An entry's time when it is within the window of ``now``, else None."""
    at = _time(entry)
    within = at is not None and (now - at).total_seconds() <= exitcodes.DEVICE_SUSPECT_WINDOW_S
    return at if within else None


def recorded(
    status: Mapping[str, Any], added: Sequence[dict[str, Any]], now: datetime.datetime
) -> list[Any] | None:
    """``status.deviceErrors`` with ``added`` (the same node and time once), those older than the
    window dropped, the newest :data:`KEPT`; None when nothing is new."""
    before = [e for e in status.get("deviceErrors") or [] if isinstance(e, Mapping)]
    known = {(e.get("node"), e.get("time")) for e in before}
    new: list[dict[str, Any]] = []
    for entry in added:
        key = (entry["node"], entry["time"])
        if key not in known:
            known.add(key)
            new.append(entry)
    if not new:
        return None
    return [e for e in [*before, *new] if _recent(e, now) is not None][-KEPT:]


def newest_by_node(status: Mapping[str, Any], now: datetime.datetime) -> dict[str, int]:
    """Node -> unix time of the job's newest device error there, for the nodes with one within
    ``exitcodes.DEVICE_SUSPECT_WINDOW_S`` of ``now`` (an unreadable time is skipped)."""
    newest: dict[str, int] = {}
    for entry in status.get("deviceErrors") or []:
        if (at := _recent(entry, now)) is not None:
            newest[entry["node"]] = max(int(at.timestamp()), newest.get(entry["node"], 0))
    return newest


def twice_within(entries: Any, now: datetime.datetime) -> dict[str, str]:
    """Node -> what happened, for each node with two device errors of the job at different times
    within the window of ``now``: as bad as a GPU its supervisor took for bad."""
    times: dict[str, set[str]] = {}
    for entry in entries if isinstance(entries, list) else []:
        if _recent(entry, now) is not None:
            times.setdefault(entry["node"], set()).add(entry["time"])
    return {
        node: f"the job's GPUs failed there with device errors at {', '.join(sorted(seen))}"
        for node, seen in times.items()
        if len(seen) >= 2
    }


def exclusions(status: Mapping[str, Any], now: datetime.datetime) -> dict[str, dict[str, Any]]:
    """The ``excludedNodes`` entries (reason ``BadGPU``, as ``bad_gpus.newly_bad`` writes them)
    of the nodes :func:`twice_within` finds in ``status.deviceErrors`` that are not excluded for
    a bad GPU yet."""
    already = excluded_nodes.excluded(excluded_nodes.of_reason(status, conditions.BAD_GPU), now)
    return {
        node: {
            "node": node,
            "reason": conditions.BAD_GPU,
            "message": said,
            "time": conditions.timestamp(now),
        }
        for node, said in twice_within(status.get("deviceErrors"), now).items()
        if node not in already
    }
