"""Which kubeconfig a Kubernetes client loads, found the way kubectl finds it.

An explicit ``--kubeconfig``, else ``$KUBECONFIG`` (a ``:``-separated path list; missing files
skipped), else ``~/.kube/config`` when it exists; none found: the in-cluster service account.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT = "~/.kube/config"


def kubeconfig_paths(explicit: str | None = None) -> str | None:
    """The kubeconfig path list to load, or None for the in-cluster service account.

    Both client libraries (``kubernetes`` and ``kubernetes_asyncio``) accept it as
    ``config_file`` and merge its files as kubectl does.
    """
    if explicit:
        return explicit
    listed = os.environ.get("KUBECONFIG", "")
    if listed:
        found = [p for p in listed.split(os.pathsep) if p and Path(p).expanduser().is_file()]
        return os.pathsep.join(found) or None
    return DEFAULT if Path(DEFAULT).expanduser().is_file() else None
