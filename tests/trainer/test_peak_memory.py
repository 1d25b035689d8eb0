"""Peak memory per rank, measured from allocations, against the planner, for ZeRO 0-2 with accumulation.

Every rank trains two steps under :class:`~meshtrain.trainer.live_memory.LiveBytes`
(a dispatch mode counting live tensor storages; the training state that
exists before is registered first) and reports the high-water mark of the
second step.  The planner's per-rank peak (:func:`meshtrain.planner.memory.plan_memory`:
state, activations and working buffers) must be within 10% of it, and
ZeRO-2 must save gradient memory at its peak under gradient accumulation
(ZeRO-2 < ZeRO-1 < ZeRO-0), which it did not while non-final micro-batches
kept full-size gradients.
"""

from __future__ import annotations

import mt_harness
import pytest
import torch

from meshtrain import layout as layout_mod
from meshtrain.api import loading
from meshtrain.planner import memory, profiles
from meshtrain.trainer import engine, live_memory, memory_accounting
from meshtrain.trainer.parallel import mesh as mesh_mod

STAGES = (0, 1, 2)
SHAPE = {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seqLen": 32, "ffnHidden": 256}


def _raw(layout: dict, stage: int) -> dict:
    raw = mt_harness.make_spec(**layout, bucket_mb=0.05, steps=2, model=SHAPE)
    raw["parallelism"]["zeroStage"] = stage
    return raw


def peaks(layout: dict) -> dict[int, dict]:
    """On every rank: per ZeRO stage, the pipeline stage and the peak live bytes of step 2."""
    out = {}
    for stage in STAGES:
        job = loading.parse_spec(_raw(layout, stage))
        mesh = mesh_mod.build_mesh(layout_mod.from_spec(job.parallelism), torch.device("cpu"))
        eng = engine.Engine(job, mesh)
        tracker = live_memory.LiveBytes()
        tracker.track(memory_accounting.state_tensors(eng.model, eng.optimizer, eng.model.reducer))
        with tracker:
            eng.train_step()  # creates what is lazily created (AdamW's moments)
            tracker.reset_peak()
            eng.train_step()
        out[stage] = {"pp": mesh.coords.pp, "peak": tracker.peak}
    return out


# id -> (layout, world, whether ZeRO-2's gradient saving exceeds its working buckets: a pipeline
# stage of this tiny model holds fewer gradient bytes than three 0.05 MiB buckets save)
LAYOUTS = {
    "dp2-accum4": (dict(data=2, micro_batches=4), 2, True),
    "dp2-pp2-accum4": (dict(data=2, pipeline=2, micro_batches=4), 4, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_planner_predicts_the_measured_peak_and_zero2_saves_it(case: str) -> None:
    layout, world, zero2_saves = LAYOUTS[case]
    cpu = profiles.get("cpu")
    results = mt_harness.run_distributed(peaks, world, layout)
    for rank, result in enumerate(results):
        for stage in STAGES:
            plan = memory.plan_memory(loading.parse_spec(_raw(layout, stage)), cpu)
            predicted = plan.stages[result[stage]["pp"]].total
            measured = result[stage]["peak"]
            assert predicted == pytest.approx(measured, rel=0.10), (
                f"rank {rank} ZeRO-{stage}: planner {predicted:.0f} B, measured peak {measured} B"
            )
        assert result[1]["peak"] < result[0]["peak"], (rank, result)
        if zero2_saves:
            assert result[2]["peak"] < result[1]["peak"], (rank, result)
