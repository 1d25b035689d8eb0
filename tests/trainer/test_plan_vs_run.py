"""The README's local example, planned and run through the real command line: the default plan
prices this host's cores (predicted within 4x of the measured step), plan and run report give
one MFU for one step time, and ``meshtrain run`` off a terminal prints one plain line per phase."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtrain.api import console, loading
from meshtrain.planner import default_plan, estimate, host_model
from meshtrain.trainer.telemetry import report, steplog

pytestmark = (
    pytest.mark.alone
)  # a wall time against a plan for the whole machine: nothing beside it

EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "tiny-cpu.yaml"
STEPS = 5


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != console.FORCE_ENV}
    return subprocess.run(
        [sys.executable, "-m", "meshtrain.cli.main", *args],
        capture_output=True,  # stderr is a pipe, not a terminal: plain lines
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


SETTLE_SECONDS = 90
"""Longest wait for the machine to settle before the timed run (see :func:`_settle`)."""


def _settle() -> None:
    """Wait, at most :data:`SETTLE_SECONDS`, until the one-minute load average is below the core
    count.  ``make test`` starts this file right after its parallel part, whose last processes
    (control planes, trainer runs) may still be ending: on 2026-12-02 a run started at load
    average 4.9 measured the step at 2.001x the plan, and the same tests a minute later passed."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while os.getloadavg()[0] >= host_model.host_cores() and time.monotonic() < deadline:
        time.sleep(2)


@pytest.fixture(scope="module")
def example_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``meshtrain run`` of the example for a few steps: (log dir, its stderr)."""
    log_dir = tmp_path_factory.mktemp("tiny-cpu")
    _settle()
    done = _cli("run", str(EXAMPLE), "--steps", str(STEPS), "--log-dir", str(log_dir), timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return log_dir, done.stderr


@pytest.mark.slow
def test_the_default_plan_is_within_4x_of_the_measured_step(example_run: tuple[Path, str]) -> None:
    log_dir, _ = example_run
    records = steplog.read(log_dir / steplog.FILENAME)
    measured = statistics.median(r["step_seconds"] for r in records[1:])
    planned = _cli("plan", str(EXAMPLE), "--json", timeout=120)
    assert planned.returncode == 0, planned.stderr
    predicted = json.loads(planned.stdout)["time"]["step_seconds"]
    # A guard on the model's structure, not its precision: the rank-per-device plan was 23x off,
    # while CI's loaded 2-core machine has measured this step at 2.02x the uncalibrated plan
    # (2026-12-02, stop 60).  The planner's precision is benchmarks/bench_planner_time.py's,
    # calibrated, on a quiet machine.
    assert 0.25 <= measured / predicted <= 4.0, (measured, predicted)


@pytest.mark.slow
def test_plan_and_report_give_one_mfu_for_one_step_time(example_run: tuple[Path, str]) -> None:
    log_dir, _ = example_run
    job = loading.load_spec_file(str(EXAMPLE))
    profile = default_plan.profile(job, local_cores=host_model.host_cores())  # as `meshtrain plan`
    plan = estimate.make_plan(job, profile)
    run = report.load(log_dir)
    for record in run.steps:  # the trainer's own MFU, step by step
        assert record["mfu"] == pytest.approx(plan.time.mfu_at(record["step_seconds"]), rel=1e-9)
    rows = dict(report.summary(run))
    steady = run.steps[1:]
    planned = statistics.fmean(plan.time.mfu_at(r["step_seconds"]) for r in steady)
    assert rows["MFU (mean, after step 1)"] == f"{100 * planned:.2f} %"


@pytest.mark.slow
def test_run_off_a_terminal_prints_one_line_per_phase(example_run: tuple[Path, str]) -> None:
    _, stderr = example_run
    assert "\r" not in stderr  # no bar redrawn into the log
    ready = [line for line in stderr.splitlines() if "ranks ready" in line]
    assert len(ready) == 1 and ready[0].startswith("tiny-cpu: 8 of 8 ranks ready ("), ready
    steps = [line for line in stderr.splitlines() if line.startswith("tiny-cpu dp2·pp2·tp2:")]
    assert len(steps) == 1 and f"{STEPS} of {STEPS} steps, loss " in steps[0], steps
