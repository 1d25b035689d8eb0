"""Straggler detection: which rank computes persistently slower than the ranks that do its work.

Pure (no torch, no process group): every rank feeds :class:`Detector` the
same vector of per-rank compute seconds (gathered by the step's one world
all-reduce, see :meth:`meshtrain.trainer.engine.Engine.train_step`), so every
rank reaches the same verdict.

A rank's peers are its data-parallel group (same pipeline stage, same tensor
shard): they run the same kernels on equally sized batches.  Each step a
rank's ratio is its compute time over the median of its peers' (the other
replicas', so two replicas compare with each other); its slowdown is the
median of its ratios over the last ``window`` steps, so one slow step (a
checkpoint, a page fault) never flags a rank while a rank slow in about half
of the window is flagged: about ``window / 2`` steps after it slows down.
A tensor-parallel group synchronises inside its compute, so a slow GPU slows
its whole group; the group shares one NVLink domain (its pod's node), which is
what the operator acts on.  Without peers (``data == 1``) nothing is judged.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Sequence

from meshtrain import layout as layout_mod


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


class Detector:
    """Sliding-window slowdown of every rank against its data-parallel peers."""

    def __init__(self, layout: layout_mod.ParallelLayout, threshold: float, window: int) -> None:
        if threshold <= 1:
            raise ValueError(f"threshold={threshold} must be above 1")
        if window < 1:
            raise ValueError(f"window={window} must be at least 1")
        self.threshold = threshold
        self.window = window
        world = layout.world_size
        self._peers = [[r for r in layout.dp_group(rank) if r != rank] for rank in range(world)]
        self._ratios: list[collections.deque[float]] = [
            collections.deque(maxlen=window) for _ in range(world)
        ]
        self._since: dict[int, int] = {}

    @property
    def judged(self) -> bool:
        """Whether ranks have peers at all (data-parallel degree above 1)."""
        return bool(self._peers and self._peers[0])

    def observe(self, step: int, compute_seconds: Sequence[float]) -> None:
        """Add ``step``'s compute seconds of every rank (index = global rank).

        A step where some rank reported nothing (0: the first step of a run,
        which has no previous step to report) is left out for every rank.
        """
        if len(compute_seconds) != len(self._ratios):
            raise ValueError(
                f"{len(compute_seconds)} compute times for a world of {len(self._ratios)}"
            )
        if not self.judged or min(compute_seconds) <= 0:
            return
        for rank, peers in enumerate(self._peers):
            reference = statistics.median(compute_seconds[p] for p in peers)
            self._ratios[rank].append(compute_seconds[rank] / reference)
        for rank in range(len(self._ratios)):
            slow = self.is_slow(rank)
            if slow and rank not in self._since:
                self._since[rank] = step
            elif not slow:
                self._since.pop(rank, None)

    def slowdown(self, rank: int) -> float | None:
        """Median ratio over the steps seen so far in the window (None before the first)."""
        ratios = self._ratios[rank]
        return statistics.median(ratios) if ratios else None

    def is_slow(self, rank: int) -> bool:
        """A full window whose median ratio is above the threshold."""
        value = self.slowdown(rank)
        return (
            len(self._ratios[rank]) == self.window and value is not None and value > self.threshold
        )

    def flags(self) -> list[Flag]:
        """Every flagged rank, slowest first."""
        found = [
            Flag(rank, self.slowdown(rank) or 0.0, since) for rank, since in self._since.items()
        ]
        return sorted(found, key=lambda f: (-f.slowdown, f.rank))

    def verdict(self, step: int) -> Verdict:
        """Slowdowns and flags as of ``step``."""
        return Verdict(
            step,
            tuple(self.slowdown(rank) for rank in range(len(self._ratios))),
            tuple(self.flags()),
        )
