"""One host sync per training step: every device-to-host read made by meshtrain's own step code is counted.

The CUDA sync-debug mode needs a GPU, so the reads are counted where they
start: the tensor methods that wait for a value (``item``, ``tolist``,
``float()``, ``int()``, ``bool()``, ``cpu``, ``numpy``) are wrapped and a call
counts when its caller is a meshtrain source file.  The batch is drawn
before counting (the sampler's CPU-side draws are host data on any device);
torch internals are not counted (on CUDA AdamW is fused and reads nothing).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mt_harness
import torch

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh as mesh_mod
from tests.builders import JobBuilder

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")
SOURCES = tuple(
    str(Path(p).resolve())
    for p in (Path(loading.__file__).parents[1], Path(engine.__file__).parent)
)
cpu = JobBuilder.cpu_run
CASES = {
    "tp2-sp": cpu().layout(tensor=2).parallelism(sequenceParallel=True),
    "dp2-zero2": cpu().layout(data=2).parallelism(microBatches=2, zeroStage=2, bucketMb=0.05),
    "dp2-accum2": cpu().layout(data=2).parallelism(microBatches=2, bucketMb=0.05),
    "pp2-1f1b": cpu().layout(pipeline=2).parallelism(microBatches=4),
}


class SyncCounter:
    """Counts host reads of tensors whose caller is meshtrain code, while installed."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._saved: dict[str, object] = {}

    def __enter__(self) -> SyncCounter:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapped(tensor, *args, _name=name, _original=original, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                if caller.startswith(SOURCES):
                    self.calls.append(f"{_name} at {caller}:{sys._getframe(1).f_lineno}")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


def count_step_syncs(cases: dict[str, JobBuilder]) -> dict[str, list[str]]:
    """On every rank, per case: the host reads meshtrain's code made during the second step."""
    out = {}
    for case, run in cases.items():
        job = loading.parse_spec(run.clone().training(steps=3).raw())
        mesh = mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
        eng = engine.Engine(job, mesh)
        eng.train_step()
        drawn = eng.sampler.next()
        eng.sampler.next = lambda drawn=drawn: drawn
        with SyncCounter() as counter:
            eng.train_step()
        out[case] = counter.calls
    return out


def test_a_step_reads_the_device_once_on_every_layout():
    for rank, result in enumerate(mt_harness.run_distributed(count_step_syncs, 2, CASES)):
        for case, calls in result.items():
            assert len(calls) == 1, f"{case} rank {rank}: {len(calls)} host reads: {calls}"
