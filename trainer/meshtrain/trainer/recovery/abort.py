"""Abort this process's process groups so that a collective blocked in them returns at once.

NCCL communicators abort (``ProcessGroup.abort()`` through torch's ``_abort_process_group``).
Gloo cannot abort a blocked collective (``abort()`` leaves an ``all_reduce`` waiting until the
peer's process exits), so :class:`GlooSockets` shuts down the TCP sockets gloo opened: the blocked
read fails in milliseconds and the collective raises.  It knows them as the sockets that appeared
since :meth:`GlooSockets.mark` (taken just before ``init_process_group``), less those to the
rendezvous store (``MASTER_PORT``) and to ports named as kept (the metrics server).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist

PROC_TCP = ("/proc/self/net/tcp", "/proc/self/net/tcp6")
MAX_PROC_BYTES = 8 << 20
"""Most bytes read of each /proc/net table (a host-network pod sees every socket of the node)."""
MAX_FDS = 65536
"""Most descriptors looked at."""
ESTABLISHED = "01"


def socket_fds() -> dict[int, int]:
    """This process's socket descriptors: inode -> fd."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")[:MAX_FDS]
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


def tcp_ports() -> dict[int, tuple[int, int]]:
    """Established TCP sockets of this network namespace: inode -> (local port, remote port)."""
    ports: dict[int, tuple[int, int]] = {}
    for table in PROC_TCP:
        try:
            with Path(table).open("rb") as handle:
                text = handle.read(MAX_PROC_BYTES).decode("ascii", "replace")
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 10 or fields[3] != ESTABLISHED:
                continue
            try:
                local = int(fields[1].rsplit(":", 1)[1], 16)
                remote = int(fields[2].rsplit(":", 1)[1], 16)
                ports[int(fields[9])] = (local, remote)
            except (ValueError, IndexError):
                continue
    return ports


class GlooSockets:
    """The TCP sockets of this process's gloo groups, found by difference (see the module)."""

    def __init__(self, store_port: int, kept_ports: Collection[int] = ()) -> None:
        self.store_port = store_port
        """The rendezvous store's port: connections to it are never touched."""
        self.kept_ports = frozenset(kept_ports)
        """Local ports whose connections are never touched (this rank's metrics server)."""
        self._before: frozenset[int] = frozenset()

    def mark(self) -> None:
        """Remember the sockets open now: they are not gloo's (call before ``init_process_group``)."""
        self._before = frozenset(socket_fds())

    def shutdown(self) -> int:
        """Shut down (both ways) every gloo socket opened since :meth:`mark`; how many."""
        ports = tcp_ports()
        done = 0
        for inode, fd in socket_fds().items():
            if inode in self._before or inode not in ports:
                continue
            local, remote = ports[inode]
            if remote == self.store_port or local == self.store_port or local in self.kept_ports:
                continue
            with contextlib.suppress(OSError):
                # a duplicate of the descriptor: shutdown acts on the socket, close only on the copy
                sock = socket.socket(fileno=os.dup(fd))
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
                finally:
                    sock.close()
        return done


def abort_groups(sockets: GlooSockets) -> int:
    """Abort every process group of this process: NCCL's communicators, gloo's sockets.

    Called from the watcher thread while the main thread may be blocked in a collective; the
    number of gloo sockets shut down.
    """
    if dist.is_initialized() and torch.cuda.is_available():
        with contextlib.suppress(Exception):  # gloo-only groups cannot abort
            dist.distributed_c10d._abort_process_group()
    return sockets.shutdown()
