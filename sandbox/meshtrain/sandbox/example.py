"""``run-example``: apply a TrainingJob to the sandbox and follow it to the end.

The README's main job on a laptop: it makes the checkpoint volume the example names, applies the
example, prints a line whenever the job's phase, step or restart count changes (like
``kubectl get tj -w``) and ends with where the metrics, logs and timeline picture are.
tests/e2e drives the same functions and asserts.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import yaml

from meshtrain.sandbox import supervisor
from meshtrain.sandbox.controlplane import binaries as binaries_mod

DEFAULT_EXAMPLE = supervisor.REPO / "manifests" / "examples" / "sandbox-dp2-pp2.yaml"
"""The job run-example applies by default: dp2·pp2·tp1 over two pods of two GPUs."""
TERMINAL = ("Succeeded", "Failed")


def kubectl(
    paths: supervisor.Paths, *args: str, stdin: str | None = None, check: bool = True
) -> str:
    """Run the pinned kubectl against the sandbox; returns stdout."""
    command = [str(binaries_mod.locate().kubectl), "--kubeconfig", str(paths.kubeconfig), *args]
    result = subprocess.run(command, input=stdin, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def ensure_claim(
    paths: supervisor.Paths, *, namespace: str, claim: str, size: str = "10Gi"
) -> pathlib.Path:
    """A PVC bound to a hostPath PV on ``<state>/volumes/<ns>/<claim>`` (the sandbox's storage)."""
    directory, volume = _volume(paths, namespace, claim, size)
    kubectl(
        paths,
        "apply",
        "-f",
        "-",
        stdin="\n---\n".join(
            yaml.safe_dump(o) for o in (volume, _claim(namespace, claim, size, volume))
        ),
    )
    return directory


def provision_for(
    paths: supervisor.Paths, *, namespace: str, claim: str, size: str = "10Gi"
) -> pathlib.Path:
    """A fresh hostPath PV on ``<state>/volumes/<ns>/<claim>`` waiting for a PVC of that name
    that the user creates (what a cluster's ReadWriteMany storage class provisions); an earlier
    PVC of the name and its volume are deleted first."""
    directory, volume = _volume(paths, namespace, claim, size)
    kubectl(paths, "delete", "pvc", claim, "-n", namespace, "--ignore-not-found", "--wait=true")
    kubectl(paths, "delete", "pv", volume["metadata"]["name"], "--ignore-not-found", "--wait=true")
    kubectl(paths, "create", "-f", "-", stdin=yaml.safe_dump(volume))
    return directory


def _volume(
    paths: supervisor.Paths, namespace: str, claim: str, size: str
) -> tuple[pathlib.Path, dict[str, Any]]:
    """The directory and the PV kept for claim ``namespace/claim``."""
    directory = paths.root / "volumes" / namespace / claim
    directory.mkdir(parents=True, exist_ok=True)
    # hostPath volumes ignore fsGroup: the pods' non-root user needs the directory writable.
    directory.chmod(0o777)
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": f"sandbox-{namespace}-{claim}"[:63],
            "labels": {"meshtrain.io/sandbox-volume": "true"},
        },
        "spec": {
            "capacity": {"storage": size},
            "accessModes": ["ReadWriteMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": str(directory), "type": "DirectoryOrCreate"},
            "claimRef": {"namespace": namespace, "name": claim},
        },
    }
    return directory, volume


def _claim(namespace: str, claim: str, size: str, volume: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim, "namespace": namespace},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "volumeName": volume["metadata"]["name"],
            "resources": {"requests": {"storage": size}},
        },
    }


RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
"""Namespace labels that make the API server enforce the restricted Pod Security Standard."""


def apply(paths: supervisor.Paths, example: pathlib.Path) -> tuple[str, str]:
    """Apply the example (and its checkpoint claim) in a namespace enforcing the restricted Pod Security Standard; returns (namespace, name)."""
    document = yaml.safe_load(example.read_text())
    meta = document.get("metadata") or {}
    namespace, name = meta.get("namespace", "default"), meta["name"]
    kubectl(paths, "create", "namespace", namespace, check=False)
    kubectl(
        paths,
        "label",
        "--overwrite",
        "namespace",
        namespace,
        *(f"{key}={value}" for key, value in RESTRICTED.items()),
    )
    claim = ((document.get("spec") or {}).get("checkpoint") or {}).get("claimName")
    if claim:
        ensure_claim(paths, namespace=namespace, claim=claim)
    kubectl(paths, "apply", "-n", namespace, "-f", str(example))
    return namespace, name


def job(paths: supervisor.Paths, namespace: str, name: str) -> dict[str, Any] | None:
    """The TrainingJob object, or None."""
    out = kubectl(
        paths, "get", "trainingjobs.meshtrain.io", name, "-n", namespace, "-o", "json", check=False
    )
    return json.loads(out) if out.strip() else None


def follow(
    paths: supervisor.Paths,
    namespace: str,
    name: str,
    *,
    timeout: float = 1800.0,
    on_change: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Poll the job until it is Succeeded or Failed; report each change; returns the final object."""
    started = time.monotonic()
    last = None
    on_change(f"{'ELAPSED':>8}  {'PHASE':<11} {'LAYOUT':<14} {'STEP':>5} {'RESTARTS':>8}  {'PODS'}")
    while time.monotonic() - started < timeout:
        obj = job(paths, namespace, name) or {}
        status = obj.get("status") or {}
        progress = status.get("progress") or {}
        pods = ",".join(
            f"{p.get('podIndex')}@{p.get('node')}" for p in status.get("placement") or []
        )
        row = (
            status.get("phase", "-"),
            status.get("layout", "-"),
            progress.get("step", 0),
            status.get("restarts", 0),
            pods,
        )
        if row != last:
            on_change(
                f"{time.monotonic() - started:7.1f}s  {row[0]:<11} {row[1] or '-':<14} {row[2]:>5} {row[3]:>8}  {row[4]}"
            )
            last = row
        if status.get("phase") in TERMINAL:
            return obj
        time.sleep(1.0)
    raise TimeoutError(f"TrainingJob {namespace}/{name} did not finish in {timeout:.0f}s")


def log_dirs(
    paths: supervisor.Paths, namespace: str, name: str, claim: str | None
) -> list[pathlib.Path]:
    """Where a job's step log and traces are: ``logs`` in the job's directory on its checkpoint claim.

    The operator sets ``MESHTRAIN_LOG_DIR=<checkpoint.path>/<ns>/<name>/logs``, which is
    ``<state>/volumes/<ns>/<claim>/<ns>/<name>/logs`` on this machine.
    """
    return [paths.root / "volumes" / namespace / claim / namespace / name / "logs"] if claim else []


def timeline(paths: supervisor.Paths, namespace: str, name: str) -> pathlib.Path | None:
    """Draw the job's last pipeline step with ``meshtrain timeline``; returns the PNG, or None without traces."""
    claim = (((job(paths, namespace, name) or {}).get("spec") or {}).get("checkpoint") or {}).get(
        "claimName"
    )
    log_dir = next(
        (d for d in log_dirs(paths, namespace, name, claim) if (d / "trace").is_dir()), None
    )
    if log_dir is None:
        return None
    picture = log_dir / "timeline.png"
    result = subprocess.run(
        [sys.executable, "-m", "meshtrain.cli.main", "timeline", str(log_dir), "-o", str(picture)],
        capture_output=True,
        text=True,
    )
    return picture if result.returncode == 0 and picture.exists() else None
