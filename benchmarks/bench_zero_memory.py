"""Benchmark: per-rank memory of weights, gradients and optimizer state for ZeRO 0/1/2 at dp 1, 2, 4.

For each data-parallel degree and ZeRO stage it starts that many
fresh local gloo ranks; each builds the meshtrain Engine for the preset,
creates AdamW's state, runs one forward/backward (so every lazily created
tensor exists) and measures its state with
:func:`meshtrain.trainer.parallel.state_bytes.measure`.  A configuration that would not fit
in the memory available now is skipped (and listed).  It prints measured
bytes per parameter beside the formula (fp32 weights and AdamW:
4 + 4 + 8 replicated, 4 + 4 + 8/N at stage 1, 4 + (4 + 8)/N at stage 2) and
writes ``benchmarks/results/zero_memory-<host>.json``.

The sequence length is cut to ``--seq-len`` (default 64) so a CPU step is
quick; only the position table depends on it.

Not a peak-memory profile (activations are not counted).

    python benchmarks/bench_zero_memory.py [--preset 125m] [--dps 1 2 4] [--seq-len 64]
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
from meshtrain.api import spec as api_spec
from meshtrain.trainer import engine
from meshtrain.trainer.checkpointing import state
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import mesh, state_bytes, zero


def _spec(preset: str, dp: int, stage: int, seq_len: int) -> api_spec.TrainingJobSpec:
    return loading.parse_spec(
        {
            "parallelism": {"data": dp, "zeroStage": stage},
            "resources": {"gpusPerNode": dp},
            "model": {"preset": preset, "seqLen": seq_len},
            "training": {"microBatch": 1, "steps": 10, "precision": "fp32", "dataset": "stdlib"},
        }
    )


def _rank(
    rank: int, world: int, port: int, preset: str, stage: int, seq_len: int, out: str
) -> None:
    ranks.join(rank, world, port, threads=ranks.cores_per_rank(world), timeout_s=900)
    job = _spec(preset, world, stage, seq_len)
    eng = engine.Engine(job, mesh.build_mesh(job.parallelism.layout, torch.device("cpu")))
    state.init_optimizer_state(
        eng.optimizer
    )  # AdamW's moments exist from the start (as the worker does)
    eng.forward_backward()  # ...and gradients, also without DP
    report = state_bytes.measure(eng.model, eng.optimizer, eng.model.reducer)
    if rank == 0:
        torch.save(report.as_dict(), Path(out) / ranks.RESULT)
    dist.barrier()
    dist.destroy_process_group()


def _available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--dps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    results, skipped = [], []
    dense = _spec(args.preset, 1, 0, args.seq_len).model.shape()
    params = gpt.dense_param_count(gpt.GPTConfig.from_shape(dense))
    for dp in args.dps:
        for stage in (0, 1, 2):
            # one fresh process group per configuration, so freed memory of the last one cannot inflate this one
            per_rank = (
                sum(zero.expected_bytes_per_param(stage=stage, dp=dp).values()) * params + 2**29
            )
            need = int(
                1.25 * per_rank * dp
            )  # the formula's state plus ~0.5 GiB of runtime per rank, with headroom
            if need > _available_bytes():
                skipped.append(
                    {
                        "dp": dp,
                        "zero_stage": stage,
                        "needs_bytes": need,
                        "available_bytes": _available_bytes(),
                    }
                )
                continue
            row = ranks.spawn(_rank, dp, args.preset, stage, args.seq_len)
            results.append({"dp": dp, "requested_zero": stage, **row})
    header = (
        f"{'dp':>3} {'zero':>4} {'params':>12} | {'weights B/p':>11} {'grads B/p':>9} {'optim B/p':>9} | "
        f"{'formula w/g/o':>17} | {'total MiB':>9}"
    )
    print(
        f"per-rank training state, preset {args.preset} (seq {args.seq_len}, {params:,} params), fp32 + AdamW, "
        f"measured after one forward/backward"
    )
    print(header)
    print("-" * len(header))
    for r in (
        results
    ):  # ZeRO over one rank is plain AdamW: the effective stage is 0, the formula the same
        per, exp = (
            r["per_param"],
            zero.expected_bytes_per_param(stage=r["requested_zero"], dp=r["dp"]),
        )
        formula = f"{exp['params']:.0f}/{exp['grads']:.2f}/{exp['optimizer']:.2f}"
        print(
            f"{r['dp']:>3} {r['requested_zero']:>4} {r['params']:>12,} | {per['params']:>11.3f} {per['grads']:>9.3f} "
            f"{per['optimizer']:>9.3f} | {formula:>17} | {r['total_bytes'] / 2**20:>9.1f}"
        )
        r["expected_per_param"] = exp
    for skip in skipped:
        print(
            f"skipped dp {skip['dp']} zero {skip['zero_stage']}: needs about {skip['needs_bytes'] / 2**30:.1f} GiB, "
            f"{skip['available_bytes'] / 2**30:.1f} GiB available"
        )
    path = machine.write_results(
        "zero_memory",
        {
            "preset": args.preset,
            "seq_len": args.seq_len,
            "params": params,
            "rows": results,
            "skipped": skipped,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
