"""Benchmark: checkpoint save/load time for the 125m preset, and the step-time cost of checkpointing every N steps.

Two parts, on local gloo ranks:

1. **save/load**: ranks build the Engine for ``--preset`` (default 125m; the
   sequence length cut to 64, which only shrinks the position table), create
   the AdamW state, then time :meth:`Checkpointer.save` (DCP write, sha256 of
   every file, marker, atomic rename) and :meth:`Checkpointer.restore`
   (verify hashes, DCP read into the live tensors), at dp1 (ZeRO 0) and dp2
   (ZeRO 1).  Reports checkpoint bytes and MB/s.
2. **interval cost**: a small model trains ``--steps`` steps and saves after
   every one; the median save time over the median step time gives the
   step-time overhead of a save every N steps, ``save / (N * step)``, for N in
   ``--intervals`` (side by side in one run, as machine noise demands).

Prints both tables and writes ``benchmarks/results/checkpoint-<host>.json``.

Not a storage benchmark (the checkpoint goes to a local temporary
directory; a PVC over the network will be slower).

    python benchmarks/bench_checkpoint.py [--preset 125m] [--steps 20] [--intervals 10 5 2 1]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine, ranks
from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.checkpointing import checkpointer, state, store
from meshtrain.trainer.parallel import mesh

SMALL = {"layers": 4, "hidden": 128, "heads": 4, "vocab": 256, "seqLen": 64}


def _engine(model: dict, dp: int, stage: int, steps: int, interval: int) -> engine.Engine:
    job = loading.parse_spec(
        {
            "parallelism": {"data": dp, "zeroStage": stage},
            "resources": {"gpusPerNode": dp},
            "model": model,
            "training": {"microBatch": 2, "steps": steps, "precision": "fp32", "dataset": "stdlib"},
            # the blocking save, whose cost this benchmark reports (asyncSave hides most of it)
            "checkpoint": {"intervalSteps": interval, "keep": 2, "asyncSave": False},
        }
    )
    return engine.Engine(job, mesh.build_mesh(job.parallelism.layout, torch.device("cpu")))


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _save_load(preset: str, dp: int, stage: int, root: Path) -> dict:
    eng = _engine({"preset": preset, "seqLen": 64}, dp, stage, 10, 0)
    state.init_optimizer_state(eng.optimizer)
    saver = checkpointer.Checkpointer(eng, root=root)
    dist.barrier()
    start = time.perf_counter()
    published = saver.save()
    save_s = time.perf_counter() - start
    marker = store.read_marker(published)
    params = sum(p.numel() for p in eng.params)
    del eng, saver
    gc.collect()
    fresh = _engine({"preset": preset, "seqLen": 64}, dp, stage, 10, 0)
    dist.barrier()
    start = time.perf_counter()
    checkpointer.Checkpointer(fresh, root=root).restore()
    load_s = time.perf_counter() - start
    size = _dir_bytes(published)
    del fresh
    gc.collect()
    return {
        "preset": preset,
        "dp": dp,
        "zero_stage": stage,
        "params_per_rank": params,
        "bytes": size,
        "save_seconds": save_s,
        "dcp_write_seconds": marker.extra.get("write_seconds"),
        "load_seconds": load_s,
    }


def _interval_cost(steps: int, intervals: list[int], dp: int, root: Path) -> dict:
    """Median step time and median save time, measured side by side; the cost of saving every N steps from them.

    Saving after every step gives ``steps`` samples of each in one run, so
    machine noise hits both alike; the overhead of a save every N steps is
    then ``save / (N * step)``.
    """
    eng = _engine(SMALL, dp, 1 if dp > 1 else 0, steps, 1)
    eng.train_step()  # warm-up step, not timed
    saver = checkpointer.Checkpointer(eng, root=root)
    saver.total = 10**9  # no end-of-run save
    step_times, save_times = [], []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        eng.train_step()
        step_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        saver.after_step(eng.step)
        save_times.append(time.perf_counter() - start)
    step_s, save_s = statistics.median(step_times), statistics.median(save_times)
    rows = [{"interval": n, "overhead_ratio": save_s / (n * step_s)} for n in intervals]
    del eng
    gc.collect()
    return {
        "steps": steps,
        "median_step_seconds": step_s,
        "median_save_seconds": save_s,
        "rows": rows,
    }


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    ranks.join(rank, world, port, threads=ranks.cores_per_rank(world), timeout_s=1800)
    with tempfile.TemporaryDirectory(prefix="mt-bench-ckpt-") as scratch:
        root = Path(scratch) if rank == 0 else None
        shared = [str(root) if root else None]
        dist.broadcast_object_list(shared, src=0)
        root = Path(shared[0])
        result = {"save_load": _save_load(args.preset, world, 1 if world > 1 else 0, root / "big")}
        result["interval"] = _interval_cost(args.steps, args.intervals, world, root / "small")
        if rank == 0:
            torch.save(result, Path(out) / ranks.RESULT)
        dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--dps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--intervals", type=int, nargs="+", default=[10, 5, 2, 1])
    args = parser.parse_args()
    results = []
    for dp in args.dps:
        results.append({"dp": dp, **ranks.spawn(_rank, dp, args)})
    print(f"checkpoint save/load, preset {args.preset} (seq 64), local disk")
    print(
        f"{'dp':>3} {'zero':>4} {'MiB':>8} | {'save s':>7} {'(dcp write)':>11} {'load s':>7} | {'save MB/s':>9} {'load MB/s':>9}"
    )
    for r in results:
        s = r["save_load"]
        mb = s["bytes"] / 1e6
        print(
            f"{r['dp']:>3} {s['zero_stage']:>4} {s['bytes'] / 2**20:>8.1f} | {s['save_seconds']:>7.2f} "
            f"{s['dcp_write_seconds']:>11.2f} {s['load_seconds']:>7.2f} | {mb / s['save_seconds']:>9.1f} "
            f"{mb / s['load_seconds']:>9.1f}"
        )
    print(
        f"\nstep-time cost of checkpointing every N steps (model {SMALL}; medians of {args.steps} steps and saves)"
    )
    print(
        f"{'dp':>3} {'step s':>8} {'save s':>8} | "
        + " ".join(f"{'every ' + str(n):>9}" for n in args.intervals)
    )
    for r in results:
        cost = r["interval"]
        print(
            f"{r['dp']:>3} {cost['median_step_seconds']:>8.4f} {cost['median_save_seconds']:>8.4f} | "
            + " ".join(f"{row['overhead_ratio']:>+9.1%}" for row in cost["rows"])
        )
    path = machine.write_results("checkpoint", {"preset": args.preset, "runs": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
