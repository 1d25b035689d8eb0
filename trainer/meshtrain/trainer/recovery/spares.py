"""The supervisor's child processes: workers, and warm spares that wait for a rank to take.

Every child runs ``python -m meshtrain.trainer.recovery.spare``: it imports torch and the
trainer, then reads one assignment (JSON: environment and trainer arguments) from its stdin and
becomes that rank's worker.  A worker of the first start is assigned at once; a spare waits, so a
failed rank's replacement pays no Python start and no ``import torch``.  Plain ``subprocess``
rather than ``torch.distributed.elastic.multiprocessing``: the elastic API starts a fixed set of
workers with their environment given at start, and a spare's rank is only known later.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

MODULE = "meshtrain.trainer.recovery.spare"
MAX_ASSIGNMENT_BYTES = 1 << 20
"""Most bytes of an assignment line a spare reads."""


@dataclasses.dataclass
class Child:
    """One child process of the supervisor."""

    proc: subprocess.Popen[bytes]
    """The process."""
    started_at: float
    """Unix time it was started (a spare's start precedes the failure it covers)."""
    local_rank: int | None = None
    """The local rank it runs (None: a spare still waiting)."""

    @property
    def pid(self) -> int:
        return self.proc.pid


class Pool:
    """Starts children with ``env`` and keeps ``size`` warm spares."""

    def __init__(self, env: Mapping[str, str], size: int) -> None:
        self.env = dict(env)
        """The environment every child starts with (an assignment adds the rank's)."""
        self.size = size
        """Warm spares to keep."""
        self.spares: list[Child] = []

    def spawn(self) -> Child:
        """A new child, waiting for its assignment."""
        proc = subprocess.Popen([sys.executable, "-m", MODULE], env=self.env, stdin=subprocess.PIPE)
        return Child(proc, time.time())

    def refill(self) -> None:
        """Drop spares that died; start new ones up to ``size`` (in the background: they import alone)."""
        self.spares = [s for s in self.spares if s.proc.poll() is None]
        while len(self.spares) < self.size:
            self.spares.append(self.spawn())

    def take(self) -> tuple[Child, bool]:
        """A child for a rank: the oldest live spare, else a new (cold) one; (child, warm)."""
        self.spares = [s for s in self.spares if s.proc.poll() is None]
        if self.spares:
            return self.spares.pop(0), True
        return self.spawn(), False

    def close(self) -> None:
        """Stop the spares (they hold no state)."""
        for spare in self.spares:
            if spare.proc.poll() is None:
                spare.proc.send_signal(signal.SIGTERM)
        for spare in self.spares:
            try:
                spare.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                spare.proc.kill()
                spare.proc.wait()
        self.spares = []


def assign(child: Child, local_rank: int, env: Mapping[str, str], argv: Sequence[str]) -> None:
    """Make ``child`` the worker of ``local_rank`` with the rank's ``env`` and trainer ``argv``."""
    assert child.proc.stdin is not None
    child.proc.stdin.write((json.dumps({"env": dict(env), "argv": list(argv)}) + "\n").encode())
    child.proc.stdin.close()
    child.local_rank = local_rank


def read_assignment() -> tuple[dict[str, str], list[str]] | None:
    """A spare's assignment from stdin: (env, argv); None when the supervisor closed it unassigned."""
    line = sys.stdin.buffer.readline(MAX_ASSIGNMENT_BYTES)
    if not line.strip():
        return None
    value = json.loads(line)
    env = {str(k): str(v) for k, v in value["env"].items()}
    return env, [str(a) for a in value["argv"]]


def become(env: Mapping[str, str]) -> None:
    """Take on the rank's environment (before the worker reads it)."""
    os.environ.update(env)
