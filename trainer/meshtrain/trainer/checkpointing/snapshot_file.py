"""One rank's in-memory snapshot as a file: a bounded JSON header, then its tensors' raw bytes.

Written under a temporary name and renamed, so a reader sees a whole file or none.  A snapshot is
bound to the layout that wrote it (a rank's own shards, not dense tensors): it is read back only
into an engine whose entries match its header exactly, which also bounds every read by what the
reading rank holds.  Files of other ranks (peer copies) are only moved as bytes, never parsed
beyond their header.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from meshtrain.trainer.checkpointing import sharded, store

MAGIC = b"MTSNAP01"
LENGTH_BYTES = 8
NAME = re.compile(r"rank-(\d{5})\.step-(\d{9})\.snap")
TMP_PREFIX = ".tmp-"
MAX_FILES = 4_096
"""Directory entries a listing reads (a rank keeps at most four snapshots: its own and a peer's,
each with the previous one while a newer one is written)."""
HEADER_SLACK = 1 << 20
"""Header bytes allowed beyond this rank's own header (the trainer record's lists vary in length)."""


def name(rank: int, step: int) -> str:
    """The file name of ``rank``'s snapshot of ``step``."""
    return f"rank-{rank:05d}.step-{step:09d}.snap"


def listing(root: Path) -> tuple[set[tuple[int, int]], list[Path]]:
    """The complete snapshots under ``root`` as (rank, step), and leftover temporary files.

    At most :data:`MAX_FILES` entries are read; a missing root holds nothing.
    """
    held: set[tuple[int, int]] = set()
    stale: list[Path] = []
    try:
        entries = list(itertools.islice(os.scandir(root), MAX_FILES))
    except OSError:  # missing, or not a directory: holds nothing
        return held, stale
    for entry in entries:
        if entry.name.startswith(TMP_PREFIX):
            stale.append(Path(entry.path))
        elif (found := NAME.fullmatch(entry.name)) is not None and entry.is_file():
            held.add((int(found.group(1)), int(found.group(2))))
    return held, stale


def tensors(entries: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...], torch.Tensor]]:
    """Every tensor of a state dict as (key, dense offsets, data), in the state dict's order."""
    for key, value in entries.items():
        if isinstance(value, sharded.ChunkedTensor):
            for piece in sharded.pieces_in(value):
                yield key, piece.offsets, piece.data
        elif isinstance(value, torch.Tensor):
            yield key, (), value


def signature(entries: dict[str, Any]) -> list[list[Any]]:
    """What the header lists of ``entries``: [key, offsets, shape, dtype] per tensor (JSON values)."""
    return [
        [key, list(offsets), list(data.shape), str(data.dtype).removeprefix("torch.")]
        for key, offsets, data in tensors(entries)
    ]


def data_bytes(entries: dict[str, Any]) -> int:
    """Bytes of the tensors of ``entries``."""
    return sum(data.numel() * data.element_size() for _, _, data in tensors(entries))


def header(facts: dict[str, Any], entries: dict[str, Any], record: str) -> dict[str, Any]:
    """The header of a snapshot of ``entries``: ``facts`` (rank, step, world, layout, model), the
    trainer record (JSON text), the tensors' signature and their total bytes."""
    return facts | {
        "record": record,
        "tensors": signature(entries),
        "bytes": data_bytes(entries),
    }


def write(root: Path, head: dict[str, Any], entries: dict[str, Any]) -> Path:
    """Write a snapshot of host tensors ``entries`` under ``root`` atomically; its final path.

    OSError (ENOSPC) before writing anything when the file system has less room than the file.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / name(head["rank"], head["step"])
    tmp = root / f"{TMP_PREFIX}{final.name}.{os.getpid()}"
    encoded = json.dumps(head, sort_keys=True).encode()
    make_room(root, len(MAGIC) + LENGTH_BYTES + len(encoded) + int(head["bytes"]))
    try:
        with open(tmp, "wb") as out:
            out.write(MAGIC + len(encoded).to_bytes(LENGTH_BYTES, "little") + encoded)
            for _, _, data in tensors(entries):
                flat = data.detach().contiguous().reshape(-1).view(torch.uint8)
                out.write(flat.numpy().data)
        os.replace(tmp, final)
    except BaseException:
        discard(tmp)
        raise
    return final


def make_room(root: Path, need: int) -> None:
    """OSError (ENOSPC) when ``root``'s file system has less than ``need`` bytes free: a snapshot
    never fills ``/dev/shm``, which NCCL and data loader workers need too."""
    room = os.statvfs(root)
    free = room.f_bavail * room.f_frsize
    if free < need:
        raise OSError(errno.ENOSPC, f"{need} bytes needed, {free} free", str(root))


def discard(path: Path) -> None:
    """Remove ``path`` if it can be removed (a cleanup never raises)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _read_header(stream: BinaryIO, path: Path, max_header: int) -> dict[str, Any]:
    lead = stream.read(len(MAGIC) + LENGTH_BYTES)
    if len(lead) != len(MAGIC) + LENGTH_BYTES or lead[: len(MAGIC)] != MAGIC:
        raise store.CheckpointError(f"{path}: not a meshtrain in-memory snapshot")
    length = int.from_bytes(lead[len(MAGIC) :], "little")
    if length > max_header:
        raise store.CheckpointError(
            f"{path}: header of {length} bytes, more than the {max_header} this rank's state needs"
        )
    try:
        head = json.loads(stream.read(length))
    except ValueError as err:
        raise store.CheckpointError(f"{path}: unreadable header ({err})") from None
    if not isinstance(head, dict):
        raise store.CheckpointError(f"{path}: header is not a JSON object")
    return head


def read_header(path: Path, max_header: int) -> dict[str, Any]:
    """The header of the snapshot at ``path`` (at most ``max_header`` bytes read)."""
    with open(path, "rb") as stream:
        return _read_header(stream, path, max_header)


def max_header(head: dict[str, Any]) -> int:
    """The largest header a snapshot of this rank may have: its own, and :data:`HEADER_SLACK`."""
    return len(json.dumps(head, sort_keys=True).encode()) + HEADER_SLACK


def mismatch(found: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """Why a snapshot with header ``found`` cannot load into this rank (header ``mine``); None: it can."""
    for key in ("rank", "world", "step"):
        if found.get(key) != mine[key]:
            return f"it is of {key} {found.get(key)!r}, this rank needs {mine[key]!r}"
    for key, what in (("layout", "layout"), ("model", "model shape")):
        if found.get(key) != mine[key]:
            return f"its {what} {found.get(key)} differs from this job's {mine[key]}"
    if found.get("tensors") != mine["tensors"] or found.get("bytes") != mine["bytes"]:
        return "its tensors (names, offsets, shapes or dtypes) differ from this rank's"
    return None if _record_readable(found.get("record")) else "its trainer record is unreadable"


def _record_readable(record: object) -> bool:
    try:
        return isinstance(record, str) and isinstance(json.loads(record), dict)
    except ValueError:
        return False


def check(path: Path, mine: dict[str, Any]) -> dict[str, Any]:
    """The header of ``path`` when it fits this rank (``mine``: the header this rank would write,
    step included) and the file holds every byte it lists; else CheckpointError saying why."""
    with open(path, "rb") as stream:
        found = _read_header(stream, path, max_header(mine))
        reason = mismatch(found, mine)
        if reason is not None:
            raise store.CheckpointError(f"{path}: {reason}")
        size, expected = os.fstat(stream.fileno()).st_size, stream.tell() + int(mine["bytes"])
    if size != expected:
        raise store.CheckpointError(f"{path}: {size} bytes, its header lists {expected}")
    return found


def load(path: Path, mine: dict[str, Any], entries: dict[str, Any]) -> dict[str, Any]:
    """Copy the snapshot at ``path`` into the live tensors of ``entries``; its header.

    :func:`check` first: every read is sized by this rank's own tensors.
    """
    found = check(path, mine)
    with open(path, "rb") as stream:
        _read_header(stream, path, max_header(mine))
        for _, _, live in tensors(entries):
            count = live.numel() * live.element_size()
            buffer = bytearray(count)
            if stream.readinto(buffer) != count:
                raise store.CheckpointError(f"{path}: truncated")
            stored = (
                torch.frombuffer(buffer, dtype=torch.uint8)
                if count
                else torch.empty(0, dtype=torch.uint8)
            )
            with torch.no_grad():
                live.copy_(stored.view(live.dtype).view(live.shape))
    return found
