"""Benchmark: in-memory checkpoints against storage checkpoints, side by side in one run.

Two local gloo ranks at dp2, each its own "pod" (``gpusPerNode: 1``), so every snapshot also goes
to the other rank (the peer copy).  For one model, in this order on the same ranks:

1. **save**: the step's wait for an in-memory snapshot (the copy to host memory), the snapshot's
   background part (file under ``/dev/shm``, peer exchange), and a storage checkpoint's blocking
   save (DCP write, sha256, publish) and asynchronous save's wait (``asyncSave``);
2. **restore** into a fresh engine: from memory (own copies), from memory after one pod's
   snapshots were lost (its shard sent by the peer), and from storage;
3. **step cost**: the mean wall time of a training step with each kind of checkpoint every
   ``--every`` steps (none, memory, storage async, storage blocking), over ``--steps`` steps each,
   the last checkpoint's background part included.

Prints the tables and writes ``benchmarks/results/memory_checkpoint-<host>.json``.  Storage is
a local directory here (a network volume or bucket is slower); memory is ``/dev/shm``.

    python benchmarks/bench_memory_checkpoint.py [--steps 12] [--every 3] [--layers 4] [--hidden 512]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine, ranks
from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.trainer import engine
from meshtrain.trainer.checkpointing import checkpointer, memory, recovery
from meshtrain.trainer.parallel import mesh

SHM = Path("/dev/shm")


def _job(args: argparse.Namespace, *, async_save: bool, every: int = 1) -> api_spec.TrainingJobSpec:
    model = {"layers": args.layers, "hidden": args.hidden, "heads": 8, "vocab": 8192, "seqLen": 64}
    return loading.parse_spec(
        {
            "parallelism": {"data": 2},
            "resources": {"gpusPerNode": 1},
            "model": model,
            "training": {"microBatch": 2, "steps": 10**6, "precision": "fp32", "dataset": "stdlib"},
            "checkpoint": {
                "intervalSteps": every,
                "keep": 2,
                "asyncSave": async_save,
                "inMemory": {"intervalSteps": every},
            },
        }
    )


def _engine(job: api_spec.TrainingJobSpec) -> engine.Engine:
    return engine.Engine(job, mesh.build_mesh(job.parallelism.layout, torch.device("cpu")))


def _pod(base: Path) -> Path:
    return base / f"pod-{dist.get_rank()}"


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _save_and_restore(args: argparse.Namespace, shm: Path, disk: Path) -> dict[str, Any]:
    """One snapshot, one blocking and one asynchronous storage save; then the three restores."""
    job = _job(args, async_save=False)
    saved = _saves(_engine(job), job, shm, disk)
    gc.collect()
    saved["restore_seconds"] = {
        "memory": _restore(job, shm, disk / "none", lose=False),
        "memory_peer": _restore(job, shm, disk / "none", lose=True),
        "storage": _restore(job, shm / "absent", disk / "blocking", lose=False),
    }
    return saved


def _saves(
    trained: engine.Engine, job: api_spec.TrainingJobSpec, shm: Path, disk: Path
) -> dict[str, Any]:
    """Step 1's snapshot and blocking storage save, timed; then an asynchronous save's wait."""
    trained.train_step()
    snaps = memory.MemorySnapshots(trained, job, root=_pod(shm))
    snapshot_wait = _timed(lambda: snaps.after_step(1))
    snapshot_total = snapshot_wait + _timed(snaps.wait)
    timing = snaps.timings[-1]
    snaps.close()
    storage_blocking = _timed(checkpointer.Checkpointer(trained, root=disk / "blocking").save)
    background = checkpointer.Checkpointer(trained, root=disk / "async")
    background.asynchronous = True
    background.after_step(trained.step)  # the first makes the background save's groups
    background.wait()
    trained.train_step()  # step 2: the memory and blocking saves above stay of step 1
    storage_async_wait = _timed(lambda: background.after_step(trained.step))
    background.wait()
    return {
        "bytes_per_rank": timing.bytes,
        "snapshot_step_wait_seconds": snapshot_wait,
        "snapshot_copy_seconds": timing.copy_seconds,
        "snapshot_write_seconds": timing.write_seconds,
        "snapshot_peer_seconds": timing.peer_seconds,
        "snapshot_total_seconds": snapshot_total,
        "storage_blocking_save_seconds": storage_blocking,
        "storage_async_step_wait_seconds": storage_async_wait,
    }


def _restore(job: api_spec.TrainingJobSpec, shm: Path, disk: Path, *, lose: bool) -> float:
    """Seconds to restore a fresh engine; ``lose``: pod 1's snapshots are gone first."""
    fresh = _engine(job)
    if lose and dist.get_rank() == 1:
        shutil.rmtree(_pod(shm), ignore_errors=True)
    snaps = memory.MemorySnapshots(fresh, job, root=_pod(shm))
    saver = checkpointer.Checkpointer(fresh, root=disk)
    got: list[Any] = []
    seconds = _timed(lambda: got.append(recovery.restore(fresh, saver, snaps)))
    assert got[0][0] == 1, got  # both sources hold step 1
    snaps.close()
    return seconds


def _step_cost(args: argparse.Namespace, shm: Path, disk: Path) -> dict[str, float]:
    """Mean seconds of a step with each kind of checkpoint every ``--every`` steps (the last
    checkpoint's background part included)."""
    out = {}
    for kind in ("none", "memory", "storage_async", "storage_blocking"):
        out[kind] = _one_kind(args, kind, shm / kind, disk / kind)
        gc.collect()
    return out


def _one_kind(args: argparse.Namespace, kind: str, shm: Path, disk: Path) -> float:
    job = _job(args, async_save=kind == "storage_async", every=args.every)
    trained = _engine(job)
    trained.train_step()  # warm-up, not timed
    snaps = memory.MemorySnapshots(trained, job, root=_pod(shm))
    saver = checkpointer.Checkpointer(trained, root=disk)

    def step() -> None:
        trained.train_step()
        if kind == "memory":
            snaps.after_step(trained.step)
        elif kind.startswith("storage"):
            saver.after_step(trained.step)

    seconds = ranks.timed_steps(step, args.steps)

    def drain() -> None:  # the background part of the last checkpoint
        snaps.wait()
        saver.wait()

    total = sum(seconds) + _timed(drain)
    snaps.close()
    return total / args.steps


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    ranks.join(rank, world, port, threads=ranks.cores_per_rank(world), timeout_s=1800)
    base = SHM if SHM.is_dir() else Path(tempfile.gettempdir())
    with (
        tempfile.TemporaryDirectory(prefix="mt-bench-mem-", dir=base) as shm,
        tempfile.TemporaryDirectory(prefix="mt-bench-disk-") as disk,
    ):
        shared = [(shm, disk)]
        dist.broadcast_object_list(shared, src=0)
        shm_dir, disk_dir = Path(shared[0][0]), Path(shared[0][1])
        result = {
            "memory_root": str(base),
            "save_restore": _save_and_restore(args, shm_dir / "a", disk_dir / "a"),
            "step_seconds": _step_cost(args, shm_dir / "b", disk_dir / "b"),
        }
        ranks.leave(result, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3, help="steps between checkpoints")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    result = ranks.spawn(_rank, 2, args)
    sr = result["save_restore"]
    print(
        f"dp2 on two 'pods', {sr['bytes_per_rank'] / 2**20:.1f} MiB per rank; "
        f"memory under {result['memory_root']}, storage on local disk"
    )
    print(f"{'':<34} {'memory':>10} {'storage':>10}")
    print(
        f"{'step waits for the save (s)':<34} {sr['snapshot_step_wait_seconds']:>10.3f} "
        f"{sr['storage_async_step_wait_seconds']:>10.3f}  (storage: asyncSave)"
    )
    print(
        f"{'whole save (s)':<34} {sr['snapshot_total_seconds']:>10.3f} "
        f"{sr['storage_blocking_save_seconds']:>10.3f}  (storage: blocking)"
    )
    rs = sr["restore_seconds"]
    print(f"{'restore (s)':<34} {rs['memory']:>10.3f} {rs['storage']:>10.3f}")
    print(f"{'restore, one pod lost (s)':<34} {rs['memory_peer']:>10.3f}")
    steps = result["step_seconds"]
    print(f"\nmean step with a checkpoint every {args.every} steps, {args.steps} steps each (s)")
    for kind, seconds in steps.items():
        print(f"  {kind:<18} {seconds:.4f}  ({seconds / steps['none'] - 1:+.0%})")
    path = machine.write_results("memory_checkpoint", {"args": vars(args), **result})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
