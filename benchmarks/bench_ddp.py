"""Benchmark: meshtrain's data-parallel reducer vs ``torch.nn.parallel.DistributedDataParallel``.

On ``--world`` local gloo ranks, two identical copies of a GPT
(8 blocks, hidden 256) train side by side on the same batches, one with
meshtrain's :class:`~meshtrain.trainer.parallel.reducer.GradReducer` and one
wrapped in DDP, both with 25 MiB buckets and AdamW; steps alternate between
the two so machine noise hits both alike.  It checks that both give the same
weights, prints median step times and writes
``benchmarks/results/ddp-<host>.json``.  Target: meshtrain <= 1.05 x DDP.

Not the full engine (no pipeline executor, clipping or data
loader): only the data-parallel part differs between the two sides.

    python benchmarks/bench_ddp.py [--world 2] [--steps 20]
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
from torch.nn.parallel import DistributedDataParallel

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine, ranks
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import reducer
from meshtrain.trainer.telemetry import recording

CONFIG = gpt.GPTConfig(vocab=256, seq_len=64, layers=8, hidden=256, heads=8, ffn_hidden=1024)
BATCH = 4
BUCKET_MB = 25.0


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, CONFIG.vocab), batch[:, 1:].reshape(-1))


def _rank(rank: int, world: int, port: int, steps: int, out: str) -> None:
    ranks.join(rank, world, port)
    ours = gpt.GPT(CONFIG, seed=0)  # the same weights on every rank
    theirs = DistributedDataParallel(copy.deepcopy(ours), bucket_cap_mb=BUCKET_MB)
    red = reducer.GradReducer(
        list(ours.parameters()),
        group=dist.group.WORLD,
        group_size=world,
        bucket_mb=BUCKET_MB,
        recorder=recording.NullRecorder(),
    )
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    torch.manual_seed(rank)
    times: dict[str, list[float]] = {"meshtrain": [], "ddp": []}
    for step in range(steps + 3):
        batch = torch.randint(0, 256, (BATCH, CONFIG.seq_len + 1))
        for name in ("meshtrain", "ddp") if step % 2 else ("ddp", "meshtrain"):
            dist.barrier()
            start = time.perf_counter()
            if name == "meshtrain":
                _loss(ours, batch).backward()
                red.finish()
                opt_ours.step()
                red.zero_grad()
            else:
                _loss(theirs, batch).backward()
                opt_theirs.step()
                opt_theirs.zero_grad(set_to_none=True)
            if step >= 3:
                times[name].append(time.perf_counter() - start)
    worst = max(
        (p - q).abs().max().item() for p, q in zip(ours.parameters(), theirs.module.parameters())
    )
    if rank == 0:
        torch.save(
            {
                "times": times,
                "max_weight_diff": worst,
                "buckets": len(red.buckets),
                "params": sum(p.numel() for p in ours.parameters()),
            },
            Path(out) / ranks.RESULT,
        )
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args, raw = ranks.spawn_from_command_line(_rank, __doc__.splitlines()[0], argv)
    ours, theirs = (
        statistics.median(raw["times"]["meshtrain"]),
        statistics.median(raw["times"]["ddp"]),
    )
    ratio = ours / theirs
    print(
        f"GPT {raw['params'] / 1e6:.1f}M params, {args.world} gloo ranks, batch {BATCH}x{CONFIG.seq_len} per rank, "
        f"{BUCKET_MB:g} MiB buckets, {args.steps} timed steps (median)"
    )
    print(f"{'side':<10} {'step ms':>9}")
    print(f"{'meshtrain':<10} {ours * 1e3:>9.1f}\n{'ddp':<10} {theirs * 1e3:>9.1f}")
    print(
        f"ratio meshtrain/ddp {ratio:.3f} (target <= 1.05 -> {'met' if ratio <= 1.05 else 'NOT met'}); "
        f"max weight difference after training {raw['max_weight_diff']:.2e}"
    )
    path = machine.write_results(
        "ddp",
        {
            "world": args.world,
            "model": CONFIG.__dict__,
            "batch_per_rank": BATCH,
            "bucket_mb": BUCKET_MB,
            "meshtrain_median_step_seconds": ours,
            "ddp_median_step_seconds": theirs,
            "ratio": ratio,
            "target": 1.05,
            "max_weight_diff": raw["max_weight_diff"],
            "buckets": raw["buckets"],
            "step_seconds": raw["times"],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
