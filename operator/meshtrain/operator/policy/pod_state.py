"""A pod of a TrainingJob as the state machine reads it, and what a set of them says.

:class:`PodState` holds the few facts of a pod the lifecycle needs; the helpers answer what the
rules ask of a gang (which pods still hold resources, which a deletion still has to reach).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.api import exitcodes
from meshtrain.operator.policy import conditions, container_reasons, identity, naming

MAX_RESTART_COUNT = 2**31 - 1
"""Largest ``restartCount`` read (the API's int32); anything else reads as 0."""


@dataclasses.dataclass(frozen=True)
class LastExit:
    """How the trainer container ended before the kubelet restarted it in place (``lastState.terminated``)."""

    exit_code: int
    """Its exit code."""
    reason: str | None = None
    """The kubelet's reason: ``Error``, ``OOMKilled``, ... (at most 64 characters)."""
    signal: int | None = None
    """The signal that ended it, when the runtime reports one."""
    finished_at: datetime.datetime | None = None
    """When it ended."""


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
    message: str | None = None
    """status.message of the pod: the kubelet's words for that reason (at most
    ``container_reasons.MAX_MESSAGE`` characters)."""
    disrupted: bool = False
    """Carries a True DisruptionTarget condition (eviction, preemption, node drain)."""
    disruption_reason: str | None = None
    """That condition's reason: who disrupts it (``PreemptionByScheduler``, ``TerminationByKubelet``,
    ``DeletionByTaintManager``, ``EvictionByEvictionAPI``, ``DeletionByPodGC``, ...)."""
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
    device_error_ranks: tuple[int, ...] = ()
    """The ranks its failure report says failed with a device error before it left
    (``exitcodes.reported_device_error_ranks``)."""
    finished_at: datetime.datetime | None = None
    """``state.terminated.finishedAt`` of the trainer container, on its node's clock: when it exited."""
    problem: container_reasons.Problem | None = None
    """The first reason the kubelet gives for a container not running or the pod's end (ErrImagePull, OOMKilled, ...)."""
    pulling: bool = False
    """A container waits in ContainerCreating with the pod ready to start containers: the kubelet
    pulls its image (``container_reasons.pulling``)."""
    unprepared: bool = False
    """A container waits in ContainerCreating before that: its volumes or sandbox are not ready."""
    started_at: datetime.datetime | None = None
    """status.startTime: when the kubelet took the pod (before pulling its image)."""
    rejoins: bool = False
    """Labelled ``naming.LABEL_REJOINS``: its trainer can join the running gang's rendezvous."""
    uid: str = ""
    """metadata.uid: a pod re-created under the same name is another pod."""
    restarts: int = 0
    """``restartCount`` of the trainer container: the kubelet's in-place restarts of it."""
    last_exit: LastExit | None = None
    """How the trainer container last ended before such a restart (None: never restarted)."""
    crash_loop: str | None = None
    """The kubelet's message while it holds the trainer container in ``CrashLoopBackOff`` (None:
    it is not)."""
    runtime_lost: bool = False
    """The node lost the trainer container under it, not its process (containerd came back
    without the container's shim: a power loss, a reboot, containerd killed with its shims; or
    the kubelet no longer finds it): terminated ``Unknown``/255 or ``ContainerStatusUnknown``
    (:func:`container_reasons.runtime_lost`)."""

    @property
    def terminal(self) -> bool:
        """Succeeded or Failed: holds no GPUs any more."""
        return self.phase in ("Succeeded", "Failed")

    @property
    def left_bad_gpu(self) -> bool:
        """Its trainer container exited ``DEVICE_SUSPECT`` with the supervisor's report of it: its
        supervisor took one of its GPUs for bad (a custom program's own 79 is no such report).
        Terminal or not: a sidecar may keep the pod Running after the trainer left."""
        return (
            self.exit_code == exitcodes.DEVICE_SUSPECT
            and self.reported is not None
            and self.reported[0] == exitcodes.DEVICE_SUSPECT
        )

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


def read(pod: dict[str, Any]) -> PodState | None:
    """Read a pod manifest; None when it lacks the operator's labels (not one of ours)."""
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    index = naming.int_label(labels, naming.LABEL_NODE_RANK)
    attempt = naming.int_label(labels, naming.LABEL_ATTEMPT)
    if index is None or attempt is None:
        return None
    status = pod.get("status") or {}
    exit_code, message, trainer, runtime_lost, finished_at = None, None, {}, False, None
    for container in (status.get("containerStatuses") or [])[: container_reasons.MAX_CONTAINERS]:
        if container.get("name") == naming.CONTAINER:
            trainer = container
            terminated = (container.get("state") or {}).get("terminated")
            if terminated and terminated.get("exitCode") is not None:
                exit_code = int(terminated["exitCode"])
            if terminated and isinstance(terminated.get("message"), str):
                message = terminated["message"]
            if terminated:
                finished_at = _time(terminated.get("finishedAt"))
            runtime_lost = container_reasons.runtime_lost(terminated)
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
    disruption = disruption_target(pod)
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
        message=_said(status.get("message")),
        disrupted=disruption is not None,
        disruption_reason=_text(disruption.get("reason")) if disruption else None,
        bound=bool((pod.get("spec") or {}).get("nodeName")),
        unschedulable_message=(refusal.get("message") or "Unschedulable") if refusal else None,
        unschedulable_since=conditions.parse_time(refusal.get("lastTransitionTime"))
        if refusal
        else None,
        nominated=status.get("nominatedNodeName") or None,
        reported=exitcodes.read_failure_report(message) if exit_code else None,
        termination_message=message,
        device_error_ranks=exitcodes.reported_device_error_ranks(message) if exit_code else (),
        finished_at=finished_at,
        problem=container_reasons.read(pod)
        or container_reasons.restarted_oom(pod, naming.CONTAINER),
        pulling=container_reasons.pulling(pod),
        unprepared=container_reasons.unprepared(pod),
        started_at=conditions.parse_time(status.get("startTime")),
        rejoins=labels.get(naming.LABEL_REJOINS) == "true",
        uid=_text(metadata.get("uid")) or "",
        restarts=_count(trainer.get("restartCount")),
        last_exit=_last_exit(trainer),
        crash_loop=_crash_loop(trainer),
        runtime_lost=runtime_lost,
    )


def _crash_loop(container: dict[str, Any]) -> str | None:
    state = container.get("state")
    waiting = state.get("waiting") if isinstance(state, dict) else None
    if not isinstance(waiting, dict) or waiting.get("reason") != container_reasons.CRASH_LOOP:
        return None
    return _said(waiting.get("message")) or container_reasons.CRASH_LOOP


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return value if 0 <= value <= MAX_RESTART_COUNT else 0


def _time(value: object) -> datetime.datetime | None:
    """An RFC 3339 time of a status read defensively (a status is any JSON): None unless it
    parses, with its zone."""
    try:
        parsed = conditions.parse_time(str(value or "")[:64])
    except ValueError:
        return None
    return parsed if parsed is not None and parsed.tzinfo is not None else None


def _last_exit(container: dict[str, Any]) -> LastExit | None:
    """``lastState.terminated`` of the trainer container, read defensively (a status is any JSON)."""
    last = container.get("lastState")
    terminated = last.get("terminated") if isinstance(last, dict) else None
    if not isinstance(terminated, dict):
        return None
    code = terminated.get("exitCode")
    if isinstance(code, bool) or not isinstance(code, int):
        return None
    signal = terminated.get("signal")
    finished = _time(terminated.get("finishedAt"))
    return LastExit(
        exit_code=code,
        reason=_text(terminated.get("reason")),
        signal=signal if isinstance(signal, int) and not isinstance(signal, bool) else None,
        finished_at=finished,
    )


def _said(value: object) -> str | None:
    """A message written by the kubelet, bounded, or None."""
    if not isinstance(value, str) or not value:
        return None
    return value[: container_reasons.MAX_MESSAGE]


def _text(value: object) -> str | None:
    """A reason written by the control plane: a short word, or None."""
    return value[:64] if isinstance(value, str) and value else None


def holding(pods: Sequence[PodState]) -> bool:
    """Whether a pod still holds its node's resources (:attr:`PodState.holds_resources`).

    A Succeeded or Failed pod holds nothing, even while a finalizer keeps the object.
    """
    return any(p.holds_resources for p in pods)


def live(pods: Sequence[PodState]) -> tuple[str, ...]:
    """Names of pods to delete when freeing the job's GPUs (not already finished or going)."""
    return tuple(p.name for p in pods if not p.deleting and not p.terminal)


def undeleted(pods: Sequence[PodState]) -> tuple[str, ...]:
    """Names of the pods a deletion still has to reach (finished ones included)."""
    return tuple(p.name for p in pods if not p.deleting)


def all_running(pods: Sequence[PodState]) -> bool:
    """Whether every pod is released and Running (or already Succeeded)."""
    return all(not p.gated and p.phase in ("Running", "Succeeded") for p in pods)


def disruption_target(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod's ``DisruptionTarget`` condition when True: the control plane or its node ends it
    (eviction, preemption, the taint manager, PodGC)."""
    found = (pod.get("status") or {}).get("conditions") or []
    return next(
        (
            c
            for c in found[: container_reasons.MAX_CONDITIONS]
            if c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        ),
        None,
    )
