"""The planning worker: plans off the event loop, in a process cut off at the deadline.

Unit tier (``make test``): a real child process, no cluster.  The hostile plan is a real one, a
job of the largest world the CRD admits with an elastic range planned size by size.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pathlib
import signal
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
    # The hostile plan runs for minutes: ending within half a minute of the deadline shows the cut.
    # (A tighter bound measured the machine's load: killing and reaping took 6-10 s at load 20.)
    assert deadline <= took < deadline + 30, took
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


def test_a_cancelled_plan_stops_the_worker_and_the_next_plan_gets_its_whole_deadline() -> None:
    """kopf cancels a deleted job's handler mid-plan: the worker is killed with it, so the next job's
    plan does not queue behind the cancelled one and run out of deadline waiting."""

    async def run() -> tuple[int | None, placement_outcome.Sized]:
        worker = planning.Worker(deadline_seconds=30)
        await worker.plan(ask(NORMAL))
        cancelled = worker._pid
        hostile = asyncio.create_task(worker.plan(ask(HOSTILE, offered=())))
        await asyncio.sleep(1.0)
        hostile.cancel()
        try:
            await hostile
        except asyncio.CancelledError:
            pass
        worker.deadline_seconds = 3
        try:
            return cancelled, await worker.plan(ask(NORMAL))
        finally:
            worker.stop()

    cancelled, after = asyncio.run(run())
    assert cancelled is not None and not _alive(cancelled), "the cancelled plan's worker runs on"
    assert after == placement_outcome.plan_sizes(ask(NORMAL))


def test_a_worker_cancelled_while_starting_is_killed_at_once() -> None:
    """Cancelled while its worker imports the planner, a start leaves no process to finish it."""

    async def run() -> list[multiprocessing.process.BaseProcess]:
        # only this worker's process: the suite's worker may hold other tests' children
        before = set(multiprocessing.active_children())
        worker = planning.Worker(deadline_seconds=30)
        starting = asyncio.create_task(worker.plan(ask(NORMAL)))
        await asyncio.sleep(0.2)
        started = [p for p in multiprocessing.active_children() if p not in before]
        assert started, "no worker process started"
        starting.cancel()
        try:
            await starting
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.3)
        return [p for p in started if p.is_alive()]

    assert not asyncio.run(run()), "a cancelled start left its worker running"


def _plan_while_stopped(deadline: float, stopped_for: float) -> placement_outcome.Sized:
    """Plan NORMAL in a worker the kernel runs none of the time for ``stopped_for`` seconds (SIGSTOP):
    a node so busy that the plan waits on the wall clock with no CPU time."""

    async def run() -> placement_outcome.Sized:
        worker = planning.Worker(deadline_seconds=deadline)
        await worker.plan(ask(NORMAL))
        pid = worker._pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(stopped_for, os.kill, pid, signal.SIGCONT)
        try:
            return await worker.plan(ask(NORMAL))
        finally:
            worker.stop()

    return asyncio.run(run())


def test_the_deadline_is_cpu_time_not_time_spent_waiting_for_a_cpu() -> None:
    """Waiting past the deadline on the wall clock with no CPU time is no verdict on the job."""
    deadline = 1.0
    assert 2 * deadline < planning.WALL_CAP_FACTOR * deadline
    assert _plan_while_stopped(deadline, 2 * deadline) == placement_outcome.plan_sizes(ask(NORMAL))


def test_a_plan_starved_past_the_wall_cap_is_stopped_without_a_verdict_on_the_job() -> None:
    deadline = 0.5
    started = time.monotonic()
    try:
        _plan_while_stopped(deadline, 60)
    except planning.DeadlineExceeded:
        raise AssertionError("a starved plan was refused as if it had used its deadline") from None
    except planning.Starved as starved:
        assert starved.cpu_seconds < deadline <= starved.wall_seconds
        assert isinstance(starved, planning.WorkerFailed)  # no verdict: the job is planned again
    else:
        raise AssertionError("the starved plan was never stopped")
    assert time.monotonic() - started < 60


def test_a_worker_that_died_while_idle_is_replaced_without_blaming_the_next_job() -> None:
    async def run() -> placement_outcome.Sized:
        worker = planning.Worker(deadline_seconds=30)
        await worker.plan(ask(NORMAL))
        assert worker._pid is not None
        os.kill(worker._pid, signal.SIGKILL)
        dead = worker._pid
        while _alive(dead):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the pool notices its worker gone
        try:
            return await worker.plan(ask(NORMAL))
        finally:
            worker.stop()

    assert asyncio.run(run()) == placement_outcome.plan_sizes(ask(NORMAL))
