"""Free loopback TCP ports for the control plane's components.

A port the kernel hands out for port 0 is released for the component to bind, so another process
can take it in between: :func:`bind_failed` recognises that in a component's log, and the caller
retries with new ports.
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
