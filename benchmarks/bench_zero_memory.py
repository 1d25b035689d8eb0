"""Benchmark: per-rank memory of weights, gradients and optimizer state for ZeRO 0/1/2 at dp 1, 2, 4.

What it is: for each data-parallel degree it starts that many local gloo
ranks; each builds the meshtrain Engine for the preset at ZeRO 0, 1 and 2 in
turn, trains one step (so every lazily created tensor exists) and measures
its state with :func:`meshtrain.trainer.memory.measure`.  It prints measured
bytes per parameter beside the formula (fp32 weights and AdamW:
4 + 4 + 8 replicated, 4 + 4 + 8/N at stage 1, 4 + (4 + 8)/N at stage 2) and
writes ``benchmarks/results/zero_memory-<host>.json``.

The sequence length is cut to ``--seq-len`` (default 64) so a CPU step is
quick; only the position table depends on it.

What it is not: a peak-memory profile (activations are not counted).

    python benchmarks/bench_zero_memory.py [--preset 125m] [--dps 1 2 4] [--seq-len 64]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import machine  # noqa: E402
from meshtrain import layout as layout_mod  # noqa: E402
from meshtrain.api import spec as spec_mod  # noqa: E402
from meshtrain.trainer import engine, memory  # noqa: E402
from meshtrain.trainer.parallel import mesh as mesh_mod  # noqa: E402
from meshtrain.trainer.parallel import zero  # noqa: E402


def _spec(preset: str, dp: int, stage: int, seq_len: int) -> spec_mod.TrainingJobSpec:
    return spec_mod.parse_spec({
        "parallelism": {"data": dp, "zeroStage": stage},
        "resources": {"gpusPerNode": dp},
        "model": {"preset": preset, "seqLen": seq_len},
        "training": {"microBatch": 1, "steps": 10, "precision": "fp32", "dataset": "stdlib"},
    })


def _rank(rank: int, world: int, port: int, preset: str, seq_len: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
    rows = []
    for stage in (0, 1, 2):
        job = _spec(preset, world, stage, seq_len)
        eng = engine.Engine(job, mesh_mod.build_mesh(layout_mod.from_spec(job.parallelism), torch.device("cpu")))
        eng.train_step()
        report = memory.measure(eng.model, eng.optimizer, eng.model.reducer)
        rows.append(report.as_dict())
        del eng
        gc.collect()
    if rank == 0:
        torch.save(rows, Path(out) / "rows.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--dps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    results = []
    for dp in args.dps:
        with tempfile.TemporaryDirectory() as out:
            port = 29500 + os.getpid() % 1000 + dp
            mp.start_processes(_rank, args=(dp, port, args.preset, args.seq_len, out), nprocs=dp, start_method="spawn")
            for row in torch.load(Path(out) / "rows.pt"):
                results.append({"dp": dp, **row})
    header = f"{'dp':>3} {'zero':>4} {'params':>12} | {'weights B/p':>11} {'grads B/p':>9} {'optim B/p':>9} | " \
             f"{'formula w/g/o':>17} | {'total MiB':>9}"
    print(f"per-rank training state, preset {args.preset} (seq {args.seq_len}), fp32 + AdamW, measured after one step")
    print(header)
    print("-" * len(header))
    for r in results:
        per, exp = r["per_param"], zero.expected_bytes_per_param(stage=r["zero_stage"], dp=r["dp"])
        formula = f"{exp['params']:.0f}/{exp['grads']:.2f}/{exp['optimizer']:.2f}"
        print(f"{r['dp']:>3} {r['zero_stage']:>4} {r['params']:>12,} | {per['params']:>11.3f} {per['grads']:>9.3f} "
              f"{per['optimizer']:>9.3f} | {formula:>17} | {r['total_bytes'] / 2**20:>9.1f}")
        r["expected_per_param"] = exp
    path = machine.write_results("zero_memory", {"preset": args.preset, "seq_len": args.seq_len, "rows": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
