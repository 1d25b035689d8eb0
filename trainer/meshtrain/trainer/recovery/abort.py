"""Abort this process's process groups so that a collective blocked in them returns at once.

Gloo cannot abort a blocked collective (``abort()`` leaves an ``all_reduce`` waiting until the
peer's process exits), so :class:`GlooSockets` shuts down the TCP sockets gloo opened: the blocked
read fails in milliseconds and the collective raises.  It knows them positively: the established
TCP sockets that appeared across each group creation (``init_process_group``, ``new_group`` and
the subgroups: :func:`install` wraps torch's ``_new_process_group_helper``; the main thread
creates groups) whose two ports are ones the kernel hands out (:func:`ephemeral_ports`) and which
is not the rendezvous store's connection.  Gloo listens on a port the kernel picks, so both ends
of each of its pairs are such ports whichever side connected; a connection another thread opened
meanwhile to a service (the object store's HTTP pool, a tracker) reaches a fixed port and is left
alone, as are clients of this process's own servers (the metrics port is also kept).  Nothing is exchanged through the
store for this: a rank used to publish its address and read every rank's, each round, which is
O(world^2) store reads.  A descriptor is re-checked by inode after ``os.dup`` so that a reused fd
number is never shut down.

NCCL communicators abort through torch's ``_abort_process_group``, which torch 2.15 documents for
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (the supervisor sets it): the watchdog must not tear the
communicators (or the process) down on its own.  The gloo sockets go first, then NCCL, in a thread
with a deadline: a communicator that does not abort in time ends the process
(:data:`ABORT_STUCK`) and the supervisor replaces it.  One lock (:data:`GROUPS`) orders group
creation, destruction and the abort.  The NCCL path is unmeasured with a peer lost (no GPU in
CI; a lent machine has one GPU, and NCCL refuses two ranks on it); one rank's abort and regroup
over NCCL is ``tests/trainer/test_on_device.py``'s, which ``benchmarks/gpu_check.sh`` runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import os
import socket
import threading
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

PROC_TCP = ("/proc/self/net/tcp", "/proc/self/net/tcp6")
MAX_PROC_BYTES = 8 << 20
"""Most bytes read of each /proc/net table (a host-network pod sees every socket of the node)."""
MAX_FDS = 65536
"""Most descriptors looked at."""
ESTABLISHED = "01"
PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL = range(32768, 61000)
"""Linux's default ``ip_local_port_range`` (32768-60999)."""
NCCL_ABORT_S = 30.0
"""How long the NCCL abort may take before the process ends itself."""
ABORT_STUCK = 70
"""Exit code of a worker whose NCCL abort did not return in time (a retryable failure)."""
GROUPS = threading.RLock()
"""Held while groups are created or destroyed, and while they are aborted."""


@dataclasses.dataclass(frozen=True)
class Connection:
    """An established TCP connection of this network namespace."""

    local_port: int
    """Its local port."""
    remote: str
    """The remote address (IPv4 or IPv6 text)."""
    remote_port: int
    """The remote port."""


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


def _address(hexed: str) -> str:
    """/proc/net/tcp's address (32-bit words in host order, little-endian here) as text."""
    raw = bytes.fromhex(hexed)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return str(ipaddress.IPv4Address(words))
    address = ipaddress.IPv6Address(words)
    return str(address.ipv4_mapped or address)


def connections() -> dict[int, Connection]:
    """Established TCP connections of this network namespace: inode -> connection."""
    found: dict[int, Connection] = {}
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
                remote, remote_port = fields[2].rsplit(":", 1)
                found[int(fields[9])] = Connection(
                    int(fields[1].rsplit(":", 1)[1], 16), _address(remote), int(remote_port, 16)
                )
            except (ValueError, IndexError):
                continue
    return found


def ephemeral_ports(path: Path = PORT_RANGE) -> range:
    """The ports the kernel picks for a socket bound to port 0 (this network namespace's
    ``ip_local_port_range``; Linux's default when it cannot be read)."""
    try:
        low, high = (int(v) for v in path.read_text()[:64].split()[:2])
    except (OSError, ValueError):
        return LINUX_EPHEMERAL
    return range(low, high + 1) if 0 < low <= high <= 65535 else LINUX_EPHEMERAL


def may_be_gloo(conn: Connection, ephemeral: range) -> bool:
    """Whether ``conn`` can be one of gloo's pairs: both ends are ports the kernel picked (a
    listener's or a connecting socket's); a client of a service reaches a fixed port, and a client
    of this process's own server (a probe, a scrape) came in on one.

    A peer whose pod narrowed its own range differently may be missed; its collective then ends
    at the process-group timeout rather than at once.  A range widened to well-known ports
    (``1024 65535``) takes a service connection opened during a group's creation for gloo's: it
    is then shut down with the groups, and its client reconnects.
    """
    return conn.remote_port in ephemeral and conn.local_port in ephemeral


class GlooSockets:
    """The TCP sockets of this process's gloo groups (see the module)."""

    def __init__(self, store_port: int, kept_ports: Collection[int] = ()) -> None:
        self.store_port = store_port
        """The rendezvous store's port: connections to it are never touched."""
        self.kept_ports = frozenset(kept_ports)
        """Local ports whose connections are never touched (this rank's metrics server)."""
        self.ephemeral = ephemeral_ports()
        """The ports the kernel hands out here (gloo's listeners' and its connecting ends')."""
        self.inodes: set[int] = set()
        """The sockets found so far."""

    @contextlib.contextmanager
    def creating(self) -> Iterator[None]:
        """Around a group's creation: the sockets that appear meanwhile are the group's."""
        with GROUPS:
            before = frozenset(socket_fds())
            try:
                yield
            finally:
                found = connections()
                for inode in frozenset(socket_fds()) - before:
                    conn = found.get(inode)
                    if conn is None or self.store_port in (conn.remote_port, conn.local_port):
                        continue
                    if conn.local_port in self.kept_ports or not may_be_gloo(conn, self.ephemeral):
                        continue
                    self.inodes.add(inode)

    def forget(self) -> None:
        """The groups were destroyed: their sockets are no longer ours to shut."""
        self.inodes.clear()

    def shutdown(self) -> int:
        """Shut down (both ways) every gloo socket found; how many."""
        done = 0
        fds = socket_fds()
        for inode in sorted(self.inodes):
            fd = fds.get(inode)
            if fd is None:
                continue
            with contextlib.suppress(OSError):
                copy = os.dup(fd)  # shutdown acts on the socket, close only on the copy
                if os.fstat(copy).st_ino != inode:  # the number was reused meanwhile
                    os.close(copy)
                    continue
                sock = socket.socket(fileno=copy)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
                finally:
                    sock.close()
        return done


_tracking: list[GlooSockets] = []


def install(sockets: GlooSockets) -> None:
    """Have every group torch creates from now on record its sockets in ``sockets``."""
    _tracking[:] = [sockets]
    c10d = dist.distributed_c10d
    helper = c10d._new_process_group_helper
    if getattr(helper, "_meshtrain_tracked", False):
        return

    @functools.wraps(helper)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        if not _tracking:
            return helper(*args, **kwargs)
        with _tracking[0].creating():
            return helper(*args, **kwargs)

    tracked._meshtrain_tracked = True  # type: ignore[attr-defined]
    c10d._new_process_group_helper = tracked


def uses_nccl(backend: str) -> bool:
    """Whether groups of ``backend`` (``nccl``, ``gloo``, ``cpu:gloo,cuda:nccl``) need NCCL's abort."""
    return "nccl" in backend.lower()


def _abort_nccl() -> None:
    with GROUPS, contextlib.suppress(Exception):  # an aborted group may refuse politely
        if dist.is_initialized():
            dist.distributed_c10d._abort_process_group()


def abort_groups(
    sockets: GlooSockets,
    backend: str,
    *,
    nccl_abort: Callable[[], None] = _abort_nccl,
    deadline_s: float = NCCL_ABORT_S,
    leave: Callable[[int], object] = os._exit,
) -> int:
    """Abort every process group of this process: gloo's sockets first, then NCCL's
    communicators (by ``backend``) within ``deadline_s``, else ``leave(ABORT_STUCK)``.

    Called from the watcher thread while the main thread may be blocked in a collective; the
    number of gloo sockets shut down.
    """
    done = sockets.shutdown()
    if uses_nccl(backend):
        worker = threading.Thread(target=nccl_abort, name="nccl-abort", daemon=True)
        worker.start()
        worker.join(deadline_s)
        if worker.is_alive():
            leave(ABORT_STUCK)
    return done
