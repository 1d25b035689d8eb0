"""The planning worker: plans off the event loop, in a process cut off at the deadline.

Unit tier (``make test``): a real child process, no cluster.  The hostile plan is a real one, a
job of the largest world the CRD admits with an elastic range planned size by size.
"""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys
import time

from meshtrain import placement
from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.operator import planning
from meshtrain.operator.policy import memory_admission, placement_outcome
from meshtrain.planner import profiles
from tests.builders import JobBuilder

CHOICE = memory_admission.Choice(profiles.get("h100-sxm"), "the test's profile")
NODES = tuple(placement.Node(f"n{i}", 8, {}) for i in range(2))
NORMAL = loading.parse_spec(JobBuilder().layout(data=2).gpus(1).raw())
HOSTILE = loading.parse_spec(JobBuilder.largest_world(elastic_down_to=1).raw())
"""65,536 GPUs, any data-parallel degree down to 1: where none fits, every degree is planned."""


def ask(
    spec: api_spec.TrainingJobSpec, offered: tuple[placement.Node, ...] = NODES
) -> placement_outcome.Ask:
    return placement_outcome.Ask(declared=spec, cap=None, choice=CHOICE, offered=offered)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a killed one not yet reaped is a zombie: not running)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_the_worker_plans_what_the_policy_plans() -> None:
    async def run() -> placement_outcome.Sized:
        worker = planning.Worker(deadline_seconds=60)
        try:
            return await worker.plan(ask(NORMAL))
        finally:
            worker.stop()

    assert asyncio.run(run()) == placement_outcome.plan_sizes(ask(NORMAL))


def test_a_plan_past_the_deadline_is_cut_off_and_the_loop_never_waits_on_it() -> None:
    """The hostile plan runs for minutes; the worker is killed at the deadline, the event loop ticks
    all along, and the next plan gets a fresh worker."""
    deadline = 2.0

    async def run() -> tuple[float, float, int | None, placement_outcome.Sized]:
        worker = planning.Worker(deadline_seconds=deadline)
        await worker.plan(ask(NORMAL))  # started: the deadline is the plan's alone
        killed = worker._pid
        gaps: list[float] = []
        stop = asyncio.Event()

        async def tick() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        started = time.monotonic()
        try:
            await worker.plan(ask(HOSTILE, offered=()))  # a full cluster
        except planning.DeadlineExceeded as exceeded:
            assert exceeded.seconds == deadline
        else:
            raise AssertionError("the hostile plan finished within the deadline")
        took = time.monotonic() - started
        stop.set()
        await ticker
        after = await worker.plan(ask(NORMAL))
        worker.stop()
        return took, max(gaps), killed, after

    took, longest_gap, killed, after = asyncio.run(run())
    assert deadline <= took < deadline + 5, took
    assert longest_gap < 0.5, f"the event loop stalled {longest_gap:.2f} s during the plan"
    assert killed is not None
    assert not _alive(killed), f"worker {killed} still runs after the deadline"
    assert after == placement_outcome.plan_sizes(ask(NORMAL))


ORPHAN = """
import asyncio, sys, time
from meshtrain.operator import planning
from tests.unit import test_operator_planning as here

async def main():
    worker = planning.Worker(deadline_seconds=600)
    await worker.plan(here.ask(here.NORMAL))
    print(worker._pid, flush=True)
    await worker.plan(here.ask(here.HOSTILE, offered=()))  # minutes of planning

asyncio.run(main())
"""


def test_a_killed_operator_leaves_no_worker_behind() -> None:
    """SIGKILL runs no clean-up: the worker, mid-plan, notices its parent gone and ends."""
    operator = subprocess.Popen(
        [sys.executable, "-c", ORPHAN],
        stdout=subprocess.PIPE,
        cwd=pathlib.Path(__file__).parents[2],
    )
    assert operator.stdout is not None
    worker = int(operator.stdout.readline())
    time.sleep(0.5)
    assert _alive(worker)
    operator.kill()
    operator.wait(timeout=10)
    deadline = time.monotonic() + 3 * planning.PARENT_CHECK_SECONDS + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), f"worker {worker} outlived the operator"
