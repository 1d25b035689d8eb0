"""Benchmark: context parallelism's memory: a tiny Llama at 4x the sequence one rank trains, split over cp4.

Three runs of the meshtrain Engine on local gloo ranks, side by side in one invocation: one rank
at ``--seq`` tokens (what one rank holds), one rank at ``4 x --seq``, and cp4 (four ranks, ring
attention) at ``4 x --seq``.  Each trains one step (lazy state), then measures the next step's
peak of live tensor bytes per rank with :class:`meshtrain.trainer.telemetry.live_bytes.LiveBytes`
(the largest over the ranks), and its activation part: the peak less the training state
(weights, gradients, optimizer state) alive before the step.  Then it times ``--steps`` steps.
Writes ``benchmarks/results/context-<host>.json``.

    python benchmarks/bench_context.py [--seq 256] [--steps 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine, ranks
from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh, state_bytes
from meshtrain.trainer.telemetry import live_bytes

MODEL = {
    "family": "llama",
    "layers": 4,
    "hidden": 128,
    "heads": 4,
    "kvHeads": 2,
    "vocab": 256,
    "ffnHidden": 384,
}
"""A tiny Llama (grouped-query attention, RoPE) whose activations dominate its state at these lengths."""

CONTEXT = 4
"""The context degree of the long run."""


def _spec(context: int, seq: int, steps: int) -> api_spec.TrainingJobSpec:
    return loading.parse_spec(
        {
            "parallelism": {"context": context},
            "resources": {"gpusPerNode": context},
            "model": {**MODEL, "seqLen": seq},
            "training": {
                "microBatch": 1,
                "steps": steps + 2,
                "precision": "fp32",
                "dataset": "stdlib",
            },
        }
    )


def _rank(rank: int, world: int, port: int, seq: int, steps: int, out: str) -> None:
    ranks.join(rank, world, port, threads=ranks.cores_per_rank(world), timeout_s=900)
    job = _spec(world, seq, steps)
    eng = engine.Engine(job, mesh.build_mesh(job.parallelism.layout, torch.device("cpu")))
    eng.train_step()
    tracker = live_bytes.LiveBytes()
    tracker.track(state_bytes.state_tensors(eng.model, eng.optimizer, eng.model.reducer))
    state = tracker.current
    with tracker:
        eng.train_step()
    peaks = torch.tensor([tracker.peak, tracker.peak - state], dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    seconds = ranks.timed_steps(eng.train_step, steps)
    result = {
        "peak_bytes": int(peaks[0].item()),
        "activation_peak_bytes": int(peaks[1].item()),
        "state_bytes": state,
        "step_seconds": seconds,
    }
    ranks.leave(result, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for context, seq in ((1, args.seq), (1, CONTEXT * args.seq), (CONTEXT, CONTEXT * args.seq)):
        measured = ranks.spawn(_rank, context, seq, args.steps)
        rows.append(
            {
                "context": context,
                "seq_len": seq,
                **measured,
                "median_step_seconds": statistics.median(measured["step_seconds"]),
            }
        )
    short, long, split = rows
    for r in rows:
        r["activation_vs_one_rank_long"] = (
            r["activation_peak_bytes"] / long["activation_peak_bytes"]
        )
        r["activation_vs_one_rank_short"] = (
            r["activation_peak_bytes"] / short["activation_peak_bytes"]
        )
    print(f"tiny llama {MODEL}, micro-batch 1, fp32 + AdamW, CPU gloo; per rank, max over ranks")
    print(
        f"{'layout':>6} {'seq':>6} | {'peak MiB':>8} {'act MiB':>8} | {'act / 1 rank @4x':>16} | {'step s':>7}"
    )
    for r in rows:
        print(
            f"{'cp' + str(r['context']):>6} {r['seq_len']:>6} | {r['peak_bytes'] / 2**20:>8.2f} "
            f"{r['activation_peak_bytes'] / 2**20:>8.2f} | {r['activation_vs_one_rank_long']:>16.3f} | "
            f"{r['median_step_seconds']:>7.3f}"
        )
    path = machine.write_results(
        "context", {"model": MODEL, "context": CONTEXT, "seq": args.seq, "rows": rows}
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
