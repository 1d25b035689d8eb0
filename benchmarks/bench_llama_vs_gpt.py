"""Tokens/s of the Llama tiny preset against the GPT tiny preset of about the same size, on CPU, side by side.

One process, a world of one rank (gloo): both engines are built, warmed up,
then trained step by step in alternation (GPT, Llama, GPT, ...), so machine
noise hits both alike; the ratio of their tokens/s is the number to read.
``llama-tiny`` (229,952 parameters: RoPE, RMSNorm, SwiGLU, 2 kv heads) and
``tiny`` (234,624: learned positions, LayerNorm, GELU) share depth, width,
heads, vocabulary and sequence length.  Writes
``benchmarks/results/llama_vs_gpt-<host>.json``.

    python benchmarks/bench_llama_vs_gpt.py [--steps 40] [--micro-batch 8]
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
from benchmarks import machine
from meshtrain.api import loading
from meshtrain.sandbox.controlplane.ports import pick_free_port
from meshtrain.trainer import engine
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import mesh as mesh_mod

PRESETS = ("tiny", "llama-tiny")
WARMUP = 3


def _engine(preset: str, micro_batch: int, steps: int, mesh: mesh_mod.Mesh) -> engine.Engine:
    job = loading.parse_spec(
        {
            "model": {"preset": preset},
            "resources": {"gpusPerNode": 1},
            "training": {
                "microBatch": micro_batch,
                "steps": steps + WARMUP,
                "precision": "fp32",
                "dataset": "stdlib",
            },
        }
    )
    return engine.Engine(job, mesh)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per model")
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args(argv)
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(pick_free_port()),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    job = loading.parse_spec({"resources": {"gpusPerNode": 1}})
    mesh = mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
    engines = {p: _engine(p, args.micro_batch, args.steps, mesh) for p in PRESETS}
    for eng in engines.values():
        for _ in range(WARMUP):
            eng.train_step()
    results: dict[str, list[engine.StepResult]] = {p: [] for p in PRESETS}
    for _ in range(args.steps):
        for preset, eng in engines.items():
            results[preset].append(eng.train_step())
    rows = []
    for preset, steps in results.items():
        config = engines[preset].config
        rows.append(
            {
                "preset": preset,
                "family": config.family,
                "params": gpt.dense_param_count(config),
                "tokens_per_step": steps[0].tokens,
                "median_step_seconds": statistics.median(r.seconds for r in steps),
                "tokens_per_second": sum(r.tokens for r in steps) / sum(r.seconds for r in steps),
                "last_loss": steps[-1].loss,
            }
        )
    ratio = rows[1]["tokens_per_second"] / rows[0]["tokens_per_second"]
    print(f"{'preset':<12} {'params':>9} {'tokens/s':>10} {'median step s':>14}")
    for row in rows:
        print(
            f"{row['preset']:<12} {row['params']:>9,} {row['tokens_per_second']:>10,.0f} "
            f"{row['median_step_seconds']:>14.4f}"
        )
    print(f"llama-tiny / tiny tokens/s: {ratio:.3f}")
    path = machine.write_results(
        "llama_vs_gpt",
        {"rows": rows, "llama_over_gpt_tokens_per_second": ratio, "threads": 1},
    )
    print(f"wrote {path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
