"""Goodput of a real run with a killed rank, rebuilt as the operator rebuilds a gang.

Two ranks train with checkpoints every 3 steps; rank 1 dies before step 6 (``MESHTRAIN_FAULT_INJECT``),
rank 0 fails in its next collective.  A new gang is started on the same log and checkpoint
directories, as a pod's ``MESHTRAIN_LOG_DIR`` on the checkpoint volume outlives a gang: it
resumes from step 3, and its rank 0 finds steps 4 and 5 in steps.jsonl and writes the ``gang``
recovery record.  The test's own clock brackets the record's times, and the account is held to
the raw step records.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from meshtrain.trainer import launch
from meshtrain.trainer.guards import faults
from meshtrain.trainer.telemetry import goodput, progress, steplog
from tests.builders import JobBuilder

WORLD = 2
HANG = 240


def _gang(spec: Path, log_dir: Path, **extra: str) -> list[int]:
    """Start every rank as a pod's trainer does (no launcher truncating steps.jsonl); exit codes."""
    port = launch.free_port()
    procs = []
    for rank in range(WORLD):
        env = {
            **launch.rank_env(rank, WORLD, port, log_dir, cuda=False),
            "MESHTRAIN_CHECKPOINT_DIR": str(log_dir / "checkpoints"),
            progress.TERMINATION_LOG_ENV: str(log_dir / f"termination-{rank}"),
            "OMP_NUM_THREADS": "1",
            **extra,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "meshtrain.trainer", "--spec", str(spec)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=(log_dir / f"rank-{rank}.err").open("a"),
            )
        )
    try:
        return [proc.wait(timeout=HANG) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
def test_a_killed_rank_and_a_rebuilt_gang_are_accounted(tmp_path: Path) -> None:
    raw = (
        JobBuilder.cpu_run()
        .layout(data=WORLD)
        .training(steps=8)
        .checkpoint(intervalSteps=3, asyncSave=False)
        .raw()
    )
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(raw))
    log_dir = tmp_path / "logs"
    log_dir.mkdir()

    first = _gang(spec, log_dir, **{faults.ENV: "1:6"})
    assert first[1] == faults.EXIT_CODE and first[0] != 0
    before = steplog.read(log_dir / steplog.FILENAME)
    assert [r["step"] for r in before] == [1, 2, 3, 4, 5]
    time.sleep(1.0)  # the operator's turn: a gang rebuild takes a while
    relaunched = time.time()
    assert _gang(spec, log_dir) == [0, 0], (log_dir / "rank-0.err").read_text()[-3000:]
    after = steplog.read(log_dir / steplog.FILENAME)

    (record,) = [
        json.loads(line) for line in (log_dir / goodput.RECOVERIES).read_text().splitlines()
    ]
    assert (record["tier"], record["resumedStep"], record["lostSteps"]) == ("gang", 3, 2)
    assert record["failedAt"] == before[-1]["time"]
    assert record["failedAt"] < relaunched < record["rejoinedAt"] <= record["restoredAt"]
    assert (
        record["restoredAt"] < after[len(before)]["time"]
    )  # before the first step of the new gang

    account = goodput.account_of(log_dir)
    # from the raw records: each step's last run is productive, steps 4 and 5's first runs are lost
    last_run = {r["step"]: r["step_seconds"] for r in after}
    assert sorted(last_run) == list(range(1, 9))
    assert account.productive_seconds == pytest.approx(sum(last_run.values()))
    assert account.wall_seconds == pytest.approx(
        after[-1]["time"] - (after[0]["time"] - after[0]["step_seconds"])
    )
    (failure,) = account.failures
    assert failure.seconds["recompute"] == pytest.approx(
        before[3]["step_seconds"] + before[4]["step_seconds"]
    )
    assert failure.seconds["restart"] == pytest.approx(record["rejoinedAt"] - record["failedAt"])
    assert failure.seconds["restart"] > 1.0  # the test's pause between the gangs is in it
    assert failure.seconds["reload"] == pytest.approx(record["restoredAt"] - record["rejoinedAt"])
    assert 0 < account.ratio < 1

    # rank 0's final progress document carries its live account of the same run
    final = json.loads((log_dir / "termination-0").read_text())["goodput"]
    assert final["lost_seconds"]["restart"] == pytest.approx(failure.seconds["restart"], abs=1e-3)
    assert final["lost_seconds"]["recompute"] == pytest.approx(
        failure.seconds["recompute"], rel=0.05
    )
    assert final["ratio"] == pytest.approx(account.ratio, abs=0.05)
