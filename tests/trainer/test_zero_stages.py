"""ZeRO 1 and 2 train exactly like ZeRO 0, with 1/N_dp of the optimizer state (and gradients) per rank."""

from __future__ import annotations

import mt_harness
import pytest
import torch

from meshtrain import layout as layout_mod
from meshtrain.api import spec as spec_mod
from meshtrain.trainer import engine, memory
from meshtrain.trainer.parallel import mesh as mesh_mod

STEPS = 5


def train_zero_stages(layout: dict, steps: int) -> dict[int, dict]:
    """On every rank: per ZeRO stage, the losses of ``steps`` steps and the memory report after them."""
    out = {}
    for stage in (0, 1, 2):
        raw = mt_harness.make_spec(**layout, steps=steps)
        raw["parallelism"]["zeroStage"] = stage
        job = spec_mod.parse_spec(raw)
        mesh = mesh_mod.build_mesh(layout_mod.from_spec(job.parallelism), torch.device("cpu"))
        eng = engine.Engine(job, mesh)
        losses = [eng.train_step().loss for _ in range(steps)]
        report = memory.measure(eng.model, eng.optimizer, eng.model.reducer)
        out[stage] = {"losses": losses, "memory": report}
    return out


def _check(results: list[dict[int, dict]], dp: int) -> None:
    for rank_result in results:
        base = rank_result[0]
        for stage in (1, 2):
            got = rank_result[stage]
            for a, b in zip(base["losses"], got["losses"]):
                assert abs(a - b) / abs(a) < 1e-5, (stage, base["losses"], got["losses"])
            zero0, zeron = base["memory"], got["memory"]
            assert zeron.param_bytes == zero0.param_bytes
            # optimizer state is 1/N_dp of ZeRO 0's (up to the padding of the last shard of each bucket)
            assert zeron.optimizer_bytes * dp == pytest.approx(zero0.optimizer_bytes, rel=0.01)
            grads = zeron.grad_bytes * dp if stage == 2 else zeron.grad_bytes
            assert grads == pytest.approx(zero0.grad_bytes, rel=0.01)
    assert len({tuple(r[0]["losses"]) for r in results}) == 1  # every rank reports the same losses


@pytest.mark.slow
def test_zero_matches_zero0_at_dp2() -> None:
    _check(mt_harness.run_distributed(train_zero_stages, 2, {"data": 2}, STEPS), dp=2)


@pytest.mark.slow
def test_zero_matches_zero0_at_dp2_pp2_tp2_sp() -> None:
    # sequence parallel too: its TP-partial norm gradients must be summed on ZeRO-2's shards
    layout = {"data": 2, "pipeline": 2, "tensor": 2, "micro_batches": 2, "sequence_parallel": True}
    _check(mt_harness.run_distributed(train_zero_stages, 8, layout, STEPS, timeout_s=400), dp=2)
