"""``status.deviceErrors``: the device errors of the job's GPUs, by node, kept across its gangs.

A supervisor takes a GPU for bad at its second device error within
``exitcodes.DEVICE_SUSPECT_WINDOW_S`` (``meshtrain.trainer.recovery.device_fault``), but it
counts in its own memory, which a gang rebuild or a replaced pod starts again: a GPU that fails
once per attempt was never taken for bad, and with in-place recovery off, where every failure
rebuilds the gang, no GPU ever was.  So the operator keeps each device error it learns of here,
with its node: from the trainer's in-place recovery records (cause
``exitcodes.DEVICE_ERROR_CAUSE``, the rank's pod by the layout, its node by ``status.placement``)
and from a pod that left for a gang rebuild with a device error in its failure report
(``exitcodes.reported_device_error``).  Each pod placed on a node with one newer than the window
is told its time (``exitcodes.DEVICE_ERROR_AT_ENV``, :func:`newest_by_node`); its supervisor
counts it as the node's first strike, so one more device error there sends the pod away and
excludes the node (``bad_gpus``).  The unit is the node: a new pod's GPUs need not be the ones
that failed, and two uncorrectable errors on one node within an hour are the node's as much as
a GPU's.  Pure.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from meshtrain.api import exitcodes
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import conditions, pod_state

REASON = "DeviceError"
"""What disrupted the gang, in ``status.disruptions.nodes``, when a device error made it rebuild."""
KEPT = 32
"""Entries kept (the newest): the status stays bounded however often GPUs fail."""
MAX_RANKS = 8
"""Ranks one entry lists."""


def _placed(status: Mapping[str, Any]) -> dict[int, str]:
    return {
        p["podIndex"]: p["node"]
        for p in status.get("placement") or []
        if isinstance(p, Mapping) and isinstance(p.get("podIndex"), int) and p.get("node")
    }


def _entry(node: str, at: datetime.datetime, ranks: Iterable[int], said: str) -> dict[str, Any]:
    return {
        "node": node,
        "time": conditions.timestamp(at),
        "ranks": sorted(ranks)[:MAX_RANKS],
        "message": said,
    }


def from_records(
    status: Mapping[str, Any], spec: api_spec.TrainingJobSpec, records: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The entries of the trainer's newly counted in-place records whose cause is a device error
    (``recovery_count.Counted.named``), one per record and node; a rank whose pod has no recorded
    node is left out (it cannot be placed again on a node nobody knows)."""
    nodes = _placed(status)
    gpus = spec.resources.gpus_per_node
    added: list[dict[str, Any]] = []
    for record in records:
        failed_at = record.get("failedAt")
        if record.get("cause") != exitcodes.DEVICE_ERROR_CAUSE or not isinstance(
            failed_at, (int, float)
        ):
            continue
        at = datetime.datetime.fromtimestamp(failed_at, datetime.UTC)
        by_node: dict[str, list[int]] = {}
        for rank in record.get("ranks") or []:
            if isinstance(rank, int) and (node := nodes.get(rank // gpus)):
                by_node.setdefault(node, []).append(rank)
        said = f"rank(s) recovered in place after a device error (round {record.get('generation')})"
        added.extend(_entry(node, at, ranks, said) for node, ranks in by_node.items())
    return added


def from_pods(
    status: Mapping[str, Any],
    spec: api_spec.TrainingJobSpec,
    pods: Sequence[pod_state.PodState],
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """The entries of the ranks the gang's failure reports name as failed with a device error
    (a gang rebuilt after it: in-place recovery off or spent; every pod's report names them,
    ``rendezvous.HALT_DEVICE_RANKS``), at the first such pod's end where known."""
    reporters = [p for p in pods if p.device_error_ranks]
    if not reporters:
        return []
    at = min((p.finished_at for p in reporters if p.finished_at), default=now)
    nodes = {**_placed(status), **{p.index: p.node for p in pods if p.node}}
    gpus = spec.resources.gpus_per_node
    by_node: dict[str, set[int]] = {}
    for pod in reporters:
        for rank in pod.device_error_ranks:
            if node := nodes.get(rank // gpus):
                by_node.setdefault(node, set()).add(rank)
    said = "the gang was rebuilt after a device error"
    return [_entry(node, at, ranks, said) for node, ranks in by_node.items()]


def recorded(status: Mapping[str, Any], added: Sequence[dict[str, Any]]) -> list[Any] | None:
    """``status.deviceErrors`` with ``added`` (the same node and time once), the newest
    :data:`KEPT`; None when nothing is new."""
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
    return [*before, *new][-KEPT:]


def newest_by_node(status: Mapping[str, Any], now: datetime.datetime) -> dict[str, int]:
    """Node -> unix time of the job's newest device error there, for the nodes with one within
    ``exitcodes.DEVICE_SUSPECT_WINDOW_S`` of ``now`` (an unreadable time is skipped)."""
    newest: dict[str, int] = {}
    for entry in status.get("deviceErrors") or []:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("node"), str):
            continue
        try:
            at = conditions.parse_time(entry.get("time"))
        except (TypeError, ValueError):
            continue
        if at is None or (now - at).total_seconds() > exitcodes.DEVICE_SUSPECT_WINDOW_S:
            continue
        newest[entry["node"]] = max(int(at.timestamp()), newest.get(entry["node"], 0))
    return newest
