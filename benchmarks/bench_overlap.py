"""Benchmark: communication overlapped with compute, before and after, side by side in one run (issue #35).

For tp2, dp2·ZeRO-1, dp2·ZeRO-2 and pp2 (4 micro-batches each) it starts two fresh local gloo ranks
per setting of the row's ``parallelism.overlap`` switch (off: the serial path, on: overlapped),
trains one step, then measures ``--steps`` steps with the trainer's own clocks and recorder:

* dp: the gradient reduction's tail after the last backward (``stepstats.exposed_comm`` over the
  reductions) plus the time the training thread blocked on the weights' all-gathers (the whole
  blocking gather in the serial path; the layers' waits with ``paramGather``);
* tp: the time the training thread was held on tensor-parallel collectives (the trainer's ``tp``
  waits: a blocking collective whole, an overlapped one for what its matmul did not hide);
* pp: the time blocked on pipeline sends and receives.

Beside the dp rows, the planner's exposed dp time (``StageTime.dp_exposed``, the ``cpu`` profile).

A row whose switch the spec does not have (a pipeline switch: the pipeline's change is memory, its
sends freed when done) runs once and says so.  Then the peak of live tensor bytes of a step (the second, as
``bench_zero3.py``) at dp2 for ZeRO-1 against ZeRO-2 at 4 and 16 micro-batches, beside the
planner's peak.  Each figure is the worst rank's median over the steps.  Writes
``benchmarks/results/overlap-<host>.json``.

    python benchmarks/bench_overlap.py [--steps 4] [--micro-batches 4 16] [--memory-only]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import bench_zero3, machine, ranks
from meshtrain.api import spec as api_spec
from meshtrain.api.spec import parallelism as api_parallelism
from meshtrain.planner import estimate, memory, profiles
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh, zero
from meshtrain.trainer.telemetry import recording, stepstats

MODEL = bench_zero3.MODEL
"""The committed ZeRO benchmark's model (docs/planner.md), so the memory rows compare with it."""
ROWS = {
    "tp2": ({"tensor": 2}, "tensor"),
    "dp2-zero1": ({"data": 2, "zeroStage": 1}, "paramGather"),
    "dp2-zero2": ({"data": 2, "zeroStage": 2}, "paramGather"),
    "pp2": ({"pipeline": 2}, "pipeline"),
}
"""Row -> (parallelism, its ``overlap`` switch)."""
MICRO_BATCHES = 4


def has_switch(name: str) -> bool:
    """Whether ``parallelism.overlap`` has the switch ``name`` (camelCase) in this tree."""
    return any(
        (field.alias or key) == name for key, field in api_parallelism.Overlap.model_fields.items()
    )


def _spec(
    parallelism: dict[str, Any], switch: dict[str, bool], micro_batches: int, steps: int
) -> api_spec.TrainingJobSpec:
    world = (
        parallelism.get("data", 1) * parallelism.get("tensor", 1) * parallelism.get("pipeline", 1)
    )
    return bench_zero3.job_spec(
        {**parallelism, "microBatches": micro_batches, "overlap": switch}, world, steps
    )


def exposed(events: list[recording.Event], gather_waits: float) -> dict[str, float]:
    """One step's exposed communication seconds by axis (see the module docstring)."""
    reductions = [e for e in events if not (e.what == "collective" and e.kind == "all_gather")]
    waits = [e for e in events if e.what == "wait"]
    return {
        "dp": stepstats.exposed_comm(reductions) + gather_waits,
        "tp": sum(e.end - e.start for e in waits if e.kind == "tp"),
        "pp": sum(e.end - e.start for e in waits if e.kind in recording.PIPELINE_WAITS),
    }


def _worst_median(values: list[float]) -> float:
    """The largest over ranks of this rank's median (collective)."""
    worst = torch.tensor([statistics.median(values)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def _timing_rank(
    rank: int, world: int, port: int, parallelism: dict, switch: dict, steps: int, out: str
) -> None:
    ranks.join(rank, world, port, threads=ranks.cores_per_rank(world), timeout_s=900)
    job = _spec(parallelism, switch, MICRO_BATCHES, steps)
    recorder = recording.MemoryRecorder()
    eng = engine.Engine(
        job, mesh.build_mesh(job.parallelism.layout, torch.device("cpu")), recorder=recorder
    )
    optimizer = eng.optimizer if isinstance(eng.optimizer, zero.ZeroAdamW) else None
    eng.train_step()
    if optimizer is not None:
        optimizer.take_gather_waits()
    per_axis: dict[str, list[float]] = {"dp": [], "tp": [], "pp": []}
    seconds = []
    for _ in range(steps):
        dist.barrier()
        seconds.append(eng.train_step().seconds)
        waits = optimizer.take_gather_waits() if optimizer is not None else []
        blocked = sum(float(end) - float(start) for start, end in waits)
        for axis, value in exposed(recorder.snapshot(), blocked).items():
            per_axis[axis].append(value)
    result = {axis: _worst_median(values) for axis, values in per_axis.items()}
    result["step_seconds"] = _worst_median(seconds)
    ranks.leave(result, out)


def _memory_rank(
    rank: int, world: int, port: int, stage: int, micro_batches: int, out: str
) -> None:
    ranks.join(rank, world, port, threads=ranks.cores_per_rank(world), timeout_s=900)
    job = _spec({"data": world, "zeroStage": stage}, {}, micro_batches, 2)
    eng = engine.Engine(job, mesh.build_mesh(job.parallelism.layout, torch.device("cpu")))
    peak = ranks.second_step_peak(eng)
    ranks.leave({"peak_bytes": peak}, out)


def timing_rows(steps: int) -> list[dict[str, Any]]:
    """Exposed communication of every row, off then on (once where the switch is missing)."""
    rows = []
    for name, (parallelism, switch) in ROWS.items():
        present = has_switch(switch)
        settings: list[bool | None] = [False, True] if present else [None]
        for setting in settings:
            overlap = {} if setting is None else {switch: setting}
            world = parallelism.get("data", 1) * parallelism.get("tensor", 1)
            world *= parallelism.get("pipeline", 1)
            load = os.getloadavg()[0]
            measured = ranks.spawn(_timing_rank, world, parallelism, overlap, steps)
            plan = estimate.make_plan(
                _spec(parallelism, overlap, MICRO_BATCHES, steps), profiles.get("cpu")
            )
            rows.append(
                {
                    "row": name,
                    "switch": f"overlap.{switch}",
                    "overlap": setting,
                    "note": "" if present else "toggle not present",
                    "exposed_seconds": {a: measured[a] for a in ("dp", "tp", "pp")},
                    "median_step_seconds": measured["step_seconds"],
                    "planned_dp_exposed_seconds": plan.time.stages[0].dp_exposed,
                    "load_average_1m_before": load,
                }
            )
    return rows


def memory_rows(micro_batch_counts: list[int]) -> list[dict[str, Any]]:
    """Peak live bytes at dp2, ZeRO-1 and ZeRO-2, at 4 and 16 micro-batches, with the planner's."""
    cpu = profiles.get("cpu")
    rows = []
    for micro_batches in micro_batch_counts:
        for stage in (1, 2):
            measured = ranks.spawn(_memory_rank, 2, stage, micro_batches)
            plan = memory.plan_memory(
                _spec({"data": 2, "zeroStage": stage}, {}, micro_batches, 2), cpu
            )
            rows.append(
                {
                    "zero_stage": stage,
                    "micro_batches": micro_batches,
                    "peak_bytes": measured["peak_bytes"],
                    "planned_peak_bytes": plan.worst.total,
                }
            )
    for r in rows:
        zero1 = next(
            o for o in rows if o["zero_stage"] == 1 and o["micro_batches"] == r["micro_batches"]
        )
        r["peak_vs_zero1"] = r["peak_bytes"] / zero1["peak_bytes"]
    return rows


def _axis(row: dict[str, Any]) -> str:
    return {"tp2": "tp", "pp2": "pp"}.get(row["row"], "dp")


def print_tables(timing: list[dict[str, Any]], mem: list[dict[str, Any]]) -> None:
    print(f"exposed communication per step, ms (worst rank's median); model {MODEL}, CPU gloo")
    print(
        f"{'layout':>10} {'switch':>20} {'overlap':>8} | {'exposed':>8} {'planned':>8} | {'step s':>7} | note"
    )
    for r in timing:
        setting = {None: "-", False: "off", True: "on"}[r["overlap"]]
        planned = f"{r['planned_dp_exposed_seconds'] * 1e3:>8.1f}" if _axis(r) == "dp" else " " * 8
        print(
            f"{r['row']:>10} {r['switch']:>20} {setting:>8} | "
            f"{r['exposed_seconds'][_axis(r)] * 1e3:>8.1f} {planned} | "
            f"{r['median_step_seconds']:>7.3f} | {r['note']}"
        )
    print("peak live tensor MiB per rank at dp2 (step 2)")
    print(f"{'zero':>4} {'micro':>5} | {'peak':>8} {'planned':>8} | {'vs ZeRO-1':>9}")
    for r in mem:
        print(
            f"{r['zero_stage']:>4} {r['micro_batches']:>5} | {r['peak_bytes'] / 2**20:>8.1f} "
            f"{r['planned_peak_bytes'] / 2**20:>8.1f} | {r['peak_vs_zero1']:>9.3f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--micro-batches", type=int, nargs="+", default=[4, 16], help="of the memory rows"
    )
    parser.add_argument("--memory-only", action="store_true", help="skip the timing rows")
    args = parser.parse_args()
    timing = [] if args.memory_only else timing_rows(args.steps)
    mem = memory_rows(args.micro_batches)
    print_tables(timing, mem)
    if args.memory_only:  # a partial run writes no results
        return 0
    path = machine.write_results(
        "overlap",
        {
            "model": MODEL,
            "micro_batches": MICRO_BATCHES,
            "steps": args.steps,
            "timing": timing,
            "memory": mem,
            "load_average_after": os.getloadavg(),
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
