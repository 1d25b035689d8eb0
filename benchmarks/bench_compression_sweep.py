"""Benchmark: PowerSGD's rank and exact warm-up swept on two model sizes, loss vs uncompressed and bytes vs bf16.

At dp ``--world`` on local gloo processes, every configuration trains the same GPT (same seed, same
batches) for ``--steps`` steps: uncompressed (fp32), bf16, and PowerSGD at each ``--ranks`` x
``--warmups`` (``parallelism.gradientCompression.warmupSteps``), on the ``tiny`` preset and on
``small`` (:data:`benchmarks.bench_compression.MODEL`, twice tiny's width).  Per configuration:
the final loss (mean of the last 5 steps) against uncompressed, the data-parallel payload of a
compressed step and of the whole run (warm-up steps included) against bf16's, from the trainer's
recorder.  Written to ``benchmarks/results/compression_sweep-<host>.json``; docs/trainer.md's
defaults (rank, warmupSteps) come from it.

    python benchmarks/bench_compression_sweep.py [--world 2] [--steps 80]
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
    rank: int, world: int, port: int, steps: int, ranks_: list[int], warmups: list[int], out: str
) -> None:
    ranks.join(rank, world, port, threads=ranks.cores_per_rank(world), timeout_s=1800)
    rows, mesh = [], None
    for name, model in MODELS.items():
        for compression in configurations(ranks_, warmups):
            raw = bench_compression._raw(world, steps, compression)
            raw["model"] = model
            row, mesh = _run(raw, mesh, steps)
            rows.append({"model": name, **compression, **row})
    if rank == 0:
        torch.save(rows, Path(out) / ranks.RESULT)
    dist.barrier()
    dist.destroy_process_group()


def compare(rows: list[dict]) -> None:
    """Add each row's loss against its model's uncompressed run and its bytes against bf16's."""
    for row in rows:
        base = next(r for r in rows if r["model"] == row["model"] and r["mode"] == "none")
        half = next(r for r in rows if r["model"] == row["model"] and r["mode"] == "bf16")
        row["loss_vs_none"] = row["final_loss"] / base["final_loss"] - 1
        row["step_bytes_vs_bf16"] = row["last_step_bytes"] / half["last_step_bytes"]
        row["run_bytes_vs_bf16"] = row["run_bytes"] / half["run_bytes"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--warmups", type=int, nargs="+", default=[0, 10, 25])
    args = parser.parse_args(argv)
    rows = ranks.spawn(_rank, args.world, args.steps, args.ranks, args.warmups)
    compare(rows)
    print(
        f"dp{args.world}, {args.steps} steps, fp32, same seed and batches; loss = mean of last {LAST}"
    )
    header = (
        f"{'model':>6} {'config':>18} {'final loss':>11} {'vs none':>8} "
        f"{'step B/bf16':>11} {'run B/bf16':>11}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        config = row["mode"] + (
            f" r{row['rank']} w{row['warmupSteps']}" if row["mode"] == "powersgd" else ""
        )
        print(
            f"{row['model']:>6} {config:>18} {row['final_loss']:>11.4f} {row['loss_vs_none']:>+8.2%} "
            f"{row['step_bytes_vs_bf16']:>11.3f} {row['run_bytes_vs_bf16']:>11.3f}"
        )
    results = {"world": args.world, "steps": args.steps, "models": MODELS, "rows": rows}
    path = machine.write_results("compression_sweep", results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
