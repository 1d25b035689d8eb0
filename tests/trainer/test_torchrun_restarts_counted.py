"""torchrun's restarts of a custom trainer's worker group are counted in ``status.recovery``.

Two torchrun agents play the gang's two pods on loopback as the operator builds them
(tests/torchrun_agents.py) and run the shipped DDP example with ``--progress-port``, the spec's
``trainer.progressPort``.  The test reads global rank 0's progress document the way the operator
does (its :class:`.progress_client.Poller`, the strict schema, ``progress_status.recovery_changes``
on the stored status), SIGKILLs global rank 0's worker once, and reads again: torchrun's own
count of the restart (its agent's ``TORCHELASTIC_RESTART_COUNT``, what ``--max-restarts`` is
checked against, and which the agent's log says as ``restart_count=1``) is counted once in
``byTier.torchrun``, with an Event, and a second read of the same count adds nothing.
``make test`` tier (slow).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from meshtrain.api import loading
from meshtrain.api.spec import status as api_status
from meshtrain.operator.cluster import progress_client
from meshtrain.operator.policy import progress_status, recovery_count
from meshtrain.trainer import launch
from tests import torchrun_agents

STEPS = 1_000_000
"""Far more than the test waits for: the agents are ended once the count is read."""
DEADLINE_S = 150.0
LIMIT = 2


def _logs(tmp_path: Path) -> str:
    return "".join(
        p.read_text(errors="replace") for p in sorted(tmp_path.glob("agent-*.log")) if p.exists()
    )


def _until(condition: Any, what: str, tmp_path: Path) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"no {what}:\n" + _logs(tmp_path)[-6000:])


def _report(port: int) -> dict[str, Any] | None:
    """Rank 0's checked progress document, read as the operator's poller reads it (None: none yet)."""

    async def read() -> dict[str, Any] | None:
        poller = progress_client.Poller(every=0.0, timeout=2.0)
        try:
            job = torchrun_agents.JOB
            return await poller.poll(job, ip="127.0.0.1", port=port)
        finally:
            await poller.close()

    return asyncio.run(read())


def _counted(port: int, count: int, tmp_path: Path) -> dict[str, Any]:
    """The first report whose torchrun count is ``count`` and that has a step past the restart."""

    def found() -> dict[str, Any] | None:
        report = _report(port)
        counts = (report or {}).get("recovery_counts") or {}
        return report if counts.get("torchrun") == count and report.get("step") else None

    return _until(found, f"progress report with recovery_counts.torchrun={count}", tmp_path)


@pytest.mark.slow
def test_a_torchrun_restart_of_the_worker_group_is_counted_once_in_status(tmp_path: Path) -> None:
    port, progress_port = launch.free_port(), launch.free_port()
    builder = torchrun_agents.ddp_example(STEPS, LIMIT, progress_port)
    spec = loading.parse_spec(builder.raw())
    agents = torchrun_agents.start_gang(
        builder, tmp_path, port, MESHTRAIN_CHECKPOINT_DIR=str(tmp_path), LOGLEVEL="INFO"
    )
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    try:
        _until(lambda: "saved step 10 " in _logs(tmp_path), "checkpoint", tmp_path)
        before = _counted(progress_port, 0, tmp_path)
        status: dict[str, Any] = {"restarts": 0}
        changes, told = progress_status.recovery_changes(status, before, spec, now)
        status |= changes
        assert told == () and status.get("recovery", {}).get("byTier", {}).get("torchrun", 0) == 0

        ranks = _until(
            lambda: torchrun_agents.workers(*(a.pid for a in agents)).get(0), "rank 0", tmp_path
        )
        os.kill(ranks, signal.SIGKILL)  # global rank 0's worker: pod 0's agent restarts
        after = _counted(progress_port, 1, tmp_path)
    finally:
        torchrun_agents.end(agents)
    logs = _logs(tmp_path)
    # torchrun's own account: one failure (said before its budget is taken), one restart
    assert re.search(rf"Worker group FAILED\. {LIMIT}/{LIMIT} attempts left", logs), logs[-6000:]
    # each agent that rejoins logs its round: pod 0's restarted once, none a second time
    pod0 = (tmp_path / "agent-0.log").read_text(errors="replace")
    assert pod0.count("restart_count=1") == 1 and "restart_count=2" not in logs, logs[-6000:]

    changes, told = progress_status.recovery_changes(status, after, spec, now)
    recovery = changes["recovery"]
    assert recovery["byTier"]["torchrun"] == 1 and recovery["inPlaceRestarts"] == 1
    assert recovery["attemptRestarts"] == 1 and recovery["last"]["tier"] == "torchrun"
    assert len(told) == 1 and recovery_count.TORCHRUN in told[0]
    # the status schema takes it, as a merge patch writes it (a null field is left out)
    last = {key: value for key, value in recovery["last"].items() if value is not None}
    api_status.RecoveryStatus.model_validate({**recovery, "last": last})
    status |= changes
    assert progress_status.recovery_changes(status, after, spec, now) == ({}, ())
