"""Benchmark: tokens/s and model FLOPs utilisation of the engine on one GPU (bf16).

For the 350M and 1.3B presets (``--presets``), one process builds
meshtrain's :class:`~meshtrain.trainer.engine.Engine` on a world of one rank
(the same code as a multi-GPU run: pipeline executor, AdamW, clipping, data
sampler), trains ``--steps`` steps with bf16 autocast and fp32 master
weights, and reports tokens/s and MFU = tokens/s x FLOPs per token / peak.
FLOPs per token is ``6N + 12 L T H`` (:func:`meshtrain.trainer.model.flops_per_token`,
full attention matrix counted); the peak is the GPU's dense bf16 figure
(:mod:`meshtrain.trainer.telemetry.peak`).  Writes
``benchmarks/results/mfu-<host>.json``.

Not a multi-GPU scaling test, and not meant for a CPU (``--device
cpu --presets tiny`` only checks that the script runs).

    python benchmarks/bench_mfu.py [--presets 350m 1.3b] [--steps 10] [--micro-batch 350m=8 1.3b=4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import machine
from meshtrain import layout as layout_mod
from meshtrain.api import loading
from meshtrain.controlplane.ports import pick_free_port
from meshtrain.trainer import engine
from meshtrain.trainer import model as gpt
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import peak

MICRO_BATCH = {"tiny": 8, "125m": 16, "350m": 8, "1.3b": 4, "7b": 1}
"""Sequences (of the preset's 2048 tokens) per step that fit an 80 GB GPU without activation checkpointing."""
WARMUP = 3


def run_preset(preset: str, micro_batch: int, steps: int, device: torch.device) -> dict:
    precision = "bf16" if device.type == "cuda" else "fp32"
    job = loading.parse_spec(
        {
            "model": {"preset": preset},
            "resources": {"gpusPerNode": 1},
            "training": {
                "microBatch": micro_batch,
                "steps": steps + WARMUP,
                "warmupSteps": 2,
                "precision": precision,
                "dataset": "stdlib",
            },
        }
    )
    mesh = mesh_mod.build_mesh(layout_mod.from_spec(job.parallelism), device)
    trainer = engine.Engine(job, mesh)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    results = [
        trainer.train_step() for _ in range(steps + WARMUP)
    ]  # each step ends with a host sync (loss)
    timed = results[WARMUP:]
    seconds = sum(r.seconds for r in timed)
    tokens_per_second = sum(r.tokens for r in timed) / seconds
    config = trainer.config
    flops = gpt.flops_per_token(config)
    peak_flops = peak.resolve_peak_flops(None, device)
    row = {
        "preset": preset,
        "params": gpt.dense_param_count(config),
        "micro_batch": micro_batch,
        "seq_len": config.seq_len,
        "precision": precision,
        "tokens_per_step": timed[0].tokens,
        "median_step_seconds": statistics.median(r.seconds for r in timed),
        "tokens_per_second": tokens_per_second,
        "flops_per_token": flops,
        "peak_flops": peak_flops,
        "mfu": tokens_per_second * flops / peak_flops,
        "first_loss": results[0].loss,
        "last_loss": results[-1].loss,
        "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30)
        if device.type == "cuda"
        else None,
    }
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=None, help="default: 350m 1.3b (on a GPU)")
    parser.add_argument(
        "--steps", type=int, default=10, help="timed steps per preset (after 3 warm-up steps)"
    )
    parser.add_argument("--micro-batch", nargs="*", default=[], metavar="PRESET=N")
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    args = parser.parse_args(argv)
    if args.presets is None:
        if (
            args.device != "cuda"
        ):  # `python -m benchmarks` on a CPU machine: nothing meaningful to measure
            print("no GPU: MFU benchmark skipped (smoke test on CPU: --device cpu --presets tiny)")
            return 0
        args.presets = ["350m", "1.3b"]
    sizes = dict(
        MICRO_BATCH, **{k: int(v) for k, v in (item.split("=") for item in args.micro_batch)}
    )
    port = pick_free_port()
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    cuda = args.device == "cuda"
    device = mesh_mod.device_for(0, use_cuda=cuda)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    mesh_mod.init_process_group(use_cuda=cuda)
    rows = []
    print(
        f"{'preset':<7} {'params':>8} {'batch':>9} {'step s':>7} {'tokens/s':>10} {'MFU':>6} {'mem GiB':>8}"
    )
    for preset in args.presets:
        row = run_preset(preset, sizes[preset], args.steps, device)
        rows.append(row)
        memory = f"{row['peak_memory_gib']:.1f}" if row["peak_memory_gib"] is not None else "-"
        print(
            f"{preset:<7} {row['params'] / 1e6:>7.0f}M {row['micro_batch']:>3}x{row['seq_len']:<5} "
            f"{row['median_step_seconds']:>7.3f} {row['tokens_per_second']:>10,.0f} {row['mfu']:>6.1%} {memory:>8}"
        )
    dist.destroy_process_group()
    path = machine.write_results("mfu", {"device": args.device, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
