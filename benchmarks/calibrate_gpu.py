"""Calibrate this GPU for a one-GPU 1.3b job and compare the plan with the datasheet profile's.

What ``meshtrain plan --calibrate`` measures on a GPU host (the block's
FLOP/s at the job's shapes in bf16, the per-operation overhead), run through
:func:`meshtrain.trainer.calibration.measure.calibrate` so it needs only the trainer's
packages (a device machine has no Kubernetes client).  Writes the profile
YAML to ``$MESHTRAIN_BENCH_RESULTS`` (default ``benchmarks/results``) and
prints the predicted step time of the job with the datasheet and the
calibrated profile; ``bench_mfu.py --presets 1.3b --micro-batch 1.3b=4``
measures the same job.

    python benchmarks/calibrate_gpu.py [SECONDS_PER_MEASUREMENT]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine
from meshtrain.api import loading
from meshtrain.planner import estimate, profiles
from meshtrain.trainer.calibration import measure
from tests.builders import JobBuilder


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU: nothing to calibrate (this measures a GPU host)")
        return 0
    device = torch.cuda.get_device_name(0)
    base = profiles.get("h200" if "H200" in device else "h100-sxm")
    raw = (
        JobBuilder()
        .layout(1, 1, 1)
        .gpus(1)
        .model(preset="1.3b")
        .training(precision="bf16", microBatch=4)
        .parallelism(microBatches=4)
        .raw()
    )
    job = loading.parse_spec(raw, "gpu-1.3b")
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
    measured = measure.calibrate(job, base, f"{base.name}-calibrated", budget=budget)
    path = profiles.write(measured, Path(os.environ.get(machine.RESULTS_ENV) or machine.RESULTS))
    summary = {
        "device": device,
        "base": base.name,
        "profile_file": str(path),
        "achievable_fraction": measured.achievable_fraction,
        "op_overhead": measured.op_overhead,
        "step_seconds_datasheet": estimate.make_plan(job, base).time.step_seconds,
        "step_seconds_calibrated": estimate.make_plan(job, measured).time.step_seconds,
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
