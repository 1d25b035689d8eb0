"""Run a benchmark body in ``world`` local gloo processes and collect rank 0's result.

The body is ``rank_fn(rank, world, port, *args, out)``: it joins a process
group on ``127.0.0.1:port`` and, on rank 0, saves its result with
``torch.save(result, Path(out) / RESULT)``.  :func:`spawn` picks a free port,
gives the ranks a scratch directory and returns what rank 0 saved.
"""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

RESULT = "result.pt"


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(rank_fn: Callable[..., None], world: int, *args: Any) -> Any:
    """Run ``rank_fn`` in ``world`` spawned processes; returns rank 0's saved result."""
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-") as out:
        mp.start_processes(rank_fn, args=(world, free_port(), *args, out), nprocs=world, start_method="spawn")
        return torch.load(Path(out) / RESULT)
