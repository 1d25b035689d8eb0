"""The sandbox's node agent: stands in for the kubelet of every simulated GPU node.

One process that registers the simulated nodes
(:mod:`.nodes`), keeps them alive (Lease renewals in ``kube-node-lease`` and
status heartbeats, so the node lifecycle controller never taints them), and
runs the pods the real scheduler binds to them: the containers' commands
become local processes (:mod:`.podspec` does the translation), each in its own
process group with its log in ``<state>/pods/<ns>/<pod>/<container>.log``.
It reports phase, podIP, Ready and container states with exit codes
(:mod:`.podstatus`), kills the process group when the pod is deleted and then
finishes the deletion as the kubelet does.  It rewrites Prometheus's file_sd
target list as pods come and go.

Not a container runtime or a real kubelet.  Images are NOT pulled;
containers are local processes with this machine's Python and meshtrain;
``kubectl logs``/``exec`` cannot work (there is no kubelet API): read the log
files, or ``python -m meshtrain.sandbox logs POD``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from meshtrain.sandbox import nodes, podspec, podstatus, procs

log = logging.getLogger("meshtrain.sandbox.nodeagent")

IP_PREFIX = "127.0.1."
"""Pod addresses are 127.0.1.1 .. 127.0.1.254 (all loopback on Linux)."""
POD_IP_ENV = "MESHTRAIN_SANDBOX_POD_IP"
"""Environment variable holding the pod's address in its processes (finds a pod's orphans)."""
METRICS_HOST_ENV = "MESHTRAIN_METRICS_HOST"
"""Where the trainer's exporters bind (``meshtrain.trainer.telemetry.exporter.HOST_ENV``; not imported: no torch here)."""


@dataclasses.dataclass
class _Proc:
    spec: podspec.ContainerProcess
    state: podstatus.ContainerState
    popen: subprocess.Popen[bytes] | None = None


@dataclasses.dataclass
class _Pod:
    key: tuple[str, str]
    uid: str
    ip: str
    obj: dict[str, Any]
    directory: pathlib.Path
    started_at: str = ""
    procs: list[_Proc] = dataclasses.field(default_factory=list)
    waiting: str = ""
    reported: str = ""
    kill_deadline: float | None = None
    finished: bool = False


class NodeAgent:
    """Registers the simulated nodes and runs the pods bound to them."""

    def __init__(
        self, *, kubeconfig: str, state_dir: pathlib.Path, sim_nodes: list[nodes.SimNode]
    ) -> None:
        self.api = kubernetes.client.CoreV1Api(
            kubernetes.config.new_client_from_config(config_file=kubeconfig)
        )
        self.coord = kubernetes.client.CoordinationV1Api(self.api.api_client)
        self.state_dir = state_dir
        self.sim_nodes = {n.name: n for n in sim_nodes}
        self.pods: dict[tuple[str, str], _Pod] = {}
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.stopping = threading.Event()
        self.targets_file = state_dir / "prometheus" / "targets.json"
        self._used_ips: set[str] = set()
        self._gone: set[str] = set()  # uids of pods whose deletion this agent completed

    # --- nodes ---------------------------------------------------------------

    def register_nodes(self) -> None:
        """Create (or refresh) every simulated node, its status and its Lease."""
        since = nodes.now()
        for node in self.sim_nodes.values():
            try:
                self.api.create_node(nodes.build_node(node))
            except ApiException as err:
                if err.status != 409:
                    raise
            self.api.patch_node_status(
                node.name, nodes.build_node_status(node, heartbeat=since, ready_since=since)
            )
        self._renew_leases(create=True)
        log.info(
            "registered %d simulated GPU nodes (%d GPUs): images are not pulled, containers run as local processes",
            len(self.sim_nodes),
            sum(n.gpus for n in self.sim_nodes.values()),
        )

    def _renew_leases(self, *, create: bool = False) -> None:
        for node in self.sim_nodes.values():
            renew = nodes.now_micro()
            try:
                self.coord.patch_namespaced_lease(
                    node.name,
                    nodes.LEASE_NAMESPACE,
                    {"spec": {"renewTime": renew, "holderIdentity": node.name}},
                )
            except ApiException as err:
                if err.status != 404 or not create:
                    log.warning("lease renewal of %s failed: %s", node.name, err.reason)
                    continue
                uid = self.api.read_node(node.name).metadata.uid
                self.coord.create_namespaced_lease(
                    nodes.LEASE_NAMESPACE, nodes.build_lease(node.name, uid=uid, renew_time=renew)
                )

    def _heartbeat_loop(self) -> None:
        beats = 0
        while not self.stopping.wait(10.0):
            try:
                self._renew_leases()
                beats += 1
                if beats % 6 == 0:  # status heartbeat every minute, like a kubelet's status update
                    since = nodes.now()
                    for node in self.sim_nodes.values():
                        self.api.patch_node_status(
                            node.name,
                            {
                                "status": {
                                    "conditions": [
                                        {
                                            "type": "Ready",
                                            "status": "True",
                                            "reason": "KubeletReady",
                                            "lastHeartbeatTime": since,
                                        }
                                    ]
                                }
                            },
                        )
            except Exception:  # noqa: BLE001 - a missed beat is logged, the next one retries
                log.exception("heartbeat failed")

    # --- pods ----------------------------------------------------------------

    def _watch_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                listing = self.api.list_pod_for_all_namespaces()
                for item in listing.items:
                    self.events.put(("SYNC", self.api.api_client.sanitize_for_serialization(item)))
                watch = kubernetes.watch.Watch()
                for event in watch.stream(
                    self.api.list_pod_for_all_namespaces,
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=60,
                    allow_watch_bookmarks=False,
                ):
                    if self.stopping.is_set():
                        watch.stop()
                        break
                    self.events.put((event["type"], event["raw_object"]))
            except Exception as err:  # noqa: BLE001 - reconnect after API hiccups
                if not self.stopping.is_set():
                    log.warning("pod watch interrupted (%s); reconnecting", err)
                    time.sleep(1.0)

    def run(self) -> None:
        """Register nodes, then handle pod events and process exits until SIGTERM."""
        self.register_nodes()
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        threading.Thread(target=self._watch_loop, name="pod-watch", daemon=True).start()
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
        while not self.stopping.is_set():
            try:
                kind, obj = self.events.get(timeout=0.5)
                self._on_event(kind, obj)
            except queue.Empty:
                pass
            except Exception:  # noqa: BLE001 - one bad pod must not stop the node
                log.exception("handling a pod event failed")
            self._tick()
        self.shutdown()

    def _on_event(self, kind: str, obj: dict[str, Any]) -> None:
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        key = (meta.get("namespace", "default"), meta["name"])
        if spec.get("nodeName") not in self.sim_nodes or meta.get("uid") in self._gone:
            return
        pod = self.pods.get(key)
        if pod is not None and pod.uid != meta.get("uid"):
            self._kill(pod, grace=0)
            self._forget(pod)
            pod = None
        if kind == "DELETED":
            if pod is not None:
                self._kill(pod, grace=0)
                self._forget(pod)
            return
        if pod is None:
            if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                if meta.get("deletionTimestamp"):
                    self._finish_deletion(key, meta.get("uid", ""))
                return  # ran before this agent started; nothing to resume
            pod = self._admit(key, obj)
        pod.obj = obj
        if meta.get("deletionTimestamp") and pod.kill_deadline is None:
            grace = int(meta.get("deletionGracePeriodSeconds") or 0)
            log.info("pod %s/%s deleted: stopping its processes (grace %ds)", *key, grace)
            self._kill(pod, grace=grace)

    def _admit(self, key: tuple[str, str], obj: dict[str, Any]) -> _Pod:
        ip = next(
            f"{IP_PREFIX}{n}" for n in range(1, 255) if f"{IP_PREFIX}{n}" not in self._used_ips
        )
        self._used_ips.add(ip)
        directory = self.state_dir / "pods" / key[0] / key[1]
        if directory.exists():  # an earlier pod of the same name: start clean
            shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
        pod = _Pod(key=key, uid=obj["metadata"]["uid"], ip=ip, obj=obj, directory=directory)
        self.pods[key] = pod
        log.info("pod %s/%s bound to %s: address %s", *key, obj["spec"]["nodeName"], ip)
        return pod

    def _forget(self, pod: _Pod) -> None:
        self.pods.pop(pod.key, None)
        self._used_ips.discard(pod.ip)
        self._write_targets()

    # --- starting ------------------------------------------------------------

    def _cluster(self) -> podspec.Cluster:
        records = [
            podspec.PodRecord(
                namespace=p.key[0],
                name=p.key[1],
                hostname=(p.obj["spec"].get("hostname") or p.key[1]),
                subdomain=p.obj["spec"].get("subdomain") or "",
                labels=p.obj["metadata"].get("labels") or {},
                ip=p.ip,
            )
            for p in self.pods.values()
            if p.kill_deadline is None
        ]
        services = {
            (s.metadata.namespace, s.metadata.name): (s.spec.selector or {})
            for s in self.api.list_service_for_all_namespaces().items
        }
        config_maps = {
            (c.metadata.namespace, c.metadata.name): (c.data or {})
            for c in self.api.list_config_map_for_all_namespaces().items
        }

        def claim_dir(namespace: str, claim: str) -> str:
            return str(self.state_dir / "volumes" / namespace / claim)

        return podspec.Cluster(
            config_maps=config_maps,
            claim_dir=claim_dir,
            resolve=lambda name, ns: podspec.resolve(name, ns, pods=records, services=services),
        )

    def _try_start(self, pod: _Pod) -> None:
        try:
            plan = podspec.translate(
                pod.obj,
                ip=pod.ip,
                pod_dir=str(pod.directory),
                base_env=base_env(self.state_dir, pod.obj, ip=pod.ip, directory=pod.directory),
                cluster=self._cluster(),
            )
        except podspec.Unresolved as err:
            if pod.waiting != str(err):
                log.info("pod %s/%s: %s", *pod.key, err)
                pod.waiting = str(err)
            return
        except podspec.Unsupported as err:
            log.error("pod %s/%s cannot run in the sandbox: %s", *pod.key, err)
            pod.finished = True
            self._patch_status(
                pod, {"phase": "Failed", "reason": "SandboxUnsupported", "message": str(err)}
            )
            return
        for directory in plan.directories:
            pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
        for path, text in plan.files.items():
            pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(path).write_text(text)
        (pod.directory / "plan.json").write_text(
            json.dumps(
                {
                    "ip": plan.ip,
                    "paths": dict(plan.path_map),
                    "containers": [{"name": c.name, "argv": c.argv} for c in plan.containers],
                },
                indent=2,
            )
        )
        images = {
            c["name"]: c.get("image", "")
            for c in (pod.obj["spec"].get("initContainers") or []) + pod.obj["spec"]["containers"]
        }
        pod.procs = [
            _Proc(
                spec=c,
                state=podstatus.ContainerState(
                    name=c.name, image=images.get(c.name, ""), pid=None, started_at=None
                ),
            )
            for c in plan.containers
        ]
        pod.started_at = nodes.now()
        log.info(
            "pod %s/%s starting %d container process(es) at %s (image not pulled: local processes)",
            *pod.key,
            len(pod.procs),
            pod.ip,
        )

    def _launch(self, pod: _Pod, proc: _Proc) -> None:
        log_path = pod.directory / f"{proc.spec.name}.log"
        with open(log_path, "ab") as out:
            proc.popen = subprocess.Popen(
                list(proc.spec.argv),
                env=dict(proc.spec.env),
                cwd=proc.spec.cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        (pod.directory / f"{proc.spec.name}.pid").write_text(str(proc.popen.pid))
        proc.state = dataclasses.replace(
            proc.state, pid=proc.popen.pid, started_at=nodes.now(), exit_code=None, finished_at=None
        )

    # --- the periodic pass ---------------------------------------------------

    def _tick(self) -> None:
        for pod in list(self.pods.values()):
            try:
                self._advance(pod)
            except Exception:  # noqa: BLE001
                log.exception("pod %s/%s: update failed", *pod.key)

    def _advance(self, pod: _Pod) -> None:
        if pod.kill_deadline is not None:
            self._advance_kill(pod)
            return
        if pod.finished:
            return
        if not pod.procs:
            self._try_start(pod)
            if not pod.procs:
                return
        restart = pod.obj["spec"].get("restartPolicy", "Always")
        init = [p for p in pod.procs if p.spec.init]
        main = [p for p in pod.procs if not p.spec.init]
        for proc in pod.procs:
            if (
                proc.popen is not None
                and proc.state.exit_code is None
                and proc.popen.poll() is not None
            ):
                code = podstatus.exit_code(proc.popen.returncode)
                proc.state = dataclasses.replace(
                    proc.state,
                    exit_code=code,
                    finished_at=nodes.now(),
                    message=_termination_message(proc.spec.termination_log),
                )
                log.info("pod %s/%s container %s exited with %d", *pod.key, proc.spec.name, code)
        next_init = next((p for p in init if p.state.exit_code != 0), None)
        if next_init is not None:
            if next_init.popen is None or (
                next_init.state.exit_code not in (None, 0) and restart != "Never"
            ):
                self._launch(pod, next_init)
            elif next_init.state.exit_code not in (None, 0):
                pod.finished = True
        else:
            for proc in main:
                if proc.popen is None:
                    self._launch(pod, proc)
                elif proc.state.exit_code is not None and (
                    restart == "Always" or (restart == "OnFailure" and proc.state.exit_code)
                ):
                    count = proc.state.restart_count + 1
                    self._launch(pod, proc)
                    proc.state = dataclasses.replace(proc.state, restart_count=count)
        status = podstatus.build_status(
            ip=pod.ip,
            started_at=pod.started_at,
            now=nodes.now(),
            init_done=next_init is None,
            init=[p.state for p in init],
            containers=[p.state for p in main],
            restart_policy=restart,
        )
        if status["phase"] in ("Succeeded", "Failed") or (next_init is not None and pod.finished):
            pod.finished = True
            if next_init is not None:
                status["phase"] = "Failed"
        self._report(pod, status)

    def _report(self, pod: _Pod, status: dict[str, Any]) -> None:
        fingerprint = json.dumps(
            [
                status["phase"],
                [c["state"] for c in status["containerStatuses"]],
                [c["status"] for c in status["conditions"]],
            ],
            sort_keys=True,
        )
        if fingerprint == pod.reported:
            return
        self._patch_status(pod, status)
        pod.reported = fingerprint
        self._write_targets()

    def _patch_status(self, pod: _Pod, status: dict[str, Any]) -> None:
        try:
            self.api.patch_namespaced_pod_status(
                pod.key[1], pod.key[0], {"metadata": {"uid": pod.uid}, "status": status}
            )
        except ApiException as err:
            if err.status not in (404, 409):
                raise

    # --- stopping ------------------------------------------------------------

    def _kill(self, pod: _Pod, *, grace: int) -> None:
        """SIGTERM (or SIGKILL for grace 0) to every container's process tree; _advance_kill finishes."""
        for proc in pod.procs:
            if proc.popen is not None and proc.popen.poll() is None:
                procs.kill_tree(proc.popen.pid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        pod.kill_deadline = time.monotonic() + grace

    def _advance_kill(self, pod: _Pod) -> None:
        alive = [p for p in pod.procs if p.popen is not None and p.popen.poll() is None]
        if alive and time.monotonic() < (pod.kill_deadline or 0):
            return
        for proc in alive:
            procs.kill_tree(proc.popen.pid)  # type: ignore[union-attr]
            proc.popen.wait(timeout=10)  # type: ignore[union-attr]
        for proc in pod.procs:  # stragglers: the group, and workers re-parented away from torchrun
            if proc.popen is not None:
                _signal_group(proc.popen.pid, signal.SIGKILL)
        procs.signal_all(self._orphans(pod), signal.SIGKILL)
        if pod.obj["metadata"].get("deletionTimestamp"):
            self._finish_deletion(pod.key, pod.uid)
        self._gone.add(pod.uid)
        self._forget(pod)

    def _finish_deletion(self, key: tuple[str, str], uid: str) -> None:
        """What the kubelet does last: delete the pod with grace 0 once its containers are gone."""
        try:
            self.api.delete_namespaced_pod(
                key[1],
                key[0],
                grace_period_seconds=0,
                body=kubernetes.client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=kubernetes.client.V1Preconditions(uid=uid)
                ),
            )
        except ApiException as err:
            if err.status not in (404, 409):
                raise

    def _orphans(self, pod: _Pod) -> list[int]:
        """Processes of this pod still alive (found by their pod address in the environment)."""
        needle = f"{POD_IP_ENV}={pod.ip}".encode()
        found = []
        for pid in procs.marked(str(self.state_dir)):
            try:
                if needle in pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    found.append(pid)
            except OSError:
                continue
        return found

    def shutdown(self) -> None:
        """Kill every pod's processes (the sandbox is going down)."""
        for pod in list(self.pods.values()):
            for proc in pod.procs:
                if proc.popen is not None:
                    procs.kill_tree(proc.popen.pid)
                    _signal_group(proc.popen.pid, signal.SIGKILL)
                    try:
                        proc.popen.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        log.error("process %d did not exit", proc.popen.pid)
        left = procs.marked(str(self.state_dir))
        procs.signal_all(left, signal.SIGKILL)
        log.info(
            "node agent stopped; no pod process left%s",
            f" (killed stragglers {left})" if left else "",
        )

    def _write_targets(self) -> None:
        groups = []
        for pod in self.pods.values():
            if pod.procs and any(p.state.running for p in pod.procs):
                labels = {
                    "sandbox_node": pod.obj["spec"]["nodeName"],
                    "sandbox_pod": pod.key[1],
                    "sandbox_namespace": pod.key[0],
                }
                groups.append((pod.ip, podstatus.metrics_targets(pod.obj, pod.ip), labels))
        self.targets_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(podstatus.file_sd(groups), indent=2))
        tmp.replace(self.targets_file)


def base_env(
    state_dir: pathlib.Path, pod: dict[str, Any], *, ip: str, directory: pathlib.Path
) -> dict[str, str]:
    """The environment every container of ``pod`` starts from (its own ``env`` is applied on top)."""
    spec = pod.get("spec") or {}
    return {
        "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(directory),
        "TMPDIR": str(directory),
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "HOSTNAME": spec.get("hostname") or (pod.get("metadata") or {}).get("name", ""),
        # The pod's own address.  Pods share this machine's network, so the trainer's exporters bind it
        # instead of 0.0.0.0: every pod keeps ports 9400.. as in its own network namespace.
        METRICS_HOST_ENV: ip,
        POD_IP_ENV: ip,
        # gloo finds its address through the loopback interface, not the (unresolvable) pod hostname.
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "MESHTRAIN_SANDBOX": "1",
        # Step log and per-rank traces of the whole job in one place (for `meshtrain timeline`);
        # the pod's own env wins if it sets one.
        "MESHTRAIN_LOG_DIR": str(run_dir(state_dir, pod)),
        # Marks every pod process so `down` finds stragglers (torchrun's workers run in their own sessions).
        procs.MARKER_ENV: str(state_dir),
    }


def run_dir(state_dir: pathlib.Path, pod: dict[str, Any]) -> pathlib.Path:
    """``<state>/runs/<ns>/<job>``: where a job's ranks write their step log and traces."""
    meta = pod.get("metadata") or {}
    job = (meta.get("labels") or {}).get("meshtrain.io/job") or meta.get("name", "pod")
    return state_dir / "runs" / meta.get("namespace", "default") / job


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _termination_message(path: str) -> str:
    """A container's termination message: the tail of its termination-log file, as the kubelet reports it."""
    if not path:
        return ""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - podstatus.TERMINATION_MESSAGE_LIMIT))
            return handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    """``python -m meshtrain.sandbox.nodeagent --kubeconfig K --state-dir D``."""
    parser = argparse.ArgumentParser(
        prog="meshtrain-sandbox-nodeagent", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--state-dir", required=True, type=pathlib.Path)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--leaves", type=int, default=2)
    parser.add_argument("--nodes-per-leaf", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=4)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s nodeagent %(levelname)s %(message)s"
    )
    sim = nodes.topology(
        blocks=args.blocks, leaves=args.leaves, nodes_per_leaf=args.nodes_per_leaf, gpus=args.gpus
    )
    NodeAgent(kubeconfig=args.kubeconfig, state_dir=args.state_dir, sim_nodes=sim).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
