"""What ``python -m meshtrain.sandbox up`` shows while the detached supervisor starts the sandbox.

The supervisor logs each step it finishes (``control plane ready in 12.3s``) and
``scripts/images.sh`` each image it builds or pushes (``[images   40s] built ... in 38s``); the
waiting command follows both logs and shows them as a :class:`meshtrain.api.console.Phase`: on a
terminal a bar with the elapsed time and the latest step, otherwise one plain line per finished
step.  Reads are bounded: a log grows by at most :data:`READ_BYTES` per look.
"""

from __future__ import annotations

import pathlib
import re
import sys

from meshtrain.api import console

READ_BYTES = 64 * 1024
"""Most bytes read from one log per look (a runaway log is skipped through, not loaded)."""

LINE_CHARS = 300
"""A shown step is cut to this many characters."""

FINISHED = re.compile(
    r"sandbox INFO (?P<supervisor>.+ ready in [\d.]+s)$"
    r"|^\[images +\d+s\] (?P<images>(built|imported|pushed|done in) .+|.+ (is up to date|present:?|already in) .+)$"
)
"""A log line that ends a step: the supervisor's ``... ready in Ns``, images.sh's built/pushed/kept."""

STARTED = re.compile(r"^\[images +\d+s\] (?P<images>.+ \.\.\.)$")
"""images.sh starting a long step (``building ... from ... ...``): shown on a bar, never as a line."""


class LogFollower:
    """New complete lines of one file, from where it ended when followed."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self.pending = b""

    def lines(self) -> list[str]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read(READ_BYTES)
        except OSError:  # not written yet
            return []
        self.offset += len(chunk)
        *complete, self.pending = (self.pending + chunk).split(b"\n")
        self.pending = self.pending[-READ_BYTES:]
        return [line.decode(errors="replace").rstrip() for line in complete]


class StartProgress:
    """The sandbox's start as the waiting user sees it (``up``)."""

    def __init__(self, logs: pathlib.Path) -> None:
        self.logs = [LogFollower(logs / "supervisor.log"), LogFollower(logs / "images.log")]
        self.phase = console.Phase("sandbox up", unit="steps")
        self.terminal = console.on_terminal()

    def poll(self) -> None:
        """Show what the logs say since the last look."""
        for follower in self.logs:
            for line in follower.lines():
                finished, started = FINISHED.search(line), STARTED.search(line)
                if finished:
                    step = (finished["supervisor"] or finished["images"])[:LINE_CHARS]
                    self.phase.update()
                    self.phase.status(step)
                    if not self.terminal:
                        print(f"sandbox up: {step}", file=sys.stderr, flush=True)
                elif started:
                    self.phase.status(started["images"][:LINE_CHARS])

    def close(self, outcome: str) -> None:
        self.poll()
        self.phase.close(outcome)
