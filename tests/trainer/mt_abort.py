"""Child process of test_gloo_abort (run by path; a unique module name).

Rank 0 blocks in an all_reduce that rank 1 (alive, asleep) never joins; a thread shuts rank 0's
gloo sockets down (:class:`meshtrain.trainer.recovery.abort.GlooSockets`, which found them across
the group's creation); rank 0 writes how long the collective took to raise, whether the store
still answers, and whether two HTTP-like connections still carry data: one opened after the
group (an object store's pool), one to a service's fixed port opened while a group was created.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.trainer.recovery import abort, rendezvous


def main(rank: int, port: int, out: Path) -> None:
    store = rendezvous.connect("127.0.0.1", port, master=rank == 0, timeout_s=60)
    sockets = abort.GlooSockets(port)
    abort.install(sockets)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("g0/", store),
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    dist.all_reduce(torch.ones(4))  # the pair is connected
    if rank == 1:  # alive but never joining: only an abort can free rank 0
        deadline = time.monotonic() + 60
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(0)
    server = socket.create_server(("127.0.0.1", 0))  # an HTTP server's stand-in
    client = socket.create_connection(server.getsockname())  # opened after the group: not gloo's
    served, _ = server.accept()
    service = _service_below(abort.ephemeral_ports())  # a service's fixed port (an object store's)
    with sockets.creating():  # another thread's connection, opened while a group is created
        pooled = socket.create_connection(service.getsockname())
    pooled_served, _ = service.accept()
    shut: list[int] = []
    timer = threading.Timer(0.5, lambda: shut.append(sockets.shutdown()))
    timer.start()
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        error = ""
    except RuntimeError as err:
        error = str(err)[:200]
    seconds = time.monotonic() - started
    timer.join()  # the count is appended after the shutdown that freed the collective
    store.set("after-abort", "still here")
    result = {
        "seconds": seconds,
        "http": _echoed(client, served, b"GET / HTTP/1.1\r\n\r\n"),
        "pool": _echoed(pooled, pooled_served, b"PUT /bucket/key HTTP/1.1\r\n\r\n"),
        "error": error,
        "shut": shut,
        "store": store.get("after-abort").decode(),
        "tracked": len(sockets.inodes),
    }
    out.write_text(json.dumps(result))
    os._exit(0)


def _echoed(client: socket.socket, served: socket.socket, request: bytes) -> str:
    """What comes back of ``request`` through a connection whose server echoes it, or why not."""
    try:
        client.sendall(request)
        served.sendall(served.recv(64))
        return client.recv(64).decode()
    except OSError as err:
        return f"broken: {err}"


def _service_below(ephemeral: range) -> socket.socket:
    """A listening socket on a free port below the kernel's ephemeral range."""
    for port in range(ephemeral.start - 1, max(ephemeral.start - 2000, 1024), -1):
        try:
            return socket.create_server(("127.0.0.1", port))
        except OSError:
            continue
    raise RuntimeError(f"no free port below {ephemeral.start}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
