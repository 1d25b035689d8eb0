"""A real, local Kubernetes control plane for tests and the sandbox.

:class:`ControlPlane` starts etcd and kube-apiserver (optionally
kube-scheduler and kube-controller-manager) from binaries that
``scripts/bootstrap.sh`` builds from the pinned Kubernetes release
(:mod:`.binaries` finds them); :mod:`.pki`, :mod:`.kubeconfig`, :mod:`.ports`
and :mod:`.rest` are its parts.

Not a cluster with nodes: no kubelet runs here; the sandbox
(:mod:`meshtrain.sandbox`) adds a real kubelet node on top. It never downloads or builds binaries itself.
"""

from meshtrain.sandbox.controlplane.binaries import Binaries, BinariesMissingError, locate
from meshtrain.sandbox.controlplane.server import ControlPlane, StartupError

__all__ = ["Binaries", "BinariesMissingError", "ControlPlane", "StartupError", "locate"]
