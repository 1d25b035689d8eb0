"""Benchmark: data-parallel bytes per step and final loss of every gradient-compression mode vs none.

Every mode trains the same small GPT (same seed, same batches) for
``--steps`` steps at dp ``--world`` in one set of local gloo processes; the
data-parallel payload bytes of the last step come from the trainer's
recorder (every collective the reducer issued, as reported), and the final
loss is the mean of the last 5 steps' losses.  Printed side by side with
the ratios to uncompressed; written to
``benchmarks/results/compression-<host>.json``.  Target of the issue: PowerSGD
rank 4 sends >= 10x fewer dp bytes with a final loss within 2%.

    python benchmarks/bench_compression.py [--world 2] [--steps 60]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine, ranks
from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import recording

MODES = (
    {"mode": "none"},
    {"mode": "bf16"},
    {"mode": "fp16"},
    {"mode": "int8"},
    {"mode": "topk", "topkRatio": 0.01},
    {"mode": "powersgd", "rank": 4},
)
MODEL = {"layers": 4, "hidden": 128, "heads": 4, "vocab": 256, "seqLen": 64}


def _raw(world: int, steps: int, compression: dict) -> dict:
    return {
        "parallelism": {"data": world, "gradientCompression": compression},
        "resources": {"gpusPerNode": world},
        "model": MODEL,
        "training": {
            "microBatch": 4,
            "steps": steps,
            "learningRate": 1e-3,
            "minLearningRate": 1e-4,
            "warmupSteps": 5,
            "precision": "fp32",
            "seed": 11,
            "dataset": "stdlib",
        },
    }


def _rank(rank: int, world: int, port: int, steps: int, out: str) -> None:
    ranks.join(rank, world, port, threads=ranks.cores_per_rank(world), timeout_s=900)
    rows, mesh = [], None
    for compression in MODES:
        job = loading.parse_spec(_raw(world, steps, compression))
        mesh = mesh or mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
        recorder = recording.MemoryRecorder()
        eng = engine.Engine(job, mesh, recorder=recorder)
        losses = [eng.train_step().loss for _ in range(steps)]
        dp_bytes = sum(
            e.nbytes
            for e in recorder.events  # the last step's events
            if e.what == "collective" and e.group == "dp" and e.bucket is not None
        )
        rows.append(
            {
                **compression,
                "dp_bytes_per_step": dp_bytes,
                "final_loss": sum(losses[-5:]) / 5,
                "first_loss": losses[0],
            }
        )
    if rank == 0:
        torch.save(rows, Path(out) / ranks.RESULT)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    rows = ranks.spawn(_rank, args.world, args.steps)
    base = rows[0]
    for row in rows:
        row["bytes_ratio_vs_none"] = base["dp_bytes_per_step"] / row["dp_bytes_per_step"]
        row["loss_vs_none"] = row["final_loss"] / base["final_loss"] - 1
    print(f"dp{args.world}, {args.steps} steps, model {MODEL}, fp32, same seed and batches")
    header = f"{'mode':>16} {'dp bytes/step':>14} {'x fewer':>8} {'final loss':>11} {'vs none':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        name = row["mode"] + (f" r{row['rank']}" if "rank" in row else "")
        name += f" {row['topkRatio']}" if "topkRatio" in row else ""
        print(
            f"{name:>16} {row['dp_bytes_per_step']:>14,} {row['bytes_ratio_vs_none']:>8.1f} "
            f"{row['final_loss']:>11.4f} {row['loss_vs_none']:>+8.2%}"
        )
    path = machine.write_results(
        "compression", {"world": args.world, "steps": args.steps, "model": MODEL, "rows": rows}
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
