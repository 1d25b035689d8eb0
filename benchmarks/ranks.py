"""Run a benchmark body in ``world`` local gloo processes and collect rank 0's result.

The body is ``rank_fn(rank, world, port, *args, out)``: it joins a process
group on ``127.0.0.1:port`` (:func:`join`) and, on rank 0, saves its result
with ``torch.save(result, Path(out) / RESULT)``.  :func:`spawn` picks a free
port, gives the ranks a scratch directory and returns what rank 0 saved;
:func:`spawn_from_command_line` does the same for ``--world`` and ``--steps``
given on the command line.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshtrain.sandbox.controlplane.ports import pick_free_port
from meshtrain.trainer.parallel import state_bytes
from meshtrain.trainer.telemetry import live_bytes

RESULT = "result.pt"


def timed_steps(step: Callable[[], object], steps: int) -> list[float]:
    """Wall seconds of ``steps`` calls of ``step``, each started together on every rank."""
    seconds = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return seconds


def second_step_peak(eng: Any) -> int:
    """The peak live bytes of an engine's second step beyond its training state, the largest over
    the ranks (the first step builds the optimizer state and warms the allocator)."""
    eng.train_step()
    tracker = live_bytes.LiveBytes()
    tracker.track(state_bytes.state_tensors(eng.model, eng.optimizer, eng.model.reducer))
    with tracker:
        eng.train_step()
    peak = torch.tensor([tracker.peak], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def spawn(rank_fn: Callable[..., None], world: int, *args: Any) -> Any:
    """Run ``rank_fn`` in ``world`` spawned processes; returns rank 0's saved result."""
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-") as out:
        mp.start_processes(
            rank_fn, args=(world, pick_free_port(), *args, out), nprocs=world, start_method="spawn"
        )
        return torch.load(Path(out) / RESULT)


def spawn_from_command_line(
    rank_fn: Callable[..., None], description: str, argv: list[str] | None
) -> tuple[argparse.Namespace, Any]:
    """Parse ``--world`` (default 2) and ``--steps`` (default 20), then :func:`spawn` ``rank_fn(..., steps, out)``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    return args, spawn(rank_fn, args.world, args.steps)


def cores_per_rank(world: int) -> int:
    """This machine's cores shared out over ``world`` ranks (at least one each)."""
    return max(1, (os.cpu_count() or 1) // world)


def join(rank: int, world: int, port: int, *, threads: int = 1, timeout_s: float = 300) -> None:
    """Join the gloo group of the spawned ranks, with ``threads`` intra-op threads for this rank."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


def leave(result: Any, out: str) -> None:
    """Rank 0 saves ``result`` for :func:`spawn`; every rank waits for it and leaves the group."""
    if dist.get_rank() == 0:
        torch.save(result, Path(out) / RESULT)
    dist.barrier()
    dist.destroy_process_group()
