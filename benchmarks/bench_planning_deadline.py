"""Benchmark of the operator's planning: its cost at 2,048 to 65,536 GPUs, and where it runs.

1. Memory admission (``memory_admission.admit``, issue #32's ``sizing.admit``) and the whole plan
   (``placement_outcome.plan_sizes``: admission and placement on a cluster that holds the gang) at
   dp2048, dp8192 and dp65536, before (rank groups collected rank by rank, the old
   ``ParallelLayout.all_groups``) and after (listed from each group's first rank), side by side.
   Each case runs in a fresh process, cut off after ``--cutoff`` seconds.
2. A plan that outlasts a 0.5 s deadline (the largest elastic job on a full cluster) run three ways:
   on the event loop, in a thread, in the operator's planning worker.  For each: the longest the
   event loop went without running, when the caller had its answer, and how long the plan kept
   burning CPU after the deadline.  This is why the operator plans in a process.

    python benchmarks/bench_planning_deadline.py [--cutoff 30]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine
from meshtrain import placement
from meshtrain.api import layout, loading
from meshtrain.api import spec as api_spec
from meshtrain.operator import planning
from meshtrain.operator.policy import memory_admission, placement_outcome
from meshtrain.planner import profiles
from tests.builders import JobBuilder

DEGREES = (2048, 8192, 65536)
GPUS_PER_NODE = 8
CHOICE = memory_admission.Choice(profiles.get("h100-sxm"), "the benchmark's profile")
DEADLINE = 0.5


def _rank_by_rank(self: layout.ParallelLayout, axis: str) -> list[list[int]]:
    """The old ``all_groups``: each rank's group collected, duplicates dropped (O(world x group))."""
    member_of = {"tp": self.tp_group, "dp": self.dp_group, "pp": self.pp_group}[axis]
    seen: dict[tuple[int, ...], None] = {}
    for rank in range(self.world_size):
        seen.setdefault(tuple(member_of(rank)), None)
    return [list(group) for group in seen]


def _spec(data: int) -> api_spec.TrainingJobSpec:
    return loading.parse_spec(JobBuilder().layout(data=data).gpus(GPUS_PER_NODE).raw())


def _ask(spec: api_spec.TrainingJobSpec, nodes: int) -> placement_outcome.Ask:
    offered = tuple(placement.Node(f"n{i:05d}", GPUS_PER_NODE) for i in range(nodes))
    return placement_outcome.Ask(declared=spec, cap=None, choice=CHOICE, offered=offered)


def _timed(what: str, data: int, before: bool) -> float:
    """Seconds of one call of ``what`` (``admit`` or ``plan``) at dp``data``, in this process."""
    if before:
        layout.ParallelLayout.all_groups = _rank_by_rank  # type: ignore[method-assign]
    spec = _spec(data)
    ask = _ask(spec, spec.pods)
    started = time.perf_counter()
    if what == "admit":
        memory_admission.admit(spec, CHOICE)
    else:
        placement_outcome.plan_sizes(ask)
    return time.perf_counter() - started


def _in_fresh_process(what: str, data: int, before: bool, cutoff: float) -> float | None:
    """:func:`_timed` in a process of its own, killed after ``cutoff`` s (None)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        future = pool.submit(_timed, what, data, before)
        try:
            return future.result(timeout=cutoff)
        except concurrent.futures.TimeoutError:
            for process in list(pool._processes.values()):  # benchmark only: stop the cut-off run
                process.kill()
            return None


def costs(cutoff: float) -> list[dict[str, Any]]:
    rows = []
    for data in DEGREES:
        row: dict[str, Any] = {"data": data, "world": data}
        for what in ("admit", "plan"):
            for when in ("before", "after"):
                row[f"{what}_{when}_s"] = _in_fresh_process(what, data, when == "before", cutoff)
        rows.append(row)
    return rows


SLOW = loading.parse_spec(JobBuilder.largest_world(elastic_down_to=2048).raw())
"""The largest world, any degree from 8192 down to 2048 (a second or two of planning on a full
cluster, where every degree is planned); down to 1 it takes more than ten minutes."""


async def _watch_loop(stop: asyncio.Event, gaps: list[float]) -> None:
    last = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.005)
        now = time.monotonic()
        gaps.append(now - last)
        last = now


async def _run_where(where: str) -> dict[str, Any]:
    """Plan :data:`SLOW` ``inline``, in a ``thread`` or in the ``process`` worker, under :data:`DEADLINE`."""
    ask = _ask(SLOW, 0)
    gaps: list[float] = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_loop(stop, gaps))
    await asyncio.sleep(0.05)
    worker = planning.Worker(DEADLINE)
    if where == "process":
        await worker.plan(_ask(_spec(8), 1))  # started: the deadline is the plan's alone
    done = threading.Event()

    def plan() -> None:
        try:
            placement_outcome.plan_sizes(ask)
        finally:
            done.set()

    started = time.monotonic()
    if where == "inline":  # nothing can cut it off: the loop gets control back when it ends
        plan()
        ended = time.monotonic()
    elif where == "thread":
        try:
            await asyncio.wait_for(asyncio.to_thread(plan), DEADLINE)
        except TimeoutError:
            pass
        answered = time.monotonic()
        await asyncio.to_thread(done.wait)  # the thread cannot be stopped: it plans on
        ended = time.monotonic()
    else:
        try:
            await worker.plan(ask)
        except planning.DeadlineExceeded:
            pass
        ended = time.monotonic()
    answered = answered if where == "thread" else ended
    stop.set()
    await watcher
    worker.stop()
    return {
        "where": where,
        "longest_loop_gap_s": max(gaps),
        "caller_answered_after_s": answered - started,
        "plan_ran_past_deadline_s": max(0.0, ended - started - DEADLINE),
    }


def placement_sites() -> list[dict[str, Any]]:
    return [asyncio.run(_run_where(where)) for where in ("inline", "thread", "process")]


def _seconds(value: float | None, cutoff: float) -> str:
    return f"> {cutoff:g}" if value is None else f"{value:.3f}"


def table(rows: list[dict[str, Any]], sites: list[dict[str, Any]], cutoff: float) -> str:
    lines = [
        "cost of planning (seconds; rank groups rank by rank before, from each first rank after)",
        f"{'world':>6}  {'admit before':>12} {'admit after':>11} {'ratio':>7}  "
        f"{'plan before':>11} {'plan after':>10} {'ratio':>7}",
    ]
    for row in rows:
        cells = []
        for what in ("admit", "plan"):
            before, after = row[f"{what}_before_s"], row[f"{what}_after_s"]
            ratio = f"{before / after:.0f}x" if before and after else "-"
            cells.append(f"{_seconds(before, cutoff):>12} {_seconds(after, cutoff):>11} {ratio:>7}")
        lines.append(f"{row['world']:>6}  {'  '.join(cells)}")
    lines += [
        "",
        f"a plan that outlasts a {DEADLINE:g} s deadline (the largest elastic job, full cluster)",
        f"{'where':>8} {'longest loop gap':>17} {'caller answered':>16} {'ran past deadline':>18}",
    ]
    for site in sites:
        lines.append(
            f"{site['where']:>8} {site['longest_loop_gap_s']:>16.3f}s "
            f"{site['caller_answered_after_s']:>15.3f}s {site['plan_ran_past_deadline_s']:>17.3f}s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cutoff", type=float, default=30.0, help="seconds after which a case is stopped"
    )
    args = parser.parse_args(argv)
    rows = costs(args.cutoff)
    sites = placement_sites()
    print(table(rows, sites, args.cutoff))
    settings = {"cutoff_s": args.cutoff, "deadline_s": DEADLINE, "gpus_per_node": GPUS_PER_NODE}
    out = machine.write_results(
        "planning_deadline", {"settings": settings, "costs": rows, "sites": sites}
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
