"""Released gang pods that kube-scheduler refused: place the gang again elsewhere, spaced by a backoff.

The operator's check and kube-scheduler can still disagree once the gates are lifted (a pod
bound in between, a filter the operator does not model such as another pod's anti-affinity),
and a pinned pod then stays Pending for good.  No pod of such a gang has trained (the ranks
rendezvous only once all are up), so the whole gang is placed again without the refused
node(s): a re-placement, not a restart.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Iterable, Mapping, Sequence

from meshtrain.operator.policy import pod_state

EXCLUDED_SECONDS = 300.0
"""How long a node the scheduler refused a released pod stays out of the job's placements."""
PERSISTS_SECONDS = 10.0
"""How long a released pod stays refused (PodScheduled=False since) before the gang is re-placed.

The scheduler's first answer may come before a freed node's pods are gone."""
SPACING_SECONDS = 5.0
"""Wait after a job's first re-placement before another; doubles with each, up to :data:`SPACING_CAP_SECONDS`,
so a disagreement the exclusion does not cure cannot loop."""
SPACING_CAP_SECONDS = 300.0

_COUNTED = re.compile(r"(?:available:|,)\s*\d+ ")
"""A part of kube-scheduler's FitError message that counts nodes (``3 node(s) had ...``, ``1 Insufficient cpu``)."""


@dataclasses.dataclass(frozen=True)
class ReplaceRefused:
    """Delete the gang (none of it ran) and place it again without ``nodes`` (node -> the scheduler's message)."""

    nodes: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class Record:
    """A job's re-placements after refusals (kept by the reconciler, per job UID)."""

    replacements: int
    """Re-placements so far; the spacing doubles with each."""
    not_before: float
    """time.monotonic() before which no further re-placement is made."""
    excluded: Mapping[str, float]
    """Node -> time.monotonic() until which it is left out of the job's placements."""


def about_the_node(message: str) -> bool:
    """Whether the scheduler judged nodes one by one (filters), not the pod as a whole (PreFilter).

    ``0/3 nodes are available: 1 node(s) had untolerated taint(s), 2 node(s) didn't match ...``
    counts nodes; ``0/3 nodes are available: persistentvolumeclaim "c" not found.`` does not.
    """
    reasons = message.split(" preemption:", 1)[0]
    return bool(_COUNTED.search(reasons))


@dataclasses.dataclass(frozen=True)
class Refusals:
    nodes: dict[str, str]
    """Planned node -> the scheduler's message, for refusals that lasted: re-place the gang."""
    recheck_after: float | None
    """Seconds until a younger refusal has lasted long enough (None: there is none)."""


def refused(pods: Sequence[pod_state.PodState], now: datetime.datetime) -> Refusals:
    """Released, unbound pods refused node by node, not nominated for their planned node.

    A pod nominated for its planned node is left alone: the scheduler is preempting pods there
    to make room (its message still reads ``Insufficient ...`` meanwhile), and re-placing would
    only have killed those victims for nothing.  A refusal of the pod as a whole (PreFilter,
    :func:`about_the_node`) is only reported: no other node would change it.
    """
    found: dict[str, str] = {}
    recheck: float | None = None
    for pod in pods:
        message = pod.unschedulable_message
        if (
            not message
            or pod.gated
            or pod.bound
            or pod.deleting
            or pod.terminal
            or (pod.nominated is not None and pod.nominated == pod.node)
            or not about_the_node(message)
        ):
            continue
        since = pod.unschedulable_since
        left = 0.0 if since is None else PERSISTS_SECONDS - (now - since).total_seconds()
        if left > 0:
            recheck = left if recheck is None else min(recheck, left)
            continue
        found.setdefault(pod.node or "", message)
    return Refusals(found, recheck)


def wait(record: Record | None, now: float) -> float | None:
    """Seconds before the job may be re-placed again (None: now)."""
    if record is None or record.not_before <= now:
        return None
    return record.not_before - now


def replaced(record: Record | None, nodes: Iterable[str], now: float) -> Record:
    """The record after one more re-placement that leaves ``nodes`` out."""
    count = (record.replacements if record is not None else 0) + 1
    excluded = {n: t for n, t in (record.excluded if record else {}).items() if t > now}
    excluded.update({node: now + EXCLUDED_SECONDS for node in nodes if node})
    spacing = min(SPACING_SECONDS * 2 ** (count - 1), SPACING_CAP_SECONDS)
    return Record(count, now + spacing, excluded)


def excluded(record: Record | None, now: float) -> frozenset[str]:
    """Nodes the job is not placed on now."""
    return frozenset(returns_in(record, now))


def returns_in(record: Record | None, now: float) -> dict[str, float]:
    """Seconds until each node excluded at ``now`` may take the job's pods again."""
    if record is None:
        return {}
    return {node: until - now for node, until in record.excluded.items() if until > now}


def message(nodes: Mapping[str, str]) -> str:
    """The condition's and Event's message for a re-placement after refusals."""
    said = "; ".join(f"{node}: {why}" for node, why in sorted(nodes.items()))
    return (
        f"kube-scheduler refused released pod(s) on their planned node(s) ({said}); "
        f"placing the gang again without {', '.join(sorted(nodes))} for {EXCLUDED_SECONDS:.0f} s"
    )
