"""Benchmark: PowerSGD's rank and exact warm-up swept on two model sizes, loss vs uncompressed and bytes vs bf16.

At dp ``--world`` on local gloo processes, every configuration trains the same GPT (same seed, same
batches) for ``--steps`` steps, once per ``--seeds`` seed (``training.seed``: initial weights and batches): uncompressed (fp32), bf16, and PowerSGD at each ``--ranks`` x
``--warmups`` (``parallelism.gradientCompression.warmupSteps``), on the ``tiny`` preset and on
``small`` (:data:`benchmarks.bench_compression.MODEL`, twice tiny's width).  Per configuration:
the final loss (mean of the last 5 steps) against uncompressed, the data-parallel payload of a
compressed step and of the whole run (warm-up steps included) against bf16's, from the trainer's
recorder.  Each configuration's loss gap is reported per seed and as the mean and spread (min, max)
over the seeds.  Written to ``benchmarks/results/compression_sweep-<host>.json``; docs/trainer.md's
defaults (rank, warmupSteps) come from it.

    python benchmarks/bench_compression_sweep.py [--world 2] [--steps 80] [--seeds 11 12 13]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import bench_compression, machine, ranks
from meshtrain.api import loading, presets
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import recording

MODELS = {
    "tiny": {k.replace("seq_len", "seqLen"): v for k, v in presets.PRESETS["tiny"].items()},
    "small": bench_compression.MODEL,
}
LAST = 5
"""Steps averaged for the final loss."""


def configurations(ranks_: list[int], warmups: list[int]) -> list[dict]:
    """Uncompressed, bf16, then PowerSGD at every rank x warm-up."""
    return [
        {"mode": "none"},
        {"mode": "bf16"},
        *({"mode": "powersgd", "rank": r, "warmupSteps": w} for r in ranks_ for w in warmups),
    ]


def _run(job_raw: dict, mesh: mesh_mod.Mesh | None, steps: int) -> tuple[dict, mesh_mod.Mesh]:
    job = loading.parse_spec(job_raw)
    mesh = mesh or mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
    recorder = recording.MemoryRecorder()
    eng = engine.Engine(job, mesh, recorder=recorder)
    losses, step_bytes = [], []
    for _ in range(steps):
        losses.append(eng.train_step().loss)
        step_bytes.append(
            sum(
                e.nbytes
                for e in recorder.events  # this step's events
                if e.what == "collective" and e.group == "dp" and e.bucket is not None
            )
        )
    return {
        "final_loss": sum(losses[-LAST:]) / LAST,
        "first_loss": losses[0],
        "last_step_bytes": step_bytes[-1],
        "run_bytes": sum(step_bytes),
    }, mesh


def _rank(
    rank: int,
    world: int,
    port: int,
    steps: int,
    ranks_: list[int],
    warmups: list[int],
    seeds: list[int],
    out: str,
) -> None:
    ranks.join(rank, world, port, threads=ranks.cores_per_rank(world), timeout_s=1800)
    rows, mesh = [], None
    for seed in seeds:
        for name, model in MODELS.items():
            for compression in configurations(ranks_, warmups):
                raw = bench_compression._raw(world, steps, compression)
                raw["model"] = model
                raw["training"]["seed"] = seed
                row, mesh = _run(raw, mesh, steps)
                rows.append({"model": name, "seed": seed, **compression, **row})
    if rank == 0:
        torch.save(rows, Path(out) / ranks.RESULT)
    dist.barrier()
    dist.destroy_process_group()


def _config(row: dict) -> str:
    return row["mode"] + (
        f" r{row['rank']} w{row['warmupSteps']}" if row["mode"] == "powersgd" else ""
    )


def compare(rows: list[dict]) -> None:
    """Add each row's loss against its model's uncompressed run of the same seed and its bytes against bf16's."""
    for row in rows:
        same = [r for r in rows if r["model"] == row["model"] and r["seed"] == row["seed"]]
        base = next(r for r in same if r["mode"] == "none")
        half = next(r for r in same if r["mode"] == "bf16")
        row["loss_vs_none"] = row["final_loss"] / base["final_loss"] - 1
        row["step_bytes_vs_bf16"] = row["last_step_bytes"] / half["last_step_bytes"]
        row["run_bytes_vs_bf16"] = row["run_bytes"] / half["run_bytes"]


def spread(rows: list[dict]) -> list[dict]:
    """Per model and configuration: the loss gap's mean, min and max over the seeds, and the bytes."""
    out: list[dict] = []
    for key in dict.fromkeys((r["model"], _config(r)) for r in rows):
        gaps = [r["loss_vs_none"] for r in rows if (r["model"], _config(r)) == key]
        first = next(r for r in rows if (r["model"], _config(r)) == key)
        out.append(
            {
                "model": key[0],
                "config": key[1],
                "seeds": len(gaps),
                "loss_vs_none_mean": sum(gaps) / len(gaps),
                "loss_vs_none_min": min(gaps),
                "loss_vs_none_max": max(gaps),
                "step_bytes_vs_bf16": first["step_bytes_vs_bf16"],
                "run_bytes_vs_bf16": first["run_bytes_vs_bf16"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--warmups", type=int, nargs="+", default=[0, 10, 25])
    parser.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13])
    args = parser.parse_args(argv)
    rows = ranks.spawn(_rank, args.world, args.steps, args.ranks, args.warmups, args.seeds)
    compare(rows)
    summary = spread(rows)
    print(
        f"dp{args.world}, {args.steps} steps, fp32, seeds {args.seeds}; loss = mean of last {LAST}; "
        "gap vs uncompressed of the same seed: mean [min, max] over the seeds"
    )
    header = (
        f"{'model':>6} {'config':>18} {'vs none mean':>12} {'min':>8} {'max':>8} "
        f"{'step B/bf16':>11} {'run B/bf16':>11}"
    )
    print(header)
    print("-" * len(header))
    for row in summary:
        print(
            f"{row['model']:>6} {row['config']:>18} {row['loss_vs_none_mean']:>+12.2%} "
            f"{row['loss_vs_none_min']:>+8.2%} {row['loss_vs_none_max']:>+8.2%} "
            f"{row['step_bytes_vs_bf16']:>11.3f} {row['run_bytes_vs_bf16']:>11.3f}"
        )
    results = {
        "world": args.world,
        "steps": args.steps,
        "seeds": args.seeds,
        "models": MODELS,
        "summary": summary,
        "rows": rows,
    }
    path = machine.write_results("compression_sweep", results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
