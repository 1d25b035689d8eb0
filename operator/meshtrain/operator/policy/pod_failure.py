"""Whether a pod of the gang failed, and how: permanent, retryable, or a disruption.

:func:`classify` judges one pod, :func:`of_gang` the gang of an attempt (a pod gone from a
released gang failed too).  What the job does about it is ``failure``'s.  Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.api import exitcodes
from meshtrain.operator.policy import conditions, container_reasons, naming, pod_state

DISRUPTION_REASONS = frozenset(
    {
        "NodeLost",
        "Preempting",
        "Shutdown",
        "Terminated",
        "UnexpectedAdmissionError",
        "TopologyAffinityError",
        "SMTAlignmentError",
        "NodeAffinity",
    }
)
"""Pod status.reason set when the node or the kubelet, not the container, ended a pod.

The kubelet's admission rejections: ``UnexpectedAdmissionError`` (its device manager could not
allocate the pod's devices), ``TopologyAffinityError`` (its topology manager could not align them
on a NUMA node), ``SMTAlignmentError`` (its CPU manager could not give whole cores),
``NodeAffinity`` (the node's labels changed after binding).  ``Evicted`` is not here: the kubelet
marks only its node-pressure evictions ``DisruptionTarget`` (reason ``TerminationByKubelet``); a
pod evicted for exceeding its own ephemeral-storage or emptyDir limit carries none and failed by
its own doing (as Job ``podFailurePolicy`` reads it).
"""

KUBELET_OUT_OF = "OutOf"
"""Prefix of the reason the kubelet gives a pod it refuses for lack of a resource
(``OutOfnvidia.com/gpu``, ``OutOfcpu``, ``OutOfpods``): e.g. while it still tears down a
terminal pod of the previous gang, whose resources the scheduler already counts free."""

PERMANENT_EXIT_CODES = exitcodes.PERMANENT
"""Exit codes after which restarting the gang cannot help."""


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
    reason: str | None = None
    """The kubelet's reason (ErrImagePull, OOMKilled, ...): the job's condition and Event carry it
    (None: the operator's own, PermanentFailure or GangRestarting)."""
    gave_up: bool = False
    """Exit 75: the trainer gave up recovering in place, which may follow from another failure
    (the rendezvous store pod's loss, ``store_pod.loss``)."""


def disrupted(pod: pod_state.PodState) -> bool:
    """Whether the node or the control plane, not the job, ended ``pod``.

    A ``DisruptionTarget`` condition (eviction, preemption, drain, taint), phase Unknown, or a
    Failed pod whose reason is one of :data:`DISRUPTION_REASONS` or a kubelet admission
    rejection (:data:`KUBELET_OUT_OF`).  A gang restart caused only by disruptions does not use
    ``backoffLimit`` (the practice of Job/JobSet ``podFailurePolicy`` with ``onPodConditions:
    DisruptionTarget`` and action ``Ignore``): a 10k-GPU job loses nodes every few hours and
    must not fail for it.
    """
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


def classify(pod: pod_state.PodState) -> Failure | None:
    """The failure of ``pod``, or None while it is healthy (pending, running or succeeded).

    Permanent: exit code 2, 3 or 4 (the trainer refused its configuration, its dataset or its
    checkpoint), 5 (the loss guard stopped training: a restart would replay the same batches from
    the same checkpoint), 126/127 (the command is not executable / not found in the image).
    Under torchrun the container exits 1 for any failed worker, so the rank's own code and
    message come from its termination message (``{"exitCode": N, "message": ...}``,
    :mod:`meshtrain.api.exitcodes`).  Retryable: 128+N (killed by signal N: OOM killer,
    preemption), any other non-zero exit code, phase Failed without an exit code (evicted, node
    shutdown), phase Unknown (node lost), a ``DisruptionTarget`` condition, a pod deleted by
    someone else.  A reason the kubelet gives (``container_reasons``) names the failure: an image
    that cannot be pulled, or a command the image cannot run, is permanent; ``OOMKilled``,
    ``Evicted`` and ``DeadlineExceeded`` are retryable, the eviction a disruption only with a
    ``DisruptionTarget`` condition (node pressure, not the pod's own storage limits).
    A trainer container the kubelet restarts in place (``kubelet_tier``) is no failure, unless it
    was OOM-killed (the same step would run out of memory again: the gang is rebuilt, as before)
    or the kubelet holds it in ``CrashLoopBackOff`` (it died again: :func:`_crash_looping`);
    exit code 75 (:data:`~meshtrain.api.exitcodes.GANG_RESTART`) asks for the gang rebuild even
    while sidecars keep the pod Running, and exit code 79
    (:data:`~meshtrain.api.exitcodes.DEVICE_SUSPECT`: a GPU taken for bad) is a disruption by the
    node, likewise.
    """
    found = _classify(pod)
    if found is None or found.permanent or not disrupted(pod):
        return found
    return dataclasses.replace(found, disruption=True)


def _classify(pod: pod_state.PodState) -> Failure | None:
    if pod.phase == "Failed" and _disruption_reason(pod.reason):
        return _ended_by_node(pod)
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
        if pod.problem is not None:
            return _named(pod.name, pod.problem, container_reasons.cannot_run(pod.problem))
        if code == exitcodes.GANG_RESTART:
            return _gang_restart(pod)
        if pod.left_bad_gpu:
            return _bad_gpu(pod)
        if pod.runtime_lost:
            return Failure(
                pod.name,
                False,
                f"pod {pod.name}: node {pod.node} lost its trainer container (the runtime came "
                "back without it, or the kubelet no longer finds it: a power loss, a reboot, "
                "containerd killed)",
                disruption=True,
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
    if not pod.terminal and pod.exit_code == exitcodes.GANG_RESTART:
        return _gang_restart(pod)  # its other containers (sidecars) may keep the pod Running
    if not pod.terminal and pod.left_bad_gpu:
        return _bad_gpu(pod)  # likewise
    if not pod.terminal and oom_killed(pod.problem) and pod.problem is not None:
        return _named(pod.name, pod.problem, False)  # restarted in place, it would run out again
    if not pod.terminal and pod.crash_loop is not None:
        return _crash_looping(pod)
    if pod.phase == "Unknown":
        return Failure(
            pod.name, False, f"pod {pod.name} is in phase Unknown (node {pod.node} lost)"
        )
    if pod.disrupted and not pod.terminal:
        why = pod.reason or pod.disruption_reason or "DisruptionTarget"
        return Failure(pod.name, False, f"pod {pod.name} is being disrupted ({why})")
    if pod.deleting and not pod.terminal:
        return Failure(pod.name, False, f"pod {pod.name} is being deleted")
    if pod.problem is not None and container_reasons.never_pulls(pod.problem):
        return _named(pod.name, pod.problem, True)
    return None


def _crash_looping(pod: pod_state.PodState) -> Failure:
    """The trainer container died again and the kubelet holds it back: its back-off (doubling to
    5 min) would soon outlast ``rejoinTimeoutSeconds``, and a crash that repeats (a bug: exit 1)
    would loop on the same pod, so the gang is rebuilt now."""
    before = f" after exit code {pod.last_exit.exit_code}" if pod.last_exit is not None else ""
    return Failure(
        pod.name,
        False,
        f"pod {pod.name}: its trainer container died again{before} and the kubelet holds it in "
        f"{container_reasons.CRASH_LOOP} ({pod.crash_loop}): the gang is rebuilt instead of "
        "waiting out the back-off",
        reason=container_reasons.CRASH_LOOP,
    )


def _gang_restart(pod: pod_state.PodState) -> Failure:
    if pod.device_error_ranks:  # the node's hardware, not the job: a disruption, remembered
        ranks = ", ".join(str(r) for r in pod.device_error_ranks)
        return Failure(
            pod.name,
            False,
            f"pod {pod.name}: the GPU of rank(s) {ranks} failed with a device error and the "
            f"trainer did not recover in place (exit code {exitcodes.GANG_RESTART}); one more "
            "on that node within an hour takes it for bad",
            disruption=True,
            gave_up=True,
        )
    return Failure(
        pod.name,
        False,
        f"pod {pod.name}: the trainer gave up recovering in place (exit code "
        f"{exitcodes.GANG_RESTART}: runPolicy.recovery.inPlaceLimit reached, a rank did not rejoin, "
        "or the rendezvous store is gone)",
        gave_up=True,
    )


def _bad_gpu(pod: pod_state.PodState) -> Failure:
    """Exit 79: the pod's supervisor took one of its GPUs for bad.  A disruption (the node's
    hardware, not the job), so ``backoffLimit`` is not spent; ``bad_gpus`` excludes the node."""
    said = bad_gpu_said(pod)
    return Failure(
        pod.name,
        False,
        f"pod {pod.name} left node {pod.node} (exit code {exitcodes.DEVICE_SUSPECT}): {said}",
        disruption=True,
        reason=conditions.BAD_GPU,
    )


def bad_gpu_said(pod: pod_state.PodState) -> str:
    """What the supervisor of a pod that left a bad GPU said (its termination message, cut short:
    the pod's words go into the job's status), or what exit 79 means."""
    if pod.reported is not None and pod.reported[1]:
        return pod.reported[1][: container_reasons.MAX_MESSAGE]
    return "one of its GPUs was taken for bad (it failed twice within an hour, or is gone)"


def oom_killed(problem: container_reasons.Problem | None) -> bool:
    """The trainer container was OOM-killed (the kubelet restarts it in place, or is about to)."""
    return (
        problem is not None
        and problem.reason == container_reasons.OOM_KILLED
        and problem.container == naming.CONTAINER
    )


def _ended_by_node(pod: pod_state.PodState) -> Failure:
    """A pod the node or its kubelet ended (a refusal at admission, a shutdown): named by its reason.

    The kubelet kills the containers of a running pod it refuses (after its restart) or shuts down;
    their exit codes follow from that, so they neither name the failure nor make it permanent.
    """
    said = f": {pod.message}" if pod.message else ""
    return Failure(pod.name, False, f"pod {pod.name} ended by node {pod.node}: {pod.reason}{said}")


def _named(pod: str, problem: container_reasons.Problem, permanent: bool) -> Failure:
    """The failure the kubelet names: its reason, and its message."""
    message = container_reasons.described(pod, problem)
    return Failure(pod, permanent, message, reason=problem.reason)


def _config_overdue(pod: pod_state.PodState, now: datetime.datetime) -> Failure | None:
    """A Secret or ConfigMap the pod needs, still missing after the grace: permanent."""
    problem = pod.problem
    if problem is None or pod.terminal or pod.deleting:
        return None
    if not container_reasons.config_overdue(problem, pod.started_at, now):
        return None
    grace = container_reasons.CONFIG_GRACE_SECONDS
    failed = _named(pod.name, problem, True)
    return dataclasses.replace(
        failed, message=f"{failed.message} (still, {grace}s after it started)"
    )


def _disappeared(index: int, placement: Sequence[Any], nodes_gone: frozenset[str]) -> Failure:
    """The failure of a pod of the gang that no longer exists: a disruption when its node is gone too."""
    node = next(
        (p.get("node") for p in placement if isinstance(p, Mapping) and p.get("podIndex") == index),
        None,
    )
    if node in nodes_gone:
        message = f"pod of node rank {index} disappeared with its node {node} (deleted)"
        return Failure(f"index {index}", False, message, disruption=True)
    return Failure(f"index {index}", False, f"pod of node rank {index} disappeared")


def of_gang(
    gang: Sequence[pod_state.PodState],
    missing: Sequence[int],
    placement: Sequence[Any],
    nodes_gone: frozenset[str],
    now: datetime.datetime,
) -> tuple[Failure, ...]:
    """The failed pods of ``gang`` at ``now``; without any, a pod ``missing`` from it once released.

    ``placement``: ``status.placement``; ``nodes_gone``: its nodes that no longer exist.
    """
    judged = (classify(p) or _config_overdue(p, now) for p in gang)
    failures = tuple(f for f in judged if f is not None)
    if missing and not failures and any(not p.gated for p in gang):
        return (_disappeared(missing[0], placement, nodes_gone),)
    return failures
