"""Benchmark: ZeRO-3 (FSDP2) against ZeRO 0-2 on one machine: peak memory per rank, the planner's peak, step time.

For each ZeRO stage it starts ``--dp`` fresh local gloo ranks; each builds
the meshtrain Engine for the model, trains one step (lazy state), measures
the next step's peak of live tensor bytes with
:class:`meshtrain.trainer.telemetry.live_bytes.LiveBytes` (training state included)
and then times ``--steps`` more steps without the tracker.  Rank 0 reports;
the planner's per-rank peak (:func:`meshtrain.planner.memory.plan_memory`)
is computed beside it.  All stages run in one invocation so their ratios
share the machine's load; writes ``benchmarks/results/zero3-<host>.json``.

    python benchmarks/bench_zero3.py [--dp 2] [--steps 5] [--micro-batches 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine, ranks
from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.planner import memory, profiles
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh

MODEL = {"layers": 8, "hidden": 256, "heads": 8, "vocab": 8192, "seqLen": 128, "ffnHidden": 1024}
"""Small enough for a 2-core CPU, large enough that weights and optimizer state dominate activations."""


def _spec(dp: int, stage: int, micro_batches: int, steps: int) -> api_spec.TrainingJobSpec:
    return job_spec({"data": dp, "zeroStage": stage, "microBatches": micro_batches}, dp, steps)


def job_spec(
    parallelism: dict[str, object], gpus_per_node: int, steps: int
) -> api_spec.TrainingJobSpec:
    """A CPU job of :data:`MODEL` with ``parallelism``, one pod of ``gpusPerNode`` ranks, fp32."""
    return loading.parse_spec(
        {
            "parallelism": parallelism,
            "resources": {"gpusPerNode": gpus_per_node},
            "model": MODEL,
            "training": {
                "microBatch": 1,
                "steps": steps + 2,
                "precision": "fp32",
                "dataset": "stdlib",
            },
        }
    )


def _rank(
    rank: int, world: int, port: int, stage: int, micro_batches: int, steps: int, out: str
) -> None:
    ranks.join(rank, world, port, threads=ranks.cores_per_rank(world), timeout_s=900)
    job = _spec(world, stage, micro_batches, steps)
    eng = engine.Engine(job, mesh.build_mesh(job.parallelism.layout, torch.device("cpu")))
    peak = ranks.second_step_peak(eng)
    seconds = ranks.timed_steps(eng.train_step, steps)
    if rank == 0:
        torch.save({"peak_bytes": peak, "step_seconds": seconds}, Path(out) / ranks.RESULT)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=4)
    args = parser.parse_args()
    cpu = profiles.get("cpu")
    rows = []
    for stage in (0, 1, 2, 3):
        load_before = os.getloadavg()[0]
        measured = ranks.spawn(_rank, args.dp, stage, args.micro_batches, args.steps)
        plan = memory.plan_memory(_spec(args.dp, stage, args.micro_batches, args.steps), cpu)
        rows.append(
            {
                "zero_stage": stage,
                "peak_bytes": measured["peak_bytes"],
                "planned_peak_bytes": plan.worst.total,
                "step_seconds": measured["step_seconds"],
                "median_step_seconds": statistics.median(measured["step_seconds"]),
                "load_average_1m_before": load_before,
            }
        )
    base = next(r for r in rows if r["zero_stage"] == 1)
    print(
        f"dp {args.dp}, {args.micro_batches} micro-batches, model {MODEL}, fp32 + AdamW, CPU gloo"
    )
    print(
        f"{'zero':>4} | {'peak MiB':>8} {'planned':>8} {'plan/meas':>9} | {'vs ZeRO-1':>9} | {'step s':>7} {'vs ZeRO-1':>9}"
    )
    for r in rows:
        r["peak_vs_zero1"] = r["peak_bytes"] / base["peak_bytes"]
        r["step_time_vs_zero1"] = r["median_step_seconds"] / base["median_step_seconds"]
        print(
            f"{r['zero_stage']:>4} | {r['peak_bytes'] / 2**20:>8.2f} {r['planned_peak_bytes'] / 2**20:>8.2f} "
            f"{r['planned_peak_bytes'] / r['peak_bytes']:>9.3f} | {r['peak_vs_zero1']:>9.3f} | "
            f"{r['median_step_seconds']:>7.3f} {r['step_time_vs_zero1']:>9.3f}"
        )
    path = machine.write_results(
        "zero3",
        {"dp": args.dp, "micro_batches": args.micro_batches, "model": MODEL, "rows": rows},
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
