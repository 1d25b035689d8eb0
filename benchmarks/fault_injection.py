"""Faults a node suffers, injected from the host into the sandbox's pods: for ``bench_faults.py``.

The sandbox's containers run on this machine (each node's containerd and runc, cgroupfs), so a
fault is what the kernel does to a process: a worker process or a container's PID 1 SIGKILLed
(found through ``ctr tasks ls`` and the container's cgroup), a pod deleted through the API, or a
node's kubelet, containerd, shims and containers SIGKILLed at once (power lost) and its kubelet and
containerd started again later with their own command lines (the sandbox's supervisor starts each
only once).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time
from typing import Any

from meshtrain.sandbox import example, supervisor
from meshtrain.sandbox import node as node_mod
from meshtrain.sandbox.controlplane import binaries


def node_state(paths: supervisor.Paths, node: str) -> dict[str, str]:
    state = supervisor.read_state(paths) or {}
    return next(n for n in supervisor.node_states(state) if n["name"] == node)


def container_pid(paths: supervisor.Paths, pod: dict[str, Any]) -> int:
    """The trainer container's PID 1 on the host (``ctr tasks ls`` of the pod's node)."""
    [status] = [c for c in pod["status"]["containerStatuses"] if c["name"] == "trainer"] or pod[
        "status"
    ]["containerStatuses"][:1]
    container = status["containerID"].removeprefix("containerd://")
    its_node = node_state(paths, pod["spec"]["nodeName"])
    ctr = [str(binaries.locate_node().ctr), "--address", its_node["socket"], "-n", "k8s.io"]
    listed = subprocess.run(
        [*ctr, "tasks", "ls"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    return next(int(line.split()[1]) for line in listed.splitlines() if line.startswith(container))


def _cgroup_procs(pid: int) -> list[int]:
    """Processes in ``pid``'s cgroup (a v1 hierarchy with cgroup.procs, or the unified one)."""
    for line in pathlib.Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        names = [c.removeprefix("name=") for c in controllers.split(",") if c] or [""]
        for name in names:
            procs = pathlib.Path("/sys/fs/cgroup", name, path.lstrip("/"), "cgroup.procs")
            if procs.exists():
                return [int(p) for p in procs.read_text().split()]
    raise RuntimeError(f"no cgroup.procs for pid {pid}: {pathlib.Path(f'/proc/{pid}/cgroup')}")


def _cpu_ticks(pid: int) -> int:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def environ(pid: int) -> dict[str, str]:
    raw = pathlib.Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def kill_process(paths: supervisor.Paths, pod: dict[str, Any]) -> dict[str, Any]:
    """SIGKILL the busiest worker process of the pod's trainer container (not its PID 1)."""
    init = container_pid(paths, pod)
    candidates = [p for p in _cgroup_procs(init) if p != init]
    if not candidates:
        raise RuntimeError(f"the container of {pod['metadata']['name']} has no process but PID 1")
    victim = max(candidates, key=_cpu_ticks)
    env = environ(victim)
    os.kill(victim, signal.SIGKILL)
    at = time.time()
    return {"at": at, "pid": victim, "rank": env.get("RANK"), "local_rank": env.get("LOCAL_RANK")}


def kill_container(paths: supervisor.Paths, pod: dict[str, Any]) -> dict[str, Any]:
    """SIGKILL the pod's trainer container's PID 1."""
    pid = container_pid(paths, pod)
    os.kill(pid, signal.SIGKILL)
    return {"at": time.time(), "pid": pid}


def delete_pod(paths: supervisor.Paths, pod: dict[str, Any]) -> dict[str, Any]:
    """``kubectl delete pod`` with the default grace period (not waiting for it to go); the
    fault's time is when the command returned (the API server had accepted the deletion)."""
    example.kubectl(
        paths,
        "delete",
        "pod",
        "-n",
        pod["metadata"]["namespace"],
        pod["metadata"]["name"],
        "--wait=false",
    )
    at = time.time()
    return {"at": at, "pod": pod["metadata"]["name"]}


class NodeOutage:
    """One node's kubelet and containerd killed with its containers, and started again later."""

    def __init__(self, paths: supervisor.Paths, node: str) -> None:
        self.paths = paths
        self.node = node_state(paths, node)
        slot = [spec.name for spec in supervisor.NODES].index(node)
        self.names = [f"{c}-{slot}" if slot else c for c in ("kubelet", "containerd")]
        # nsenter executed each: its command line is the binary's own, outside the namespace.
        self.commands = {
            name: (
                pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1],
                environ(pid),
            )
            for name, pid in self._pids().items()
        }
        self.started: dict[str, subprocess.Popen[bytes]] = {}

    def _pids(self) -> dict[str, int]:
        """The process group of the node's kubelet and containerd, as state.json records them."""
        groups = (supervisor.read_state(self.paths) or {})["groups"]
        return {name: int(groups[name]) for name in self.names}

    def stop(self) -> dict[str, Any]:
        """SIGKILL kubelet, containerd, the shims and the containers of the node."""
        at = time.time()
        for name in self.names:  # kubelet first: it must not see its containers die
            pid = self.started[name].pid if name in self.started else self._pids()[name]
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if name in self.started:
                self.started.pop(name).wait(timeout=30)
        killed = node_mod.leftovers(self.node)
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return {
            "at": at,
            "node": self.node["name"],
            "killed_processes": len(killed) + len(self.names),
        }

    def start(self) -> None:
        """containerd, then the kubelet, with their command lines and environments."""
        pathlib.Path(self.node["socket"]).unlink(missing_ok=True)
        for name in reversed(self.names):  # containerd first
            argv, env = self.commands[name]
            command = ["nsenter", f"--net=/run/netns/{self.node['netns']}", "--", *argv]
            with open(self.paths.logs / f"{name}.log", "ab") as out:
                self.started[name] = subprocess.Popen(
                    command, stdout=out, stderr=out, env=env, start_new_session=True
                )
            if name.startswith("containerd"):
                node_mod.wait_socket(
                    pathlib.Path(self.node["socket"]),
                    alive=lambda n=name: self.started[n].poll() is None,  # type: ignore[misc]
                    log=self.paths.logs / f"{name}.log",
                )

    def close(self) -> None:
        """Stop what :meth:`start` started: the sandbox's ``down`` stops only the processes its
        supervisor started (which writes state.json), so these are stopped here, before it."""
        kubelet, containerd = self.names
        if kubelet in self.started:
            self.started[kubelet].terminate()
            self.started[kubelet].wait(timeout=60)
        if containerd in self.started:
            node_mod.remove_containers(pathlib.Path(self.node["socket"]))
            self.started[containerd].terminate()
            self.started[containerd].wait(timeout=60)
        self.started.clear()
