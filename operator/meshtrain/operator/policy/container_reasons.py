"""What the kubelet says about a pod's containers: why one cannot start, or why it ended.

:func:`read` finds, in a pod manifest, the first reason worth naming (a pull that failed, a
Secret the environment names that is missing, the OOM killer, an eviction); the rest say
what it means for the job: a failure now (:func:`never_pulls`, :func:`cannot_run`), a failure
once :data:`CONFIG_GRACE_SECONDS` passed (:func:`config_overdue`), or only a condition while the
kubelet retries.  The pod's own words are bounded: a few containers, a few hundred characters.  Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Mapping, Sequence
from typing import Any

IMAGE_PULL_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "RegistryUnavailable",
        "SignatureValidationFailed",
        "ImageInspectError",
    }
)
"""Waiting reasons of a container whose image the kubelet could not get (kubelet/images/types.go)."""
NEVER_PULLS = frozenset({"InvalidImageName", "ErrImageNeverPull", "SignatureValidationFailed"})
"""Image reasons no retry can change: a malformed name, ``imagePullPolicy: Never`` without the
image on the node, a signature the node's policy refuses."""
MISSING_IMAGE = re.compile(
    r"not found|manifest unknown|name unknown|repository does not exist"
    r"|invalid reference format|pull access denied",
    re.IGNORECASE,
)
"""What the registry answers (through containerd) for an image that is not there or not ours to
pull: ``ErrImagePull``/``ImagePullBackOff`` with such a message fail the job at once.  Any other
message is named and retried by the kubelet, the startup timeout bounding it: a timeout, a
refused connection, 429/5xx, and also what a passing fault of the cluster says (``no such host``
while CoreDNS restarts; ``401 Unauthorized``, ``403 Forbidden`` or ``denied: Your authorization
token has expired`` while a registry token is renewed, every 12 h on ECR)."""
CONFIG_ERROR = "CreateContainerConfigError"
"""The container's configuration names something missing: a Secret or ConfigMap of ``env``."""
CREATE_ERROR = "CreateContainerError"
"""The runtime could not create the container (a name still reserved, a bad mount); retried."""
WAITING_REASONS = IMAGE_PULL_REASONS | {CONFIG_ERROR, CREATE_ERROR, "RunContainerError"}
"""Waiting reasons that name a problem (``ContainerCreating`` and ``PodInitializing`` do not)."""
CREATING = frozenset({"ContainerCreating", "PodInitializing"})
"""Waiting reasons while the kubelet prepares the pod or pulls the image: not a problem."""
READY_TO_START = "PodReadyToStartContainers"
"""Pod condition the kubelet sets True once the pod's sandbox exists, its network configured and
its volumes mounted (kubelet 1.29+): past it, a container still ``ContainerCreating`` waits for
its image."""
OOM_KILLED = "OOMKilled"
CRASH_LOOP = "CrashLoopBackOff"
"""Waiting reason of a container the kubelet holds back before restarting it again (its crash
back-off: 10 s after the second death in a row, doubling to 5 min)."""
START_ERROR_REASONS = frozenset({"StartError", "ContainerCannotRun"})
"""Terminated reasons of a container whose command could not start."""
CANNOT_RUN = re.compile(
    r"executable file not found"
    r'|exec:? "?[^"\s]+"?: (?:stat \S+: )?(?:no such file or directory|permission denied'
    r"|exec format error)",
    re.IGNORECASE,
)
"""A start error no retry can change: runc could not find or execute the command
(``exec: "torchrun": executable file not found in $PATH``, ``exec: "/run.sh": stat /run.sh: no
such file or directory``, ``exec /run.sh: exec format error``).  The same words from a mount
(``error mounting "..." to rootfs at "/data": ...: no such file or directory``: a volume not yet
there) are not the command's: retried."""
TERMINATED_REASONS = START_ERROR_REASONS | {OOM_KILLED}
"""Terminated reasons that name a problem (``Error`` and ``Completed`` say only the exit code)."""
RUNTIME_LOST = ("Unknown", 255)
"""Terminated reason and exit code containerd's CRI gives, when it starts again, a container it
had running whose task (its shim) is gone: the node lost power or rebooted, or containerd was
killed with the shims (seen in the sandbox with the node's kubelet, containerd and shims SIGKILLed
and started again, ``make bench-faults``'s ``node`` fault).  A process's own exit 255 is reason
``Error``."""
STATUS_UNKNOWN = "ContainerStatusUnknown"
"""Terminated reason (exit code 137) the kubelet itself writes for a container the runtime no
longer reports (its state wiped, or another runtime's way of losing it)."""
RUNTIME_LOST_REASON = "ContainerRuntimeLost"
"""The reason meshtrain records for either: not the trainer's exit, the node's."""
EVICTED, DEADLINE_EXCEEDED = "Evicted", "DeadlineExceeded"
POD_REASONS = frozenset({EVICTED, DEADLINE_EXCEEDED})
"""Pod ``status.reason`` values the kubelet explains in ``status.message``."""
REASONS = WAITING_REASONS | TERMINATED_REASONS | POD_REASONS
"""Every reason :func:`read` reports: each is also the reason of the job's condition and Event."""

CONFIG_GRACE_SECONDS = 60
"""How long a missing Secret or ConfigMap may stay missing after the kubelet took the pod (its
``status.startTime``) before the job fails: one applied with the job, or by a controller
moments later, is seen by the kubelet's next retry (10 s, then 20 s, 40 s)."""
PULL_ALLOWANCE_SECONDS = 3600
"""How long ``startupTimeoutSeconds`` waits while the kubelet pulls a pod's image (a 6 GB image:
minutes): the timeout covers scheduling and starting, not the download.  Only once the pod is
:data:`READY_TO_START`: before that ``ContainerCreating`` also covers a volume that never mounts
(Multi-Attach, a missing Secret volume) and a sandbox the CNI cannot create, which time out as
any start does, the message saying so (:func:`unprepared`)."""
MAX_CONTAINERS = 16
"""Container statuses read per list of a pod: ours have one; a tenant's webhook may add more."""
MAX_CONDITIONS = 32
"""Pod conditions read (the kubelet and the control plane write fewer than ten)."""
MAX_MESSAGE = 512
"""Characters of the kubelet's message kept (the image name is the tenant's; status stays small)."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """A reason the kubelet gives for a pod's container not running, or for the pod's end."""

    reason: str
    """The kubelet's reason, one of :data:`REASONS`."""
    message: str
    """The kubelet's message, at most :data:`MAX_MESSAGE` characters."""
    container: str | None = None
    """The container it concerns (None: the pod as a whole, evicted or past its deadline)."""
    memory_limit: str | None = None
    """The container's ``resources.limits.memory`` (None: unlimited)."""


def _text(value: object) -> str:
    text = value if isinstance(value, str) else ""
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def _memory_limits(spec: Mapping[str, Any]) -> dict[str, str]:
    found: dict[str, str] = {}
    for key in ("initContainers", "containers"):
        for container in (spec.get(key) or [])[:MAX_CONTAINERS]:
            limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
            if isinstance(limit, str):
                found[str(container.get("name"))] = limit
    return found


def _statuses(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Init containers first (a pod's later containers wait for them), each list bounded."""
    init = (status.get("initContainerStatuses") or [])[:MAX_CONTAINERS]
    return [*init, *(status.get("containerStatuses") or [])[:MAX_CONTAINERS]]


def _of_container(container: Mapping[str, Any], limits: Mapping[str, str]) -> Problem | None:
    state = container.get("state") or {}
    name = str(container.get("name") or "")
    for kind, reasons in (("terminated", TERMINATED_REASONS), ("waiting", WAITING_REASONS)):
        said = state.get(kind) or {}
        if said.get("reason") in reasons:
            message = _text(said.get("message"))
            return Problem(said["reason"], message, name, limits.get(name))
    return None


def runtime_lost(terminated: object) -> bool:
    """Whether a container's ``state.terminated`` says the node lost it, not its process
    (:data:`RUNTIME_LOST`, :data:`STATUS_UNKNOWN`)."""
    if not isinstance(terminated, Mapping):
        return False
    reason = terminated.get("reason")
    return reason == STATUS_UNKNOWN or (reason, terminated.get("exitCode")) == RUNTIME_LOST


def any_runtime_lost(pod: Mapping[str, Any]) -> bool:
    """Whether the node lost any container of ``pod`` (a few containers read)."""
    return any(
        runtime_lost((c.get("state") or {}).get("terminated"))
        for c in _statuses(pod.get("status") or {})
    )


def read(pod: Mapping[str, Any]) -> Problem | None:
    """The first problem ``pod`` (a manifest) reports: the pod's own reason, then its containers'."""
    status = pod.get("status") or {}
    if status.get("reason") in POD_REASONS:
        return Problem(status["reason"], _text(status.get("message")))
    limits = _memory_limits(pod.get("spec") or {})
    for container in _statuses(status):
        problem = _of_container(container, limits)
        if problem is not None:
            return problem
    return None


def restarted_oom(pod: Mapping[str, Any], container: str) -> Problem | None:
    """The OOM kill ``container`` was restarted in place after (its ``lastState``), or None."""
    limits = _memory_limits(pod.get("spec") or {})
    for status in _statuses(pod.get("status") or {}):
        if status.get("name") != container:
            continue
        last = status.get("lastState")
        said = last.get("terminated") if isinstance(last, Mapping) else None
        if isinstance(said, Mapping) and said.get("reason") == OOM_KILLED:
            return Problem(OOM_KILLED, _text(said.get("message")), container, limits.get(container))
    return None


def _creating(pod: Mapping[str, Any]) -> bool:
    return any(
        ((c.get("state") or {}).get("waiting") or {}).get("reason") in CREATING
        for c in _statuses(pod.get("status") or {})
    )


def _ready_to_start(pod: Mapping[str, Any]) -> bool:
    found = (pod.get("status") or {}).get("conditions") or []
    return any(
        isinstance(c, Mapping) and c.get("type") == READY_TO_START and c.get("status") == "True"
        for c in found[:MAX_CONDITIONS]
    )


def pulling(pod: Mapping[str, Any]) -> bool:
    """Whether the kubelet pulls an image of ``pod``: a container waits in ``ContainerCreating``
    (or ``PodInitializing``) with the sandbox made and the volumes mounted (:data:`READY_TO_START`)."""
    return _creating(pod) and _ready_to_start(pod)


def unprepared(pod: Mapping[str, Any]) -> bool:
    """Whether a container of ``pod`` waits in ``ContainerCreating`` before :data:`READY_TO_START`:
    its volumes are not mounted or its sandbox not created (the pod's Events say which)."""
    return _creating(pod) and not _ready_to_start(pod)


UNPREPARED = (
    "ContainerCreating, not yet PodReadyToStartContainers: its volumes are not mounted or its "
    "sandbox not created (the pod's Events say which: FailedMount, FailedAttachVolume, "
    "FailedCreatePodSandBox)"
)
"""What the startup timeout adds for a pod :func:`unprepared`."""


def described(pod: str, problem: Problem) -> str:
    """``problem`` in a sentence that names the pod, the container and the kubelet's words."""
    where = f"pod {pod}" + (f", container {problem.container}" if problem.container else "")
    said = f": {problem.message}" if problem.message else ""
    if problem.reason != OOM_KILLED:
        return f"{where}: {problem.reason}{said}"
    limit = problem.memory_limit or "none set"
    return (
        f"{where}: OOMKilled: the container used more than its memory limit ({limit}); "
        "raise spec.resources.memory, or lower training.microBatch (activations) or "
        "resources.shmSize (/dev/shm counts against the limit)"
    )


def never_pulls(problem: Problem) -> bool:
    """Whether ``problem`` is an image no retry can get: a bad name, or one the registry does not have for us."""
    return problem.reason in NEVER_PULLS or (
        problem.reason in IMAGE_PULL_REASONS and bool(MISSING_IMAGE.search(problem.message))
    )


def cannot_run(problem: Problem) -> bool:
    """Whether ``problem`` is a command the image cannot run (not found, not executable)."""
    return problem.reason in START_ERROR_REASONS and bool(CANNOT_RUN.search(problem.message))


def config_overdue(
    problem: Problem, started: datetime.datetime | None, now: datetime.datetime
) -> bool:
    """Whether a missing Secret or ConfigMap is still missing :data:`CONFIG_GRACE_SECONDS` after ``started``."""
    if problem.reason != CONFIG_ERROR or started is None:
        return False
    return (now - started).total_seconds() >= CONFIG_GRACE_SECONDS


def pending(pods: Sequence[tuple[str, Problem]]) -> str | None:
    """The message of the first of ``pods``' problems (name, problem), and how many there are."""
    if not pods:
        return None
    name, problem = pods[0]
    more = f" (and {len(pods) - 1} more pod(s))" if len(pods) > 1 else ""
    return described(name, problem) + more
