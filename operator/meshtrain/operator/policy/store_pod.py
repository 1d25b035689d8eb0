"""When a job's rendezvous store pod goes (``rendezvousStore: dedicated``).  Pure.

The store pod is made with its gang (``placing``) and leaves by itself once the gang finished or
halted and its pods left (``meshtrain.trainer.recovery.store_host``).  A gang stopped from outside
(rebuilt, suspended, evicted by Kueue, finished by the operator) never says it left: its ranks
stop alone and a replacement could still take their slots.  So the operator deletes the store pod
of an earlier gang attempt, or of a job with no placement (queued again, suspended) or that is
over, but only once no trainer pod of its attempt is left running or stopping: the stopping
ranks agree on the step of their last checkpoint through the store.  The next placement of the
same attempt never reuses it: ``children.ensure`` refuses a store pod that is going away, ended,
or stamped with another placement's start (its state is the old gang's), deletes it, and the
placement follows once it is gone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.operator.policy import (
    container_reasons,
    job_state,
    kubelet_tier,
    naming,
    pod_failure,
    pod_state,
)

ENDED = ("Succeeded", "Failed")
"""Pod phases of a pod that runs nothing any more."""
OVER = (*job_state.FINAL, job_state.Phase.SUSPENDED.value)
"""Job phases in which no gang runs."""
LAST_SEEN_LABELS = (naming.LABEL_STORE, naming.LABEL_ATTEMPT, naming.LABEL_SPEC_HASH)
"""The labels :func:`last_seen` keeps of a gone store pod (what :func:`_of_placement` reads)."""
MAX_ENV = 512
"""Environment entries of a container read (a pod is the job's, but bound what is read)."""


def _labels(pod: Mapping[str, Any]) -> Mapping[str, str]:
    return (pod.get("metadata") or {}).get("labels") or {}


def _ended(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ENDED


def is_store(pod: Mapping[str, Any]) -> bool:
    """Whether ``pod`` is a store pod (labelled ``naming.LABEL_STORE``): no GPU, no node rank."""
    return naming.LABEL_STORE in _labels(pod)


def store_pods(pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The job's store pods among ``pods``."""
    return [p for p in pods if is_store(p)]


def stale(pod: Mapping[str, Any], manifest: Mapping[str, Any]) -> bool:
    """Whether an existing store pod must not serve the gang of ``manifest`` (the store pod a
    placement would make): it is going away or ended, or another placement made it (an earlier
    one of the same attempt, before a Kueue eviction or a suspension: another ``startTime``; or
    of another spec or size: another spec hash)."""
    metadata = pod.get("metadata") or {}
    return (
        bool(metadata.get("deletionTimestamp"))
        or _ended(pod)
        or _placed(pod) != _placed(manifest)
        or _labels(pod).get(naming.LABEL_SPEC_HASH) != _labels(manifest).get(naming.LABEL_SPEC_HASH)
    )


def terminating(pods: Sequence[Mapping[str, Any]], attempt: int) -> list[str]:
    """Names of the store pods of gang ``attempt`` still terminating (a new placement of the same
    attempt waits for them: its store takes the name)."""
    return [
        str(p["metadata"]["name"])
        for p in store_pods(pods)
        if naming.int_label(_labels(p), naming.LABEL_ATTEMPT) == attempt
        and (p.get("metadata") or {}).get("deletionTimestamp")
    ]


def _placed(pod: Mapping[str, Any]) -> str | None:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(naming.ANNOTATION_PLACED)


def doomed(pods: Sequence[Mapping[str, Any]], status: Mapping[str, Any]) -> list[str]:
    """Names of the job's store pods to delete now, among the job's ``pods``: ones not being
    deleted, of an attempt other than the gang's (``status.restarts``), or of the gang's own when
    the job has no placement or its phase is over and the store has not ended by itself (a
    finished job keeps its ended pods), whose attempt has no trainer pod left that has not ended."""
    attempt = int(status.get("restarts") or 0)
    current = bool(status.get("placement")) and status.get("phase") not in OVER
    running_attempts = {
        naming.int_label(_labels(p), naming.LABEL_ATTEMPT)
        for p in pods
        if naming.LABEL_NODE_RANK in _labels(p) and not _ended(p)
    }
    names = []
    for pod in store_pods(pods):
        own = naming.int_label(_labels(pod), naming.LABEL_ATTEMPT)
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        finished = _ended(pod) and status.get("phase") in job_state.FINAL
        if own == attempt and (current or finished):  # a finished job keeps its ended pods
            continue
        if own in running_attempts:
            continue
        names.append(str(pod["metadata"]["name"]))
    return names


def uses_store(pods: Sequence[Mapping[str, Any]], attempt: int) -> bool:
    """Whether gang ``attempt``'s trainer pods were made to meet a store pod (their
    ``MESHTRAIN_RECOVERY_RENDEZVOUS_STORE``; the live spec may have been edited since)."""
    for pod in pods:
        labels = _labels(pod)
        if naming.LABEL_NODE_RANK not in labels:
            continue
        if naming.int_label(labels, naming.LABEL_ATTEMPT) != attempt:
            continue
        for container in ((pod.get("spec") or {}).get("containers") or [])[:8]:
            for var in (container.get("env") or [])[:MAX_ENV]:
                if var.get("name") == kubelet_tier.ENV_RENDEZVOUS_STORE:
                    return bool(var.get("value") == kubelet_tier.DEDICATED)
        return False
    return False


def loss(
    pods: Sequence[Mapping[str, Any]],
    status: Mapping[str, Any],
    job: str,
    nodes_down: frozenset[str] = frozenset(),
    departed: Mapping[str, Any] | None = None,
) -> pod_failure.Failure | None:
    """The running gang's store pod lost, as a failure of the gang (every rank loses the store
    with it: the gang is rebuilt, a disruption when the node or the control plane ended it); None
    while it serves, or when the gang has none.

    Only the store pod of this placement counts (its attempt, ``naming.ANNOTATION_PLACED`` and
    spec hash): an earlier gang's going away is no loss of this one.  Lost: deleted, disrupted,
    failed, on a node that is not Ready (``nodes_down``: its ranks' calls time out before the
    taint manager evicts it) or in phase Unknown, or gone while the gang's pods, made to meet it,
    run.  ``departed``: the last version the operator saw of a store pod that is gone (the
    informer's, ``Cache.departed``): gone with a node in ``nodes_down`` (deleted or not Ready) or
    marked ``DisruptionTarget`` (PodGC's removal with its node), it is a disruption; else, or
    unknown (an operator started since), a deletion.  ``Situation.failures`` leaves it out once
    a rank finished: a store ended with its finished gang is no failure.
    """
    if status.get("phase") != "Running" or not status.get("placement"):
        return None
    attempt = int(status.get("restarts") or 0)
    pod = next((p for p in store_pods(pods) if _of_placement(p, status)), None)
    if pod is None:
        if not uses_store(pods, attempt):
            return None
        last = departed if departed is not None and _of_placement(departed, status) else None
        return _gone(naming.store_pod_name(job, attempt), last, nodes_down)
    metadata, state = pod.get("metadata") or {}, pod.get("status") or {}
    name, phase = str(metadata.get("name")), state.get("phase")
    node = _node(pod)
    target = pod_state.disruption_target(pod)
    said = f"the rendezvous store's pod {name}"
    if phase == "Unknown" or (node and node in nodes_down):
        return pod_failure.Failure(name, False, f"{said}: its node {node} is lost", True)
    if target is not None:
        return pod_failure.Failure(name, False, f"{said} is being disrupted ({_why(target)})", True)
    if phase == "Failed":
        reason = str(state.get("reason") or "")
        lost = container_reasons.any_runtime_lost(pod)
        disrupted = reason in pod_failure.DISRUPTION_REASONS or lost
        why = reason or (container_reasons.RUNTIME_LOST_REASON if lost else "exited")
        return pod_failure.Failure(name, False, f"{said} failed ({why})", disrupted)
    if metadata.get("deletionTimestamp"):
        return pod_failure.Failure(name, False, f"{said} is being deleted")
    return None  # Succeeded: it left once the gang halted or finished (the ranks say which)


def _gone(
    name: str, last: Mapping[str, Any] | None, nodes_down: frozenset[str]
) -> pod_failure.Failure:
    """The store pod ``name`` is gone; ``last``: its last version seen, if the operator saw it."""
    said = f"the rendezvous store's pod {name} is gone"
    node = _node(last) if last is not None else None
    if node and node in nodes_down:
        return pod_failure.Failure(name, False, f"{said} with its node {node}", True)
    target = pod_state.disruption_target(last) if last is not None else None
    if target is not None:
        return pod_failure.Failure(
            name, False, f"{said}, removed by the cluster ({_why(target)})", True
        )
    return pod_failure.Failure(name, False, said)


def last_seen(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What :func:`loss` reads of a store pod that is gone (the informer keeps it a while): its
    name, labels, placement stamp and owners, node, and ``DisruptionTarget`` condition."""
    metadata = pod.get("metadata") or {}
    target = pod_state.disruption_target(pod)
    return {
        "metadata": {
            "name": metadata.get("name"),
            "namespace": metadata.get("namespace"),
            "labels": _picked(metadata.get("labels"), LAST_SEEN_LABELS),
            "annotations": _picked(metadata.get("annotations"), (naming.ANNOTATION_PLACED,)),
            "ownerReferences": [
                {"uid": r.get("uid")} for r in (metadata.get("ownerReferences") or [])[:4]
            ],
        },
        "spec": {"nodeName": (pod.get("spec") or {}).get("nodeName")},
        "status": {"conditions": [dict(target)] if target is not None else []},
    }


def _why(target: Mapping[str, Any]) -> str:
    """Who disrupts the pod: its ``DisruptionTarget`` condition's reason."""
    return str(target.get("reason") or "DisruptionTarget")


def _picked(found: object, keys: Sequence[str]) -> dict[str, Any]:
    """The entries of ``keys`` in the mapping ``found`` (a pod's labels or annotations)."""
    if not isinstance(found, Mapping):
        return {}
    return {k: found[k] for k in keys if k in found}


def _node(pod: Mapping[str, Any]) -> str | None:
    node = (pod.get("spec") or {}).get("nodeName")
    return node if isinstance(node, str) and node else None


def _of_placement(pod: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Whether ``pod`` is the store pod of the placement ``status`` records."""
    labels = _labels(pod)
    spec_hash = status.get("specHash")
    return (
        naming.int_label(labels, naming.LABEL_ATTEMPT) == int(status.get("restarts") or 0)
        and _placed(pod) == str(status.get("startTime") or "")
        and (not spec_hash or labels.get(naming.LABEL_SPEC_HASH) == spec_hash)
    )
