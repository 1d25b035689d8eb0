"""Cost of the straggler detector per training step at large worlds: per-rank Python loop vs numpy.

Every rank runs :class:`meshtrain.trainer.guards.stragglers.Detector` on the whole
world's compute times each step (``observe`` then ``verdict``), so its cost is
added to every step of every rank.  ``before`` is the per-rank loop the
detector used until it was vectorised (each rank's peer list and a
``statistics.median`` per rank per step, then a median over the window per
rank), kept here as the reference; ``after`` is the detector as shipped.  Both
see the same times (one 1.5x slow rank) and must flag the same rank.

Run: ``python benchmarks/bench_straggler_detector.py`` (writes
``benchmarks/results/straggler_detector-<host>.json``).
"""

from __future__ import annotations

import collections
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks import machine
from meshtrain.api import layout as layout_mod
from meshtrain.trainer.guards import stragglers

WINDOW = 20
THRESHOLD = 1.3
LAYOUTS = [(128, 8), (1280, 8)]
"""(data, tensor): world 1024 and world 10240."""


class PerRankLoop:
    """The detector before vectorisation: a Python loop over ranks each step."""

    def __init__(self, layout: layout_mod.ParallelLayout) -> None:
        world = layout.world_size
        self._peers = [[r for r in layout.dp_group(rank) if r != rank] for rank in range(world)]
        self._ratios: list[collections.deque[float]] = [
            collections.deque(maxlen=WINDOW) for _ in range(world)
        ]

    def step(self, compute_seconds: Sequence[float]) -> list[int]:
        for rank, peers in enumerate(self._peers):
            reference = statistics.median(compute_seconds[p] for p in peers)
            self._ratios[rank].append(compute_seconds[rank] / reference)
        slowdowns = [statistics.median(r) for r in self._ratios]
        return [
            rank
            for rank, value in enumerate(slowdowns)
            if len(self._ratios[rank]) == WINDOW and value > THRESHOLD
        ]


class Shipped:
    """The detector as the worker drives it: ``observe`` then ``verdict`` each step."""

    def __init__(self, layout: layout_mod.ParallelLayout) -> None:
        self._detector = stragglers.Detector(layout, THRESHOLD, WINDOW)
        self._step = 0

    def step(self, compute_seconds: Sequence[float]) -> list[int]:
        self._step += 1
        self._detector.observe(self._step, compute_seconds)
        return [f.rank for f in self._detector.verdict(self._step).flagged]


def _times(world: int, steps: int, slow: int) -> list[list[float]]:
    rng = random.Random(0)
    rows = []
    for _ in range(steps):
        row = [0.1 * (1 + rng.uniform(-0.05, 0.05)) for _ in range(world)]
        row[slow] *= 1.5
        rows.append(row)
    return rows


def _seconds_per_step(run: Any, rows: list[list[float]], timed: int) -> tuple[float, Any]:
    result = None
    for row in rows[:-timed]:  # fill the window untimed
        result = run(row)
    start = time.perf_counter()
    for row in rows[-timed:]:
        result = run(row)
    return (time.perf_counter() - start) / timed, result


def main() -> int:
    rows_out = []
    for data, tensor in LAYOUTS:
        layout = layout_mod.ParallelLayout(data=data, pipeline=1, tensor=tensor)
        world = layout.world_size
        slow = world // 2 + 3
        timed = 3 if world > 5000 else 10
        rows = _times(world, WINDOW + timed, slow)
        loop = PerRankLoop(layout)
        before, flagged_before = _seconds_per_step(loop.step, rows, timed)
        after, flagged_after = _seconds_per_step(Shipped(layout).step, rows, timed)
        assert flagged_before == flagged_after == [slow], (flagged_before, flagged_after)
        row = {
            "layout": f"dp{data}·tp{tensor}",
            "world": world,
            "window": WINDOW,
            "timed_steps": timed,
            "before_seconds_per_step": round(before, 5),
            "after_seconds_per_step": round(after, 5),
            "speedup": round(before / after, 1),
        }
        print(row, flush=True)
        rows_out.append(row)
    path = machine.write_results("straggler_detector", rows_out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
