"""Pod status as the kubelet would report it, for the sandbox's node agent.

Pure builders of the ``status`` the agent writes for a pod whose
containers run as local processes: phase, podIP, conditions (Initialized,
ContainersReady, Ready), container states with exit codes, and the
``file_sd`` target list Prometheus reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

SANDBOX_IMAGE_ID = "sandbox://local-process"
"""imageID reported for every container: nothing was pulled."""
TERMINATION_MESSAGE_LIMIT = 4096
"""Bytes of a termination-log file the kubelet reports (and the agent should read)."""


@dataclasses.dataclass(frozen=True)
class ContainerState:
    """What the agent knows about one container process."""

    name: str
    image: str
    """Image named in the pod spec (not pulled)."""
    pid: int | None
    """Process ID while running (reported as the container ID)."""
    started_at: str | None
    """When the process started."""
    exit_code: int | None = None
    """Exit code once it ended (negative signal numbers are reported as 128+signal)."""
    finished_at: str | None = None
    """When it ended."""
    restart_count: int = 0
    """How often the agent restarted it (restartPolicy Always/OnFailure)."""
    message: str = ""
    """Termination message once it ended: the content of its termination-log file (at most
    :data:`TERMINATION_MESSAGE_LIMIT` bytes, as the kubelet reads it)."""

    @property
    def running(self) -> bool:
        """Started and not ended."""
        return self.started_at is not None and self.exit_code is None


def exit_code(returncode: int) -> int:
    """Popen returncode -> container exit code (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _container_status(state: ContainerState) -> dict[str, Any]:
    status: dict[str, Any] = {
        "name": state.name,
        "image": state.image,
        "imageID": SANDBOX_IMAGE_ID,
        "restartCount": state.restart_count,
        "ready": state.running,
        "started": state.running,
    }
    if state.pid is not None:
        status["containerID"] = f"sandbox://{state.pid}"
    if state.started_at is None:
        status["state"] = {
            "waiting": {
                "reason": "ContainerCreating",
                "message": "waiting for the pod's names and volumes",
            }
        }
    elif state.exit_code is None:
        status["state"] = {"running": {"startedAt": state.started_at}}
    else:
        status["state"] = {
            "terminated": {
                "exitCode": state.exit_code,
                "reason": "Completed" if state.exit_code == 0 else "Error",
                "startedAt": state.started_at,
                "finishedAt": state.finished_at,
                "containerID": f"sandbox://{state.pid}",
            }
        }
        if state.message:
            status["state"]["terminated"]["message"] = state.message[-TERMINATION_MESSAGE_LIMIT:]
    return status


def phase(containers: Sequence[ContainerState], restart_policy: str) -> str:
    """Pod phase from its main containers' states, as the kubelet decides it."""
    if any(c.started_at is None for c in containers):
        return "Pending"
    if any(c.running for c in containers):
        return "Running"
    if all(c.exit_code == 0 for c in containers):
        return "Succeeded" if restart_policy != "Always" else "Running"
    return "Failed" if restart_policy == "Never" else "Running"


def build_status(
    *,
    ip: str,
    started_at: str,
    now: str,
    init_done: bool,
    init: Sequence[ContainerState],
    containers: Sequence[ContainerState],
    restart_policy: str,
    message: str = "",
) -> dict[str, Any]:
    """The ``status`` object of a pod run by the agent."""
    pod_phase = phase(containers, restart_policy) if init_done else "Pending"
    ready = pod_phase == "Running" and all(c.running for c in containers)

    def condition(kind: str, value: bool, reason: str = "") -> dict[str, Any]:
        cond = {
            "type": kind,
            "status": "True" if value else "False",
            "lastTransitionTime": now,
            "lastProbeTime": None,
        }
        if reason:
            cond["reason"] = reason
        return cond

    finished = pod_phase in ("Succeeded", "Failed")
    status: dict[str, Any] = {
        "phase": pod_phase,
        "hostIP": "127.0.0.1",
        "hostIPs": [{"ip": "127.0.0.1"}],
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "startTime": started_at,
        "conditions": [
            condition("PodScheduled", True),
            condition("Initialized", init_done, "" if init_done else "ContainersNotInitialized"),
            condition(
                "ContainersReady",
                ready,
                "" if ready else ("PodCompleted" if finished else "ContainersNotReady"),
            ),
            condition(
                "Ready",
                ready,
                "" if ready else ("PodCompleted" if finished else "ContainersNotReady"),
            ),
        ],
        "containerStatuses": [_container_status(c) for c in containers],
    }
    if init:
        status["initContainerStatuses"] = [_container_status(c) for c in init]
    if message:
        status["message"] = message
    return status


def metrics_targets(
    pod: Mapping[str, Any], ip: str, *, gpu_resource: str = "nvidia.com/gpu"
) -> list[int]:
    """Ports Prometheus should scrape on a running pod.

    Every container port whose name starts with ``metrics``; for the port named
    ``metrics`` also the per-rank ports after it (the trainer serves rank r of
    a pod on ``port + r``, one per GPU the container asks for).
    """
    ports: list[int] = []
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        gpus = int(
            (resources.get("limits") or {}).get(gpu_resource)
            or (resources.get("requests") or {}).get(gpu_resource)
            or 1
        )
        for port in container.get("ports") or []:
            name = port.get("name", "")
            if not name.startswith("metrics"):
                continue
            count = gpus if name == "metrics" else 1
            ports.extend(int(port["containerPort"]) + r for r in range(count))
    return sorted(set(ports))


def file_sd(groups: Sequence[tuple[str, Sequence[int], Mapping[str, str]]]) -> list[dict[str, Any]]:
    """Prometheus file_sd content from (ip, ports, labels) groups."""
    return [
        {"targets": [f"{ip}:{port}" for port in ports], "labels": dict(labels)}
        for ip, ports, labels in groups
        if ports
    ]
