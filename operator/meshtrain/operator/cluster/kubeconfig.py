"""Which kubeconfig a Kubernetes client loads, found the way kubectl finds it.

An explicit ``--kubeconfig`` wins.  Otherwise ``$KUBECONFIG`` is a path list
(``:``-separated; files that do not exist are skipped) whose files the client
library merges; otherwise ``~/.kube/config`` when it exists.  When none is
found, the caller uses the in-cluster service account.  Both Kubernetes
client libraries (``kubernetes`` and ``kubernetes_asyncio``) accept the
returned path list as ``config_file`` and merge it as kubectl does.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT = "~/.kube/config"


def kubeconfig_paths(explicit: str | None = None) -> str | None:
    """The kubeconfig path list to load, or None for the in-cluster service account."""
    if explicit:
        return explicit
    listed = os.environ.get("KUBECONFIG", "")
    if listed:
        found = [p for p in listed.split(os.pathsep) if p and Path(p).expanduser().is_file()]
        return os.pathsep.join(found) or None
    return DEFAULT if Path(DEFAULT).expanduser().is_file() else None
