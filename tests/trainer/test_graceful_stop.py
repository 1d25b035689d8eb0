"""Graceful stop: a signal to any rank stops every rank after the same step, with a checkpoint of that step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mt_harness
import pytest
import torch
import yaml

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.checkpointing import store
from meshtrain.trainer.guards import stopping
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import steplog
from tests.builders import JobBuilder

REPO = Path(__file__).resolve().parents[2]


def agreement_case(raw: dict, asking_rank: int, ask_at: int) -> list[bool]:
    """Only ``asking_rank`` asks to stop, from step ``ask_at`` on; returns what every step said on this rank."""
    job = loading.parse_spec(raw)
    trainer = engine.Engine(job, mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu")))
    rank = torch.distributed.get_rank()
    return [
        trainer.train_step(stop_requested=rank == asking_rank and step >= ask_at).stop
        for step in range(1, 5)
    ]


@pytest.mark.slow
def test_one_rank_asking_stops_every_rank_after_the_same_step():
    raw = (
        JobBuilder.cpu_run()
        .layout(data=2, pipeline=2)
        .parallelism(microBatches=2)
        .training(steps=4)
        .raw()
    )
    answers = mt_harness.run_distributed(agreement_case, 4, raw, 3, 2)
    assert answers == [[False, True, True, True]] * 4


def test_stop_signals_only_set_the_flag():
    previous = {s: signal.getsignal(s) for s in stopping.SIGNALS}
    try:
        stop = stopping.StopRequest().install()
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs at the next bytecode boundary of the main thread
        assert stop.requested and stop.signal_name == "SIGTERM"
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _meshtrain_run(job: Path, log_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshtrain.cli.main",
            "run",
            str(job),
            "--log-dir",
            str(log_dir),
            *extra,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _steps(log_dir: Path) -> list[int]:
    path = log_dir / steplog.FILENAME
    return [r["step"] for r in steplog.read(path)] if path.exists() else []


@pytest.mark.slow
def test_interrupted_run_saves_its_last_step_and_the_same_command_resumes_there(tmp_path):
    raw = (
        JobBuilder.cpu_run()
        .layout(data=2)
        .training(steps=400)
        .checkpoint(intervalSteps=1000)  # no periodic checkpoint: the only one is the stop's
        .raw()
    )
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "meshtrain.io/v1alpha1",
                "kind": "TrainingJob",
                "metadata": {"name": "stoppable"},
                "spec": raw,
            }
        )
    )
    log_dir = tmp_path / "logs"
    first = _meshtrain_run(job, log_dir)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(_steps(log_dir)) < 3:
        assert first.poll() is None, first.communicate()[0]
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    output, _ = first.communicate(timeout=120)
    assert first.returncode == 130, output
    found = store.latest(log_dir / "checkpoints")
    assert found is not None, output
    stopped_at = found[1].step
    assert 3 <= stopped_at < 400
    assert f"stopped after step {stopped_at}" in (log_dir / "rank-0.log").read_text()
    assert _steps(log_dir)[-1] == stopped_at

    second = _meshtrain_run(job, log_dir, "--steps", str(stopped_at + 2))
    output, _ = second.communicate(timeout=300)
    assert second.returncode == 0, output
    assert (
        f"(step {stopped_at})" in (log_dir / "rank-0.log").read_text()
    )  # "resumed from <dir> (step N)"
    assert _steps(log_dir)[-2:] == [stopped_at + 1, stopped_at + 2]
