"""Failure policy: is a pod of the gang failed, and may the gang be retried?

:class:`PodState` (the few facts of a pod the lifecycle needs, read
from its manifest) and :func:`classify`, which says whether a pod failed and
whether that failure is *permanent* (restarting cannot help: the job fails at
once) or *retryable* (the gang is restarted, up to ``runPolicy.backoffLimit``).
It does not count restarts or act (see ``lifecycle``).

Classification:

* exit code 2, 3, 4 — the trainer refused its configuration, its dataset or
  its checkpoint: permanent.  Under torchrun the container exits 1 for any
  failed worker, so the rank's own code comes from its termination message
  (``{"exitCode": N, "message": ...}``, :mod:`meshtrain.api.exitcodes`),
  which also gives the trainer's message;
* exit code 5 — the loss guard stopped training (a restart would replay the
  same batches from the same checkpoint): permanent;
* exit codes 126/127 — the command is not executable / not found in the image:
  permanent;
* exit code 128+N — killed by signal N (OOM killer, preemption): retryable;
* any other non-zero exit code, pod phase Failed without an exit code
  (evicted, node shutdown), phase Unknown (node lost), a ``DisruptionTarget``
  condition, or a pod deleted by someone else: retryable.

A failure is a *disruption* when the infrastructure, not the job, ended the pod:
a ``DisruptionTarget`` condition (eviction, preemption, drain, taint), phase
Unknown, or a Failed pod whose reason is one of :data:`DISRUPTION_REASONS` or a
kubelet admission rejection (:data:`KUBELET_OUT_OF`).  A
gang restart caused only by disruptions does not use ``backoffLimit`` (the
practice of Job/JobSet ``podFailurePolicy`` with ``onPodConditions:
DisruptionTarget`` and action ``Ignore``): a 10k-GPU job loses nodes every few
hours and must not fail for it.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from meshtrain.api import exitcodes
from meshtrain.operator.policy import conditions, identity, naming

DISRUPTION_REASONS = frozenset(
    {"NodeLost", "Evicted", "Preempting", "Shutdown", "Terminated", "UnexpectedAdmissionError"}
)
"""Pod status.reason set when the node or the kubelet, not the container, ended a pod.

``UnexpectedAdmissionError``: the kubelet's device manager could not allocate the pod's devices.
"""

KUBELET_OUT_OF = "OutOf"
"""Prefix of the reason the kubelet gives a pod it refuses for lack of a resource
(``OutOfnvidia.com/gpu``, ``OutOfcpu``, ``OutOfpods``): e.g. while it still tears down a
terminal pod of the previous gang, whose resources the scheduler already counts free."""

PERMANENT_EXIT_CODES = exitcodes.PERMANENT
"""Exit codes after which restarting the gang cannot help."""


@dataclasses.dataclass(frozen=True)
class PodState:
    """What the lifecycle needs to know about one pod."""

    name: str
    index: int
    """Node rank in the gang (label meshtrain.io/node-rank)."""
    attempt: int
    """Gang attempt (label meshtrain.io/attempt)."""
    phase: str
    """Pod phase: Pending, Running, Succeeded, Failed, Unknown."""
    gated: bool
    """Still carries the operator's gang scheduling gate (other controllers' gates do not count)."""
    deleting: bool
    """Has a deletionTimestamp."""
    created_at: datetime.datetime | None
    """metadata.creationTimestamp."""
    node: str | None = None
    """Node it is bound or pinned to."""
    ip: str | None = None
    """status.podIP once it has one."""
    exit_code: int | None = None
    """Exit code of the trainer container once it terminated."""
    reason: str | None = None
    """status.reason of the pod (Evicted, NodeLost, ...)."""
    disrupted: bool = False
    """Carries a True DisruptionTarget condition (eviction, preemption, node drain)."""
    bound: bool = False
    """spec.nodeName is set: the scheduler bound it."""
    unschedulable_message: str | None = None
    """The scheduler's message while its PodScheduled condition is False/Unschedulable."""
    unschedulable_since: datetime.datetime | None = None
    """lastTransitionTime of that condition: when the scheduler first refused it."""
    nominated: str | None = None
    """status.nominatedNodeName: the node kube-scheduler makes room on (preempts) for it."""
    reported: tuple[int, str] | None = None
    """(exit code, message) a rank left in its termination message when it failed (torchrun hides its code)."""
    termination_message: str | None = None
    """``state.terminated.message`` of the trainer container (rank 0's final progress on success)."""

    @property
    def terminal(self) -> bool:
        """Succeeded or Failed: holds no GPUs any more."""
        return self.phase in ("Succeeded", "Failed")

    @property
    def holds_resources(self) -> bool:
        """Whether it may still hold its node's resources (and so the quota Kueue charged).

        Until it is Succeeded or Failed, terminating or not: the scheduler counts it until then.
        A deleted Pending pod never bound holds nothing (the scheduler skips it; binding is
        refused); one that runs is bound.
        Stricter than Kueue's pod integration (Pod.IsActive counts only Running pods): a bound
        Pending pod may already hold GPUs while its containers start.
        """
        return not self.terminal and not (
            self.deleting and self.phase == "Pending" and not self.bound
        )


@dataclasses.dataclass(frozen=True)
class Failure:
    """A failed pod and what that means for the job."""

    pod: str
    permanent: bool
    """True: fail the job now; False: restart the gang if the backoff limit allows."""
    message: str
    """What happened, with the exit code or reason."""
    disruption: bool = False
    """The infrastructure ended the pod (node lost, eviction, preemption): not counted against backoffLimit."""


def pod_state(pod: dict[str, Any]) -> PodState | None:
    """Read a pod manifest; None when it lacks the operator's labels (not one of ours)."""
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    index = naming.int_label(labels, naming.LABEL_NODE_RANK)
    attempt = naming.int_label(labels, naming.LABEL_ATTEMPT)
    if index is None or attempt is None:
        return None
    status = pod.get("status") or {}
    exit_code, message = None, None
    for container in status.get("containerStatuses") or []:
        if container.get("name") == naming.CONTAINER:
            terminated = (container.get("state") or {}).get("terminated")
            if terminated and terminated.get("exitCode") is not None:
                exit_code = int(terminated["exitCode"])
            if terminated and isinstance(terminated.get("message"), str):
                message = terminated["message"]
    refusal = next(
        (
            c
            for c in status.get("conditions") or []
            if c.get("type") == "PodScheduled"
            and c.get("status") == "False"
            and c.get("reason") == "Unschedulable"
        ),
        None,
    )
    disrupted = any(
        c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return PodState(
        name=metadata.get("name", ""),
        index=index,
        attempt=attempt,
        phase=status.get("phase") or "Pending",
        gated=any(
            gate.get("name") == naming.GANG_GATE
            for gate in (pod.get("spec") or {}).get("schedulingGates") or []
        ),
        deleting=bool(metadata.get("deletionTimestamp")),
        created_at=conditions.parse_time(metadata.get("creationTimestamp")),
        node=identity.planned_node(pod),
        ip=status.get("podIP"),
        exit_code=exit_code,
        reason=status.get("reason"),
        disrupted=disrupted,
        bound=bool((pod.get("spec") or {}).get("nodeName")),
        unschedulable_message=(refusal.get("message") or "Unschedulable") if refusal else None,
        unschedulable_since=conditions.parse_time(refusal.get("lastTransitionTime"))
        if refusal
        else None,
        nominated=status.get("nominatedNodeName") or None,
        reported=exitcodes.read_failure_report(message) if exit_code else None,
        termination_message=message,
    )


def disrupted(pod: PodState) -> bool:
    """Whether the node or the control plane, not the job, ended ``pod``."""
    return (
        pod.disrupted
        or pod.phase == "Unknown"
        or (pod.phase == "Failed" and _disruption_reason(pod.reason))
    )


def _disruption_reason(reason: str | None) -> bool:
    if reason is None:
        return False
    return reason in DISRUPTION_REASONS or (
        reason.startswith(KUBELET_OUT_OF) and len(reason) > len(KUBELET_OUT_OF)
    )


def classify(pod: PodState) -> Failure | None:
    """The failure of ``pod``, or None while it is healthy (pending, running or succeeded)."""
    found = _classify(pod)
    if found is None or found.permanent or not disrupted(pod):
        return found
    return dataclasses.replace(found, disruption=True)


def _classify(pod: PodState) -> Failure | None:
    if pod.phase == "Failed":
        code = pod.exit_code
        if pod.reported is not None and pod.reported[0] in PERMANENT_EXIT_CODES:
            rank_code, said = pod.reported
            return Failure(
                pod.name,
                True,
                f"pod {pod.name}: a rank exited with code {rank_code} "
                f"({PERMANENT_EXIT_CODES[rank_code]}): {said}",
            )
        if code in PERMANENT_EXIT_CODES:
            return Failure(
                pod.name,
                True,
                f"pod {pod.name} exited with code {code}: {PERMANENT_EXIT_CODES[code]}",
            )
        if code is not None and code > 128:
            return Failure(
                pod.name,
                False,
                f"pod {pod.name} was killed by signal {code - 128} (exit code {code})",
            )
        if code is not None and code != 0:
            return Failure(pod.name, False, f"pod {pod.name} exited with code {code}")
        return Failure(pod.name, False, f"pod {pod.name} failed ({pod.reason or 'no exit code'})")
    if pod.phase == "Unknown":
        return Failure(
            pod.name, False, f"pod {pod.name} is in phase Unknown (node {pod.node} lost)"
        )
    if pod.disrupted and not pod.terminal:
        return Failure(
            pod.name,
            False,
            f"pod {pod.name} is being disrupted ({pod.reason or 'DisruptionTarget'})",
        )
    if pod.deleting and not pod.terminal:
        return Failure(pod.name, False, f"pod {pod.name} is being deleted")
    return None
