"""Benchmark: meshtrain's own ZeRO-2 against FSDP2 without resharding after forward (ZeRO-2-like), side by side.

The question of issue #14: should ZeRO-2 be FSDP2 too?  For each
accumulation count (``--micro-batches``, default 2 and 4) it starts
``--dp`` fresh local gloo ranks per variant, on the model of
``bench_zero3.py``:

* ``own-zero2``: ``zeroStage: 2`` (replicated weights, bucketed
  reduce-scatter of gradients, sharded AdamW state);
* ``fsdp2-no-reshard``: the ZeRO-3 engine with every FSDP2 unit's
  ``reshard_after_forward=False`` (PyTorch's SHARD_GRAD_OP: a unit is
  gathered once per micro-batch's forward and kept through its backward);
* ``fsdp2-zero3``: the ZeRO-3 engine as shipped (TorchTitan's units), for
  reference.

Each rank trains one step (lazy state), measures the next step's peak of
live tensor bytes with :class:`meshtrain.trainer.telemetry.live_bytes.LiveBytes`
(training state included), then times ``--steps`` steps without the
tracker, and step 2's data-parallel collective bytes by kind (the
engine's recorder).  Rank 0 reports; writes ``benchmarks/results/zero2_fsdp-<host>.json``.

    python benchmarks/bench_zero2_fsdp.py [--dp 2] [--steps 5] [--micro-batches 2 4]
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
from benchmarks import bench_zero3, machine, ranks
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh, state_bytes, zero3
from meshtrain.trainer.telemetry import live_bytes, recording

VARIANTS = {"own-zero2": 2, "fsdp2-no-reshard": 3, "fsdp2-zero3": 3}
"""Variant -> the zeroStage its engine runs."""


def _never_reshard(units_of_chunk):  # noqa: ANN001, ANN202 - wraps zero3.units
    def units(
        chunk: torch.nn.Module, *, pipelined: bool = False
    ) -> list[tuple[list[torch.nn.Module], bool]]:
        return [(modules, False) for modules, _ in units_of_chunk(chunk, pipelined=pipelined)]

    return units


def _rank(
    rank: int, world: int, port: int, variant: str, micro_batches: int, steps: int, out: str
) -> None:
    ranks.join(rank, world, port, threads=ranks.cores_per_rank(world), timeout_s=900)
    if variant == "fsdp2-no-reshard":
        zero3.units = _never_reshard(zero3.units)  # this spawned process only
    job = bench_zero3._spec(world, VARIANTS[variant], micro_batches, steps)
    recorder = recording.MemoryRecorder()
    eng = engine.Engine(
        job,
        mesh.build_mesh(job.parallelism.layout, torch.device("cpu")),
        recorder=recorder,
    )
    eng.train_step()
    tracker = live_bytes.LiveBytes()
    tracker.track(state_bytes.state_tensors(eng.model, eng.optimizer, eng.model.reducer))
    with tracker:
        loss = eng.train_step()  # step 2
    peak = torch.tensor([tracker.peak], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dp_bytes: dict[str, int] = {}  # step 2's data-parallel collectives, by kind
    for event in recorder.events:
        if event.what == "collective" and event.group == "dp":
            dp_bytes[event.kind] = dp_bytes.get(event.kind, 0) + event.nbytes
    seconds = ranks.timed_steps(eng.train_step, steps)
    if rank == 0:
        torch.save(
            {
                "peak_bytes": int(peak.item()),
                "step_seconds": seconds,
                "loss_step2": loss.loss,
                "dp_bytes_step2": dp_bytes,
            },
            Path(out) / ranks.RESULT,
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    rows = []
    for micro_batches in args.micro_batches:
        for variant in VARIANTS:
            load_before = os.getloadavg()[0]
            measured = ranks.spawn(_rank, args.dp, variant, micro_batches, args.steps)
            rows.append(
                {
                    "variant": variant,
                    "micro_batches": micro_batches,
                    "peak_bytes": measured["peak_bytes"],
                    "loss_step2": measured["loss_step2"],
                    "dp_bytes_step2": measured["dp_bytes_step2"],
                    "step_seconds": measured["step_seconds"],
                    "median_step_seconds": statistics.median(measured["step_seconds"]),
                    "load_average_1m_before": load_before,
                }
            )
    print(f"dp {args.dp}, model {bench_zero3.MODEL}, fp32 + AdamW, CPU gloo")
    print(
        f"{'variant':>17} {'accum':>5} | {'peak MiB':>8} {'vs own':>6} | {'dp MiB/step':>11} | {'step s':>7} {'vs own':>6} | load"
    )
    for r in rows:
        own = next(
            o
            for o in rows
            if o["variant"] == "own-zero2" and o["micro_batches"] == r["micro_batches"]
        )
        r["peak_vs_own_zero2"] = r["peak_bytes"] / own["peak_bytes"]
        r["step_time_vs_own_zero2"] = r["median_step_seconds"] / own["median_step_seconds"]
        print(
            f"{r['variant']:>17} {r['micro_batches']:>5} | {r['peak_bytes'] / 2**20:>8.2f} "
            f"{r['peak_vs_own_zero2']:>6.3f} | {sum(r['dp_bytes_step2'].values()) / 2**20:>11.2f} | "
            f"{r['median_step_seconds']:>7.3f} "
            f"{r['step_time_vs_own_zero2']:>6.3f} | {r['load_average_1m_before']:.2f}"
        )
    path = machine.write_results(
        "zero2_fsdp",
        {
            "dp": args.dp,
            "model": bench_zero3.MODEL,
            "rows": rows,
            "load_average_after": os.getloadavg(),
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
