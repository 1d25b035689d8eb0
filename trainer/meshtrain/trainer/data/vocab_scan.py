"""The recorded result of a token file's vocabulary scan, so a restart need not read it all again.

On a corpus of hundreds of GB the scan is minutes of reading at every start of every rank.  The
largest id is recorded beside the file (or in the cache directory) with what identifies its
contents (:func:`fingerprint`); any change scans again.  A record that cannot be written is skipped.
:func:`sampled_digest` is the cheaper, modification-time-free identity ``data prepare`` records.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from meshtrain.api import limits
from meshtrain.trainer import small_files
from meshtrain.trainer.data import file_modes

FORMAT = "meshtrain-token-scan/1"
"""Value of a record's ``format`` field; a record without it is ignored."""
SUFFIX = ".scan.json"
"""``FILE.bin.scan.json`` records the scan of ``FILE.bin``."""
EDGE_BYTES = 1 << 20
"""Bytes hashed at each end of the file: appends, truncations and rewrites of either end change it."""


def cache_dir() -> Path:
    """Where meshtrain caches data: $MESHTRAIN_CACHE_DIR, else ~/.cache/meshtrain."""
    env = os.environ.get("MESHTRAIN_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "meshtrain"


class RecordTooLarge(ValueError):
    """A scan record larger than :data:`~meshtrain.api.limits.MAX_SCAN_RECORD_BYTES`: not one this module wrote."""


def beside(path: Path) -> Path:
    """The record next to the token file."""
    return path.with_name(path.name + SUFFIX)


def in_cache(path: Path) -> Path:
    """The record under the cache directory, for a token file whose directory is read-only."""
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]
    return cache_dir() / "token-scans" / f"{key}.json"


def fingerprint(path: Path, dtype: str) -> dict[str, Any]:
    """What must still hold for a record of ``path`` read as ``dtype`` to be trusted."""
    stat = path.stat()
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        digest.update(handle.read(EDGE_BYTES))
        if stat.st_size > EDGE_BYTES:
            handle.seek(max(EDGE_BYTES, stat.st_size - EDGE_BYTES))
            digest.update(handle.read(EDGE_BYTES))
    return {
        "format": FORMAT,
        "path": str(path.resolve()),
        "dtype": dtype,
        "bytes": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "edges_sha256": digest.hexdigest(),
    }


SAMPLE_BLOCKS = 16
"""Blocks hashed by :func:`sampled_digest`, spread evenly from the first byte to the last."""
SAMPLE_BYTES = 1 << 16
"""Bytes per sampled block: 16 x 64 KiB = 1 MiB read, whatever the file's size."""


def sampled_digest(path: Path) -> str:
    """sha256 of the file's size and :data:`SAMPLE_BLOCKS` evenly spaced blocks of :data:`SAMPLE_BYTES`
    (the first and the last 64 KiB among them).

    What ``data prepare`` records to be checked cheaply at every start: no
    modification time (a copy to another volume does not keep it), and a
    rewrite that changes a sampled block or the size is noticed.  A change
    confined to the unsampled bytes of a copy is trusted; the file
    ``data prepare`` wrote itself is also held to its modification time
    (:func:`identity`), so editing it in place is noticed.
    """
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    last = max(0, size - SAMPLE_BYTES)
    with path.open("rb") as handle:
        for index in range(SAMPLE_BLOCKS):
            handle.seek(last * index // (SAMPLE_BLOCKS - 1))
            digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()


def identity(path: Path) -> dict[str, int]:
    """Which file ``path`` is (device, inode) and when it was last written (``mtime_ns``)."""
    stat = path.stat()
    return {"device": stat.st_dev, "inode": stat.st_ino, "mtime_ns": stat.st_mtime_ns}


def edited_in_place(path: Path, written: object) -> bool:
    """Whether ``path`` is the very file whose :func:`identity` was ``written`` and was written since.

    A copy (another device or inode) is not: its modification time says
    nothing about its contents, so only :func:`sampled_digest` vouches for it.
    """
    if not isinstance(written, dict):
        return False
    now = identity(path)
    same_file = (written.get("device"), written.get("inode")) == (now["device"], now["inode"])
    return same_file and written.get("mtime_ns") != now["mtime_ns"]


def largest_id(path: Path, dtype: str) -> int | None:
    """The largest id a record of the file as it is now holds; None when no record matches."""
    current = fingerprint(path, dtype)
    for candidate in (beside(path), in_cache(path)):
        try:
            record = small_files.read_json(
                candidate, limits.MAX_SCAN_RECORD_BYTES, "vocabulary scan record", RecordTooLarge
            )
        except RecordTooLarge:
            raise
        except (OSError, ValueError):  # a damaged record vouches for nothing: the file is scanned
            continue
        if not isinstance(record, dict) or not isinstance(record.get("max_id"), int):
            continue
        if all(record.get(key) == value for key, value in current.items()):
            return int(record["max_id"])
    return None


def record(path: Path, dtype: str, max_id: int, fingerprint_before: dict[str, Any]) -> Path | None:
    """Record the scan's result, if the file did not change while it was scanned; returns where.

    ``fingerprint_before`` is the :func:`fingerprint` taken before the scan.
    """
    if fingerprint(path, dtype) != fingerprint_before:
        return None  # written to meanwhile: the result may not describe the file as it is now
    text = json.dumps({**fingerprint_before, "max_id": max_id}, indent=2) + "\n"
    for target in (beside(path), in_cache(path)):
        try:
            file_modes.write_atomically(target, text)
            return target
        except OSError:
            continue
    return None
