"""The planning worker: a gang's plan computed in a child process and cut off at a deadline.

Planning is CPU work that grows with a job's world size and elastic range.  On the event loop it
would stall Lease renewals, the liveness probe and every other job; in a thread it would still
share the GIL and could not be stopped at the deadline, nor its memory reclaimed.  A process runs
beside the loop, is killed when it overruns, and a fresh one serves the next plan
(``benchmarks/bench_planning_deadline.py`` measures the three; docs/operator.md has the numbers).
One worker: placements are planned one at a time anyway (``placing``'s lock).

The deadline is the worker's CPU time, not the wall clock: on a busy node (the chart requests a
tenth of a core, no limit) a plan of one CPU second can take ten on the wall, and that is no verdict
on the job.  A wall-clock cap of :data:`WALL_CAP_FACTOR` deadlines still ends a plan that is starved
(:class:`Starved`, no verdict: the job is planned again later), so nothing waits forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import pathlib
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool

from meshtrain.operator.policy import placement_outcome

logger = logging.getLogger("meshtrain.operator")

DEFAULT_DEADLINE_SECONDS = 10.0
"""Default of ``--planning-deadline-seconds``: the largest job the CRD admits (65,536 GPUs) plans in
well under a second; only a wide elastic range of such a job, planned size by size, takes longer."""
WALL_CAP_FACTOR = 6.0
"""A plan is stopped after this many deadlines on the wall clock, whatever CPU time it had."""
START_SECONDS = 60.0
"""How long a fresh worker may take to start (import the planner); not counted against a plan."""


class DeadlineExceeded(Exception):
    """The plan used the deadline's CPU time; the worker was killed."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"planning took longer than {seconds:g} s")
        self.seconds = seconds


class WorkerFailed(Exception):
    """The worker died (out of memory, killed) or did not start: no verdict on the job."""


class Starved(WorkerFailed):
    """The plan reached the wall-clock cap with less CPU time than the deadline: the worker was
    killed, and the node's load, not the job, is to blame (no verdict on the job)."""

    def __init__(self, cpu_seconds: float, wall_seconds: float) -> None:
        super().__init__(
            f"planning was stopped after {wall_seconds:.0f} s on the wall clock with only "
            f"{cpu_seconds:.1f} s of CPU time (the operator's node is busy); planning again later"
        )
        self.cpu_seconds = cpu_seconds
        self.wall_seconds = wall_seconds


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) process ``pid`` has used, from ``/proc``; None where unreadable."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (IndexError, ValueError):
        return None


PARENT_CHECK_SECONDS = 1.0
"""How often the worker checks that the operator that started it still runs."""


def _exit_with(parent: int) -> None:
    """Run in the worker at its start: end it once ``parent`` is gone.

    A killed operator (SIGKILL, OOM) closes nothing, and the worker, mid-plan or idle, would
    live on as an orphan burning CPU; its new parent is not ``parent``.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _ready() -> int:
    """Run first in a fresh worker: its imports done, it answers with its process id."""
    return os.getpid()


class Worker:
    """One planning process, started on first use and replaced after a kill or a crash."""

    def __init__(self, deadline_seconds: float = DEFAULT_DEADLINE_SECONDS) -> None:
        self.deadline_seconds = deadline_seconds
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._pid: int | None = None
        self._lock = asyncio.Lock()
        """One plan at a time: a plan's deadline starts when the worker takes it, not when queued."""
        self.last_seconds = 0.0
        """What the last plan that finished took in the worker (not counting a worker's start)."""

    async def plan(self, ask: placement_outcome.Ask) -> placement_outcome.Sized:
        """:func:`placement_outcome.plan_sizes` of ``ask`` in the worker, within the deadline.

        A worker that dies is replaced and the plan tried once more before :class:`WorkerFailed`
        blames nobody: a worker that died while idle says nothing of the job it was handed.
        """
        async with self._lock:
            for retried in (False, True):
                pool = await self._started()
                try:
                    return await self._run(pool, ask)
                except BrokenProcessPool as err:
                    self.stop()
                    if retried:
                        raise WorkerFailed(f"the planning worker died: {err}") from err
                    logger.info("planning worker died (%s); planning again in a fresh one", err)
            raise AssertionError("unreachable")

    async def _run(
        self, pool: concurrent.futures.ProcessPoolExecutor, ask: placement_outcome.Ask
    ) -> placement_outcome.Sized:
        """The plan in ``pool``'s worker, cut off once it used the deadline's CPU time (or the wall cap).

        Cancelled (kopf cancels a deleted job's handler), the worker is killed too: left planning,
        it would hold up the next plan, whose deadline would run out waiting.
        """
        assert self._pid is not None
        pid, deadline = self._pid, self.deadline_seconds
        started, cpu_before = time.monotonic(), cpu_seconds(pid)
        fut = asyncio.get_running_loop().run_in_executor(pool, placement_outcome.plan_sizes, ask)
        try:
            while not fut.done():
                wall = time.monotonic() - started
                now_cpu = cpu_seconds(pid)
                used = wall if cpu_before is None or now_cpu is None else now_cpu - cpu_before
                if used >= deadline:
                    raise DeadlineExceeded(deadline)
                if wall >= WALL_CAP_FACTOR * deadline:
                    raise Starved(used, wall)
                wait = min(deadline - used, WALL_CAP_FACTOR * deadline - wall)
                await asyncio.wait({fut}, timeout=max(wait, 0.02))
        except BaseException:  # past the deadline or the cap, or cancelled: the worker goes too
            if not fut.done():
                fut.cancel()  # its worker's death is no news to anyone
                self.stop()
            raise
        sized = fut.result()
        self.last_seconds = time.monotonic() - started
        return sized

    async def _started(self) -> concurrent.futures.ProcessPoolExecutor:
        """The running worker, or a fresh one once it has imported the planner."""
        if self._pool is not None:
            return self._pool
        # spawn, not fork: the operator runs threads (the metrics server, the executor's own).
        # A spawned child imports the parent's main module again: `meshtrain` and
        # `python -m meshtrain.cli.main` run their entry only under `__name__ == "__main__"`.
        pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_exit_with,
            initargs=(os.getpid(),),
        )
        try:
            pid = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(pool, _ready), START_SECONDS
            )
        except (TimeoutError, BrokenProcessPool, OSError) as err:
            pool.shutdown(wait=False, cancel_futures=True)
            raise WorkerFailed(
                f"the planning worker did not start within {START_SECONDS:g} s: {err!r}"
            ) from err
        except BaseException:  # cancelled: the pool, never assigned, would outlive the worker
            _kill_all(pool)
            raise
        self._pool, self._pid = pool, pid
        logger.info("planning worker started (pid %d)", pid)
        return pool

    def stop(self) -> None:
        """Kill the worker (mid-plan too) and forget it; the next plan starts a fresh one."""
        if self._pid is not None:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:  # already gone (it crashed)
                pass
            logger.info("planning worker (pid %d) stopped", self._pid)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool, self._pid = None, None


def _kill_all(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Kill ``pool``'s process, started but not yet ready (its id not learnt), and shut it down."""
    for pid in list(pool._processes or {}):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    pool.shutdown(wait=False, cancel_futures=True)
