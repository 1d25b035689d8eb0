"""Bringing the sandbox up and down: one supervisor process owns every part.

``up`` starts a detached supervisor (``python -m meshtrain.sandbox serve``) and waits until it
reports ready; the supervisor starts the parts in order (docs/sandbox.md, "What runs") and
records every process group and the nodes' names in ``state.json``, so that ``down`` can stop it
all and check that nothing is left, even after a crash.
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

from meshtrain.sandbox import (
    dra,
    network_policies,
    nodeconfig,
    prometheus,
    publish,
    registry,
    watch,
)
from meshtrain.sandbox import node as node_mod
from meshtrain.sandbox import nodes as nodes_mod
from meshtrain.sandbox.controlplane import binaries as binaries_mod
from meshtrain.sandbox.controlplane import ports, server

log = logging.getLogger("meshtrain.sandbox")

REPO = pathlib.Path(__file__).resolve().parents[3]
"""The source tree (chart, dashboards, examples)."""
RELEASE = "meshtrain"
"""Helm release name of the chart in the sandbox."""
NAMESPACE = "meshtrain-system"
"""Namespace of the release and of the operator's ServiceAccount."""
NODES = (
    nodes_mod.NodeSpec(name="gpu-b0-l0-n0", block="block-0", leaf="leaf-0-0", gpus=2),
    nodes_mod.NodeSpec(name="gpu-b0-l0-n1", block="block-0", leaf="leaf-0-0", gpus=2),
)
"""The sandbox's kubelet nodes: names, topology labels and advertised GPUs.  Two GPUs each, so
the example's two pods of two GPUs run on two nodes and its gang's traffic crosses between them."""


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
        self.nodes: list[node_mod.Node] = []
        self.store_locks: list[int] = []

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
        node_bins = binaries_mod.locate_node()
        taken = node_mod.taken_indices()
        for spec in NODES:
            net = nodeconfig.addresses(self.paths.root / spec.name, taken)
            taken.add(net.index)
            self.nodes.append(
                node_mod.Node(root=self.paths.root / "nodes" / spec.name, net=net, spec=spec)
            )
        self.state["nodes"] = [n.to_state() for n in self.nodes]
        _write_state(self.paths, self.state)
        for n in self.nodes:
            node_mod.setup_network(n.net)
        node_mod.join_nodes([n.net for n in self.nodes])
        hub = self.nodes[0].net
        self.plane = server.ControlPlane(
            binaries=found,
            with_scheduler=True,
            with_controller_manager=True,
            data_root=self.paths.root,
            startup_timeout=180.0,
            bind_address=hub.host_ip,
        )
        self.plane.start()
        self.state["groups"].update({f"controlplane-{k}": v for k, v in self.plane.pids().items()})
        shutil.copyfile(self.plane.kubeconfig_path, self.paths.kubeconfig)
        self.state.update(kubeconfig=str(self.paths.kubeconfig), server=self.plane.server)
        self._timed("control plane", t0)

        t1 = time.monotonic()
        address = self._start_registry(hub.host_ip)
        publish.push_images(address, self.paths.logs / "images.log")
        names = registry.images()
        digests = {name: publish.manifest_digest(address, name) for name in names.all()}
        self._timed("images (build if changed, push to the registry)", t1)

        t2 = time.monotonic()
        env = node_mod.node_env(node_bins.bin_dir)
        commands = {}
        for slot, n in enumerate(self.nodes):
            containerd_root, lock = node_mod.image_store(n, slot)
            if lock is None:
                log.warning(
                    "another sandbox holds the shared image store of node slot %d; pulling into %s",
                    slot,
                    containerd_root,
                )
            else:
                self.store_locks.append(lock)
            node_mod.write_configs(
                n,
                kubeconfig=self.paths.kubeconfig,
                ca_file=self.plane.ca_file,
                pause_image=names.pause,
                containerd_root=containerd_root,
                hub=hub,
                registry_address=address,
            )
            node_mod.write_dra_config(n, slot)
            commands[n.spec.name] = node_mod.commands(n, kubeconfig=self.paths.kubeconfig)
            self._start_containerd(
                n, _process_name("containerd", slot), commands[n.spec.name]["containerd"], env
            )
            stale = publish.forget_stale(node_bins.ctr, n.socket, digests, address)
            if stale:
                log.info("%s: dropped images to pull afresh: %s", n.spec.name, ", ".join(stale))
        self._timed("containerd", t2)

        t3 = time.monotonic()
        self._spawn("coredns", commands[self.nodes[0].spec.name]["coredns"], env=env)
        for slot, n in enumerate(self.nodes):
            node_mod.make_cgroups(n.cgroup_root)
            for name in ("kubelet", "kube-proxy"):
                self._spawn(_process_name(name, slot), commands[n.spec.name][name], env=env)
        for slot, n in enumerate(self.nodes):
            self._wait_node_ready(found.kubectl, n.spec.name, _process_name("kubelet", slot))
            self._kubectl(
                found.kubectl,
                "patch",
                "node",
                n.spec.name,
                "--subresource=status",
                "--type=json",
                "-p",
                json.dumps(nodeconfig.gpu_capacity_patch(n.spec.gpus)),
            )
        self._timed("kubelet nodes Ready", t3)
        self._start_network_policies()
        self._start_dra_drivers(found.kubectl, commands)

        t4 = time.monotonic()
        chart = publish.push_chart(
            found.helm, address, self.paths.root / "dist", self.paths.logs / "helm.log"
        )
        self._timed("chart (package, push to the registry)", t4)
        t5 = time.monotonic()
        self._helm_install(found.helm, chart)
        self._timed("helm install from oci:// (operator Deployment)", t5)
        self._start_prometheus()
        self.state["timings"]["up"] = round(time.monotonic() - t0, 2)
        self.state["status"] = "ready"
        _write_state(self.paths, self.state)

    def _start_containerd(
        self, node: node_mod.Node, name: str, command: list[str], env: dict[str, str]
    ) -> None:
        containerd = self._spawn(name, command, env=env)
        node_mod.wait_socket(
            node.socket,
            alive=lambda: containerd.poll() is None,
            log=self.paths.logs / f"{name}.log",
        )

    def _start_dra_drivers(
        self, kubectl: pathlib.Path, commands: dict[str, dict[str, list[str]]]
    ) -> None:
        """The simulated GPU DRA driver on every node, its DeviceClass, and until each node's slice is published."""
        started = time.monotonic()
        for slot, n in enumerate(self.nodes):
            self._spawn(_process_name("dra-driver", slot), commands[n.spec.name]["dra-driver"])
        self._kubectl(kubectl, "apply", "-f", "-", stdin=json.dumps(dra.device_class()))
        deadline = time.monotonic() + 120.0
        published: dict[str, list[str]] = {}
        while time.monotonic() < deadline:
            published = dra.slice_summary(
                json.loads(self._kubectl(kubectl, "get", "resourceslices", "-o", "json"))["items"]
            )
            if all(len(published.get(n.spec.name, [])) == dra.GPUS_PER_NODE for n in self.nodes):
                self._timed("DRA driver: ResourceSlices published", started)
                return
            time.sleep(1.0)
        raise RuntimeError(
            f"the DRA driver did not publish {dra.GPUS_PER_NODE} devices per node in 120s "
            f"(published: {published}); see {self.paths.logs / 'dra-driver.log'} and the kubelet's log"
        )

    def _start_network_policies(self) -> None:
        """The NetworkPolicy enforcer on every node (:mod:`.network_policies`)."""
        binary = network_policies.locate()
        for slot, n in enumerate(self.nodes):
            argv = network_policies.command(
                binary,
                netns=n.net.netns,
                node_name=n.spec.name,
                kubeconfig=self.paths.kubeconfig,
                service_range=server.SERVICE_CLUSTER_IP_RANGE,
            )
            self._spawn(_process_name("network-policies", slot), argv)

    def _kubectl(self, kubectl: pathlib.Path, *args: str, stdin: str | None = None) -> str:
        result = subprocess.run(
            [str(kubectl), "--kubeconfig", str(self.paths.kubeconfig), *args],
            input=stdin,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def _start_registry(self, host: str) -> str:
        """The registry on the first node's link (:mod:`.registry`); returns its address (host:port)."""
        directory = self.paths.root / "registry"
        directory.mkdir(parents=True, exist_ok=True)
        port = registry.free_port(host)
        config = registry.config(storage=registry.storage(), host=host, port=port)
        (directory / "config.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        proc = self._spawn(
            "registry", registry.command(registry.locate(), directory / "config.yml")
        )
        address = f"{host}:{port}"
        registry.wait_ready(address, alive=lambda: proc.poll() is None)
        self.state["registry"] = address
        _write_state(self.paths, self.state)
        return address

    def _helm_install(self, helm: pathlib.Path, chart: str) -> None:
        """The chart as users install it, from the registry; the nodes pull both images from it."""
        env = [
            {"name": "MESHTRAIN_PROGRESS_SECONDS", "value": "3"},
            {"name": "MESHTRAIN_RESYNC_SECONDS", "value": "5"},
        ]
        overrides = [
            "--set",
            "operator.logFormat=text",
            # The node's "GPUs" are CPU worker processes: plan and admit jobs as such.
            "--set",
            "operator.gpuProfile=cpu",
            "--set-json",
            f"operator.extraEnv={json.dumps(env)}",
            # Prometheus and the tests run on the host: let its link addresses through.
            "--set-json",
            f'networkPolicy.extraIngressFrom=[{{"ipBlock":{{"cidr":"{nodeconfig.LINK_PREFIX}.0.0/16"}}}}]',
        ]
        command = publish.install_command(
            helm,
            chart,
            host=registry.ALIAS,
            release_name=RELEASE,
            kubeconfig=self.paths.kubeconfig,
            namespace=NAMESPACE,
            overrides=overrides,
        )
        with open(self.paths.logs / "helm.log", "ab") as out:
            result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
        if result.returncode != 0:
            raise RuntimeError(
                f"helm install of {chart} failed (exit {result.returncode}): see "
                f"{self.paths.logs / 'helm.log'} and `kubectl -n {NAMESPACE} describe pods`"
            )

    def _start_prometheus(self) -> None:
        directory = self.paths.root / "prometheus"
        directory.mkdir(parents=True, exist_ok=True)
        rules = []
        if (REPO / "dashboards" / "rules.yaml").exists():
            shutil.copyfile(REPO / "dashboards" / "rules.yaml", directory / "rules.yaml")
            rules.append(directory / "rules.yaml")
        self._write_targets()
        config = prometheus.build_config(targets_dir=directory, rule_files=rules)
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

    def _wait_node_ready(
        self, kubectl: pathlib.Path, node: str, kubelet: str, timeout: float = 180.0
    ) -> None:
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
                    "node",
                    node,
                    "-o",
                    "jsonpath={.status.conditions[?(@.type=='Ready')].status}",
                ],
                capture_output=True,
                text=True,
            )
            if out.stdout.strip() == "True":
                return
            time.sleep(1.0)
        raise RuntimeError(
            f"kubelet: node {node} was not Ready after {timeout:.0f}s; see "
            f"{self.paths.logs / (kubelet + '.log')} and the containerd log beside it"
        )

    def _write_targets(self) -> None:
        """Rewrite Prometheus's target files from the pods the API server lists."""
        assert self.plane is not None
        answer = self.plane.admin_client().request("GET", "/api/v1/pods", timeout=10)
        if answer.status != 200:
            return
        pods = answer.body.get("items", [])
        directory = self.paths.root / "prometheus"
        for job, port_names in (
            ("meshtrain-trainer", prometheus.TRAINER_PORTS),
            ("meshtrain-operator", prometheus.OPERATOR_PORTS),
        ):
            tmp = directory / f"{job}.json.tmp"
            tmp.write_text(json.dumps(prometheus.targets(pods, port_names)))
            tmp.replace(directory / f"{job}.json")

    def wait(self) -> None:
        while not self.stopping:
            try:
                self._write_targets()
            except OSError as err:
                log.warning("could not refresh Prometheus targets: %s", err)
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
        self._stop_process("prometheus")
        for slot in range(len(self.nodes)):
            # Its rules go with the node's namespace: nothing to wind down, no slow shutdown.
            self._stop_process(_process_name("network-policies", slot), grace_seconds=1.0)
        for component in ("dra-driver", "kube-proxy", "kubelet"):
            for slot in range(len(self.nodes)):
                self._stop_process(_process_name(component, slot))
        self._stop_process("coredns")
        for slot, n in enumerate(self.nodes):
            node_mod.teardown(n.to_state())  # containers die before their runtime
            node_mod.remove_containers(n.socket)
            self._stop_process(_process_name("containerd", slot))
        for n in self.nodes:
            node_mod.teardown(n.to_state())
        self._stop_process("registry")
        for lock in self.store_locks:
            os.close(lock)
        if self.plane is not None:
            self.plane.stop()
        self.state["status"] = "stopped"
        _write_state(self.paths, self.state)

    def _stop_process(self, name: str, grace_seconds: float = 30.0) -> None:
        proc = self.children.get(name)
        if proc is None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        _signal_group(proc.pid, signal.SIGKILL)  # stragglers of the group


def _process_name(component: str, slot: int) -> str:
    """A node process's name in state.json and its log's: ``kubelet`` for the first node, ``kubelet-1`` for the second..."""
    return f"{component}-{slot}" if slot else component


class _Interrupted(BaseException):
    """SIGTERM/SIGINT while the sandbox is still starting."""


def serve(paths: Paths) -> int:
    """The supervisor's main: start everything, then wait for SIGTERM and stop it all."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s sandbox %(levelname)s %(message)s")
    supervisor = _Supervisor(paths)

    def interrupt_start(*_: object) -> None:
        raise _Interrupted("stopped while starting (sandbox down or Ctrl-C)")

    signal.signal(signal.SIGTERM, interrupt_start)
    signal.signal(signal.SIGINT, interrupt_start)
    try:
        supervisor.start()
        signal.signal(signal.SIGTERM, lambda *_: setattr(supervisor, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(supervisor, "stopping", True))
        log.info(
            "sandbox ready: export KUBECONFIG=%s ; Prometheus %s",
            paths.kubeconfig,
            supervisor.state.get("prometheus_url"),
        )
        supervisor.wait()
        return 0
    except (Exception, _Interrupted) as err:  # recorded for `up`, then everything is stopped
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


def up(paths: Paths, *, timeout: float = 3600.0) -> dict[str, Any]:
    """Start the sandbox (or return the running one's state); raises RuntimeError on failure.

    The timeout covers a first start on a fresh machine, which builds the
    images and imports the trainer image (gigabytes) into containerd.
    """
    state = read_state(paths)
    if state and state.get("status") == "ready" and alive(state["supervisor_pid"]):
        return state
    if state:  # a sandbox that failed, is stopping, or whose supervisor died: clear it all first
        down(paths)
    for stale in ("nodes", "node", "prometheus", "logs"):
        shutil.rmtree(paths.root / stale, ignore_errors=True)
    paths.logs.mkdir(parents=True, exist_ok=True)
    paths.state.unlink(missing_ok=True)
    started = time.monotonic()
    shown = watch.StartProgress(paths.logs)  # the steps as they finish, while the user waits
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
        shown.poll()
        if state and state.get("status") == "ready":
            state["up_seconds"] = round(time.monotonic() - started, 1)
            shown.close("ready")
            return state
        if proc.poll() is not None or (state and state.get("status") == "failed"):
            shown.close("failed")
            proc.wait()
            tail = (paths.logs / "supervisor.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(
                f"the sandbox failed to start ({(state or {}).get('error', 'supervisor exited')}):\n{tail}"
            )
        time.sleep(0.5)
    shown.close("timed out")
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
    for node_state in node_states(state):  # containers, shims, namespace
        leftovers.extend(node_mod.teardown(node_state))
    if state:
        state["status"] = "down"
        _write_state(paths, state)
    for data in paths.root.glob("meshtrain-cp-*"):
        shutil.rmtree(data, ignore_errors=True)
    return leftovers


def node_states(state: dict[str, Any]) -> list[dict[str, str]]:
    """The nodes recorded in ``state`` (``node``: a sandbox started before there were several)."""
    if "nodes" in state:
        return list(state["nodes"])
    return [state["node"]] if state.get("node") else []


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
