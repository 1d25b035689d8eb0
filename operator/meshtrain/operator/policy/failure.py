"""Failure policy: is a pod of the gang failed, may the gang be retried, and the rules that say so.

:func:`classify` judges a pod: *permanent* (the job fails at once) or *retryable* (the gang
restarts, up to ``runPolicy.backoffLimit``; a restart caused only by disruptions, see
:func:`disrupted`, does not use it).  The rows of ``lifecycle``'s table that fail or restart
a job live here too.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence

from meshtrain.api import exitcodes
from meshtrain.operator.policy import conditions, job_actions, job_state, pod_state, situation

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
class Failure:
    """A failed pod and what that means for the job."""

    pod: str
    permanent: bool
    """True: fail the job now; False: restart the gang if the backoff limit allows."""
    message: str
    """What happened, with the exit code or reason."""
    disruption: bool = False
    """The infrastructure ended the pod (node lost, eviction, preemption): not counted against backoffLimit."""


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
    someone else.
    """
    found = _classify(pod)
    if found is None or found.permanent or not disrupted(pod):
        return found
    return dataclasses.replace(found, disruption=True)


def _classify(pod: pod_state.PodState) -> Failure | None:
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


BROKEN_GANG_GRACE_SECONDS = 5
"""Grace period of the surviving pods of a failed gang: a checkpoint is collective, so with a rank gone they
cannot save and their full ``runPolicy.terminationGracePeriodSeconds`` would only delay the restart."""


def fail(
    seen: situation.Situation,
    pods: Sequence[pod_state.PodState],
    reason: str,
    message: str,
    grace_seconds: int | None = None,
) -> job_actions.Decision:
    """Failed for ``reason``: the live ``pods`` are deleted (with ``grace_seconds``)."""
    conds = situation.set_conditions(
        seen,
        reason,
        message,
        (conditions.FAILED, conditions.TRUE),
        (conditions.RUNNING, conditions.FALSE),
    )
    actions: list[job_actions.Action] = [
        job_actions.set_status(
            seen.job,
            phase=job_state.Phase.FAILED.value,
            conditions=conds,
            completionTime=conditions.timestamp(seen.now),
        ),
        job_actions.Emit("Warning", reason, message),
    ]
    if pod_state.live(pods):
        actions.append(job_actions.DeletePods(pod_state.live(pods), grace_seconds=grace_seconds))
    return job_actions.Decision(tuple(actions), requeue_after=0)


def restart_or_fail(seen: situation.Situation, failures: Sequence[Failure]) -> job_actions.Decision:
    """Failed pods of the gang: fail the job (permanent, or backoff used up), else restart the gang.

    A restart counts in ``restarts`` (the new attempt: the old pods become stale) and, when
    only disruptions caused it, in ``disruptionRestarts``, which ``backoffLimit`` does not count.
    """
    job, current = seen.job, seen.current
    restarts = seen.attempt
    limit = seen.spec.run_policy.backoff_limit
    permanent = [f for f in failures if f.permanent]
    if permanent:
        message = f"{permanent[0].message}; not retried"
        reason = conditions.PERMANENT_FAILURE
        return fail(seen, current, reason, message, grace_seconds=BROKEN_GANG_GRACE_SECONDS)
    message = "; ".join(f.message for f in failures[:3])
    disruptions = int(job.status.get("disruptionRestarts") or 0)
    disruption = all(f.disruption for f in failures)
    used = max(restarts - disruptions, 0)  # restarts the job's own failures caused
    if not disruption and used >= limit:
        return fail(
            seen,
            current,
            conditions.BACKOFF_LIMIT_EXCEEDED,
            f"{message}; backoffLimit={limit} restart(s) already used",
            grace_seconds=BROKEN_GANG_GRACE_SECONDS,
        )
    note = (
        f"{message}; restarting the gang (a disruption: not counted against "
        f"backoffLimit={limit}, {used} used)"
        if disruption
        else f"{message}; restarting the gang (restart {used + 1} of {limit})"
    )
    conds = situation.set_conditions(
        seen,
        conditions.GANG_RESTARTING,
        note,
        (conditions.RUNNING, conditions.FALSE),
        (conditions.PLACED, conditions.FALSE),
    )
    restarted = job_actions.set_status(
        job,
        phase=job_state.Phase.RESTARTING.value,
        restarts=restarts + 1,
        **({"disruptionRestarts": disruptions + 1} if disruption else {}),
        placement=[],
        straggler=None,
        conditions=conds,
    )
    event = job_actions.Emit("Warning", conditions.GANG_RESTARTING, note)
    return situation.gang_stopped(seen, restarted, event, BROKEN_GANG_GRACE_SECONDS)


def _disappeared(seen: situation.Situation, index: int) -> Failure:
    """The failure of a pod of the gang that no longer exists: a disruption when its node is gone too."""
    node = next(
        (
            p.get("node")
            for p in seen.job.status.get("placement") or []
            if isinstance(p, Mapping) and p.get("podIndex") == index
        ),
        None,
    )
    if node in seen.nodes_gone:
        message = f"pod of node rank {index} disappeared with its node {node} (deleted)"
        return Failure(f"index {index}", False, message, disruption=True)
    return Failure(f"index {index}", False, f"pod of node rank {index} disappeared")


def gang_failures(seen: situation.Situation) -> tuple[Failure, ...]:
    """The failed pods of the gang; without any, a pod missing from a released gang."""
    failures = tuple(f for f in (classify(p) for p in seen.current) if f is not None)
    if seen.missing and not failures and any(not p.gated for p in seen.current):
        return (_disappeared(seen, seen.missing[0]),)
    return failures


def _invalid_spec(seen: situation.Situation) -> job_actions.Decision:
    message = "spec breaks the rules: " + "; ".join(seen.job.problems)
    return fail(seen, seen.pods, conditions.INVALID_SPEC, message)


def _deadline_left(seen: situation.Situation) -> float | None:
    """Seconds of ``activeDeadlineSeconds`` left since ``startTime`` (None: no deadline, or not started)."""
    started = conditions.parse_time(seen.job.status.get("startTime"))
    deadline = seen.spec.run_policy.active_deadline_seconds
    if deadline is None or started is None:
        return None
    return (started + datetime.timedelta(seconds=deadline) - seen.now).total_seconds()


def _past_deadline(seen: situation.Situation) -> bool:
    left = _deadline_left(seen)
    return left is not None and left <= 0


def _deadline_exceeded(seen: situation.Situation) -> job_actions.Decision:
    deadline = seen.spec.run_policy.active_deadline_seconds
    message = f"job active for more than activeDeadlineSeconds={deadline}"
    return fail(seen, seen.current, conditions.DEADLINE_EXCEEDED, message)


def _too_slow_to_start(seen: situation.Situation) -> bool:
    return seen.startup_left is not None and seen.startup_left <= 0


def _startup_timed_out(seen: situation.Situation) -> job_actions.Decision:
    timeout = seen.spec.run_policy.startup_timeout_seconds
    waiting = [p.name for p in seen.current if p.phase != "Running"]
    slow = Failure(
        waiting[0] if waiting else "gang",
        False,
        f"{len(waiting)} pod(s) not Running after startupTimeoutSeconds={timeout}",
    )
    return restart_or_fail(seen, [slow])


INVALID_SPEC = situation.Rule(
    "the spec breaks a rule: Failed (InvalidSpec)",
    lambda seen: seen.job.spec is None,
    _invalid_spec,
)
DEADLINE_EXCEEDED = situation.Rule(
    "activeDeadlineSeconds passed since startTime: Failed, and nothing else this pass",
    _past_deadline,
    _deadline_exceeded,
    owed=False,
)
GANG_FAILED = situation.Rule(
    "a pod of the gang failed or vanished: restart the gang, or Failed",
    lambda seen: bool(seen.once(gang_failures)),
    lambda seen: restart_or_fail(seen, seen.once(gang_failures)),
)
STARTUP_TIMED_OUT = situation.Rule(
    "the gang is not running startupTimeoutSeconds after its first pod: restart, or Failed",
    _too_slow_to_start,
    _startup_timed_out,
)
