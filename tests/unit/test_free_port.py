"""``launch.free_port``: a port no outgoing connection can take before the caller binds it."""

from __future__ import annotations

import socket

from meshtrain.trainer import launch


def test_a_free_port_lies_below_the_kernels_ephemeral_range_and_binds() -> None:
    low, high = (int(v) for v in launch.EPHEMERAL_RANGE.read_text().split())
    ports = {launch.free_port() for _ in range(20)}
    top = min(launch.PICKED_PORTS[1], low)
    if top > launch.PICKED_PORTS[0]:  # the kernel's own picks start above ours
        assert all(launch.PICKED_PORTS[0] <= p < top for p in ports), ports
    else:
        assert all(low <= p <= high for p in ports), ports
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
