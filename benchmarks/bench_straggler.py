"""Straggler detection latency: how many steps after one rank slows down 1.5x the trainer flags it.

Real trainer processes (``meshtrain run``, gloo on CPU), data-parallel 2, one
rank slowed from step ``--slow-from`` by fault injection
(``MESHTRAIN_FAULT_SLOW=1:1.5:STEP``: sleeps inside its forward, sized from its
own previous compute).  For each detector window, reads rank 0's
``steps.jsonl`` (the detector's per-step verdict: ``slowdowns``,
``stragglers``) and the per-rank traces (each rank's measured compute), and
reports:

- ``detect_step``: first step at which rank 1 is flagged; ``latency_steps`` =
  detect_step - slow_from (expect about window/2 + 1: the median tips after
  more than half the window is slow, and each step shares the previous one's
  time);
- ``injected_ratio``: median over the slowed steps of rank 1's compute over
  rank 0's (the slowdown the fault injection really produced on this machine);
- ``false_flags``: flagged (rank, step) pairs other than rank 1 from
  ``slow_from`` on, plus the same for a control run with no slowdown.

Run: ``python benchmarks/bench_straggler.py [--steps 60] [--slow-from 21] [--windows 10 20] [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks import machine
from meshtrain.trainer.guards import faults
from meshtrain.trainer.telemetry import steplog

LAUNCH = (
    "import sys; from meshtrain.trainer import launch; "
    "sys.exit(launch.run_local(sys.argv[1], log_dir=sys.argv[2]))"
)
SLOW_RANK = 1
FACTOR = 1.5


def _spec(steps: int, window: int, threshold: float) -> dict[str, Any]:
    return {
        "apiVersion": "meshtrain.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "straggler-bench"},
        "spec": {
            "parallelism": {"data": 2, "pipeline": 1, "tensor": 1, "microBatches": 2},
            "resources": {"gpusPerNode": 2},
            "model": {"preset": "tiny", "layers": 4, "hidden": 128, "heads": 4, "seqLen": 64},
            "training": {
                "microBatch": 4,
                "steps": steps,
                "learningRate": 1e-3,
                "warmupSteps": 2,
                "precision": "fp32",
                "seed": 7,
                "dataset": "stdlib",
            },
            "checkpoint": {"intervalSteps": 0},
            "runPolicy": {"stragglerPolicy": {"threshold": threshold, "window": window}},
        },
    }


def _run(directory: Path, spec: dict[str, Any], slow: str | None) -> Path:
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    log_dir = directory / "run"
    env = {k: v for k, v in os.environ.items() if k != faults.SLOW_ENV}
    env["MESHTRAIN_METRICS_HOST"] = "127.0.0.1"
    if slow:
        env[faults.SLOW_ENV] = slow
    subprocess.run(
        [sys.executable, "-c", LAUNCH, str(path), str(log_dir)],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return log_dir


def _compute(log_dir: Path, rank: int) -> dict[int, float]:
    lines = (log_dir / "trace" / f"rank-{rank}.jsonl").read_text().splitlines()
    return {r["step"]: r["compute_seconds"] for r in map(json.loads, lines)}


def measure(steps: int, slow_from: int, window: int, threshold: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mt-straggler-") as tmp:
        started = time.perf_counter()
        log_dir = _run(
            Path(tmp), _spec(steps, window, threshold), f"{SLOW_RANK}:{FACTOR}:{slow_from}"
        )
        seconds = time.perf_counter() - started
        records = steplog.read(log_dir / steplog.FILENAME)
        fast, slow = _compute(log_dir, 0), _compute(log_dir, SLOW_RANK)
    detect = next((r["step"] for r in records if SLOW_RANK in r["stragglers"]), None)
    false = [
        (rank, r["step"])
        for r in records
        for rank in r["stragglers"]
        if rank != SLOW_RANK or r["step"] < slow_from
    ]
    ratios = [slow[s] / fast[s] for s in range(slow_from, steps + 1) if fast.get(s)]
    at_detect = next((r for r in records if r["step"] == detect), None)
    return {
        "window": window,
        "threshold": threshold,
        "factor": FACTOR,
        "slow_from": slow_from,
        "steps": steps,
        "detect_step": detect,
        "latency_steps": None if detect is None else detect - slow_from,
        "slowdown_at_detect": None if at_detect is None else at_detect["slowdowns"][SLOW_RANK],
        "injected_ratio": round(statistics.median(ratios), 3),
        "rank0_compute_seconds_median": round(statistics.median(fast.values()), 4),
        "false_flags": false,
        "wall_seconds": round(seconds, 1),
    }


def control(steps: int, window: int, threshold: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mt-straggler-") as tmp:
        log_dir = _run(Path(tmp), _spec(steps, window, threshold), None)
        records = steplog.read(log_dir / steplog.FILENAME)
    flagged = [(rank, r["step"]) for r in records for rank in r["stragglers"]]
    worst = max(
        (max(x for x in r["slowdowns"] if x is not None) for r in records[1:]), default=None
    )
    return {"window": window, "steps": steps, "false_flags": flagged, "max_slowdown": worst}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--slow-from", type=int, default=21)
    parser.add_argument("--windows", type=int, nargs="+", default=[10, 20])
    parser.add_argument("--threshold", type=float, default=1.25)
    parser.add_argument(
        "--repeats", type=int, default=2, help="rounds of every window and a control"
    )
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows, baselines = [], []
    for repeat in range(args.repeats):
        for window in args.windows:
            rows.append(
                {"repeat": repeat, **measure(args.steps, args.slow_from, window, args.threshold)}
            )
        baselines.append(
            {"repeat": repeat, **control(args.steps, max(args.windows), args.threshold)}
        )
    load = {"before": load_before, "after": os.getloadavg()}
    print(
        f"{'window':>6} {'slow from':>9} {'detected':>8} {'latency':>7} {'slowdown':>8} "
        f"{'injected':>8} {'false':>5}"
    )
    for r in rows:
        print(
            f"{r['window']:>6} {r['slow_from']:>9} {r['detect_step']!s:>8} {r['latency_steps']!s:>7} "
            f"{r['slowdown_at_detect'] or 0:>8.2f} {r['injected_ratio']:>8.2f} {len(r['false_flags']):>5}"
        )
    for baseline in baselines:
        print(
            f"control (no slowdown, window {baseline['window']}): {len(baseline['false_flags'])} "
            f"flagged step(s), largest slowdown {baseline['max_slowdown']:.2f}"
        )
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}")
    path = machine.write_results(
        "straggler_detection", {"runs": rows, "controls": baselines, "load_average": load}
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
