"""Kill test: ``meshtrain run`` SIGKILLed in the middle of a checkpoint save resumes from the last complete one.

The run pauses inside the save of step 4 (``MESHTRAIN_FAULT_INJECT_SAVE=4:pause``:
every rank's data is written, the checkpoint is not yet published) and the
whole process group is SIGKILLed there.  The save is asynchronous
(``checkpoint.asyncSave``, the default), so training goes on beside the
paused save: the kill comes only once step 5 is logged.  Re-running with the
same log directory must skip the unpublished save, resume from step 2, and
produce exactly the losses of an uninterrupted run for steps 3..6.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from meshtrain.trainer.checkpointing import checkpointer, store
from meshtrain.trainer.telemetry import steplog
from tests.builders import JobBuilder

STEPS = 6
LAUNCH = "import sys; from meshtrain.trainer import launch; sys.exit(launch.run_local(sys.argv[1], log_dir=sys.argv[2]))"


def _spec(tmp_path: Path) -> Path:
    raw = (
        JobBuilder.cpu_run()
        .layout(data=2)
        .parallelism(zeroStage=1)
        .training(steps=STEPS)
        .checkpoint(intervalSteps=2, keep=2)
        .raw()
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _start(spec: Path, log_dir: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, str(spec), str(log_dir)],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _losses(log_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in steplog.read(log_dir / steplog.FILENAME)}


def _finish(proc: subprocess.Popen, timeout: float = 300) -> None:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]


@pytest.mark.slow
def test_sigkill_during_save_resumes_from_last_complete_checkpoint(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    _finish(_start(spec, reference))

    proc = _start(spec, killed, **{checkpointer.FAULT_ENV: "4:pause"})
    log = killed / "rank-0.log"
    deadline = time.monotonic() + 300
    while f"{checkpointer.FAULT_ENV}: pause" not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None, proc.stderr.read().decode(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "the run never reached the save of step 4"
        time.sleep(0.2)
    while max(_losses(killed), default=0) < 5:  # the paused save does not hold training
        assert proc.poll() is None, proc.stderr.read().decode(errors="replace")[-3000:]
        assert time.monotonic() < deadline, (
            "training stopped while the save of step 4 was in flight"
        )
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank, mid-save
    proc.wait()
    proc.stderr.close()

    root = killed / "checkpoints"
    assert [p.step for p in store.scan(root)] == [2]
    unpublished = list(root.glob(".tmp-step-00000004-*"))
    assert (
        unpublished and (unpublished[0] / ".metadata").exists()
    )  # complete DCP data, but never published

    _finish(_start(spec, killed))
    assert "resumed from" in (killed / "rank-0.log").read_text()
    resumed, uninterrupted = _losses(killed), _losses(reference)
    assert sorted(resumed) == [3, 4, 5, 6]
    assert [resumed[s] for s in range(3, 7)] == [
        uninterrupted[s] for s in range(3, 7)
    ]  # bit-for-bit
    assert [p.step for p in store.scan(root)] == [4, 6] and not list(root.glob(".tmp-*"))
