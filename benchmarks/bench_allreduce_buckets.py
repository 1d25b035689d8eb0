"""Benchmark: bucketed gradient all-reduce vs one all-reduce per parameter tensor.

On ``--world`` local gloo ranks, a GPT with 101 parameter
tensors (12 blocks, hidden 128) runs forward + backward + gradient
reduction with meshtrain's :class:`~meshtrain.trainer.parallel.reducer.GradReducer`
in three settings, interleaved step by step so machine noise hits all alike:
one bucket per tensor (``bucket_mb=0``, the per-tensor baseline, still
launched asynchronously from the hooks), 1 MiB buckets, and 25 MiB buckets.
It prints the median step time and collectives per step and writes
``benchmarks/results/allreduce_buckets-<host>.json``.  Target: bucketed
<= 0.7 x per-tensor step time.

Not a network benchmark; on one machine gloo's per-collective
latency dominates, which is exactly what bucketing removes.

    python benchmarks/bench_allreduce_buckets.py [--world 2] [--steps 20]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine, ranks
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import reducer
from meshtrain.trainer.telemetry import recording

CONFIG = gpt.GPTConfig(vocab=256, seq_len=32, layers=12, hidden=128, heads=4, ffn_hidden=512)
BATCHES = (1, 8)
"""Sequences per rank per step: 1 is communication-bound (where bucketing matters), 8 compute-heavier."""
VARIANTS = {"per-tensor": 0.0, "bucketed 1 MiB": 1.0, "bucketed 25 MiB": 25.0}


def _rank(rank: int, world: int, port: int, steps: int, out: str) -> None:
    ranks.join(rank, world, port)
    base = gpt.GPT(CONFIG, seed=0)  # the same weights on every rank
    setups = {}
    for name, mb in VARIANTS.items():
        model = copy.deepcopy(base)
        rec = recording.MemoryRecorder()
        red = reducer.GradReducer(
            list(model.parameters()),
            group=dist.group.WORLD,
            group_size=world,
            bucket_mb=mb,
            recorder=rec,
        )
        setups[name] = (model, red, rec)
    times: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    for size in BATCHES:
        torch.manual_seed(rank)
        batch = torch.randint(0, 256, (size, CONFIG.seq_len + 1))
        for step in range(steps + 3):
            for name, (model, red, rec) in setups.items():
                dist.barrier()
                rec.step_start(step, time.perf_counter())
                start = time.perf_counter()
                logits = model(batch[:, :-1])
                F.cross_entropy(
                    logits.reshape(-1, CONFIG.vocab), batch[:, 1:].reshape(-1)
                ).backward()
                red.finish()
                elapsed = time.perf_counter() - start
                red.zero_grad()
                counts[name] = rec.count("collective", "dp")
                if step >= 3:  # warm-up steps are not timed
                    times.setdefault(f"{size}|{name}", []).append(elapsed)
    if rank == 0:
        tensors = sum(1 for _ in base.parameters())
        torch.save(
            {
                "times": times,
                "counts": counts,
                "tensors": tensors,
                "buckets": {n: len(s[1].buckets) for n, s in setups.items()},
            },
            Path(out) / ranks.RESULT,
        )
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args, raw = ranks.spawn_from_command_line(_rank, __doc__.splitlines()[0], argv)
    rows = []
    print(
        f"{raw['tensors']} parameter tensors, {args.world} gloo ranks, {args.steps} timed steps (median)"
    )
    print(
        f"{'batch':>5} {'variant':<18} {'buckets':>8} {'collectives/step':>17} {'step ms':>9} {'vs per-tensor':>14}"
    )
    for size in BATCHES:
        baseline = statistics.median(raw["times"][f"{size}|per-tensor"])
        for name in VARIANTS:
            median = statistics.median(raw["times"][f"{size}|{name}"])
            rows.append(
                {
                    "batch_per_rank": size,
                    "variant": name,
                    "bucket_mb": VARIANTS[name],
                    "buckets": raw["buckets"][name],
                    "collectives_per_step": raw["counts"][name],
                    "median_step_seconds": median,
                    "ratio_to_per_tensor": median / baseline,
                    "step_seconds": raw["times"][f"{size}|{name}"],
                }
            )
            print(
                f"{size:>5} {name:<18} {raw['buckets'][name]:>8} {raw['counts'][name]:>17} {median * 1e3:>9.1f} "
                f"{median / baseline:>13.2f}x"
            )
    best = {
        size: min(
            r["ratio_to_per_tensor"] for r in rows if r["batch_per_rank"] == size and r["bucket_mb"]
        )
        for size in BATCHES
    }
    for size, ratio in best.items():
        print(
            f"batch {size}: target bucketed <= 0.70x per-tensor: best {ratio:.2f}x -> {'met' if ratio <= 0.7 else 'NOT met'}"
        )
    path = machine.write_results(
        "allreduce_buckets",
        {
            "world": args.world,
            "parameter_tensors": raw["tensors"],
            "model": CONFIG.__dict__,
            "rows": rows,
            "target": 0.7,
            "best_ratio_by_batch": best,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
