"""Multi-process test harness: run a function on N local ranks and collect the results.

:func:`run_distributed` starts ``world`` processes (torch multiprocessing:
forked from a server that imported torch and the trainer once, or spawned
for GPUs), gives each torchrun's environment and
a joined process group (gloo on the CPU, or NCCL with a GPU per rank),
calls ``fn(*args)`` and returns every rank's return value (through
``torch.save`` files), or raises if a rank fails or the deadline passes.
The specs come from :meth:`tests.builders.JobBuilder.cpu_run`.

Not the product launcher (:mod:`meshtrain.trainer.launch`).
Unique module name on purpose: child processes import it by name.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from meshtrain.trainer import launch
from meshtrain.trainer.parallel import mesh


def no_silent_eager() -> Any:
    """A context in which a graph that fails to compile, or passes dynamo's recompile limit,
    raises instead of running eagerly (an engine with ``training.compile`` has turned dynamo's
    ``suppress_errors`` on by then)."""
    return torch._dynamo.config.patch(suppress_errors=False, fail_on_recompile_limit_hit=True)


def write_job(directory: Path, raw: dict, name: str = "job.yaml") -> Path:
    """A TrainingJob YAML file of spec ``raw`` in ``directory`` (for ``meshtrain run``)."""
    path = directory / name
    manifest = {
        "apiVersion": "meshtrain.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "t"},
    }
    path.write_text(yaml.safe_dump({**manifest, "spec": raw}))
    return path


PRELOAD = ["torch", "torch.distributed", "meshtrain.trainer.engine", "mt_harness"]
"""What the CPU ranks' fork server imports once: each spawned rank imported these itself, seconds of
CPU per rank on CI's two cores, most of a small test's time."""
multiprocessing.set_forkserver_preload(PRELOAD)


def _start_method(use_cuda: bool) -> str:
    """Forked from the preloaded server on the CPU; spawned for GPUs (no CUDA state is forked)."""
    return "spawn" if use_cuda else "forkserver"


def _entry(
    rank: int,
    world: int,
    port: int,
    fn,
    args: tuple,
    out_dir: str,
    use_cuda: bool,
    caller: tuple[dict[str, str], str],
) -> None:
    # a forked rank has the fork server's environment and directory: take the test's, as spawn did
    environ, cwd = caller
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    if use_cuda:  # the product's setup: one GPU per rank, NCCL
        mesh.device_for(rank, use_cuda=True)
        mesh.init_process_group(use_cuda=True, timeout_s=120)
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    result = fn(*args)
    torch.save(result, Path(out_dir) / f"rank-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    mesh.exit_now(0)  # gloo can abort in the interpreter's teardown; the result is saved


def run_distributed(
    fn, world: int, *args: Any, timeout_s: float = 540.0, use_cuda: bool = False
) -> list[Any]:
    """``fn(*args)`` on ``world`` ranks; the list of their return values, rank order.

    ``use_cuda``: each rank on its own GPU in an NCCL group (gloo on the CPU otherwise).
    """
    with tempfile.TemporaryDirectory(prefix="mt-dist-") as out_dir:
        context = mp.start_processes(
            _entry,
            args=(
                world,
                launch.free_port(),
                fn,
                args,
                out_dir,
                use_cuda,
                (dict(os.environ), os.getcwd()),
            ),
            nprocs=world,
            join=False,
            start_method=_start_method(use_cuda),
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{getattr(fn, '__name__', fn)} on {world} ranks did not finish in {timeout_s} s"
                    )
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [
            torch.load(Path(out_dir) / f"rank-{r}.pt", weights_only=False) for r in range(world)
        ]
