"""Kueue's controller manager on a local control plane, as a cluster runs it: :class:`Kueue`.

It installs the CRDs the bootstrap copied from the pinned release, serves Kueue's webhooks on
loopback with a certificate of the control plane's CA (Kueue's own rotation needs a Service and a
Secret, which a control plane without nodes cannot serve), and registers the job kinds it is given
as external frameworks, whose controllers create their own Workloads, and turns on the Kueue job
integrations it is asked for (e.g. ``batch/job``) with their webhooks (docs/controlplane.md).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from meshtrain.sandbox.controlplane import binaries, ports, server

#: The Kueue release the project pins; must equal the default in scripts/bootstrap.sh.
DEFAULT_KUEUE_VERSION = "v0.17.0"
KUEUE_VERSION = os.environ.get("MESHTRAIN_KUEUE_VERSION", DEFAULT_KUEUE_VERSION)
NAMESPACE = "kueue-system"
# Without its own certificate management Kueue reads a metrics-server certificate from this
# fixed path, even with metrics off; any valid pair will do.
METRICS_CERT_DIR = pathlib.Path("/etc/kueue/metrics/certs")
FRAMEWORK_GROUPS = {"batch/job": "batch"}
"""API group of each Kueue job integration :class:`Kueue` can turn on (its webhooks are kept)."""


@dataclasses.dataclass(frozen=True)
class Files:
    """What the bootstrap provides for one Kueue release."""

    binary: pathlib.Path
    crds: tuple[pathlib.Path, ...]
    webhooks: pathlib.Path


def locate() -> Files:
    """The pinned Kueue release's binary, CRDs and webhooks; tells how to get them when missing."""
    root = binaries.cache_root() / f"kueue-{KUEUE_VERSION}"
    binary, webhooks = root / "bin" / "kueue", root / "webhooks.yaml"
    crds = tuple(sorted((root / "crds").glob("*.yaml")))
    if not (binary.is_file() and webhooks.is_file() and crds):
        raise binaries.BinariesMissingError(
            f"Kueue {KUEUE_VERSION} is not in {root}: run `make bootstrap` (scripts/bootstrap.sh "
            "builds it from the sigs.k8s.io/kueue Go module)"
        )
    return Files(binary=binary, crds=crds, webhooks=webhooks)


def _config(
    *,
    webhook_port: int,
    health_port: int,
    cert_dir: pathlib.Path,
    external: Sequence[str],
    frameworks: Sequence[str],
) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        # Job kinds whose controllers create their own Workloads (Kind.version.group).
        "integrations": {"frameworks": list(frameworks), "externalFrameworks": list(external)},
    }


def _webhook_configurations(
    path: pathlib.Path, base_url: str, ca_bundle: str, groups_kept: frozenset[str]
) -> list[dict[str, Any]]:
    """Kueue's webhooks for ``groups_kept`` (its own kueue.x-k8s.io and its on integrations').

    The release's manifests also carry webhooks for every job framework Kueue integrates
    (pods, batch Jobs, ...); the integrations that are off have their webhooks dropped rather
    than left to refuse every pod.
    """
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for document in documents:
        kept = []
        for hook in document.get("webhooks") or []:
            groups = {g for rule in hook.get("rules") or [] for g in rule.get("apiGroups") or []}
            if not groups <= groups_kept:
                continue
            service = hook["clientConfig"].pop("service")
            hook["clientConfig"] = {"url": base_url + service["path"], "caBundle": ca_bundle}
            kept.append(hook)
        document["webhooks"] = kept
        document["metadata"] = {"name": "kueue-" + document["metadata"]["name"]}
    return documents


class Kueue:
    """Kueue's controller manager serving one control plane; a context manager."""

    def __init__(
        self,
        plane: server.ControlPlane,
        work_dir: pathlib.Path,
        external_frameworks: Sequence[str],
        config: Mapping[str, Any] | None = None,
        frameworks: Sequence[str] = (),
    ) -> None:
        unknown = sorted(set(frameworks) - FRAMEWORK_GROUPS.keys())
        if unknown:
            raise ValueError(
                f"Kueue integrations {unknown} unknown here; known: {sorted(FRAMEWORK_GROUPS)}"
            )
        self.files = locate()
        self.external_frameworks = tuple(external_frameworks)
        self.frameworks = tuple(frameworks)
        """Kueue's own job integrations turned on (keys of :data:`FRAMEWORK_GROUPS`)."""
        self.extra_config = dict(config or {})
        """Fields of Kueue's Configuration a cluster sets (e.g. waitForPodsReady)."""
        self.kubeconfig, self.kubectl = plane.kubeconfig_path, plane.binaries.kubectl
        self.pki_dir, self.work_dir = plane.data_dir / "pki", work_dir
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = work_dir / "kueue.log"

    def _kubectl(self, *args: str, stdin: str | None = None) -> str:
        result = subprocess.run(
            [str(self.kubectl), "--kubeconfig", str(self.kubeconfig), *args],
            input=stdin,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def start(self, timeout: float = 120.0) -> Kueue:
        """Install the CRDs, start the manager, register its webhooks; returns once it admits."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for crd in self.files.crds:
            self._kubectl("apply", "--server-side", "-f", str(crd))
        self._kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        self._kubectl("apply", "-f", "-", stdin=json.dumps(namespace))
        cert_dir = self.work_dir / "certs"
        cert_dir.mkdir(exist_ok=True)
        # The control plane's serving certificate is valid for 127.0.0.1 and signed by its CA.
        (cert_dir / "tls.crt").write_bytes((self.pki_dir / "apiserver.crt").read_bytes())
        (cert_dir / "tls.key").write_bytes((self.pki_dir / "apiserver.key").read_bytes())
        self._metrics_certificate(cert_dir)
        webhook_port, health_port = ports.pick_free_port(), ports.pick_free_port()
        config = self.work_dir / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                _config(
                    webhook_port=webhook_port,
                    health_port=health_port,
                    cert_dir=cert_dir,
                    external=self.external_frameworks,
                    frameworks=self.frameworks,
                )
                | self.extra_config
            )
        )
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    str(self.files.binary),
                    f"--config={config}",
                    f"--kubeconfig={self.kubeconfig}",
                    # The on-demand visibility API is an aggregated API server with its own
                    # certificates; nothing here reads pending workloads through it.
                    "--feature-gates=VisibilityOnDemand=false",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait(lambda: _ok(f"http://127.0.0.1:{health_port}/readyz"), timeout, "ready")

        ca = base64.b64encode((self.pki_dir / "ca.crt").read_bytes()).decode()
        kept = frozenset({"kueue.x-k8s.io", *(FRAMEWORK_GROUPS[f] for f in self.frameworks)})
        hooks = _webhook_configurations(
            self.files.webhooks, f"https://127.0.0.1:{webhook_port}", ca, kept
        )
        self._kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": hooks}))  # fmt: skip
        probe = {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": "kueue-webhook-probe"},
        }
        self._wait(
            lambda: _succeeds(self._kubectl, "create", "--dry-run=server", "-f", "-", stdin=json.dumps(probe)),
            timeout,
            "serving its webhooks",
        )  # fmt: skip
        return self

    @staticmethod
    def _metrics_certificate(cert_dir: pathlib.Path) -> None:
        if (METRICS_CERT_DIR / "tls.crt").is_file() and (METRICS_CERT_DIR / "tls.key").is_file():
            return
        try:
            METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
            for name in ("tls.crt", "tls.key"):
                (METRICS_CERT_DIR / name).write_bytes((cert_dir / name).read_bytes())
        except OSError as err:
            raise RuntimeError(
                f"Kueue {KUEUE_VERSION} needs a certificate pair in {METRICS_CERT_DIR} (tls.crt, "
                f"tls.key) and this user cannot write it ({err}): create it once as root"
            ) from err

    def _wait(self, check: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"kueue exited with {self.process.returncode}: {self._tail()}")
            if check():
                return
            time.sleep(0.5)
        raise RuntimeError(f"kueue not {what} after {timeout:.0f}s: {self._tail()}")

    def _tail(self) -> str:
        lines = (
            self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        )
        return "\n".join(lines[-30:])

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> Kueue:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def _succeeds(run: Any, *args: str, stdin: str | None = None) -> bool:
    try:
        run(*args, stdin=stdin)
    except RuntimeError:
        return False
    return True
