"""Permissions of the files meshtrain writes for users: what the process umask gives (0644 by default).

``tempfile.mkstemp`` / ``mkdtemp`` create 0600 / 0700 entries, and safetensors' ``save_file``
writes 0600, so a token file or an exported model renamed into place from one is unreadable by
pods of another UID on a shared volume.  :func:`publish` gives them the mode ``open()`` would
have, and is applied before the rename that makes them visible.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

FILE_MODE = 0o666
"""What ``open(..., "w")`` asks for; the umask takes bits away."""
DIRECTORY_MODE = 0o777
"""What ``mkdir`` asks for; the umask takes bits away."""
_UMASK_LOCK = threading.Lock()


def umask() -> int:
    """The process umask, read without changing it (Linux's /proc, else set and restored under a lock)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        current = os.umask(0o077)
        os.umask(current)
    return current


def publish(path: str | Path) -> None:
    """Give ``path`` (a file or a directory) the mode a plain ``open()`` / ``mkdir`` would have."""
    wanted = DIRECTORY_MODE if os.path.isdir(path) else FILE_MODE
    os.chmod(path, wanted & ~umask())


def write_atomically(target: Path, text: str) -> None:
    """Write ``text`` to ``target`` through a temporary sibling renamed over it: a reader (or a crash)
    sees the old file or the whole new one, never a part; the file gets :func:`publish`'s mode."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        publish(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
