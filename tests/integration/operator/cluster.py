"""Test helpers for the operator against a real API server: fluent objects, waits, the operator process.

No API mocks: everything here talks to the control plane of the session
fixture.  Nodes are plain Node objects with GPU capacity patched into their
status (there is no kubelet); pod state changes are status patches too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import kubernetes

from meshtrain.api import crd
from meshtrain.operator import reconciler
from meshtrain.operator.cluster import children, informer, kube
from meshtrain.operator.policy import kueue_workload, naming
from meshtrain.sandbox import controlplane
from meshtrain.sandbox.controlplane import binaries
from meshtrain.sandbox.controlplane.ports import bind_failed, pick_free_port
from tests.builders import POOL_LABEL, JobBuilder

GROUP, VERSION, PLURAL = "meshtrain.io", "v1alpha1", "trainingjobs"
SIM_DRIVER = "gpu.sim.meshtrain.io"
"""The simulated DRA driver's name, and its DeviceClass's (tests publish its slices by hand)."""
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout: float = 30.0,
    interval: float = 0.1,
    explain: Callable[[], str] | None = None,
) -> Any:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after ``timeout``,
    and with what ``explain`` says then (an operator's log lines, say)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    told = f"\n{explain()}" if explain is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r}){told}")


SETTLE_CALM_SECONDS = 5.0
"""How long a chaos test's jobs must stay settled before it counts them settled."""


def settle(
    unsettled: Callable[[], list[str]], timeout: float, calm: float = SETTLE_CALM_SECONDS
) -> list[str]:
    """Poll ``unsettled`` until it has stayed empty for ``calm`` seconds, or ``timeout`` passes;
    what it said last.  One empty answer is not enough: a fault's late effect (capacity freed by a
    deleted job, say) can still move a job that looked settled, between two reads."""
    deadline = time.monotonic() + timeout
    calm_since: float | None = None
    while True:
        left = unsettled()
        now = time.monotonic()
        if left:
            calm_since = None
        elif calm_since is None:
            calm_since = now
        elif now - calm_since >= calm:
            return left
        if now >= deadline:
            return left
        time.sleep(0.5)


def log_lines(path: str, *needles: str, last: int = 60) -> str:
    """The last ``last`` lines of the log at ``path`` that hold any of ``needles``."""
    try:
        with open(path, encoding="utf-8", errors="replace") as log:
            found = [line.rstrip() for line in log if any(n in line for n in needles)]
    except OSError as err:
        return f"{path}: {err}"
    return f"{path}, last lines of {needles}:\n" + "\n".join(found[-last:])


class Cluster:
    """Typed access to the control plane for tests (kubernetes client, admin credentials)."""

    @classmethod
    @contextlib.contextmanager
    def private(
        cls, found: binaries.Binaries, *, gang_api: bool = False, controller_manager: bool = False
    ) -> Iterator[Cluster]:
        """A control plane of the caller's own (apiserver, etcd, scheduler), CRDs installed.

        ``gang_api``: the native gang API on (``GenericWorkload``, ``GangScheduling``,
        scheduling.k8s.io/v1alpha2 served).  ``controller_manager``: kube-controller-manager
        runs too (garbage collection, ResourceClaims from templates, ServiceAccounts).
        """
        gates = "--feature-gates=GenericWorkload=true,GangScheduling=true"
        options: dict[str, Any] = (
            {
                "extra_apiserver_args": [gates, "--runtime-config=scheduling.k8s.io/v1alpha2=true"],
                "extra_scheduler_args": [gates],
            }
            if gang_api
            else {}
        )
        with controlplane.ControlPlane(
            binaries=found,
            with_scheduler=True,
            with_controller_manager=controller_manager,
            **options,
        ) as plane:
            api = kubernetes.config.new_client_from_config(config_file=str(plane.kubeconfig_path))
            try:
                cluster = cls(api, str(plane.kubeconfig_path), str(found.kubectl))
                cluster.install_crds()
                yield cluster
            finally:
                api.close()

    def __init__(self, api: kubernetes.client.ApiClient, kubeconfig: str, kubectl: str) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.extensions = kubernetes.client.ApiextensionsV1Api(api)
        self.kubeconfig = kubeconfig
        self.kubectl_path = kubectl

    # CRDs
    def install_crds(self) -> None:
        documents = [crd.build()]
        for document in documents:
            try:
                self.extensions.create_custom_resource_definition(document)
            except kubernetes.client.ApiException as err:
                if err.status != 409:
                    raise
        for document in documents:
            name = document["metadata"]["name"]
            wait_for(
                f"CRD {name} established",
                lambda n=name: any(
                    c.type == "Established" and c.status == "True"
                    for c in (
                        self.extensions.read_custom_resource_definition(n).status.conditions or []
                    )
                ),
            )
        # discovery of the new group may lag a moment behind Established
        wait_for(
            "trainingjobs served", lambda: self.kubectl("get", "trainingjobs", "-A").returncode == 0
        )
        # and kubectl explain reads the OpenAPI v3 document, which the server republishes later still
        wait_for(
            "trainingjobs in the OpenAPI schema",
            lambda: self.kubectl("explain", "trainingjobs").returncode == 0,
        )

    def kubectl(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.kubectl_path, "--kubeconfig", self.kubeconfig, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )

    # Nodes
    def add_node(
        self,
        pool: str,
        gpus: int = 8,
        labels: dict[str, str] | None = None,
        name: str | None = None,
        taints: list[dict[str, str]] | None = None,
    ) -> str:
        """A Ready node of ``pool`` with ``gpus`` GPUs (and plenty of cpu, memory and pod slots)."""
        name = name or f"{pool}-{uuid.uuid4().hex[:6]}"
        body = {
            "metadata": {
                "name": name,
                "labels": {
                    POOL_LABEL: pool,
                    "kubernetes.io/hostname": name,
                    **(labels or {}),
                },
            }
        }
        self.core.create_node(body)
        # What the node lifecycle controller does once the kubelet reports Ready (neither runs
        # here): drop the not-ready taint the TaintNodesByCondition admission plugin adds.
        self.core.patch_node(name, {"spec": {"taints": taints or []}})
        self.core.patch_node_status(
            name,
            {
                "status": {
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "reason": "KubeletReady",
                            "message": "simulated node",
                        }
                    ],
                    "capacity": {
                        "nvidia.com/gpu": str(gpus),
                        "cpu": "64",
                        "memory": "512Gi",
                        "pods": "110",
                    },
                    "allocatable": {
                        "nvidia.com/gpu": str(gpus),
                        "cpu": "64",
                        "memory": "512Gi",
                        "pods": "110",
                    },
                }
            },
        )
        return name

    def delete_nodes(self, pool: str) -> None:
        for node in self.core.list_node(label_selector=f"{POOL_LABEL}={pool}").items:
            self.core.delete_node(node.metadata.name)
        resource = kubernetes.client.ResourceV1Api(self.core.api_client)
        resource.delete_collection_resource_slice(label_selector=f"{POOL_LABEL}={pool}")

    def publish_gpus(self, node: str, count: int, pool: str) -> None:
        """A ResourceSlice of ``count`` simulated H200s (141Gi, one PCIe root and NVLink clique) on
        ``node``, as the simulated DRA driver publishes them (no driver runs), and its DeviceClass."""
        resource = kubernetes.client.ResourceV1Api(self.core.api_client)
        selector = {"cel": {"expression": f'device.driver == "{SIM_DRIVER}"'}}
        try:
            resource.create_device_class(
                {"metadata": {"name": SIM_DRIVER}, "spec": {"selectors": [selector]}}
            )
        except kubernetes.client.ApiException as err:
            if err.status != 409:
                raise
        attributes = {
            "productName": {"string": "NVIDIA H200"},
            "cliqueId": {"string": f"{pool}.0"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
        }
        memory = {"memory": {"value": "141Gi"}}
        devices = [
            {"name": f"gpu-{i}", "attributes": attributes, "capacity": memory} for i in range(count)
        ]
        spec = {
            "driver": SIM_DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        }
        metadata = {"name": f"{node}-gpus", "labels": {POOL_LABEL: pool}}
        resource.create_resource_slice({"metadata": metadata, "spec": spec})

    # Jobs
    def apply(self, job: JobBuilder) -> dict[str, Any]:
        body = job.manifest()
        return self.custom.create_namespaced_custom_object(
            GROUP, VERSION, body["metadata"]["namespace"], PLURAL, body
        )

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except kubernetes.client.ApiException as err:
            if err.status == 404:
                return None
            raise

    KUEUE_CLUSTER_SCOPED = {
        "Topology": "topologies",
        "ResourceFlavor": "resourceflavors",
        "ClusterQueue": "clusterqueues",
        "WorkloadPriorityClass": "workloadpriorityclasses",
    }
    """Kueue's cluster-scoped kinds and their plurals (the rest are namespaced)."""

    def create_kueue_object(self, body: dict[str, Any], namespace: str) -> None:
        """Create a Kueue object (kueue.x-k8s.io/v1beta2): cluster-scoped, else a LocalQueue in
        ``namespace``."""
        body = {"apiVersion": kueue_workload.API_VERSION, **body}
        plural = self.KUEUE_CLUSTER_SCOPED.get(body["kind"])
        group, version = kueue_workload.GROUP, kueue_workload.VERSION
        if plural is not None:
            self.custom.create_cluster_custom_object(group, version, plural, body)
        else:
            self.custom.create_namespaced_custom_object(
                group, version, namespace, "localqueues", body
            )

    def workload(self, namespace: str, job: str) -> dict[str, Any] | None:
        """The Kueue Workload of ``job`` (``trainingjob-<job>``), or None."""
        try:
            return self.custom.get_namespaced_custom_object(
                kueue_workload.GROUP,
                kueue_workload.VERSION,
                namespace,
                kueue_workload.PLURAL,
                kueue_workload.workload_name(job),
            )
        except kubernetes.client.ApiException as err:
            if err.status == 404:
                return None
            raise

    def patch_job(self, namespace: str, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, {"spec": spec}
        )

    def delete_job(self, namespace: str, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        return (self.job(namespace, name) or {}).get("status") or {}

    def condition(self, namespace: str, name: str, type_: str) -> dict[str, Any]:
        return next(
            (c for c in self.status(namespace, name).get("conditions") or [] if c["type"] == type_),
            {},
        )

    def wait_reason(
        self, namespace: str, name: str, type_: str, reason: str, timeout: float = 30
    ) -> dict[str, Any]:
        """The job's condition ``type_`` once its reason is ``reason``."""
        return wait_for(
            f"{namespace}/{name} {type_} with reason {reason}",
            lambda: (c := self.condition(namespace, name, type_)).get("reason") == reason and c,
            timeout,
        )

    def events(self, namespace: str, name: str, reason: str) -> list[Any]:
        """The Events of ``reason`` about object ``name``, once there is one."""
        return wait_for(
            f"a {reason} Event of {namespace}/{name}",
            lambda: [
                e
                for e in self.core.list_namespaced_event(namespace).items
                if e.reason == reason and e.involved_object.name == name
            ],
        )

    def wait_phase(
        self, namespace: str, name: str, phase: str, timeout: float = 30
    ) -> dict[str, Any]:
        return wait_for(
            f"{namespace}/{name} phase {phase}",
            lambda: (s := self.status(namespace, name)).get("phase") == phase and s,
            timeout,
        )

    # Pods
    def pods(self, namespace: str, job: str | None = None) -> list[Any]:
        selector = f"meshtrain.io/job={job}" if job else "meshtrain.io/job"
        return sorted(
            self.core.list_namespaced_pod(namespace, label_selector=selector).items,
            key=lambda p: p.metadata.name,
        )

    def wait_gang(
        self, namespace: str, job: str, count: int, timeout: float = 30, attempt: int = 0
    ) -> list[Any]:
        """Wait until ``count`` pods of ``attempt`` exist, none gated, none older left; returns them.

        A spare node's placeholder pod and the rendezvous store's pod carry the job's label too
        but are no members of the gang (no node rank): they may appear before or after the gang
        is ungated, so they are never counted.
        """

        def ready() -> list[Any] | None:
            pods = [
                p
                for p in self.pods(namespace, job)
                if naming.LABEL_NODE_RANK in (p.metadata.labels or {})
            ]
            if len(pods) != count or any(
                p.metadata.labels["meshtrain.io/attempt"] != str(attempt) for p in pods
            ):
                return None
            return pods if all(not p.spec.scheduling_gates for p in pods) else None

        return wait_for(f"gang of {count} pod(s) of {namespace}/{job} ungated", ready, timeout)

    def set_pod_phase(
        self,
        namespace: str,
        pod: str,
        phase: str,
        exit_code: int | None = None,
        ip: str | None = None,
        message: str | None = None,
    ) -> None:
        """What a kubelet would report: phase, container state (with a termination ``message``), pod IP."""
        if phase == "Running":
            state: dict[str, Any] = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
        elif phase in ("Succeeded", "Failed"):
            state = {
                "terminated": {
                    "exitCode": exit_code
                    if exit_code is not None
                    else (0 if phase == "Succeeded" else 1),
                    "startedAt": "2026-01-01T00:00:00Z",
                    "finishedAt": "2026-01-01T00:01:00Z",
                }
            }
            if message is not None:
                state["terminated"]["message"] = message
        else:
            state = {"waiting": {"reason": "ContainerCreating"}}
        status: dict[str, Any] = {
            "phase": phase,
            "containerStatuses": [
                {
                    "name": "trainer",
                    "ready": phase == "Running",
                    "restartCount": 0,
                    "image": "trainer",
                    "imageID": "",
                    "state": state,
                }
            ],
        }
        if ip:
            status["podIP"] = ip
            status["podIPs"] = [{"ip": ip}]
        self.core.patch_namespaced_pod_status(pod, namespace, {"status": status})


class OperatorProcess:
    """``meshtrain operator`` as a subprocess with short timers; start, kill, restart."""

    def __init__(
        self,
        kubeconfig: str,
        log_path: str,
        scope: tuple[str, ...] = ("--all-namespaces",),
        lease: str = "meshtrain-operator",
        lease_seconds: int = 3,
        identity: str | None = None,
        lease_namespace: str = "default",
        env: dict[str, str] | None = None,
        resync_seconds: float = 2,
        log_format: str = "json",
    ) -> None:
        self.kubeconfig = kubeconfig
        self.log_format = log_format
        """``--log-format``: the operator's default (json), or text as the churn benchmark runs it."""
        self.resync_seconds = resync_seconds
        """Longest wait between two passes of a job (short: the tests need not wait for events)."""
        self.env = env or {}
        """Environment beside the test's (what a Deployment's ``env`` would set)."""
        self.scope = scope
        self.lease = lease
        """Lease in namespace ``lease_namespace``; replicas that share it elect one."""
        self.lease_namespace = lease_namespace
        self.log_path = log_path
        self.health_port = pick_free_port()
        self.metrics_port = pick_free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.lease_seconds = lease_seconds
        self.identity = identity or f"operator-{uuid.uuid4().hex[:6]}"
        """Lease holder name (POD_NAME): a restart keeps it, as a container restart keeps its pod name."""

    def _start_once(self) -> None:
        command = [
            sys.executable,
            "-m",
            "meshtrain.cli.main",
            "operator",
            *self.scope,
            "--kubeconfig",
            self.kubeconfig,
            "--lease",
            self.lease,
            "--lease-namespace",
            self.lease_namespace,
            "--lease-seconds",
            str(self.lease_seconds),
            "--liveness",
            f"http://127.0.0.1:{self.health_port}/healthz",
            "--metrics-port",
            str(self.metrics_port),
            "--resync-seconds",
            str(self.resync_seconds),
            "--progress-seconds",
            "0.5",
            f"--log-format={self.log_format}",
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child process
        env = {**os.environ, **self.env, "POD_NAME": self.identity}
        self.process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env
        )
        wait_for("operator liveness endpoint", self.alive, timeout=60, interval=0.2)

    def start(self, attempts: int = 5) -> None:
        """Start the operator; a port another process took since it was picked (the health or
        metrics port is only free "a moment ago") gets new ports and another try."""
        for attempt in range(attempts):
            logged = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
            try:
                self._start_once()
                return
            except AssertionError:
                with open(self.log_path, "rb") as log:
                    log.seek(logged)
                    since = log.read().decode(errors="replace")
                if attempt + 1 == attempts or not bind_failed(since):
                    raise
                self.kill()
                self.health_port, self.metrics_port = pick_free_port(), pick_free_port()

    def alive(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise AssertionError(f"operator exited; see {self.log_path}")
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.health_port}/healthz", timeout=1
            ) as response:
                return response.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2
        ) as response:
            return response.read().decode()

    def kill(self) -> None:
        """SIGKILL: no clean-up, as when a node dies under the operator."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    @contextlib.contextmanager
    def instead_of(self, session: OperatorProcess) -> Iterator[OperatorProcess]:
        """Run this operator while ``session`` is stopped (one operator at a time acts on a
        namespace); ``session`` is started again after."""
        session.stop()
        self.start()
        try:
            yield self
        finally:
            self.stop()
            session.start()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None


@contextlib.contextmanager
def operated(
    control_plane_binaries: Any,
    log_path: str,
    resync_seconds: float,
    env: dict[str, str] | None = None,
    log_format: str = "json",
) -> Iterator[tuple[Cluster, OperatorProcess]]:
    """A private control plane and an operator process on it (``resync_seconds`` between passes
    at most; ``env``: its environment beside the test's), stopped at the end."""
    with Cluster.private(control_plane_binaries) as cluster:
        operator = OperatorProcess(
            cluster.kubeconfig,
            log_path,
            env=env,
            resync_seconds=resync_seconds,
            log_format=log_format,
        )
        operator.start()
        try:
            yield cluster, operator
        finally:
            operator.stop()


def reconcile_passes(
    cluster: Cluster,
    namespace: str,
    name: str,
    passes: int = 1,
    settings: reconciler.Settings | None = None,
    stop_before_gates: bool = False,
) -> None:
    """Run ``passes`` reconcile passes of one job in this process (a reconciler with its cache;
    ``settings``: the operator's flags, default its defaults).

    ``stop_before_gates``: a pass that creates the gang ends there, as an operator that crashed
    after creating the pods (else it lifts their gates itself): the gated gang stays for the
    test to change the cluster before a later pass lifts them.
    """

    async def run() -> None:
        client = await kube.Client.connect(kubeconfig=cluster.kubeconfig)
        cache = informer.Cache(follow_devices=True)  # as the operator (handlers.py)
        follow = asyncio.create_task(cache.run(client))
        try:
            worker = reconciler.Reconciler(
                client=client, cache=cache, settings=settings or reconciler.Settings()
            )
            with contextlib.ExitStack() as stack:
                if stop_before_gates:
                    stack.enter_context(
                        mock.patch.object(reconciler.Reconciler, "_gates_in_pass", _stopped)
                    )
                for _ in range(passes):
                    await worker.reconcile(namespace=namespace, name=name)
        finally:
            follow.cancel()
            await client.close()

    asyncio.run(run())


async def _stopped(
    self: reconciler.Reconciler, body: dict[str, Any], job: Any, queue: Any
) -> tuple[dict[str, Any], Any, bool]:
    """``Reconciler._gates_in_pass`` of an operator that crashed once the gang was created."""
    return body, job, False


def ensure_children(
    cluster: Cluster, uid: str, shared: list[dict[str, Any]]
) -> children.Refused | None:
    """``children.ensure`` of these objects for the job ``uid`` (no pods), as a placement does."""

    async def run() -> children.Refused | None:
        client = await kube.Client.connect(kubeconfig=cluster.kubeconfig)
        try:
            return await children.ensure(client, uid, shared, [])
        finally:
            await client.close()

    return asyncio.run(run())


class Reconciling:
    """A reconciler of this process whose cache follows the cluster and whose memory (backoffs,
    exclusions) lasts across passes, as in the operator; :meth:`passes` runs passes of one job."""

    def __init__(self, cluster: Cluster) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.worker, self._follow = self._run(self._start(cluster.kubeconfig))

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=120)

    async def _start(self, kubeconfig: str) -> tuple[reconciler.Reconciler, asyncio.Task[None]]:
        client = await kube.Client.connect(kubeconfig=kubeconfig)
        cache = informer.Cache(follow_devices=True)  # as the operator (handlers.py)
        follow = asyncio.create_task(cache.run(client))
        worker = reconciler.Reconciler(client=client, cache=cache, settings=reconciler.Settings())
        return worker, follow

    def passes(self, namespace: str, name: str, passes: int = 1) -> reconciler.Outcome:
        async def run() -> reconciler.Outcome:
            outcome = None
            for _ in range(passes):
                outcome = await self.worker.reconcile(namespace=namespace, name=name)
            assert outcome is not None
            return outcome

        return self._run(run())

    def close(self) -> None:
        async def stop() -> None:
            self._follow.cancel()
            await self.worker.client.close()

        self._run(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
