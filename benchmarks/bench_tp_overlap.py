"""Benchmark: exposed tensor-parallel time, serial against overlapped, measured and planned, side by side.

Two local gloo ranks train tp2 and tp2 with sequence parallelism, each with
``parallelism.overlap.tensor`` off and on, the four runs' steps interleaved in one process group (so
the machine's load falls on all four alike).  Per layout it prints the trainer's own clocks, the
median over the measured steps: the flight of every tp collective (``tp_allreduce_seconds``) and the
time the compute thread was held on them (``tp_exposed_seconds``), and the step.  Beside them the
planner's exposed share of its tp time (:mod:`meshtrain.planner.timing.tp_overlap`) against the
measured one, exposed with overlap over the serial run's tp time (the planner prices the calls of
``meshtrain plan``'s profile, so absolute seconds are compared only where calibrated).  Results:
``benchmarks/results/tp_overlap-<host>.json``.

    python benchmarks/bench_tp_overlap.py [--steps 8] [--hidden 256] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine, ranks
from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.planner import estimate, profiles
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh
from meshtrain.trainer.telemetry import recording

RUNS = [(sp, overlap) for sp in (False, True) for overlap in (False, True)]


def _spec(sp: bool, overlap: bool, hidden: int, seq_len: int) -> api_spec.TrainingJobSpec:
    return loading.parse_spec(
        {
            "parallelism": {"tensor": 2, "sequenceParallel": sp, "overlap": {"tensor": overlap}},
            "resources": {"gpusPerNode": 2},
            "model": {
                "layers": 2,
                "hidden": hidden,
                "heads": 4,
                "vocab": 256,
                "seqLen": seq_len,
                "ffnHidden": 4 * hidden,
            },
            "training": {"microBatch": 2, "steps": 1000, "precision": "fp32", "dataset": "stdlib"},
        }
    )


def _rank(
    rank: int, world: int, port: int, steps: int, hidden: int, seq_len: int, out: str
) -> None:
    ranks.join(rank, world, port, threads=ranks.cores_per_rank(world), timeout_s=900)
    runs = []
    for sp, overlap in RUNS:
        job = _spec(sp, overlap, hidden, seq_len)
        recorder = recording.MemoryRecorder()
        eng = engine.Engine(
            job, mesh.build_mesh(job.parallelism.layout, torch.device("cpu")), recorder=recorder
        )
        runs.append((eng, recorder))
    for _ in range(2):  # warm-up: AdamW's state, the allocator
        for eng, _recorder in runs:
            eng.train_step()
    for _ in range(steps):
        for eng, _recorder in runs:
            eng.train_step()
    rows = [
        {"sequence_parallel": sp, "overlap": overlap, **_medians(recorder.steps[2:])}
        for (sp, overlap), (_eng, recorder) in zip(RUNS, runs)
    ]
    ranks.leave(rows, out)


def _medians(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = {
        "tp_seconds": "tp_collective_seconds",
        "tp_exposed_seconds": "tp_exposed_seconds",
        "step_seconds": "step_seconds",
    }
    return {name: statistics.median(s.get(key, 0.0) for s in steps) for name, key in keys.items()}


def _planned(sp: bool, overlap: bool, hidden: int, seq_len: int) -> dict[str, float]:
    stage = estimate.make_plan(_spec(sp, overlap, hidden, seq_len), profiles.get("cpu")).time
    worst = stage.stages[0]
    return {"planned_tp_seconds": worst.tp, "planned_tp_exposed_seconds": worst.tp_exposed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = ranks.spawn(_rank, 2, args.steps, args.hidden, args.seq_len)
    for row in rows:
        row.update(_planned(row["sequence_parallel"], row["overlap"], args.hidden, args.seq_len))
    print(f"tp2, 2 layers, hidden {args.hidden}, seq {args.seq_len}, micro-batch 2, fp32, gloo")
    header = (
        f"{'layout':<8} {'overlap':<7} | {'tp flight ms':>12} {'tp exposed ms':>13} {'step ms':>8} | "
        f"{'exposed share: measured':>23} {'planned':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        serial = next(
            r
            for r in rows
            if r["sequence_parallel"] == row["sequence_parallel"] and not r["overlap"]
        )
        row["exposed_share"] = row["tp_exposed_seconds"] / max(serial["tp_seconds"], 1e-12)
        row["planned_exposed_share"] = row["planned_tp_exposed_seconds"] / max(
            row["planned_tp_seconds"], 1e-12
        )
        print(
            f"{'tp2-sp' if row['sequence_parallel'] else 'tp2':<8} {'on' if row['overlap'] else 'off':<7} | "
            f"{row['tp_seconds'] * 1e3:>12.1f} {row['tp_exposed_seconds'] * 1e3:>13.1f} "
            f"{row['step_seconds'] * 1e3:>8.1f} | {row['exposed_share']:>23.2f} "
            f"{row['planned_exposed_share']:>7.2f}"
        )
    path = machine.write_results(
        "tp_overlap",
        {"steps": args.steps, "hidden": args.hidden, "seq_len": args.seq_len, "rows": rows},
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
