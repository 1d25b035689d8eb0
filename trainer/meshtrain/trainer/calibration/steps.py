"""What ``meshtrain plan --calibrate`` shows while it measures: each measurement, ``i of n``.

The measuring processes are spawned; rank 0 names each finished measurement on a queue and the
parent advances a :class:`meshtrain.api.console.Phase` with it (a bar on a terminal, one line
otherwise).
"""

from __future__ import annotations

import queue
from typing import Any

from meshtrain.api import console
from meshtrain.planner import profiles

FIXED = ("matmul FLOP/s", "per-op overhead", "transformer block")
"""The measurements before the collectives, in the order the workers take them."""


def count(groups: int, sizes: int) -> int:
    """Measurements of a calibration: :data:`FIXED`, then every collective op at ``sizes`` sizes per group axis."""
    return len(FIXED) + groups * len(profiles.COLLECTIVE_OPS) * sizes


def done(progress: Any, rank: int, what: str) -> None:
    """Rank 0 tells the parent that ``what`` is measured (``progress``: the queue, or None)."""
    if rank == 0 and progress is not None:
        progress.put(what)


def follow(workers: list[Any], progress: Any, phase: console.Phase) -> None:
    """Until every worker exited: each measurement rank 0 reports advances ``phase``; then join them."""
    alive = True
    while alive:
        alive = any(worker.is_alive() for worker in workers)
        try:  # after the last exit, what is still queued (bounded: one entry per measurement)
            what = progress.get(timeout=0.2) if alive else progress.get_nowait()
        except queue.Empty:
            continue
        phase.update()
        phase.status(what)
        alive = True
    for worker in workers:
        worker.join()
