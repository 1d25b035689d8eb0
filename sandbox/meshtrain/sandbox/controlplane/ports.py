"""Free loopback TCP ports for the control plane's components.

Ask the kernel for an unused port by binding port 0, then release
it for the component to bind. Another process can take the port in between;
:func:`bind_failed` recognises that in a component's log so the caller can
retry with new ports.

Not a reservation. Nothing here holds a port for anyone.
"""

from __future__ import annotations

import socket

_IN_USE_MARKERS = ("address already in use", "bind: address in use")


def pick_free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bind_failed(log_text: str) -> bool:
    """True when a component's log says it could not bind its port."""
    lowered = log_text.lower()
    return any(marker in lowered for marker in _IN_USE_MARKERS)
