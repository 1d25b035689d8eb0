"""``meshtrain report`` covers every attempt of a run: a killed ``meshtrain run`` resumed with its
``--log-dir`` keeps the first attempt's steps, and the report marks the restart and the steps
trained again.

The run is SIGKILLed (launcher and ranks) once a few steps are logged and started again with the
same log directory; it resumes from its newest checkpoint.  The expected numbers come from what
was trained: the first attempt's step log as it stood when it was killed, and the step the second
attempt's rank 0 says it resumed from.  ``make test`` tier (slow); the pods' one appended
``steps.jsonl`` is split the same way (the unit test below).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from meshtrain.trainer.telemetry import report, steplog
from tests.builders import JobBuilder

STEPS = 40
KILL_AFTER = 10
LAUNCH = "import sys; from meshtrain.trainer import launch; sys.exit(launch.run_local(sys.argv[1], log_dir=sys.argv[2]))"


def _start(spec: Path, log_dir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, str(spec), str(log_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _logged(log_dir: Path) -> list[int]:
    path = log_dir / steplog.FILENAME
    return [r["step"] for r in steplog.read(path)] if path.exists() else []


@pytest.mark.slow
def test_the_report_of_a_killed_and_resumed_run_shows_both_attempts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = (
        JobBuilder.cpu_run()
        .training(steps=STEPS)
        .checkpoint(intervalSteps=4, keep=2, asyncSave=False)
        .raw()
    )
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(raw))
    log_dir = tmp_path / "logs"

    proc = _start(spec, log_dir)
    deadline = time.monotonic() + 300
    while max(_logged(log_dir), default=0) < KILL_AFTER:
        assert proc.poll() is None, (
            proc.stderr.read().decode(errors="replace")[-3000:] if proc.stderr else ""
        )
        assert time.monotonic() < deadline, "the run logged no steps"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if proc.stderr:
        proc.stderr.close()
    first = _logged(log_dir)  # what the first attempt trained, as it stood when killed
    assert first == list(range(1, len(first) + 1)) and len(first) < STEPS

    second_proc = _start(spec, log_dir)
    _, err = second_proc.communicate(timeout=300)
    assert second_proc.returncode == 0, err.decode(errors="replace")[-3000:]
    said = re.search(r"resumed from \S+ \(step (\d+)", (log_dir / "rank-0.log").read_text())
    assert said, "the second attempt resumed from a checkpoint"
    resumed = int(said.group(1))
    second = steplog.read(log_dir / steplog.FILENAME)  # the second attempt's own records
    assert [r["step"] for r in second] == list(range(resumed + 1, STEPS + 1))

    run = report.load(log_dir)
    one, two = run.attempts
    assert (one.first_step, one.last_step, one.recorded, one.recomputed) == (
        1,
        len(first),
        len(first),
        0,
    )
    assert (two.first_step, two.last_step, two.recorded) == (resumed + 1, STEPS, len(second))
    assert two.recomputed == len(first) - resumed  # the steps after the checkpoint, again
    assert [r["step"] for r in run.steps] == list(range(1, STEPS + 1))
    assert run.steps[resumed:] == second, "a step trained twice shows its last training"

    out = tmp_path / "report.html"
    assert report.main(argparse.Namespace(log_dir=str(log_dir), output=str(out))) == 0
    printed = capsys.readouterr().out
    assert f"attempts: 2 (restarted at step {resumed + 1})" in printed
    trained, recomputed = len(first) + len(second), len(first) - resumed
    assert f"steps trained, all attempts: {trained} ({recomputed} recomputed" in printed
    page = out.read_text()
    assert 'id="attempts"' in page and f"<td>{resumed + 1} .. {STEPS}</td>" in page


def test_the_pods_one_appended_step_log_is_split_where_a_step_goes_back(tmp_path: Path) -> None:
    lines = [
        {"step": s, "loss": 1.0, "step_seconds": 0.1, "tokens_per_second": 10.0}
        for s in [1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 7, 8]
    ]
    (tmp_path / steplog.FILENAME).write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = report.load(tmp_path)
    assert [(a.first_step, a.last_step, a.recorded, a.recomputed) for a in run.attempts] == [
        (1, 5, 5, 0),
        (3, 7, 5, 3),
        (7, 8, 2, 1),
    ]


def test_each_earlier_attempt_of_meshtrain_run_is_kept_in_order(tmp_path: Path) -> None:
    def attempt(*steps: int) -> None:
        records = [
            {"step": s, "loss": 1.0, "step_seconds": 0.1, "tokens_per_second": 1.0} for s in steps
        ]
        (tmp_path / steplog.FILENAME).write_text("".join(json.dumps(r) + "\n" for r in records))

    assert steplog.keep_previous(tmp_path) is None  # a first start: nothing to keep
    attempt(1, 2, 3)
    assert steplog.keep_previous(tmp_path) == tmp_path / "attempts" / "steps-0001.jsonl"
    attempt(2, 3, 4)
    assert steplog.keep_previous(tmp_path) == tmp_path / "attempts" / "steps-0002.jsonl"
    (tmp_path / steplog.FILENAME).write_text("")  # an attempt that logged no step
    assert steplog.keep_previous(tmp_path) is None
    assert not (tmp_path / steplog.FILENAME).exists()
    attempt(4, 5)
    found = [[r["step"] for r in records] for records in steplog.attempts(tmp_path)]
    assert found == [[1, 2, 3], [2, 3, 4], [4, 5]]
