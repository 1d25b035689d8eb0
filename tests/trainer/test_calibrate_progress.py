"""``meshtrain plan --calibrate`` through the real command line, its stderr a pipe: one line per
phase (every measurement counted, then the step-loop run), and the plan names its calibration."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshtrain.api import console
from meshtrain.planner import profiles
from meshtrain.trainer.calibration import measure, steps
from tests.builders import JobBuilder


@pytest.mark.slow
def test_calibration_counts_its_measurements_in_one_line_each_phase(tmp_path: Path) -> None:
    job = (
        JobBuilder("cal")
        .layout(2, 1, 1)
        .model(preset="tiny", layers=2, hidden=32, heads=2, seqLen=16)
        .training(precision="fp32", microBatch=2)
    )
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job.manifest()))
    env = {k: v for k, v in os.environ.items() if k != console.FORCE_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "meshtrain.cli.main", "plan", str(tmp_path / "job.yaml")]
        + ["--calibrate", "--calibration-seconds", "0.05", "--profile-name", "cal-here"]
        + ["--profiles-dir", str(tmp_path / "profiles")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "\r" not in done.stderr
    total = steps.count(1, len(measure.MESSAGE_BYTES))  # dp2: one group axis
    [measured] = [x for x in done.stderr.splitlines() if x.startswith("calibrating dp2·pp1·tp1 (")]
    assert measured.startswith(
        f"calibrating dp2·pp1·tp1 (2 processes): {total} of {total} measurements, dp send, "
    ), measured
    [loop] = [x for x in done.stderr.splitlines() if "step-loop run" in x]
    assert loop.startswith("calibrating dp2·pp1·tp1: step-loop run: done (")
    written = profiles.load_file(tmp_path / "profiles" / "cal-here.yaml")
    assert done.stdout.splitlines()[1].startswith(
        f"calibrated: profile cal-here measured on {written.calibration['host']} "
    )
