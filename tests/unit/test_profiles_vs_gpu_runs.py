"""The planner's device memory and peak-memory model against what a real GPU reported.

The expectations are the committed results of the run on a lent H200
(``benchmarks/results/gpu-h200-session-log.txt``, ``mfu-h200-*.json``):
the driver's own memory total, and ``torch.cuda.max_memory_allocated`` over
each bench_mfu run's timed steps.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import bench_mfu
from meshtrain.planner import memory, profiles

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

H200_RUNS = sorted(RESULTS.glob("mfu-h200-*.json"))


def test_the_h200_profile_has_the_memory_the_lent_h200_reported() -> None:
    """nvidia-smi's ``memory.total`` (MiB) as the device printed it, not the datasheet's 141 GB."""
    log = (RESULTS / "gpu-h200-session-log.txt").read_text()
    reported = re.findall(r"^NVIDIA H200, (\d+) MiB,", log, flags=re.MULTILINE)
    assert reported, "the H200 log has no nvidia-smi memory.total line"
    assert profiles.get("h200").memory_bytes == int(reported[0]) * 2**20


def bench_job(row: dict):
    """The TrainingJob bench_mfu built for ``row``, through its own argument parser and spec."""
    preset, micro_batch = row["preset"], row["micro_batch"]
    argv = ["--presets", preset, "--micro-batch", f"{preset}={micro_batch}"]
    argv += ["--micro-batches", str(row["micro_batches"]), "--device", "cuda"]
    argv += ["--selective-recompute", *row["selective_recompute"]]
    if not row["compiled"]:
        argv.append("--no-compile")
    args = bench_mfu.parse_args(argv)
    return bench_mfu._spec(preset, args, micro_batch, row["gpus"], "cuda", profiled_steps=0)


@pytest.mark.parametrize("path", H200_RUNS, ids=lambda p: p.stem)
def test_the_planner_predicts_the_peak_memory_the_h200_measured(path: Path) -> None:
    """Within 5% (the rows span -2.6% to +2.7%); the planned peak is the same on every profile,
    since the job names its precision."""
    document = json.loads(path.read_text())
    assert document["results"]["device_name"] == "NVIDIA H200"
    for row in document["results"]["rows"]:
        job = bench_job(row)
        plan = memory.plan_memory(job, profiles.get("h200"))
        # the job rebuilt today is the one measured then
        assert (plan.total_params, job.model.shape().seq_len) == (row["params"], row["seq_len"])
        measured, planned = row["peak_memory_gib"] * 2**30, plan.worst.total
        assert planned == pytest.approx(measured, rel=0.05), (
            f"{row['preset']} micro-batch {row['micro_batch']}: planned {planned / 2**30:.2f} GiB, "
            f"the H200 measured {measured / 2**30:.2f} GiB"
        )


def test_there_are_h200_runs_to_check() -> None:
    """The parametrised test above must not pass by having nothing to check."""
    assert len(H200_RUNS) >= 6
