"""Bounded reads of the small files a tenant controls: token-file metadata, scan records, markers.

Such a file sits on a volume or in a bucket that anyone with write access to it can replace, so
it is never read whole on trust: each kind has its bound in :mod:`meshtrain.api.limits`, the size
is checked before reading and the read itself stops one byte past the bound (a file that grows
meanwhile is caught too).  A larger file is refused with an error naming the file, its size, the
bound and the fix, raised as the caller's own error type so that it leaves the trainer the way
that caller's other errors do (a checkpoint's with the checkpoint exit code).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from meshtrain.trainer import storage

Location = Path | storage.ObjectPath
"""A local path or an object of a bucket."""


def read_bytes(path: Location, limit: int, what: str, refuse: type[Exception]) -> bytes:
    """The whole of ``path`` (a ``what``, e.g. "checkpoint marker"), at most ``limit`` bytes.

    Raises ``refuse`` naming the file, its size and ``limit`` when it is larger; OSError as
    reading raises it.
    """
    if isinstance(path, storage.ObjectPath):
        size = storage.size(path.url)
        if size > limit:
            raise refuse(_too_large(path, size, limit, what))
        return storage.read_small(path.url, limit)
    with Path(path).open("rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        data = handle.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise refuse(_too_large(path, max(size, len(data)), limit, what))
    return data


def read_json(path: Location, limit: int, what: str, refuse: type[Exception]) -> Any:
    """``path`` read as :func:`read_bytes` reads it and parsed as JSON (ValueError when it is not)."""
    try:
        return json.loads(read_bytes(path, limit, what, refuse))
    except (
        RecursionError
    ) as err:  # nesting deeper than the parser's stack: not JSON meshtrain wrote
        raise ValueError(f"nested too deeply ({err})") from None


def _too_large(path: Location, size: int, limit: int, what: str) -> str:
    return (
        f"{path}: {size} bytes, more than the {limit} a {what} may have (meshtrain.api.limits); "
        f"meshtrain did not write it: delete or replace {path}"
    )
