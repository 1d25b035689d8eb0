"""``meshtrain run`` on a terminal (a real pseudo-terminal): ranks ready as they come, then the steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mt_harness
import pytest

from meshtrain.api import console
from meshtrain.trainer.telemetry import steplog
from tests import terminal
from tests.builders import JobBuilder


@pytest.mark.slow
def test_run_on_a_terminal_shows_ranks_ready_then_steps(tmp_path: Path) -> None:
    path = mt_harness.write_job(tmp_path, JobBuilder.cpu_run().layout(data=2).raw())
    master, slave = terminal.open_terminal()
    env = {k: v for k, v in os.environ.items() if k != console.FORCE_ENV}
    command = [sys.executable, "-m", "meshtrain.cli.main", "run", str(path), "--steps", "2"]
    proc = subprocess.Popen(
        [*command, "--log-dir", str(tmp_path / "logs")],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
    )
    os.close(slave)
    shown = terminal.read_all(master, proc)
    os.close(master)
    assert proc.wait(timeout=600) == 0, shown
    assert "t: 2 of 2 ranks ready" in shown, shown
    assert "t dp2·pp1·tp1: 2 of 2 steps" in shown and "tokens/s" in shown, shown
    assert shown.index("ranks ready") < shown.index("of 2 steps")
    assert len(steplog.read(tmp_path / "logs" / steplog.FILENAME)) == 2
    assert sorted(p.name for p in (tmp_path / "logs" / "ready").iterdir()) == ["rank-0", "rank-1"]
