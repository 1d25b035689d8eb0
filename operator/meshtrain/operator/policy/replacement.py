"""Replacing a lost pod of a running gang: whether its pods rejoin, the recorded pod of each
index, and the status a replacement writes.

``status.placement[i].pod`` names the pod that holds index ``i`` once it was replaced (absent:
the gang's own ``<job>-r<attempt>-<i>``); a pod of the attempt whose name is not the recorded one
is superseded: stale, like a pod of an earlier attempt.  The entry is written before the pod is
created, with ``pending: true`` until the create succeeded, so a pass after a crash finds the name
to create; an entry no longer pending names a pod that was created: once it is gone it was lost
again, a new loss (counted, announced, within ``inPlaceLimit``), never recreated silently.  Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from meshtrain.api import limits
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import conditions, job_state, naming, pod_state, recovery_count

TIER = "pod"
"""``status.recovery.byTier`` key and record tier of a replaced pod."""
MAX_CONTAINERS, MAX_ENV = 64, 1024
"""Containers and environment variables of a pod read (a pod is bounded by the API server, but
a read loop is bounded here too)."""
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
"""The taint an administrator puts on a node known to be shut down (non-graceful node shutdown):
its pods are no longer running anywhere."""


def rejoins(spec: api_spec.TrainingJobSpec) -> bool:
    """Whether the job's pods can join a running gang's rendezvous (built-in trainer, in place)."""
    return spec.trainer.type == "builtin" and spec.run_policy.recovery.in_place


NODE_LOSS_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
"""The NoExecute taints the node lifecycle controller puts on a node that stopped reporting."""
NODE_LOSS_TOLERATION_MAX = 30
"""Most seconds a rejoining gang's pod stays on a node that stopped reporting before the taint
manager evicts it (the API server's DefaultTolerationSeconds would give 300)."""


def node_loss_seconds(spec: api_spec.TrainingJobSpec) -> int:
    """How long a rejoining pod tolerates its node's loss: a third of the rejoin window, at most
    :data:`NODE_LOSS_TOLERATION_MAX`, so the survivors still wait when its loss is seen."""
    return max(
        1, min(NODE_LOSS_TOLERATION_MAX, spec.run_policy.recovery.rejoin_timeout_seconds // 3)
    )


def node_loss_tolerations(spec: api_spec.TrainingJobSpec) -> list[dict[str, Any]]:
    """Tolerations of a rejoining gang's pod for its node's loss, with :func:`node_loss_seconds`.

    The API server's DefaultTolerationSeconds admission adds its 300 s tolerations only to a pod
    that has none for these taints, so these stand; a taint the job tolerates itself
    (``resources.tolerations``, by key or by an empty key) is left as the job wrote it.  None for
    a gang that cannot rejoin.
    """
    if not rejoins(spec):
        return []
    own = {t.key for t in spec.resources.tolerations}
    seconds = node_loss_seconds(spec)
    return [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds}
        for key in NODE_LOSS_TAINTS
        if key not in own and None not in own
    ]


def entries(status: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    """``status.placement`` by pod index (malformed entries skipped)."""
    found: dict[int, Mapping[str, Any]] = {}
    for entry in status.get("placement") or []:
        if isinstance(entry, Mapping) and isinstance(entry.get("podIndex"), int):
            found[entry["podIndex"]] = entry
    return found


def recorded_pod(job: str, attempt: int, entry: Mapping[str, Any] | None, index: int) -> str:
    """The pod that holds ``index``: the replacement the entry names, else the gang's own."""
    named = entry.get("pod") if entry is not None else None
    return named if isinstance(named, str) and named else naming.pod_name(job, attempt, index)


def pending(entry: Mapping[str, Any] | None) -> bool:
    """Whether ``entry`` names a replacement recorded but not yet created (``pending: true``)."""
    return entry is not None and entry.get("pending") is True


def created(status: Mapping[str, Any], indices: Sequence[int]) -> dict[str, Any]:
    """Status fields once the replacements of ``indices`` were created: no longer pending."""
    placed = entries(status)
    for index in indices:
        if index in placed:
            placed[index] = {k: v for k, v in placed[index].items() if k != "pending"}
    return {"placement": [placed[i] for i in sorted(placed)]}


def node_dead(node: Mapping[str, Any] | None) -> bool:
    """Whether a pod on ``node`` is known to run no more: the Node object is gone (None), or it
    carries the ``out-of-service`` taint.  An unreachable node is not dead: its pods may run."""
    if node is None:
        return True
    taints = (node.get("spec") or {}).get("taints") or []
    return any(isinstance(t, Mapping) and t.get("key") == OUT_OF_SERVICE for t in taints)


def holders(
    pods: Sequence[Mapping[str, Any]],
    attempt: int,
    index: int,
    replacement_pod: str,
    node: Callable[[str], Mapping[str, Any] | None],
) -> list[str]:
    """The pods other than ``replacement_pod`` that may still run as pod ``index`` of gang
    ``attempt``: not terminal, bound to a node (``node``: by name, None once deleted) not known
    dead.  The replacement is created only
    once there are none, so a rank slot never has two live holders (a deleted pod runs out its
    grace period; a pod on an unreachable node keeps running until its node is declared dead)."""
    found = []
    for pod in pods:
        metadata = pod.get("metadata") or {}
        labels = metadata.get("labels") or {}
        if metadata.get("name") == replacement_pod:
            continue
        if naming.int_label(labels, naming.LABEL_NODE_RANK) != index:
            continue
        if naming.int_label(labels, naming.LABEL_ATTEMPT) != attempt:
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        bound = (pod.get("spec") or {}).get("nodeName")
        if bound and not node_dead(node(str(bound))):
            found.append(str(metadata.get("name") or ""))
    return sorted(found)


RECOVERY_ENV_PREFIX = "MESHTRAIN_RECOVERY_"
"""The trainer's environment that carries ``runPolicy.recovery`` (``kubelet_tier.recovery_env``)."""


def recovery_env(pod: Mapping[str, Any]) -> dict[str, str]:
    """The ``runPolicy.recovery`` a pod was built with, as its trainer container's environment."""
    found: dict[str, str] = {}
    for container in ((pod.get("spec") or {}).get("containers") or [])[:MAX_CONTAINERS]:
        if container.get("name") != naming.CONTAINER:
            continue
        for var in (container.get("env") or [])[:MAX_ENV]:
            name = var.get("name") if isinstance(var, Mapping) else None
            if isinstance(name, str) and name.startswith(RECOVERY_ENV_PREFIX):
                found[name] = str(var.get("value"))
    return found


def recovery_changed(
    survivor: Mapping[str, Any] | None, replacement_pod: Mapping[str, Any]
) -> bool:
    """Whether ``runPolicy.recovery`` changed since the gang attempt began: the replacement built
    now would run with other settings than ``survivor`` (pod 0, which every pod tier keeps).  The
    pod tier is then refused and the gang rebuilt, so one gang never mixes recovery settings."""
    return survivor is not None and recovery_env(survivor) != recovery_env(replacement_pod)


def superseded(
    job: str, attempt: int, placed: Mapping[int, Mapping[str, Any]], pod: pod_state.PodState
) -> bool:
    """Whether ``pod`` (of ``attempt``) holds an index that a replacement now holds."""
    return pod.name != recorded_pod(job, attempt, placed.get(pod.index), pod.index)


def replaced_so_far(status: Mapping[str, Any]) -> int:
    """Pods replaced in this gang attempt (``status.placement[*].replaced``)."""
    return sum(int(e.get("replaced") or 0) for e in entries(status).values())


def attempt_restarts(
    status: Mapping[str, Any], attempt: int, now: datetime.datetime | None = None
) -> int:
    """In-place restarts of any tier in gang ``attempt`` (``status.recovery.attemptRestarts``,
    ``recovery_count``'s book: none once the gang ran steadily since the last), and at least the
    pods replaced in it where the book is older than ``countedAt``."""
    booked = recovery_count.book(status, attempt, now)
    since = (
        replaced_so_far(status) if booked["countedAt"] is None else 0
    )  # written before the count
    return max(int(booked["attemptRestarts"]), since)


def planned_name(job: str, attempt: int, entry: Mapping[str, Any] | None, index: int) -> str:
    """Name of the replacement to plan for ``index``: a pending one keeps its recorded name (it
    was never created), else the next one."""
    if pending(entry) and entry is not None and isinstance(entry.get("pod"), str):
        return str(entry["pod"])
    return next_name(job, attempt, entry, index)


def next_name(job: str, attempt: int, entry: Mapping[str, Any] | None, index: int) -> str:
    """Name of the next replacement of ``index``."""
    done = int(entry.get("replaced") or 0) if entry is not None else 0
    return naming.replacement_pod_name(job, attempt, index, done + 1)


@dataclasses.dataclass(frozen=True)
class Replaced:
    """One lost pod and its replacement."""

    index: int
    lost: str
    """The lost pod's name."""
    cause: str
    """Why it was lost (``pod deleted``, ``node lost``, ...)."""
    pod: str
    """The replacement's name."""
    node: str
    spare: bool
    """It lands on a spare node reserved for the job."""


def status_changes(
    job: job_state.JobState,
    replaced: Sequence[Replaced],
    gpus_per_pod: int,
    now: datetime.datetime,
) -> dict[str, Any]:
    """Placement entries of the replacements, and ``status.recovery`` counted (tier ``pod``).

    A replacement planned again while its entry is still pending (its node was taken while the
    lost pod stopped) moves to its new node under the same name, and is not counted again.
    """
    placed = entries(job.status)
    new = 0
    for r in replaced:
        before = placed.get(r.index) or {}
        again = pending(before)
        new += not again
        # the lost pod's node (a pending entry's node held no pod yet: its own previous one stays)
        previous = before.get("previousNode") if again else before.get("node")
        placed[r.index] = {
            "podIndex": r.index,
            "node": r.node,
            "pod": r.pod,
            "replaced": int(before.get("replaced") or 0) + (0 if again else 1),
            "pending": True,
            **({"previousNode": previous} if previous else {}),
        }
    attempt = int(job.status.get("restarts") or 0)
    recovery = recovery_count.book(job.status, attempt, now)
    if new == 0:
        return {"placement": [placed[i] for i in sorted(placed)], "recovery": recovery}
    by_tier = dict(recovery["byTier"])
    by_tier[TIER] = by_tier.get(TIER, 0) + new
    stamp = round(now.timestamp(), 3)
    ranks = [x.index * gpus_per_pod + r for x in replaced for r in range(gpus_per_pod)]
    lost_on = []  # where the lost pods ran, as status.recovery.last.nodes
    for x in replaced:
        if node := placed[x.index].get("previousNode"):
            first = x.index * gpus_per_pod
            held = range(first, first + min(gpus_per_pod, recovery_count.MAX_RANKS))
            lost_on.append({"node": node, "ranks": list(held)})
    record: dict[str, Any] = dict.fromkeys(recovery_count.RECORD_KEYS)
    record.update(
        tier=TIER,
        cause="; ".join(sorted({r.cause for r in replaced})),
        pod=replaced[0].lost,
        ranks=ranks[: recovery_count.MAX_RANKS],
        failedAt=stamp,
        detectedAt=stamp,
        nodes=lost_on[: limits.MAX_RECOVERY_NODES] or None,
    )
    recovery.update(
        inPlaceRestarts=recovery["inPlaceRestarts"] + new,
        attemptRestarts=attempt_restarts(job.status, attempt, now) + new,
        attemptDisruptions=recovery["attemptDisruptions"] + new,
        countedAt=conditions.timestamp(now),
        byTier=by_tier,
        last=record,
    )
    return {
        "placement": [placed[i] for i in sorted(placed)],
        "recovery": recovery,
        "observedGeneration": job.generation,
    }


def message(replaced: Sequence[Replaced]) -> str:
    """The Event's words: which pod went, why, and where its replacement runs."""
    return (
        "; ".join(
            f"pod {r.index} ({r.lost}: {r.cause}) replaced by {r.pod} on node {r.node}"
            + (" (a spare)" if r.spare else "")
            for r in replaced
        )
        + "; the other pods keep running"
    )
