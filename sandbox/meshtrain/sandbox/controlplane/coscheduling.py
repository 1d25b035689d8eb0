"""scheduler-plugins' scheduler as a second scheduler of a local control plane: :class:`SecondScheduler`.

It installs the PodGroup CRD (``scheduling.x-k8s.io``) the bootstrap copied from the pinned
release's manifests and runs its kube-scheduler with one profile, named like the chart's
``gang.schedulerName``, whose Coscheduling plugin binds a PodGroup's pods all or none (the
profile of scheduler-plugins' own ``manifests/coscheduling/scheduler-config.yaml``).  Pods of
any other ``schedulerName`` stay the control plane's kube-scheduler's.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import time
import urllib.error
from typing import Any

import yaml

from meshtrain.sandbox.controlplane import binaries, ports, rest, server

#: The scheduler-plugins release the project pins; must equal the default in scripts/bootstrap.sh.
DEFAULT_VERSION = "v0.34.1-devel"
VERSION = os.environ.get("MESHTRAIN_SCHEDULER_PLUGINS_VERSION", DEFAULT_VERSION)
SCHEDULER_NAME = "scheduler-plugins-scheduler"
"""The second scheduler's name (the chart's ``gang.schedulerName`` default)."""
BUILD_COMMAND = "scripts/bootstrap.sh (the full bootstrap: `make bootstrap`; --no-node skips it)"


@dataclasses.dataclass(frozen=True)
class Files:
    """What the bootstrap provides for one scheduler-plugins release."""

    binary: pathlib.Path
    """scheduler-plugins' kube-scheduler (its cmd/scheduler)."""
    crd: pathlib.Path
    """The PodGroup CRD (podgroups.scheduling.x-k8s.io)."""


def locate() -> Files:
    """The pinned release's scheduler and PodGroup CRD; :class:`binaries.BinariesMissingError`
    naming the command that builds them when missing."""
    root = binaries.cache_root() / f"scheduler-plugins-{VERSION}"
    binary = root / "bin" / "kube-scheduler"
    crd = root / "crds" / "scheduling.x-k8s.io_podgroups.yaml"
    if not (binary.is_file() and os.access(binary, os.X_OK) and crd.is_file()):
        raise binaries.BinariesMissingError(
            f"scheduler-plugins {VERSION} is not in {root}: run {BUILD_COMMAND}; it builds "
            "kube-scheduler from the sigs.k8s.io/scheduler-plugins Go module"
        )
    return Files(binary=binary, crd=crd)


def config(kubeconfig: pathlib.Path, name: str, permit_seconds: int) -> dict[str, Any]:
    """The KubeSchedulerConfiguration: one profile ``name`` with Coscheduling at every point it
    implements and as the queue's sort (a gang's pods next to each other)."""
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "leaderElection": {"leaderElect": False},
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "profiles": [
            {
                "schedulerName": name,
                "plugins": {
                    "multiPoint": {"enabled": [{"name": "Coscheduling"}]},
                    "queueSort": {
                        "enabled": [{"name": "Coscheduling"}],
                        "disabled": [{"name": "*"}],
                    },
                },
                "pluginConfig": [
                    {"name": "Coscheduling", "args": {"permitWaitingTimeSeconds": permit_seconds}}
                ],
            }
        ],
    }


class SecondScheduler:
    """scheduler-plugins' scheduler beside a control plane's own; a context manager."""

    def __init__(
        self,
        kubeconfig: pathlib.Path,
        kubectl: pathlib.Path,
        work_dir: pathlib.Path,
        name: str = SCHEDULER_NAME,
        permit_seconds: int = 10,
    ) -> None:
        self.files = locate()
        self.kubeconfig, self.kubectl = kubeconfig, kubectl
        """An admin kubeconfig of the control plane (the scheduler reads PodGroups with it) and kubectl."""
        self.work_dir, self.name = work_dir, name
        self.permit_seconds = permit_seconds
        """How long a pod waits in Permit when its PodGroup names no scheduleTimeoutSeconds."""
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = work_dir / "second-scheduler.log"

    def start(self, timeout: float = 120.0) -> SecondScheduler:
        """Install the PodGroup CRD and start the scheduler; returns once its /healthz answers."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        kubectl = [str(self.kubectl), "--kubeconfig", str(self.kubeconfig)]
        for args in (
            ("apply", "--server-side", "-f", str(self.files.crd)),
            ("wait", "--for=condition=Established", "--timeout=60s", "crd/podgroups.scheduling.x-k8s.io"),
        ):  # fmt: skip
            result = subprocess.run([*kubectl, *args], capture_output=True, text=True, timeout=90)
            if result.returncode != 0:
                raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        path = self.work_dir / "scheduler-config.yaml"
        path.write_text(yaml.safe_dump(config(self.kubeconfig, self.name, self.permit_seconds)))
        port = ports.pick_free_port()
        auth = str(self.kubeconfig)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    str(self.files.binary),
                    f"--config={path}",
                    f"--authentication-kubeconfig={auth}",
                    f"--authorization-kubeconfig={auth}",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={port}",
                    f"--cert-dir={self.work_dir / 'certs'}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        health = rest.Client(server=f"https://127.0.0.1:{port}", ca_file=None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}: {self.tail()}"
                )
            try:
                if health.request("GET", "/healthz", timeout=2).status == 200:
                    return self
            except (OSError, rest.ApiError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f}s: {self.tail()}")

    def tail(self, lines: int = 30) -> str:
        """The scheduler log's last lines."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM the scheduler's process group (SIGKILL after a grace), as the control plane
        stops its own components."""
        if self.process is not None:
            server._kill_group(self.process)  # the control plane stops its components so
            self.process = None

    def __enter__(self) -> SecondScheduler:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
