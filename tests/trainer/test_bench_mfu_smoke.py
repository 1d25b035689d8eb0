"""The GPU MFU benchmark's harness, run on the CPU with the tiny preset, so it does not rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.api import spec as spec_mod
from meshtrain.trainer import model as gpt

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_mfu_runs_on_cpu_and_reports_mfu_by_its_formula(tmp_path):
    """Throughput comes from the bare steps; the profiled ones only check the timings."""
    env = {**os.environ, "MESHTRAIN_BENCH_RESULTS": str(tmp_path)}
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_mfu.py",
            "--device",
            "cpu",
            "--presets",
            "tiny",
            "--steps",
            "2",
            "--profile",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [written] = list(tmp_path.glob("mfu-*.json"))
    row = json.loads(written.read_text())["results"]["rows"][0]
    config = gpt.GPTConfig.from_shape(spec_mod.ModelSpec(preset="tiny").shape())
    assert row["flops_per_token"] == gpt.flops_per_token(config)
    assert row["tokens_per_second"] > 0 and row["peak_flops"] > 0
    assert row["mfu"] == pytest.approx(
        row["tokens_per_second"] * row["flops_per_token"] / row["peak_flops"]
    )
    assert row["precision"] == "fp32" and "tiny" in done.stdout
    # tokens/s is the bare steps' own pace, not the profiled steps' (slower, and followed by
    # the profiler parsing its trace)
    bare_pace = row["tokens_per_step"] / row["median_step_seconds"]
    assert row["tokens_per_second"] == pytest.approx(bare_pace, rel=0.25)
    profiled = row["profile"]
    assert profiled["steps"] == 2 and profiled["step"]["within_tolerance"] is True
