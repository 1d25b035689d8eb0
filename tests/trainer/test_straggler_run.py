"""Straggler detection in a real run: two gloo ranks, rank 1 slowed 4x from step 4 by fault
injection (``MESHTRAIN_FAULT_SLOW``).  The detector (window 8, threshold 2: wide of this shared
machine's noise) must flag rank 1, and only rank 1, within window/2 + 1 steps plus a margin, and
the final progress document (what the operator reads) must name it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshtrain.trainer.guards import faults
from meshtrain.trainer.telemetry import progress, steplog
from tests.builders import JobBuilder

LAUNCH = "import sys; from meshtrain.trainer import launch; sys.exit(launch.run_local(sys.argv[1], log_dir=sys.argv[2]))"
SLOW_FROM, WINDOW, STEPS = 4, 8, 16


@pytest.mark.slow
def test_a_rank_slowed_4x_is_flagged_within_the_window_and_reported(tmp_path: Path) -> None:
    raw = (
        JobBuilder.cpu_run()
        .layout(data=2)
        .parallelism(microBatches=2)
        .training(steps=STEPS)
        .run_policy(stragglerPolicy={"threshold": 2.0, "window": WINDOW})
        .raw()
    )
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(raw))
    final = tmp_path / "termination-log"
    env = {
        **os.environ,
        "MESHTRAIN_METRICS_HOST": "127.0.0.1",
        faults.SLOW_ENV: f"1:4:{SLOW_FROM}",
        progress.TERMINATION_LOG_ENV: str(final),
    }
    done = subprocess.run(
        [sys.executable, "-c", LAUNCH, str(spec), str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    records = steplog.read(tmp_path / "run" / steplog.FILENAME)
    flagged = {step["step"]: step["stragglers"] for step in records}
    first = next(step for step, ranks in flagged.items() if 1 in ranks)
    # Half the window slow tips the median; each step shares the previous step's time (+1).
    assert SLOW_FROM + 1 <= first <= SLOW_FROM + WINDOW // 2 + 1 + 3, flagged
    assert all(ranks in ([], [1]) for ranks in flagged.values()), [
        (r["step"], r["slowdowns"], r["stragglers"]) for r in records
    ]
    slowdown = records[-1]["slowdowns"][1]
    assert slowdown > 2.0, records[-1]
    document = json.loads(final.read_text())
    assert document["straggler"]["rank"] == 1
    assert document["straggler"]["slowdown"] == pytest.approx(slowdown, rel=1e-3)
    assert SLOW_FROM <= document["straggler"]["since_step"] < first
