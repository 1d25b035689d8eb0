"""A real pseudo-terminal for tests of what a user sees: opened at a window's size, read until its child exits."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios


def open_terminal(rows: int = 30, columns: int = 160) -> tuple[int, int]:
    """(master, slave) of a pseudo-terminal of ``rows`` x ``columns`` (a new one is 0x0: no bar there, :func:`meshtrain.api.console.on_terminal`)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    return master, slave


def read_all(master: int, proc: subprocess.Popen[bytes] | None = None) -> str:
    """What was written to the terminal, until ``proc`` exits (without one: what is there now)."""
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc is None or proc.poll() is not None:
            break
    return out.decode(errors="replace")
