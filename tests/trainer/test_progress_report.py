"""What rank 0 tells the operator: ``last_checkpoint_step`` on /progress and the final progress file.

A one-rank ``meshtrain run`` with a checkpoint every 2 of 6 steps is paused
inside the save of step 4 (``MESHTRAIN_FAULT_INJECT_SAVE=4:pause``: data
written, not published).  At that moment /progress must say at least step 4
(an asynchronous save lets training go on) with ``last_checkpoint_step`` 2:
a checkpoint counts once it is published, not when its save begins.  The run
is then SIGKILLed (no final progress file: it did not succeed) and re-run
with the same log directory: it resumes from step 2, finishes, and writes its
final progress document, with the same keys as /progress, to
``$MESHTRAIN_TERMINATION_LOG``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from meshtrain.sandbox.controlplane.ports import pick_free_port
from meshtrain.trainer.checkpointing import checkpointer
from meshtrain.trainer.telemetry import progress
from tests.builders import JobBuilder

STEPS = 6
LAUNCH = "import sys; from meshtrain.trainer import launch; sys.exit(launch.run_local(sys.argv[1], log_dir=sys.argv[2]))"
KEYS = set(progress.FIELDS)
"""The document's keys as the trainer declares them (operator/meshtrain/operator/policy/progress_status.py reads them by name)."""


def _spec(tmp_path: Path, port: int) -> Path:
    raw = (
        JobBuilder.cpu_run()
        .training(steps=STEPS)
        .checkpoint(intervalSteps=2, keep=2)
        .metrics(port=port)
        .raw()
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _start(spec: Path, log_dir: Path, **env: str) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if k != progress.TERMINATION_LOG_ENV}
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, str(spec), str(log_dir)],
        env={**clean, "MESHTRAIN_METRICS_HOST": "127.0.0.1", **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _progress(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=5) as resp:
        return json.load(resp)


@pytest.mark.slow
def test_progress_reports_published_checkpoints_and_the_final_document(tmp_path: Path) -> None:
    port = pick_free_port()
    spec, log_dir = _spec(tmp_path, port), tmp_path / "run"
    final = tmp_path / "termination-log"

    proc = _start(
        spec,
        log_dir,
        **{checkpointer.FAULT_ENV: "4:pause", progress.TERMINATION_LOG_ENV: str(final)},
    )
    rank_log = log_dir / "rank-0.log"
    deadline = time.monotonic() + 300
    try:
        while f"{checkpointer.FAULT_ENV}: pause" not in (
            rank_log.read_text() if rank_log.exists() else ""
        ):
            assert proc.poll() is None, proc.stderr.read().decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the run never reached the save of step 4"
            time.sleep(0.2)
        during = _progress(port)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    assert set(during) == KEYS
    # step 4's save is not published (with checkpoint.asyncSave, the default, training goes on
    # while the save is held, so the run may be past step 4)
    assert during["step"] >= 4 and during["last_checkpoint_step"] == 2, during
    assert not final.exists(), "a killed run must not write the final progress"

    proc = _start(spec, log_dir, **{progress.TERMINATION_LOG_ENV: str(final)})
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    assert "resumed from" in rank_log.read_text()
    doc = json.loads(final.read_text())
    assert set(doc) == KEYS
    assert (doc["step"], doc["last_checkpoint_step"]) == (STEPS, STEPS), doc
    assert doc["loss"] > 0 and doc["tokens_per_second"] > 0 and doc["updated_at"].endswith("Z")
    assert doc["gradient_noise_scale"] is None  # one replica: nothing to measure it from
