"""What the sandbox publishes to its registry and installs from it, as a release does for a cluster.

The images (``scripts/images.sh --push``: pause, operator, trainer) and the packaged chart
(``scripts/chart-package.sh`` then ``helm push``) go to the sandbox's registry (:mod:`.registry`);
the operator is installed with ``helm install oci://...``, its images pulled by the nodes.

The nodes know the registry by a fixed name, :data:`.registry.ALIAS`, that their containerd's hosts.toml
maps to the registry's address: image names then stay the same from one sandbox to the next
(whose address may differ), so the shared image stores keep them, and :func:`forget_stale` drops
a node's copy whose digest is no longer the registry's (a rebuilt image under the same tag).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import urllib.request

from meshtrain.api import release
from meshtrain.sandbox import registry

REPO = pathlib.Path(__file__).resolve().parents[3]
CHART = "meshtrain"
"""The chart's name in the registry: ``oci://<prefix>/charts/meshtrain``."""
MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)


class PublishError(RuntimeError):
    """A push or the install failed; the message names the step, its log and the fix."""


def _run(argv: list[str], log: pathlib.Path, what: str, hint: str) -> None:
    """``argv`` with its output appended to ``log``; killed with its group if the caller is interrupted."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
        )
        try:
            returncode = proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise PublishError(f"{what} failed (exit {returncode}): see {log}.\n{tail}\n{hint}")


def push_images(address: str, log: pathlib.Path) -> None:
    """Build (cached) and push the pause, operator and trainer images to the registry at ``address``."""
    _run(
        [
            str(REPO / "scripts" / "images.sh"),
            "--push",
            registry.prefix(address),
            "--with-pause",
            "--plain-http",
            "--zstd",
        ],
        log,
        "images: scripts/images.sh --push",
        "It needs buildah, mmdebstrap and gcc (scripts/bootstrap.sh) and PyPI for the wheels.",
    )


def push_chart(helm: pathlib.Path, address: str, dist: pathlib.Path, log: pathlib.Path) -> str:
    """``helm package`` the chart into ``dist`` and ``helm push`` it; returns its ``oci://`` reference."""
    _run(
        [str(REPO / "scripts" / "chart-package.sh"), str(dist)],
        log,
        "chart: scripts/chart-package.sh",
        "The chart's version and appVersion must be meshtrain.api.release.VERSION.",
    )
    archive = dist / f"{CHART}-{release.VERSION}.tgz"
    _run(
        [
            str(helm),
            "push",
            str(archive),
            f"oci://{registry.prefix(address)}/charts",
            "--plain-http",
        ],
        log,
        "chart: helm push",
        f"The registry on {address} must be up (logs/registry.log).",
    )
    return f"oci://{registry.prefix(address)}/charts/{CHART}"


def manifest_digest(address: str, name: str) -> str:
    """The digest the registry at ``address`` serves for ``name`` (``.../repo:tag``) (HEAD, Docker-Content-Digest)."""
    repository, _, tag = name.partition("/")[2].rpartition(":")
    request = urllib.request.Request(
        f"http://{address}/v2/{repository}/manifests/{tag}",
        method="HEAD",
        headers={"Accept": ", ".join(MANIFEST_TYPES)},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return str(answer.headers["Docker-Content-Digest"])


def forget_stale(
    ctr: pathlib.Path, socket: pathlib.Path, wanted: dict[str, str], address: str
) -> list[str]:
    """Remove from the node's containerd what a pull from this sandbox's registry must fetch afresh; returns the names removed.

    ``wanted`` (name -> the registry's digest): an image held at another digest was rebuilt
    since. Names under ``address`` itself are left from an earlier sandbox that had the same
    address (users' installs name it, the sandbox's own :data:`.registry.ALIAS`). The kubelet
    pulls them again (``IfNotPresent``); their layers' snapshots stay, shared by digest.
    """
    base = [str(ctr), "--address", str(socket), "--namespace", "k8s.io", "images"]
    listed = subprocess.run([*base, "ls"], capture_output=True, text=True, timeout=60, check=True)
    removed = stale_names(listed.stdout, wanted, address)
    if removed:
        subprocess.run([*base, "rm", *removed], capture_output=True, timeout=120, check=True)
    return removed


def stale_names(listing: str, wanted: dict[str, str], address: str) -> list[str]:
    """The names :func:`forget_stale` removes, from ``ctr images ls`` output (REF TYPE DIGEST ...)."""
    rows = [line.split() for line in listing.splitlines()[1:] if len(line.split()) >= 3]
    return [
        row[0]
        for row in rows
        if row[0].startswith(f"{address}/") or wanted.get(row[0], row[2]) != row[2]
    ]


def install_command(
    helm: pathlib.Path,
    chart: str,
    *,
    host: str,
    release_name: str,
    kubeconfig: pathlib.Path,
    namespace: str,
    overrides: list[str],
) -> list[str]:
    """``helm install meshtrain oci://... --version VERSION`` with both images' repositories under ``host``.

    ``overrides``: the sandbox's own ``--set``/``--set-json`` arguments.
    """
    names = registry.images(host)
    return [
        str(helm),
        "install",
        release_name,
        chart,
        "--version",
        release.VERSION,
        "--plain-http",
        "--namespace",
        namespace,
        "--create-namespace",
        "--set",
        f"image.repository={names.operator.rpartition(':')[0]}",
        "--set",
        f"trainer.image.repository={names.trainer.rpartition(':')[0]}",
        *overrides,
        "--kubeconfig",
        str(kubeconfig),
        "--wait",
        "--timeout",
        "5m",
    ]
