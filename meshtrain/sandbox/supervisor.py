"""Bringing the sandbox up and down: one supervisor process owns every part.

``up`` starts a detached supervisor (``python -m meshtrain.sandbox
serve``) and waits until it reports ready; the supervisor starts, in order,
the control plane (etcd, kube-apiserver, kube-scheduler,
kube-controller-manager), the chart's CRD and RBAC (``helm install`` with
``operator.deploy=false``), the node agent, the operator (a local process
with a token of the chart's ServiceAccount: the chart's RBAC is all it has),
and Prometheus.  It records every process group in ``state.json`` so that
``down`` can stop it all, and check that nothing is left, even after a crash.

Not a daemon manager.  One sandbox per state directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import yaml

from meshtrain.controlplane import binaries as binaries_mod
from meshtrain.controlplane import kubeconfig as kubeconfig_mod
from meshtrain.controlplane import ports, server
from meshtrain.sandbox import procs, prometheus

log = logging.getLogger("meshtrain.sandbox")

REPO = pathlib.Path(__file__).resolve().parents[2]
"""The source tree (chart, dashboards, examples)."""
RELEASE = "meshtrain"
"""Helm release name of the chart in the sandbox."""
NAMESPACE = "meshtrain-system"
"""Namespace of the release and of the operator's ServiceAccount."""
SERVICE_ACCOUNT = "meshtrain"
"""The chart's ServiceAccount (release name + chart name collapse to this)."""


def default_state_dir() -> pathlib.Path:
    """$MESHTRAIN_SANDBOX_DIR, else ``.sandbox/`` in the repository (gitignored)."""
    return pathlib.Path(os.environ.get("MESHTRAIN_SANDBOX_DIR") or REPO / ".sandbox").resolve()


@dataclasses.dataclass(frozen=True)
class Paths:
    """Files of one sandbox."""

    root: pathlib.Path
    """The state directory."""

    @property
    def state(self) -> pathlib.Path:
        """state.json: status, process groups, kubeconfig, URLs."""
        return self.root / "state.json"

    @property
    def logs(self) -> pathlib.Path:
        """Logs of the supervisor and every component."""
        return self.root / "logs"

    @property
    def kubeconfig(self) -> pathlib.Path:
        """Admin kubeconfig (export KUBECONFIG=...)."""
        return self.root / "kubeconfig"

    @property
    def operator_kubeconfig(self) -> pathlib.Path:
        """Kubeconfig of the chart's ServiceAccount, used by the operator."""
        return self.root / "operator.kubeconfig"


def read_state(paths: Paths) -> dict[str, Any] | None:
    """The recorded state, or None when no sandbox was started here."""
    try:
        state: dict[str, Any] = json.loads(paths.state.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return state


def _write_state(paths: Paths, state: dict[str, Any]) -> None:
    tmp = paths.state.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(paths.state)


def alive(pid: int) -> bool:
    """True when a process with this id exists (and is not a zombie)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (from /proc)."""
    members = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


# --- the supervisor process ----------------------------------------------------


class _Supervisor:
    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self.plane: server.ControlPlane | None = None
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.state: dict[str, Any] = {
            "status": "starting",
            "supervisor_pid": os.getpid(),
            "groups": {},
            "timings": {},
        }
        self.stopping = False

    def _spawn(
        self, name: str, argv: list[str], *, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with open(self.paths.logs / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
                cwd=self.paths.root,
            )
        self.children[name] = proc
        self.state["groups"][name] = proc.pid
        _write_state(self.paths, self.state)
        return proc

    def _timed(self, name: str, started: float) -> None:
        self.state["timings"][name] = round(time.monotonic() - started, 2)
        log.info("%s ready in %.1fs", name, time.monotonic() - started)

    def start(self) -> None:
        t0 = time.monotonic()
        found = binaries_mod.locate()
        self.plane = server.ControlPlane(
            binaries=found,
            with_scheduler=True,
            with_controller_manager=True,
            data_root=self.paths.root,
            startup_timeout=180.0,
        )
        self.plane.start()
        self.state["groups"].update({f"controlplane-{k}": v for k, v in self.plane.pids().items()})
        shutil.copyfile(self.plane.kubeconfig_path, self.paths.kubeconfig)
        self.state.update(kubeconfig=str(self.paths.kubeconfig), server=self.plane.server)
        self._timed("control plane", t0)

        t1 = time.monotonic()
        with open(self.paths.logs / "helm.log", "ab") as helm_log:
            subprocess.run(
                [
                    str(found.helm),
                    "install",
                    RELEASE,
                    str(REPO / "charts" / "meshtrain"),
                    "--namespace",
                    NAMESPACE,
                    "--create-namespace",
                    "--set",
                    "operator.deploy=false",
                    "--kubeconfig",
                    str(self.paths.kubeconfig),
                    "--wait",
                ],
                check=True,
                stdout=helm_log,
                stderr=subprocess.STDOUT,
            )
        self._timed("helm install (CRD, RBAC)", t1)

        t2 = time.monotonic()
        self._spawn(
            "nodeagent",
            [
                sys.executable,
                "-m",
                "meshtrain.sandbox.nodeagent",
                "--kubeconfig",
                str(self.paths.kubeconfig),
                "--state-dir",
                str(self.paths.root),
            ],
        )
        self._write_operator_kubeconfig()
        operator_metrics, operator_health = ports.pick_free_port(), ports.pick_free_port()
        env = {**os.environ, "MESHTRAIN_PROGRESS_SECONDS": "3", "MESHTRAIN_RESYNC_SECONDS": "5"}
        env.pop("KUBECONFIG", None)
        self._spawn(
            "operator",
            [
                sys.executable,
                "-m",
                "meshtrain.cli",
                "operator",
                "--all-namespaces",
                # The chart's Lease Role is in the release namespace; the identity (the host
                # name) survives a restart, so a restarted operator resumes at once.
                "--lease",
                RELEASE,
                "--lease-namespace",
                NAMESPACE,
                "--kubeconfig",
                str(self.paths.operator_kubeconfig),
                "--metrics-port",
                str(operator_metrics),
                "--liveness",
                f"http://127.0.0.1:{operator_health}/healthz",
                "--log-format",
                "text",
                # The simulated nodes' GPUs are CPU worker processes: plan and admit jobs as such.
                "--gpu-profile",
                "cpu",
            ],
            env=env,
        )
        self.state["operator_metrics"] = f"127.0.0.1:{operator_metrics}"
        self._start_prometheus(f"127.0.0.1:{operator_metrics}")
        self._wait_nodes_ready(found.kubectl)
        self._timed("node agent, operator, prometheus", t2)
        self.state["timings"]["up"] = round(time.monotonic() - t0, 2)
        self.state["status"] = "ready"
        _write_state(self.paths, self.state)

    def _write_operator_kubeconfig(self) -> None:
        """A token for the chart's ServiceAccount (TokenRequest API, 24 h)."""
        assert self.plane is not None
        answer = self.plane.admin_client().request(
            "POST",
            f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{SERVICE_ACCOUNT}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": 86400},
            },
        )
        config = kubeconfig_mod.build(
            server=self.plane.server,
            ca_file=self.plane.ca_file,
            user=f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}",
            token=answer.body["status"]["token"],
            namespace=NAMESPACE,
        )
        kubeconfig_mod.write(self.paths.operator_kubeconfig, config)

    def _start_prometheus(self, operator_target: str) -> None:
        directory = self.paths.root / "prometheus"
        directory.mkdir(parents=True, exist_ok=True)
        targets = directory / "targets.json"
        if not targets.exists():
            targets.write_text("[]")
        rules = []
        if (REPO / "dashboards" / "rules.yaml").exists():
            shutil.copyfile(REPO / "dashboards" / "rules.yaml", directory / "rules.yaml")
            rules.append(directory / "rules.yaml")
        config = prometheus.build_config(
            targets_file=targets, operator_target=operator_target, rule_files=rules
        )
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        port = ports.pick_free_port()
        self._spawn(
            "prometheus",
            prometheus.command(
                prometheus.find_binary(),
                config_file=directory / "prometheus.yml",
                data_dir=directory / "data",
                port=port,
            ),
        )
        self.state["prometheus_url"] = f"http://127.0.0.1:{port}"

    def _wait_nodes_ready(self, kubectl: pathlib.Path, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.children.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode}: see {self.paths.logs / (name + '.log')}"
                    )
            out = subprocess.run(
                [
                    str(kubectl),
                    "--kubeconfig",
                    str(self.paths.kubeconfig),
                    "get",
                    "nodes",
                    "-l",
                    "meshtrain.io/sandbox-node=true",
                    "-o",
                    "name",
                ],
                capture_output=True,
                text=True,
            )
            if len(out.stdout.split()) >= 1 and out.returncode == 0:
                return
            time.sleep(1.0)
        raise RuntimeError("the node agent did not register its nodes in time")

    def wait(self) -> None:
        while not self.stopping:
            for name, proc in self.children.items():
                if proc.poll() is not None and not self.stopping:
                    log.error("%s exited with %s; see logs/%s.log", name, proc.returncode, name)
                    self.state.setdefault("exited", {})[name] = proc.returncode
                    _write_state(self.paths, self.state)
                    self.children = {k: v for k, v in self.children.items() if k != name}
                    break
            time.sleep(1.0)

    def stop(self) -> None:
        self.stopping = True
        for name in ("operator", "nodeagent", "prometheus"):  # the agent kills its pods on SIGTERM
            proc = self.children.get(name)
            if proc is None:
                continue
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            _signal_group(proc.pid, signal.SIGKILL)  # stragglers of the group
        if self.plane is not None:
            self.plane.stop()
        self.state["status"] = "stopped"
        _write_state(self.paths, self.state)


def serve(paths: Paths) -> int:
    """The supervisor's main: start everything, then wait for SIGTERM and stop it all."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s sandbox %(levelname)s %(message)s")
    supervisor = _Supervisor(paths)
    signal.signal(signal.SIGTERM, lambda *_: setattr(supervisor, "stopping", True))
    signal.signal(signal.SIGINT, lambda *_: setattr(supervisor, "stopping", True))
    try:
        supervisor.start()
        log.info(
            "sandbox ready: export KUBECONFIG=%s ; Prometheus %s",
            paths.kubeconfig,
            supervisor.state.get("prometheus_url"),
        )
        supervisor.wait()
        return 0
    except Exception as err:  # noqa: BLE001 - recorded for `up`, then everything is stopped
        log.exception("sandbox failed to start")
        supervisor.state.update(status="failed", error=str(err))
        _write_state(paths, supervisor.state)
        return 1
    finally:
        supervisor.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# --- the commands ------------------------------------------------------------------


def up(paths: Paths, *, timeout: float = 600.0) -> dict[str, Any]:
    """Start the sandbox (or return the running one's state); raises RuntimeError on failure."""
    state = read_state(paths)
    if state and state.get("status") == "ready" and alive(state["supervisor_pid"]):
        return state
    if state:  # a sandbox that failed, is stopping, or whose supervisor died: clear it all first
        down(paths)
    for stale in ("pods", "prometheus", "logs"):
        shutil.rmtree(paths.root / stale, ignore_errors=True)
    paths.logs.mkdir(parents=True, exist_ok=True)
    paths.state.unlink(missing_ok=True)
    started = time.monotonic()
    with open(paths.logs / "supervisor.log", "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshtrain.sandbox", "--state-dir", str(paths.root), "serve"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    while time.monotonic() - started < timeout:
        state = read_state(paths)
        if state and state.get("status") == "ready":
            state["up_seconds"] = round(time.monotonic() - started, 1)
            return state
        if proc.poll() is not None or (state and state.get("status") == "failed"):
            proc.wait()
            tail = (paths.logs / "supervisor.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(
                f"the sandbox failed to start ({(state or {}).get('error', 'supervisor exited')}):\n{tail}"
            )
        time.sleep(0.5)
    down(paths)
    raise RuntimeError(f"the sandbox was not ready after {timeout:.0f}s; see {paths.logs}")


def down(paths: Paths, *, timeout: float = 90.0) -> list[int]:
    """Stop the sandbox; returns the ids of processes that had to be killed afterwards (ideally none)."""
    state = read_state(paths) or {}
    pid = state.get("supervisor_pid")
    if pid and alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.3)
    leftovers: list[int] = []
    groups = [pid] if pid else []
    groups += list((state.get("groups") or {}).values())
    for pgid in groups:
        members = group_members(pgid)
        if members:
            leftovers.extend(members)
            _signal_group(pgid, signal.SIGKILL)
    strays = procs.marked(str(paths.root))  # pod processes, whatever their group or parent
    if strays:
        leftovers.extend(strays)
        procs.signal_all(strays, signal.SIGKILL)
    if state:
        state["status"] = "down"
        _write_state(paths, state)
    for data in paths.root.glob("meshtrain-cp-*"):
        shutil.rmtree(data, ignore_errors=True)
    return leftovers


def status(paths: Paths) -> dict[str, Any]:
    """The recorded state plus which of its processes are alive."""
    state = read_state(paths) or {"status": "absent"}
    if (
        state.get("supervisor_pid")
        and not alive(state["supervisor_pid"])
        and state.get("status") == "ready"
    ):
        state["status"] = "dead (supervisor gone; run down)"
    state["alive"] = {
        name: bool(group_members(pgid)) for name, pgid in (state.get("groups") or {}).items()
    }
    return state
