"""Process trees of the sandbox, read from /proc (Linux).

Finding a process's descendants (torchrun starts its workers in
sessions of their own, so a process group is not enough to stop a pod), and
finding every process a sandbox started by the marker variable the node
agent puts in each pod process's environment.
"""

from __future__ import annotations

import os
import pathlib
import signal

MARKER_ENV = "MESHTRAIN_SANDBOX_DIR"
"""Set in every pod process: the state directory of the sandbox that started it."""


def _stat(pid: int) -> list[str] | None:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _all_pids() -> list[int]:
    return [int(p.name) for p in pathlib.Path("/proc").iterdir() if p.name.isdigit()]


def tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants, parents before children."""
    children: dict[int, list[int]] = {}
    for other in _all_pids():
        fields = _stat(other)
        if fields is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(other)
    result, queue = [], [pid]
    while queue:
        current = queue.pop(0)
        if alive(current):
            result.append(current)
        queue.extend(children.get(current, []))
    return result


def signal_all(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each pid, ignoring processes that are already gone."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Signal ``pid`` and its descendants (snapshot taken first); returns the pids signalled."""
    pids = tree(pid)
    signal_all(pids, sig)
    return pids


def marked(state_dir: str) -> list[int]:
    """Live processes whose environment carries ``MESHTRAIN_SANDBOX_DIR=state_dir``."""
    needle = f"{MARKER_ENV}={state_dir}".encode()
    found = []
    for pid in _all_pids():
        try:
            environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and alive(pid):
            found.append(pid)
    return found
