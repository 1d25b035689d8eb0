"""A real, local Kubernetes control plane on loopback (the envtest pattern): :class:`ControlPlane`.

etcd and kube-apiserver, optionally kube-scheduler and kube-controller-manager, as child processes
for the pytest fixtures and the sandbox (docs/controlplane.md).  Pods are stored and (with the
scheduler) bound, never run: the sandbox's kubelet runs them.  Credentials are throw-away and etcd
runs without fsync: nothing here is for production.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, TypeVar

from meshtrain.sandbox.controlplane import binaries as binaries_mod
from meshtrain.sandbox.controlplane import kubeconfig, ports, rest

if TYPE_CHECKING:  # cryptography (the sandbox extra): imported when the control plane starts
    from meshtrain.sandbox.controlplane import pki

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: How often a component may fail to bind a port that was free when picked.
_PORT_ATTEMPTS = 4
#: Cluster IP range handed to the apiserver and controller-manager.
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
#: Issuer of service-account tokens (and their default audience).
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"


class StartupError(RuntimeError):
    """A component did not become ready; the message ends with its log tail."""


@dataclasses.dataclass
class _Component:
    """One running child process."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: pathlib.Path
    log_file: IO[bytes]


class ControlPlane:
    """etcd and kube-apiserver (optionally scheduler and controller-manager) on loopback.

    Use as a context manager, or call :meth:`start` and :meth:`stop`::

        with ControlPlane(with_scheduler=True) as cp:
            subprocess.run([cp.binaries.kubectl, "--kubeconfig", cp.kubeconfig_path, "get", "ns"])
    """

    def __init__(
        self,
        *,
        binaries: binaries_mod.Binaries | None = None,
        with_scheduler: bool = False,
        with_controller_manager: bool = False,
        data_root: pathlib.Path | None = None,
        keep_data_dir: bool = False,
        startup_timeout: float = 60.0,
        extra_apiserver_args: Sequence[str] = (),
        extra_scheduler_args: Sequence[str] = (),
        bind_address: str = "127.0.0.1",
        extra_controller_manager_args: Sequence[str] = (),
    ) -> None:
        """Configure; nothing starts before :meth:`start`.

        ``binaries``: where the executables are (default: :func:`binaries.locate`).
        ``with_scheduler`` / ``with_controller_manager``: start these too.
        Without the controller-manager nobody creates ``default`` ServiceAccounts,
        so the ``ServiceAccount`` admission plugin is disabled in that case.
        ``data_root``: parent of the temporary data directory (default: system temp).
        ``keep_data_dir``: leave the data directory (logs, etcd) after :meth:`stop`.
        ``startup_timeout``: seconds each component gets to become ready.
        ``extra_apiserver_args``: appended to kube-apiserver's command line.
        ``extra_scheduler_args``: appended to kube-scheduler's (e.g. ``--feature-gates``).
        ``extra_controller_manager_args``: appended to kube-controller-manager's (e.g.
        ``--controllers=job-controller`` beside simulated nodes no lifecycle may evict).
        ``bind_address``: where kube-apiserver listens and what it advertises to
        pods (the sandbox's node needs an address its pods can route to).
        """
        self._binaries = binaries
        self._with_scheduler = with_scheduler
        self._with_controller_manager = with_controller_manager
        self._data_root = data_root
        self._keep_data_dir = keep_data_dir
        self._startup_timeout = startup_timeout
        self._extra_apiserver_args = tuple(extra_apiserver_args)
        self._extra_scheduler_args = tuple(extra_scheduler_args)
        self._extra_controller_manager_args = tuple(extra_controller_manager_args)
        self._bind_address = bind_address
        self._components: list[_Component] = []
        self._data_dir: pathlib.Path | None = None
        self._pki: pki.Pki | None = None
        self._server: str | None = None
        self._etcd_url: str | None = None
        self._kubeconfig_path: pathlib.Path | None = None
        self.startup_seconds: float | None = None
        """Wall time the last :meth:`start` took, once it has succeeded."""

    # --- lifecycle ---------------------------------------------------------------

    def start(self) -> ControlPlane:
        """Start every component and wait until each is ready. Returns ``self``."""
        if self._components:
            return self
        started = time.monotonic()
        if self._binaries is None:
            self._binaries = binaries_mod.locate()
        self._data_dir = pathlib.Path(tempfile.mkdtemp(prefix="meshtrain-cp-", dir=self._data_root))
        (self._data_dir / "logs").mkdir()
        atexit.register(self.stop)
        from meshtrain.sandbox.controlplane import pki  # noqa: PLC0415 - cryptography, when it starts

        try:
            self._pki = pki.generate(
                self._data_dir / "pki",
                extra_ips=(self._bind_address,) if self._bind_address != "127.0.0.1" else (),
            )
            self._start_component("etcd", self._launch_etcd)
            self._start_component("kube-apiserver", self._launch_apiserver)
            self._kubeconfig_path = self._write_component_kubeconfig("admin", self._pki.admin)
            if self._with_scheduler:
                self._start_component("kube-scheduler", self._launch_scheduler)
            if self._with_controller_manager:
                self._start_component("kube-controller-manager", self._launch_controller_manager)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        logger.info(
            "control plane ready in %.1fs at %s",
            self.startup_seconds,
            self._server,
            extra={
                "server": self._server,
                "data_dir": str(self._data_dir),
                "components": [c.name for c in self._components],
            },
        )
        return self

    def stop(self) -> None:
        """Kill every component's process group and remove the data directory.

        Safe to call any number of times, and after a failed :meth:`start`; it
        also runs at exit.
        """
        for component in reversed(self._components):
            _kill_group(component.process)
            component.log_file.close()
            logger.debug("stopped %s", component.name, extra={"component": component.name})
        self._components.clear()
        if self._data_dir is not None and not self._keep_data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)
        self._data_dir = None
        atexit.unregister(self.stop)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- what callers use --------------------------------------------------------

    @property
    def binaries(self) -> binaries_mod.Binaries:
        """The executables in use (also kubectl and helm for callers)."""
        if self._binaries is None:
            self._binaries = binaries_mod.locate()
        return self._binaries

    @property
    def server(self) -> str:
        """The apiserver's URL, e.g. ``https://127.0.0.1:40123``."""
        return _required(self._server, "server")

    @property
    def kubeconfig_path(self) -> pathlib.Path:
        """An admin (``system:masters``) kubeconfig."""
        return _required(self._kubeconfig_path, "kubeconfig_path")

    @property
    def data_dir(self) -> pathlib.Path:
        """Temporary directory with etcd data, certificates, kubeconfigs and ``logs/``."""
        return _required(self._data_dir, "data_dir")

    @property
    def ca_file(self) -> pathlib.Path:
        """The CA that signed the serving and client certificates."""
        return _required(self._pki, "ca_file").ca.cert

    @property
    def etcd_url(self) -> str:
        """etcd's client URL."""
        return _required(self._etcd_url, "etcd_url")

    def pids(self) -> dict[str, int]:
        """Process id (= process group id) of each running component."""
        return {c.name: c.process.pid for c in self._components}

    def log_path(self, component: str) -> pathlib.Path:
        """Where ``component`` (e.g. ``kube-apiserver``) logs."""
        return self.data_dir / "logs" / f"{component}.log"

    def admin_client(self) -> rest.Client:
        """A minimal REST client authenticated as the admin."""
        admin = _required(self._pki, "admin_client").admin
        return rest.Client(server=self.server, ca_file=self.ca_file, cert=(admin.cert, admin.key))

    def restricted_kubeconfig(
        self,
        *,
        namespace: str,
        name: str,
        rules: Sequence[Mapping[str, Any]],
        token_seconds: int = 3600,
    ) -> pathlib.Path:
        """A kubeconfig for ServiceAccount ``namespace/name`` allowed only ``rules``.

        Creates the namespace (if missing), the ServiceAccount, a Role ``name``
        with ``rules`` (RBAC PolicyRule dicts: ``apiGroups``, ``resources``,
        ``verbs``, ...) and a RoleBinding, then asks the TokenRequest API for a
        token valid ``token_seconds``.
        """
        client = self.admin_client()
        client.create(
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        )
        meta = {"name": name, "namespace": namespace}
        client.create(
            f"/api/v1/namespaces/{namespace}/serviceaccounts",
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        )
        rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
        role = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [dict(rule) for rule in rules],
        }
        try:
            client.request("PUT", f"{rbac}/roles/{name}", role)
        except rest.ApiError as error:
            if error.status != 404:
                raise
            client.create(f"{rbac}/roles", role)
        client.create(
            f"{rbac}/rolebindings",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": meta,
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
            },
        )
        answer = client.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": token_seconds},
            },
        )
        token = answer.body["status"]["token"]
        config = kubeconfig.build(
            server=self.server,
            ca_file=self.ca_file,
            user=f"{namespace}-{name}",
            token=token,
            namespace=namespace,
        )
        return kubeconfig.write(
            self.data_dir / "kubeconfigs" / f"{namespace}-{name}.kubeconfig", config
        )

    # --- components ----------------------------------------------------------------

    def _start_component(
        self, name: str, launch: Callable[[], tuple[list[str], Callable[[], bool]]]
    ) -> None:
        """Launch ``name`` until it is ready, retrying with fresh ports if a bind fails."""
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            command, ready = launch()
            component = self._spawn(name, command)
            started = time.monotonic()
            outcome = self._wait_ready(component, ready)
            if outcome == "ready":
                logger.info(
                    "%s ready in %.1fs",
                    name,
                    time.monotonic() - started,
                    extra={"component": name, "pid": component.process.pid},
                )
                return
            tail = _tail(component.log_path)
            self._components.remove(component)
            _kill_group(component.process)
            component.log_file.close()
            if outcome == "exited" and ports.bind_failed(tail) and attempt < _PORT_ATTEMPTS:
                logger.warning(
                    "%s could not bind its port; retrying with new ports",
                    name,
                    extra={"component": name, "attempt": attempt},
                )
                component.log_path.rename(component.log_path.with_suffix(f".attempt{attempt}.log"))
                continue
            reason = (
                "exited"
                if outcome == "exited"
                else f"was not ready after {self._startup_timeout:.0f}s"
            )
            raise StartupError(
                f"{name} {reason}; last lines of its log ({component.log_path.name}):\n{tail}"
            )

    def _spawn(self, name: str, command: list[str]) -> _Component:
        log_path = self.data_dir / "logs" / f"{name}.log"
        log_file = log_path.open("ab")
        logger.debug("starting %s", name, extra={"component": name, "command": command})
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=self.data_dir,
            start_new_session=True,  # own process group: stop() kills it whole
        )
        component = _Component(name=name, process=process, log_path=log_path, log_file=log_file)
        self._components.append(component)
        return component

    def _wait_ready(self, component: _Component, ready: Callable[[], bool]) -> str:
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if component.process.poll() is not None:
                return "exited"
            try:
                if ready():
                    return "ready"
            except (OSError, rest.ApiError):
                pass  # not listening yet, or not ready yet
            time.sleep(0.1)
        return "timeout"

    def _launch_etcd(self) -> tuple[list[str], Callable[[], bool]]:
        client_port, peer_port = ports.pick_free_port(), ports.pick_free_port()
        self._etcd_url = f"http://127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        command = [
            str(self.binaries.etcd),
            "--name=default",
            f"--data-dir={self.data_dir / 'etcd'}",
            f"--listen-client-urls={self._etcd_url}",
            f"--advertise-client-urls={self._etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
            "--unsafe-no-fsync",  # throw-away data: durability costs startup and test time
            "--log-level=warn",
        ]
        client = rest.Client(server=self._etcd_url, ca_file=None)

        def ready() -> bool:
            body = client.request("GET", "/health", timeout=2).body
            return isinstance(body, dict) and body.get("health") == "true"

        return command, ready

    def _launch_apiserver(self) -> tuple[list[str], Callable[[], bool]]:
        material = _required(self._pki, "pki")
        port = ports.pick_free_port()
        self._server = f"https://{self._bind_address}:{port}"
        disabled = [] if self._with_controller_manager else ["ServiceAccount"]
        command = [
            str(self.binaries.kube_apiserver),
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={self._bind_address}",
            f"--advertise-address={self._bind_address}",
            f"--secure-port={port}",
            f"--cert-dir={self.data_dir / 'apiserver-certs'}",
            # kubectl logs/exec: the apiserver calls kubelets as a system:masters client.
            f"--kubelet-client-certificate={material.admin.cert}",
            f"--kubelet-client-key={material.admin.key}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--tls-cert-file={material.serving.cert}",
            f"--tls-private-key-file={material.serving.key}",
            f"--client-ca-file={material.ca.cert}",
            f"--service-account-key-file={material.service_account_pub}",
            f"--service-account-signing-key-file={material.service_account_key}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",
            "--profiling=false",
            # API priority and fairness only matters under contention from many
            # clients; its bootstrap costs ~20% of startup on 2 cores.
            "--enable-priority-and-fairness=false",
            *([f"--disable-admission-plugins={','.join(disabled)}"] if disabled else []),
            *self._extra_apiserver_args,
        ]

        def ready() -> bool:
            return self.admin_client().request("GET", "/readyz", timeout=2).status == 200

        return command, ready

    def _launch_scheduler(self) -> tuple[list[str], Callable[[], bool]]:
        config = self._write_component_kubeconfig(
            "kube-scheduler", _required(self._pki, "pki").scheduler
        )
        port = ports.pick_free_port()
        command = [
            str(self.binaries.kube_scheduler),
            *_component_auth_args(config),
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.data_dir / 'scheduler-certs'}",
            *self._extra_scheduler_args,
        ]
        return command, _healthz(port)

    def _launch_controller_manager(self) -> tuple[list[str], Callable[[], bool]]:
        material = _required(self._pki, "pki")
        config = self._write_component_kubeconfig(
            "kube-controller-manager", material.controller_manager
        )
        port = ports.pick_free_port()
        command = [
            str(self.binaries.kube_controller_manager),
            *_component_auth_args(config),
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.data_dir / 'controller-manager-certs'}",
            f"--service-account-private-key-file={material.service_account_key}",
            f"--root-ca-file={material.ca.cert}",
            "--use-service-account-credentials=true",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            f"--cluster-signing-cert-file={material.ca.cert}",
            f"--cluster-signing-key-file={material.ca.key}",
            *self._extra_controller_manager_args,
        ]
        return command, _healthz(port)

    def _write_component_kubeconfig(self, user: str, pair: pki.CertPair) -> pathlib.Path:
        config = kubeconfig.build(
            server=self.server, ca_file=self.ca_file, user=user, cert=(pair.cert, pair.key)
        )
        return kubeconfig.write(self.data_dir / "kubeconfigs" / f"{user}.kubeconfig", config)


def _component_auth_args(config: pathlib.Path) -> list[str]:
    return [
        f"--kubeconfig={config}",
        f"--authentication-kubeconfig={config}",
        f"--authorization-kubeconfig={config}",
    ]


def _healthz(port: int) -> Callable[[], bool]:
    """Readiness of a scheduler/controller-manager: its own /healthz (self-signed cert)."""
    client = rest.Client(server=f"https://127.0.0.1:{port}", ca_file=None)
    return lambda: client.request("GET", "/healthz", timeout=2).status == 200


def _kill_group(process: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace`` seconds, reap the leader."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        if not _group_alive(process.pid):
            break
    process.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _tail(path: pathlib.Path, lines: int = 40) -> str:
    try:
        with path.open(errors="replace") as handle:
            return "".join(collections.deque(handle, maxlen=lines))
    except OSError:
        return "(no log)"


def _required(value: _T | None, what: str) -> _T:
    if value is None:
        raise RuntimeError(f"ControlPlane.{what} is only available after start()")
    return value
