"""Find what ``scripts/bootstrap.sh`` provides: binaries at the pinned versions, third-party CRDs.

:func:`locate` finds the control plane's binaries, :func:`locate_node` the sandbox node's,
:func:`monitoring_crds` and :func:`nvidia_compute_domain_crd` the CRD files.  Nothing is built or downloaded here: a missing binary
raises :class:`BinariesMissingError` telling the user to run ``make bootstrap``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import re
import shutil
import subprocess

logger = logging.getLogger(__name__)

#: The Kubernetes release the project pins; must equal the default in
#: scripts/bootstrap.sh (tests/unit/test_bootstrap_errors.py checks it).
DEFAULT_K8S_VERSION = "v1.36.3"
#: The helm release the project pins (same check).
DEFAULT_HELM_VERSION = "v3.22.0"
#: The Prometheus Operator release whose CRDs the chart's monitoring objects are checked against (same check).
DEFAULT_PROMETHEUS_OPERATOR_VERSION = "v0.85.0"
MONITORING_CRDS = ("podmonitors", "servicemonitors", "prometheusrules")

KUBE_NAMES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
ALL_NAMES = (*KUBE_NAMES, "etcd", "helm")


class BinariesMissingError(RuntimeError):
    """A control-plane binary is not available at the pinned version."""


@dataclasses.dataclass(frozen=True)
class Versions:
    """The versions the binaries were built at."""

    kubernetes: str
    """Kubernetes release, e.g. ``v1.36.3`` (apiserver, scheduler, controller-manager, kubectl)."""
    etcd: str
    """etcd release without the ``v``, e.g. ``3.6.8``."""
    helm: str
    """helm release, e.g. ``v3.22.0``."""


@dataclasses.dataclass(frozen=True)
class Binaries:
    """Absolute paths of the binaries a control plane and its tests run."""

    kube_apiserver: pathlib.Path
    kube_controller_manager: pathlib.Path
    """The controller manager (garbage collection, Jobs, service-account tokens, ...)."""
    kube_scheduler: pathlib.Path
    kubectl: pathlib.Path
    """The command-line client, at the same version as the server."""
    etcd: pathlib.Path
    """The storage backend, at the version the Kubernetes release recommends."""
    helm: pathlib.Path
    """helm v3, for rendering and installing the chart."""
    versions: Versions
    """What the binaries were built at."""


def k8s_version() -> str:
    """The Kubernetes release in use: ``$MESHTRAIN_K8S_VERSION`` or the pin."""
    return os.environ.get("MESHTRAIN_K8S_VERSION", DEFAULT_K8S_VERSION)


def cache_bin_dir() -> pathlib.Path:
    """The directory the bootstrap writes binaries to (same rule as the script)."""
    return cache_root() / "bin" / k8s_version()


def cache_root() -> pathlib.Path:
    return pathlib.Path(
        os.environ.get("MESHTRAIN_CACHE") or str(pathlib.Path.home() / ".cache" / "meshtrain")
    )


def module_binary(name: str, version: str, module: str) -> pathlib.Path:
    """``<cache>/<name>-<version>/bin/<name>``, a tool scripts/bootstrap.sh builds from Go ``module``.

    :class:`BinariesMissingError` says how to build it when it is not there.
    """
    binary = cache_root() / f"{name}-{version}" / "bin" / name
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise BinariesMissingError(
            f"{name} {version} is not at {binary}: run `make bootstrap` (scripts/bootstrap.sh "
            f"builds it from the {module} Go module; `--no-node` skips it)"
        )
    return binary


def monitoring_crds() -> list[pathlib.Path]:
    """The Prometheus Operator CRD files the bootstrap fetched, or :class:`BinariesMissingError`."""
    version = os.environ.get(
        "MESHTRAIN_PROMETHEUS_OPERATOR_VERSION", DEFAULT_PROMETHEUS_OPERATOR_VERSION
    )
    directory = cache_root() / "crds" / f"prometheus-operator-{version}"
    files = [directory / f"monitoring.coreos.com_{name}.yaml" for name in MONITORING_CRDS]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise BinariesMissingError(
            f"Prometheus Operator {version} CRDs missing in {directory}: {', '.join(missing)}. "
            "Run `make bootstrap` (or `scripts/bootstrap.sh`) to fetch them from the Go module proxy."
        )
    return files


#: NVIDIA's DRA driver module whose ComputeDomain CRD the operator's ComputeDomains are checked
#: against (same check as the versions above).
DEFAULT_NVIDIA_DRA_DRIVER_VERSION = "v0.0.0-20251216103315-fc69d9852802"


def nvidia_compute_domain_crd() -> pathlib.Path:
    """NVIDIA's ComputeDomain CRD file the full bootstrap fetched, or :class:`BinariesMissingError`."""
    version = os.environ.get(
        "MESHTRAIN_NVIDIA_DRA_DRIVER_VERSION", DEFAULT_NVIDIA_DRA_DRIVER_VERSION
    )
    crd = (
        cache_root()
        / "crds"
        / f"nvidia-dra-driver-gpu-{version}"
        / "resource.nvidia.com_computedomains.yaml"
    )
    if not crd.is_file():
        raise BinariesMissingError(
            f"NVIDIA's ComputeDomain CRD is not at {crd}: run `scripts/bootstrap.sh` (without "
            "--no-node), which fetches it from the github.com/NVIDIA/k8s-dra-driver-gpu Go module "
            f"at {version}, and read its log if the module proxy refused the module."
        )
    return crd


def locate() -> Binaries:
    """Find every binary at the pinned version, or raise :class:`BinariesMissingError`.

    Per binary: ``$KUBEBUILDER_ASSETS``, then the bootstrap's cache directory
    ``${MESHTRAIN_CACHE:-~/.cache/meshtrain}/bin/<k8s version>/``, then ``PATH``;
    one from the first or the last is used only if it reports the pinned version.
    """
    bin_dir = cache_bin_dir()
    versions = _read_versions(bin_dir)
    found: dict[str, pathlib.Path] = {}
    missing: list[str] = []
    for name in ALL_NAMES:
        path = _find(name, bin_dir, _wanted(name, versions))
        if path is None:
            missing.append(name)
        else:
            found[name] = path
    if missing:
        raise BinariesMissingError(
            f"control-plane binaries missing at Kubernetes {versions.kubernetes}: {', '.join(missing)} "
            f"(looked in $KUBEBUILDER_ASSETS, {bin_dir} and PATH). "
            "Run `make bootstrap` (or `scripts/bootstrap.sh`) to build them; "
            "the first run compiles Kubernetes from source and takes a while."
        )
    logger.debug("control-plane binaries located", extra={"bin_dir": str(bin_dir)})
    return Binaries(
        kube_apiserver=found["kube-apiserver"],
        kube_controller_manager=found["kube-controller-manager"],
        kube_scheduler=found["kube-scheduler"],
        kubectl=found["kubectl"],
        etcd=found["etcd"],
        helm=found["helm"],
        versions=versions,
    )


def reported_version(name: str, path: pathlib.Path) -> str | None:
    """The version ``path`` says it is, spelled like the pins (``v1.36.3``, ``3.6.8``)."""
    args = {
        "kubectl": ["version", "--client"],
        "helm": ["version", "--short"],
    }.get(name, ["--version"])
    try:
        out = subprocess.run(
            [str(path), *args], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except OSError:
        return None
    patterns = {
        "kubectl": r"^Client Version: (\S+)",
        "etcd": r"^etcd Version: (\S+)",
        "helm": r"^(v[^+\s]+)",
    }
    match = re.search(patterns.get(name, r"^Kubernetes (\S+)"), out, re.MULTILINE)
    return match.group(1) if match else None


def _read_versions(bin_dir: pathlib.Path) -> Versions:
    """Read the bootstrap's ``versions`` file; fall back to the pins."""
    values: dict[str, str] = {}
    versions_file = bin_dir / "versions"
    if versions_file.is_file():
        for line in versions_file.read_text().splitlines():
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return Versions(
        kubernetes=k8s_version(),
        etcd=values.get("etcd", ""),
        helm=values.get("helm", DEFAULT_HELM_VERSION),
    )


def _wanted(name: str, versions: Versions) -> str:
    if name in KUBE_NAMES:
        return versions.kubernetes
    return versions.etcd if name == "etcd" else versions.helm


def _find(name: str, bin_dir: pathlib.Path, wanted: str) -> pathlib.Path | None:
    """First usable ``name``: the assets dir at ``wanted``, else the cache dir, else PATH at ``wanted``.

    Binaries in the cache dir are trusted without running them: the bootstrap
    verified their versions and the directory is keyed by version.
    """
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and wanted:
        candidate = pathlib.Path(assets) / name
        if _executable(candidate) and reported_version(name, candidate) == wanted:
            return candidate.resolve()
    cached = bin_dir / name
    if _executable(cached):
        return cached.resolve()
    on_path = shutil.which(name)
    if on_path and wanted and reported_version(name, pathlib.Path(on_path)) == wanted:
        return pathlib.Path(on_path).resolve()
    return None


def _executable(path: pathlib.Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


NODE_NAMES = ("kubelet", "kube-proxy", "containerd", "containerd-shim-runc-v2", "ctr", "coredns")


@dataclasses.dataclass(frozen=True)
class NodeBinaries:
    """Absolute paths of the node's binaries (the sandbox's real node)."""

    bin_dir: pathlib.Path
    """The bootstrap's directory; containerd finds its shim on PATH there."""
    kubelet: pathlib.Path
    """The kubelet, at the control plane's Kubernetes version."""
    kube_proxy: pathlib.Path
    """Service virtual IPs (iptables) for the pods."""
    containerd: pathlib.Path
    """The container runtime (2.x), with containerd-shim-runc-v2 beside it."""
    ctr: pathlib.Path
    """containerd's client (image import)."""
    coredns: pathlib.Path
    """Cluster DNS."""


def locate_node() -> NodeBinaries:
    """The node's binaries from the bootstrap's directory, or :class:`BinariesMissingError`."""
    bin_dir = cache_bin_dir()
    missing = [name for name in NODE_NAMES if not _executable(bin_dir / name)]
    if missing:
        raise BinariesMissingError(
            f"node binaries missing in {bin_dir}: {', '.join(missing)}. "
            "Run `make bootstrap` (or `scripts/bootstrap.sh`) to build kubelet, kube-proxy, "
            "containerd and CoreDNS from their Go modules."
        )
    return NodeBinaries(
        bin_dir=bin_dir,
        kubelet=bin_dir / "kubelet",
        kube_proxy=bin_dir / "kube-proxy",
        containerd=bin_dir / "containerd",
        ctr=bin_dir / "ctr",
        coredns=bin_dir / "coredns",
    )
