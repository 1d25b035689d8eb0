"""Kubeconfig files for the local control plane: one cluster, one user, one context.

The CA and credentials are embedded, so a file works from any directory; it is written with mode
0600.
"""

from __future__ import annotations

import base64
import pathlib
from typing import Any

import yaml


def build(
    *,
    server: str,
    ca_file: pathlib.Path,
    user: str,
    cert: tuple[pathlib.Path, pathlib.Path] | None = None,
    token: str | None = None,
    namespace: str | None = None,
) -> dict[str, Any]:
    """A kubeconfig for ``user`` authenticating by client certificate or token."""
    credentials: dict[str, str] = {}
    if cert:
        credentials["client-certificate-data"] = _b64(cert[0])
        credentials["client-key-data"] = _b64(cert[1])
    if token:
        credentials["token"] = token
    context: dict[str, str] = {"cluster": "meshtrain-local", "user": user}
    if namespace:
        context["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "meshtrain-local",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_file)},
            }
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": user, "context": context}],
        "current-context": user,
    }


def write(path: pathlib.Path, config: dict[str, Any]) -> pathlib.Path:
    """Write ``config`` to ``path`` readable by the owner only; return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _b64(path: pathlib.Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()
