"""The planning worker: a gang's plan computed in a child process and cut off at a deadline.

Planning is CPU work that grows with a job's world size and elastic range.  On the event loop it
would stall Lease renewals, the liveness probe and every other job; in a thread it would still
share the GIL and could not be stopped at the deadline, nor its memory reclaimed.  A process runs
beside the loop, is killed when it overruns, and a fresh one serves the next plan
(``benchmarks/bench_planning_deadline.py`` measures the three; docs/operator.md has the numbers).
One worker: placements are planned one at a time anyway (``placing``'s lock).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool

from meshtrain.operator.policy import placement_outcome

logger = logging.getLogger("meshtrain.operator")

DEFAULT_DEADLINE_SECONDS = 10.0
"""Default of ``--planning-deadline-seconds``: the largest job the CRD admits (65,536 GPUs) plans in
well under a second; only a wide elastic range of such a job, planned size by size, takes longer."""
START_SECONDS = 60.0
"""How long a fresh worker may take to start (import the planner); not counted against a plan."""


class DeadlineExceeded(Exception):
    """The plan outlasted the deadline; the worker was killed."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"planning took longer than {seconds:g} s")
        self.seconds = seconds


class WorkerFailed(Exception):
    """The worker died (out of memory, killed) or did not start: no verdict on the job."""


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
        """:func:`placement_outcome.plan_sizes` of ``ask`` in the worker, within the deadline."""
        async with self._lock:
            pool = await self._started()
            loop = asyncio.get_running_loop()
            started = time.monotonic()
            try:
                sized = await asyncio.wait_for(
                    loop.run_in_executor(pool, placement_outcome.plan_sizes, ask),
                    self.deadline_seconds,
                )
            except TimeoutError:
                self.stop()
                raise DeadlineExceeded(self.deadline_seconds) from None
            except BrokenProcessPool as err:
                self.stop()
                raise WorkerFailed(f"the planning worker died: {err}") from err
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
