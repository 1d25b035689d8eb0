"""The sandbox's container registry: the CNCF distribution registry, as a cluster's private one.

``scripts/bootstrap.sh`` builds it from its Go module. The supervisor serves it over plain HTTP
on the first node's host-side link address (every node's namespace routes there, and so does
the host), its configuration in the sandbox's state directory and its storage shared by this
machine's sandboxes (:func:`storage`); ``scripts/images.sh --push``
pushes the pause, operator and trainer images to it, ``helm push`` the packaged chart, and each
node's containerd pulls from it through a ``hosts.toml`` (containerd's ``config_path``), as a
node of a cluster with a private registry would; the nodes also know it by the fixed name
:data:`ALIAS`, so the sandbox's image names do not change with its address.  Pure builders apart from :func:`locate`,
:func:`free_port` and :func:`wait_ready`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from meshtrain.api import release
from meshtrain.sandbox.controlplane import binaries

DEFAULT_VERSION = "v3.1.2"
"""github.com/distribution/distribution/v3 release built by scripts/bootstrap.sh."""
VERSION = os.environ.get("MESHTRAIN_REGISTRY_VERSION", DEFAULT_VERSION)
NAME = "registry"
PORT = 5000
"""The registry's usual port; :func:`free_port` takes another when it is taken on the address."""
ALIAS = "registry.meshtrain.internal"
"""The registry's name on the nodes (``.internal``: reserved for private names, never resolved)."""
PROJECT = "meshtrain"
"""The path under the registry the images and charts live in (``<address>/meshtrain/operator``)."""


def locate() -> pathlib.Path:
    """The registry's binary, or :class:`binaries.BinariesMissingError` saying how to build it."""
    return binaries.module_binary(NAME, VERSION, "github.com/distribution/distribution/v3")


def storage() -> pathlib.Path:
    """The registry's storage: one per machine, beside the nodes' shared image stores.

    Not the sandbox's state directory: the trainer image is 3 GB compressed, and every
    sandbox (each test module starts one, in a directory of its own) would push and keep it
    again. Shared, an unchanged layer is stored once and its push costs no upload.
    """
    return binaries.cache_root() / "registry" / "storage"


def free_port(host: str, preferred: int = PORT) -> int:
    """``preferred`` when it can be bound on ``host``, else a port the kernel hands out there."""
    for port in (preferred, 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise OSError(f"registry: no TCP port can be bound on {host}")


def config(*, storage: pathlib.Path, host: str, port: int) -> dict[str, Any]:
    """The registry's config.yml: filesystem storage under ``storage``, plain HTTP on ``host:port``.

    Deletes are allowed (``helm push`` of a rebuilt chart replaces its tag), no debug server, no
    auth: the address is reachable only from this host and the sandbox's namespaces.
    """
    return {
        "version": 0.1,
        "log": {"level": "info", "accesslog": {"disabled": True}},
        "storage": {
            "filesystem": {"rootdirectory": str(storage)},
            "delete": {"enabled": True},
            "maintenance": {"uploadpurging": {"enabled": False}},
        },
        "http": {"addr": f"{host}:{port}", "headers": {"X-Content-Type-Options": ["nosniff"]}},
    }


def command(binary: pathlib.Path, config_file: pathlib.Path) -> list[str]:
    """``registry serve CONFIG``."""
    return [str(binary), "serve", str(config_file)]


def env() -> dict[str, str]:
    """The registry's environment: no OpenTelemetry export (it would retry a collector on localhost forever)."""
    return {**os.environ, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}


def hosts_toml(address: str) -> str:
    """containerd's ``<config_path>/<address>/hosts.toml``: pull and resolve from ``address`` over plain HTTP."""
    url = f"http://{address}"
    return f'server = "{url}"\n\n[host."{url}"]\n  capabilities = ["pull", "resolve"]\n'


def write_hosts(config_path: pathlib.Path, address: str) -> None:
    """The node's registry host configuration (containerd's ``config_path`` directory).

    One ``hosts.toml`` for the registry's address and one for :data:`ALIAS`, both sending pulls
    to ``address``: a user's ``helm install`` names the address, the sandbox's own the alias.
    """
    for name in (address, ALIAS):  # host:port directories, as containerd looks them up on Linux
        (config_path / name).mkdir(parents=True, exist_ok=True)
        (config_path / name / "hosts.toml").write_text(hosts_toml(address))


def wait_ready(address: str, *, alive: Callable[[], bool], timeout: float = 60.0) -> None:
    """Until ``GET /v2/`` answers 200 (the distribution API's version check); RuntimeError otherwise."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the registry on {address} exited while starting")
        try:
            with urllib.request.urlopen(f"http://{address}/v2/", timeout=2) as answer:
                if answer.status == 200:
                    return
                last = f"HTTP {answer.status}"
        except (urllib.error.URLError, OSError) as err:
            last = str(err)
        time.sleep(0.2)
    raise RuntimeError(f"the registry on {address} did not answer /v2/ in {timeout:.0f}s ({last})")


@dataclasses.dataclass(frozen=True)
class Images:
    """The three images under one registry host (``host/meshtrain/<name>:<tag>``)."""

    operator: str
    """The operator's image, tagged with meshtrain.api.release.VERSION."""
    trainer: str
    """The trainer's image, tagged with meshtrain.api.release.VERSION."""
    pause: str
    """The pod sandbox image, tagged with the Kubernetes version."""

    def all(self) -> tuple[str, str, str]:
        """(operator, trainer, pause)."""
        return self.operator, self.trainer, self.pause


def prefix(host: str) -> str:
    """``host/meshtrain``: what ``make release REGISTRY=...`` takes."""
    return f"{host}/{PROJECT}"


def images(host: str = ALIAS) -> Images:
    """The images' names under ``host`` (by default the nodes' name of the registry)."""
    return Images(
        operator=f"{prefix(host)}/operator:{release.VERSION}",
        trainer=f"{prefix(host)}/trainer:{release.VERSION}",
        pause=f"{prefix(host)}/pause:{binaries.k8s_version()}",
    )
