"""A real, local Kubernetes control plane for tests and the sandbox: :class:`ControlPlane`.

It runs the binaries ``scripts/bootstrap.sh`` builds from the pinned Kubernetes release
(:mod:`.binaries` finds them, never builds them).  No kubelet runs here: the sandbox adds real
nodes on top.
"""

from meshtrain.sandbox.controlplane.binaries import Binaries, BinariesMissingError, locate
from meshtrain.sandbox.controlplane.server import ControlPlane, StartupError

__all__ = ["Binaries", "BinariesMissingError", "ControlPlane", "StartupError", "locate"]
