"""Ranks tell ``meshtrain run`` they are ready: one empty file per rank in the directory it names.

A rank is ready once its imports (torch) are done and its spec and data are checked, the minute a
laptop spends before any step with eight ranks; it joins the process group next.  ``meshtrain
run`` names the directory in ``MESHTRAIN_READY_DIR`` and shows ``3 of 8 ranks ready`` from the
files; without the variable (a pod, a test's own launcher) a rank writes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "MESHTRAIN_READY_DIR"
"""Directory of the ready files, set by ``meshtrain run`` for its ranks."""


def _path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}"


def mark(rank: int) -> None:
    """Say that ``rank`` is ready, where ``meshtrain run`` asked; a failed write only loses the count."""
    directory = os.environ.get(ENV)
    if not directory:
        return
    try:
        _path(Path(directory), rank).touch()
    except OSError:
        pass


def reset(directory: Path) -> None:
    """An empty ready directory (a reused log directory keeps the last run's files otherwise)."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("rank-*"):
        stale.unlink(missing_ok=True)


def count(directory: Path, world: int) -> int:
    """Ranks below ``world`` that said they are ready (one stat per rank, nothing else read)."""
    return sum(_path(directory, rank).exists() for rank in range(world))
