"""Straggler detection: which rank computes persistently slower than the ranks that do its work.

Pure: every rank feeds :class:`Detector` the same vector of per-rank compute seconds (carried by
the step's one world all-reduce), so all reach the same verdict.  A rank's peers are its
data-parallel group; its slowdown is the median over a window of its time over theirs, with
hysteresis (docs/trainer.md, "Straggler detection").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from meshtrain.api import layout as layout_mod


@dataclasses.dataclass(frozen=True)
class Flag:
    """A rank judged a straggler."""

    rank: int
    slowdown: float
    """Median over the window of its compute time over its peers' median."""
    since_step: int
    """Step at which it was flagged (in this run of the gang); it stays flagged while slow."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the detector says after a step."""

    step: int
    slowdowns: tuple[float | None, ...]
    """Per global rank: its slowdown so far (None before its first judged step)."""
    flagged: tuple[Flag, ...]
    """Straggler ranks, slowest first."""

    @property
    def worst(self) -> Flag | None:
        return self.flagged[0] if self.flagged else None

    def is_flagged(self, rank: int) -> bool:
        return any(f.rank == rank for f in self.flagged)


def clear_margin(threshold: float) -> float:
    """How far below ``threshold`` a flagged rank's slowdown must fall to be cleared."""
    return min(0.05, (threshold - 1) / 2)


def leave_one_out_medians(times: np.ndarray) -> np.ndarray:
    """``out[g, i]``: median of row ``g`` of ``times`` without its element ``i`` (rows of 2 or more)."""
    groups, size = times.shape
    order = np.argsort(times, axis=1, kind="stable")
    ordered = np.take_along_axis(times, order, axis=1)
    position = np.empty_like(order)
    np.put_along_axis(position, order, np.arange(size)[None, :].repeat(groups, axis=0), axis=1)
    others = size - 1

    def without(j: int) -> np.ndarray:
        # j-th smallest of the row once the element at sorted ``position`` is removed
        shifted = np.minimum(j + (j >= position), size - 1)
        return np.take_along_axis(ordered, shifted, axis=1)

    if others % 2:
        return without(others // 2)
    middle: np.ndarray = (without(others // 2 - 1) + without(others // 2)) / 2
    return middle


class Detector:
    """Sliding-window slowdown of every rank against its data-parallel peers."""

    def __init__(self, layout: layout_mod.ParallelLayout, threshold: float, window: int) -> None:
        if threshold <= 1:
            raise ValueError(f"threshold={threshold} must be above 1")
        if window < 1:
            raise ValueError(f"window={window} must be at least 1")
        self.threshold = threshold
        self.window = window
        self._world = layout.world_size
        self._groups = np.array(
            [layout.dp_group(r) for r in range(self._world) if layout.coords(r).dp == 0],
            dtype=np.int64,
        )
        self._ratios = np.zeros((window, self._world))
        self._filled = 0
        self._next = 0
        self._slowdowns: np.ndarray | None = None
        self._since: dict[int, int] = {}

    @property
    def judged(self) -> bool:
        """Whether ranks have peers at all (data-parallel degree above 1)."""
        return bool(self._groups.shape[1] > 1)

    def observe(self, step: int, compute_seconds: Sequence[float]) -> None:
        """Add ``step``'s compute seconds of every rank (index = global rank).

        A step where some rank reported nothing (0: the first step of a run,
        which has no previous step to report) is left out for every rank.
        """
        if len(compute_seconds) != self._world:
            raise ValueError(f"{len(compute_seconds)} compute times for a world of {self._world}")
        times = np.asarray(compute_seconds, dtype=np.float64)
        if not self.judged or times.min() <= 0:
            return
        grouped = times[self._groups]
        ratios = np.empty(self._world)
        ratios[self._groups] = grouped / leave_one_out_medians(grouped)
        self._ratios[self._next] = ratios
        self._next = (self._next + 1) % self.window
        self._filled = min(self._filled + 1, self.window)
        self._slowdowns = np.median(self._ratios[: self._filled], axis=0)
        if self._filled < self.window:
            return
        flagged = np.zeros(self._world, dtype=bool)
        if self._since:
            flagged[list(self._since)] = True
        limit = np.where(flagged, self.threshold - clear_margin(self.threshold), self.threshold)
        slow = self._slowdowns > limit
        for rank in np.flatnonzero(slow & ~flagged).tolist():
            self._since[rank] = step
        for rank in np.flatnonzero(flagged & ~slow).tolist():
            del self._since[rank]

    def slowdown(self, rank: int) -> float | None:
        """Median ratio over the steps seen so far in the window (None before the first)."""
        return None if self._slowdowns is None else float(self._slowdowns[rank])

    def is_slow(self, rank: int) -> bool:
        """Flagged: a full window whose median ratio went above the threshold and has not fallen back."""
        return rank in self._since

    def flags(self) -> list[Flag]:
        """Every flagged rank, slowest first."""
        found = [
            Flag(rank, self.slowdown(rank) or 0.0, since) for rank, since in self._since.items()
        ]
        return sorted(found, key=lambda f: (-f.slowdown, f.rank))

    def verdict(self, step: int) -> Verdict:
        """Slowdowns and flags as of ``step``."""
        slowdowns: tuple[float | None, ...] = (
            (None,) * self._world if self._slowdowns is None else tuple(self._slowdowns.tolist())
        )
        return Verdict(step, slowdowns, tuple(self.flags()))
