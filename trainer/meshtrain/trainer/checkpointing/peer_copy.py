"""Snapshot files between ranks over a gloo group: a size, the receiver's readiness, the bytes.

A receiver first makes room: a preallocated temporary file under its root, mapped, so the bytes
land in ``/dev/shm`` without another copy and a full ``/dev/shm`` is an error here rather than a
SIGBUS later.  It then says whether it is ready, and only then do the bytes move, so a receiver
that cannot take a file never leaves its sender blocked.  Both sides bound the size by ``limit``
(from the spec); a received file is renamed into place only when complete.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.trainer.checkpointing import snapshot_file


def _say(message: str) -> None:
    sys.stderr.write(f"[memory-checkpoint] {message}\n")
    sys.stderr.flush()


def _post_send(group: dist.ProcessGroup, tensor: torch.Tensor, to: int) -> dist.Work:
    work = dist.isend(tensor, to, group=group)
    assert work is not None  # every rank is in the group
    return work


def _post_recv(group: dist.ProcessGroup, tensor: torch.Tensor, source: int) -> dist.Work:
    work = dist.irecv(tensor, source, group=group)
    assert work is not None  # every rank is in the group
    return work


def swap(group: dist.ProcessGroup, value: int, *, to: int, source: int) -> int:
    """Send ``value`` to ``to`` while receiving one from ``source``; the received value."""
    out, into = torch.tensor([value], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    for work in (_post_send(group, out, to), _post_recv(group, into, source)):
        work.wait()
    return int(into.item())


def _tell(group: dist.ProcessGroup, value: int, to: int) -> None:
    dist.send(torch.tensor([value], dtype=torch.int64), to, group=group)


def _hear(group: dist.ProcessGroup, source: int) -> int:
    into = torch.zeros(1, dtype=torch.int64)
    dist.recv(into, source, group=group)
    return int(into.item())


def _size(path: Path | None, limit: int) -> int:
    """Bytes of ``path`` to send (0: nothing, or more than ``limit``)."""
    if path is None or not path.is_file():
        return 0
    size = path.stat().st_size
    return size if size <= limit else 0


def _outgoing(path: Path, size: int) -> torch.Tensor:
    """The file's bytes as a tensor over a private mapping (read by the send, never copied)."""
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)


class Incoming:
    """A file being received: room made under its final name's directory, renamed when complete."""

    def __init__(self, final: Path, size: int, limit: int) -> None:
        self.final = final
        self.tmp = final.with_name(f"{snapshot_file.TMP_PREFIX}{final.name}.{os.getpid()}")
        self.target: torch.Tensor | None = None
        """Where the bytes go (a shared mapping of the temporary file); None: not ready."""
        if not 0 < size <= limit:
            return
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            snapshot_file.make_room(final.parent, size)
            with open(self.tmp, "wb") as out:
                try:
                    os.posix_fallocate(out.fileno(), 0, size)  # ENOSPC now, not SIGBUS later
                except OSError as err:
                    if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    out.truncate(size)  # a file system without fallocate (tests, local runs)
            self.target = torch.from_file(str(self.tmp), shared=True, size=size, dtype=torch.uint8)
        except (OSError, RuntimeError) as err:
            _say(f"no room for {final.name} under {final.parent}: {err}")
            snapshot_file.discard(self.tmp)

    @property
    def ready(self) -> bool:
        """Whether the bytes can be received."""
        return self.target is not None

    def commit(self) -> bool:
        """Rename the received file into place (the mapping is dropped first); whether it was."""
        if self.target is None:
            return False
        self.target = None
        try:
            os.replace(self.tmp, self.final)
        except OSError as err:  # the root went away meanwhile: this copy is lost, not the run
            _say(f"keeping {self.final} failed: {err}")
            snapshot_file.discard(self.tmp)
            return False
        return True

    def abandon(self) -> None:
        """Drop the temporary file (nothing, or not all, was received)."""
        self.target = None
        snapshot_file.discard(self.tmp)


def exchange(
    group: dist.ProcessGroup, path: Path | None, *, to: int, source: int, final: Path, limit: int
) -> tuple[bool, bool]:
    """Send ``path`` to ``to`` while receiving ``source``'s file as ``final``: (sent, received)."""
    size = _size(path, limit)
    incoming = Incoming(final, swap(group, size, to=to, source=source), limit)
    peer_ready = swap(group, int(incoming.ready), to=source, source=to)
    try:
        works = []
        if size and peer_ready:
            assert path is not None
            works.append(_post_send(group, _outgoing(path, size), to))
        if incoming.target is not None:
            works.append(_post_recv(group, incoming.target, source))
        for work in works:
            work.wait()
        del works
    except BaseException:
        incoming.abandon()
        raise
    return bool(size and peer_ready), incoming.commit()


def send(group: dist.ProcessGroup, path: Path, *, to: int, limit: int) -> None:
    """Send ``path`` to ``to`` (which calls :func:`receive`), if it is ready for it."""
    size = _size(path, limit)
    _tell(group, size, to)
    if _hear(group, to) and size:
        dist.send(_outgoing(path, size), to, group=group)


def receive(group: dist.ProcessGroup, final: Path, *, source: int, limit: int) -> bool:
    """Receive ``source``'s file (it calls :func:`send`) as ``final``; whether it arrived."""
    incoming = Incoming(final, _hear(group, source), limit)
    _tell(group, int(incoming.ready), source)
    if incoming.target is None:
        return False
    try:
        dist.recv(incoming.target, source, group=group)
    except BaseException:
        incoming.abandon()
        raise
    return incoming.commit()
