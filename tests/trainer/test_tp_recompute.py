"""Activation checkpointing replays the same tensor-parallel collectives overlapped or serial.

torch's non-reentrant checkpoint stops a block's recompute once the last tensor backward needs
is saved, so the serial path never replays the MLP output's all-reduce (or reduce-scatter).  The
overlapped row-parallel linear used to run its collectives before its save and replayed it: one
collective more per block than the serial path.  Here one training step of tp2 (with and
without sequence parallelism) counts its tensor-parallel collectives with recompute on and off,
overlapped and serial: what recompute adds must be the same bytes for both paths, and as many
calls of the row-parallel linear's reduction (the reference is the serial path under torch's own
checkpoint).  That the overlapped recompute gives one device's numbers is the
``tp2-recompute`` / ``tp2-sp-recompute`` rows of ``test_equivalence.py``.
"""

from __future__ import annotations

import mt_harness
import pytest
import torch

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import recording
from tests.builders import JobBuilder

MODES = {  # (overlap.tensor, activationCheckpointing)
    "serial": (False, False),
    "serial-recompute": (False, True),
    "overlap": (True, False),
    "overlap-recompute": (True, True),
}


def _raw(sequence_parallel: bool, overlap: bool, recompute: bool) -> dict:
    return (
        JobBuilder.cpu_run()
        .layout(tensor=2)
        .parallelism(sequenceParallel=sequence_parallel, overlap={"tensor": overlap})
        .training(steps=1, activationCheckpointing=recompute)
        .raw()
    )


def tp_collectives(sequence_parallel: bool) -> dict[str, dict[str, list[int]]]:
    """Per mode: the tp collectives of one training step, as op -> [calls, bytes]."""
    out: dict[str, dict[str, list[int]]] = {}
    mesh = None
    for mode, (overlap, recompute) in MODES.items():
        job = loading.parse_spec(_raw(sequence_parallel, overlap, recompute))
        mesh = mesh or mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
        recorder = recording.MemoryRecorder()
        engine.Engine(job, mesh, recorder=recorder).train_step()
        counts: dict[str, list[int]] = {}
        for event in recorder.events:
            if event.what == "collective" and event.group == "tp":
                entry = counts.setdefault(event.kind, [0, 0])
                entry[0] += 1
                entry[1] += event.nbytes
        out[mode] = counts
    return out


def _added(counts: dict[str, dict[str, list[int]]], base: str, op: str, field: int) -> int:
    """What recompute added to ``base``'s calls (field 0) or bytes (1) of ``op``."""
    return counts[f"{base}-recompute"].get(op, [0, 0])[field] - counts[base].get(op, [0, 0])[field]


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_recompute_replays_as_many_tp_collectives_overlapped_as_serial(
    sequence_parallel: bool,
) -> None:
    counts = mt_harness.run_distributed(tp_collectives, 2, sequence_parallel)[0]
    reduction = "reduce_scatter" if sequence_parallel else "all_reduce"
    assert _added(counts, "serial", reduction, 1) > 0  # the attention output's, replayed
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert _added(counts, "overlap", op, 1) == _added(counts, "serial", op, 1), (op, counts)
    # the row-parallel linear's reduction: replayed whole after its matmul, as on the serial path
    assert _added(counts, "overlap", reduction, 0) == _added(counts, "serial", reduction, 0)
    # the same bytes in all (under SP the overlapped linears gather their inputs again)
    if not sequence_parallel:
        for op, (_, nbytes) in counts["serial-recompute"].items():
            assert counts["overlap-recompute"][op][1] == nbytes, (op, counts)
