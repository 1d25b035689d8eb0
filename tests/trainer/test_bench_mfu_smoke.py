"""The GPU MFU benchmark's harness, run on the CPU with the tiny preset, so it does not rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.api.spec import model as api_model
from meshtrain.trainer.models import gpt

REPO = Path(__file__).resolve().parents[2]


def _bench(tmp_path: Path, launcher: list[str], *options: str) -> dict:
    """The one results row of ``bench_mfu.py --device cpu --presets tiny OPTIONS`` under ``launcher``."""
    env = {**os.environ, "MESHTRAIN_BENCH_RESULTS": str(tmp_path)}
    done = subprocess.run(
        [*launcher, "benchmarks/bench_mfu.py", "--device", "cpu", "--presets", "tiny", *options],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tiny" in done.stdout
    [written] = list(tmp_path.glob("mfu-*.json"))
    row: dict = json.loads(written.read_text())["results"]["rows"][0]
    return row


@pytest.mark.slow
def test_bench_mfu_runs_on_cpu_and_reports_mfu_by_its_formula(tmp_path):
    """Throughput comes from the bare steps; the profiled ones only check the timings."""
    row = _bench(tmp_path, [sys.executable], "--steps", "2", "--profile")
    config = gpt.GPTConfig.from_shape(api_model.ModelSpec(preset="tiny").shape())
    assert row["flops_per_token"] == gpt.flops_per_token(config)
    assert row["tokens_per_second"] > 0 and row["peak_flops"] > 0
    assert row["mfu"] == pytest.approx(
        row["tokens_per_second"] * row["flops_per_token"] / row["peak_flops"]
    )
    assert row["precision"] == "fp32"
    # tokens/s is the bare steps' own pace, not the profiled steps' (slower, and followed by
    # the profiler parsing its trace)
    bare_pace = row["tokens_per_step"] / row["median_step_seconds"]
    assert row["tokens_per_second"] == pytest.approx(bare_pace, rel=0.25)
    profiled = row["profile"]
    assert profiled["steps"] == 2 and profiled["step"]["within_tolerance"] is True


@pytest.mark.slow
def test_bench_mfu_under_torchrun_checks_the_gradient_all_reduce_against_the_profiler(tmp_path):
    """Two data-parallel ranks: meshtrain's timing of the bucket all-reduces agrees with the
    profiler's record of gloo's runs of them (the step's bookkeeping all-reduce left out of both)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    row = _bench(tmp_path, torchrun, "--steps", "3", "--profile", "--no-compile")
    assert row["gpus"] == 2
    allreduce = row["profile"]["allreduce"]
    # one bucket a step (the tiny model's gradients fit one), seen by both sides
    assert allreduce["calls"] == {"meshtrain": 3, "profiler": 3}
    # On a CPU both sides are host times of the same calls, but meshtrain stamps a call's end
    # when its thread next runs, which on two busy cores can come late by a good part of the
    # call.  The bound catches a wrong unit or a missed call, not the 5% of a GPU run.
    assert 0.5 < allreduce["meshtrain_seconds"] / allreduce["profiler_seconds"] < 2.0, allreduce
