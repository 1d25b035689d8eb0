"""ZeRO 1, 2 and 3 train exactly like ZeRO 0, with 1/N_dp of the optimizer state (and gradients, and weights) per rank.

Also the bytes ZeRO's collectives report: a reduce-scatter or all-gather
counts the full, unsharded (padded) bucket, as nccl-tests does, so that the
bus bandwidth ``bytes / time x (n - 1) / n`` is right.
"""

from __future__ import annotations

import mt_harness
import pytest
import torch

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.parallel import state_bytes, zero
from meshtrain.trainer.telemetry import recording, stepstats
from tests.builders import JobBuilder

STEPS = 5
STAGES = (0, 1, 2, 3)


def train_zero_stages(run: JobBuilder, steps: int) -> dict[int, dict]:
    """On every rank: per ZeRO stage, the losses of ``steps`` steps and the memory report after them."""
    out = {}
    for stage in STAGES:
        raw = run.clone().training(steps=steps).parallelism(zeroStage=stage).raw()
        job = loading.parse_spec(raw)
        mesh = mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
        eng = engine.Engine(job, mesh)
        losses = [eng.train_step().loss for _ in range(steps)]
        report = state_bytes.measure(eng.model, eng.optimizer, eng.model.reducer)
        out[stage] = {"losses": losses, "memory": report}
    return out


def _check(results: list[dict[int, dict]], dp: int) -> None:
    for rank_result in results:
        base = rank_result[0]
        for stage in STAGES[1:]:
            got = rank_result[stage]
            for a, b in zip(base["losses"], got["losses"]):
                assert abs(a - b) / abs(a) < 1e-5, (stage, base["losses"], got["losses"])
            zero0, zeron = base["memory"], got["memory"]
            assert zeron.zero_stage == stage and zeron.dp == dp
            params = zeron.param_bytes * dp if stage == 3 else zeron.param_bytes
            assert params == pytest.approx(zero0.param_bytes, rel=0.01)
            # optimizer state is 1/N_dp of ZeRO 0's (up to the padding of the last shard of each bucket)
            assert zeron.optimizer_bytes * dp == pytest.approx(zero0.optimizer_bytes, rel=0.01)
            if stage == 3:  # FSDP2's gradients are freed by zero_grad (set to None) after the step
                assert zeron.grad_bytes == 0
                continue
            grads = zeron.grad_bytes * dp if stage == 2 else zeron.grad_bytes
            assert grads == pytest.approx(zero0.grad_bytes, rel=0.01)
    assert len({tuple(r[0]["losses"]) for r in results}) == 1  # every rank reports the same losses


@pytest.mark.slow
def test_zero_matches_zero0_at_dp2() -> None:
    run = JobBuilder.cpu_run().layout(data=2)
    _check(mt_harness.run_distributed(train_zero_stages, 2, run, STEPS), dp=2)


@pytest.mark.slow
def test_zero_matches_zero0_at_dp2_pp2_tp2_sp() -> None:
    # sequence parallel too: its TP-partial norm gradients must be summed on ZeRO-2's shards
    run = (
        JobBuilder.cpu_run()
        .layout(data=2, pipeline=2, tensor=2)
        .parallelism(microBatches=2, sequenceParallel=True)
    )
    _check(mt_harness.run_distributed(train_zero_stages, 8, run, STEPS, timeout_s=400), dp=2)


def zero_collectives() -> dict[int, dict]:
    """On every rank: per ZeRO stage, the dp collectives of the second step and the buckets' element counts."""
    out = {}
    for stage in (0, 1, 2):
        raw = (
            JobBuilder.cpu_run()
            .layout(data=2)
            .parallelism(bucketMb=0.05, zeroStage=stage)  # several buckets of ~13k elements
            .training(steps=2)
            .raw()
        )
        job = loading.parse_spec(raw)
        mesh = mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
        recorder = recording.MemoryRecorder()
        eng = engine.Engine(job, mesh, recorder=recorder)
        for _ in range(2):
            eng.train_step()
        out[stage] = {
            "numels": [sum(n for _, _, n in b.members()) for b in eng.model.reducer.buckets],
            "calls": [
                (e.kind, e.nbytes, e.end - e.start)
                for e in recorder.events  # not ZeRO's 8-byte norm sum
                if e.what == "collective"
                and e.group == "dp"
                and (e.bucket is not None or e.kind != "all_reduce")
            ],
        }
    return out


@pytest.mark.slow
def test_zero_collectives_report_the_full_unsharded_buffer() -> None:
    for result in mt_harness.run_distributed(zero_collectives, 2):
        numels = result[0]["numels"]
        assert len(numels) > 1 and result[1]["numels"] == numels
        full = sorted(zero.shard_size(n, 2) * 2 * 4 for n in numels)  # padded bucket, fp32
        # ZeRO-2 cuts its own buckets (exactly bucketMb, large tensors split over several)
        assert len(result[2]["numels"]) > 1 and sum(result[2]["numels"]) == sum(numels)
        full2 = sorted(zero.shard_size(n, 2) * 2 * 4 for n in result[2]["numels"])
        by_op = {stage: {} for stage in (0, 1, 2)}
        for stage in (0, 1, 2):
            for op, nbytes, _ in result[stage]["calls"]:
                by_op[stage].setdefault(op, []).append(nbytes)
        assert sorted(by_op[0]["all_reduce"]) == sorted(
            4 * n for n in numels
        )  # ZeRO 0: whole buckets
        assert sorted(by_op[1]["all_reduce"]) == sorted(
            4 * n for n in numels
        )  # ZeRO 1 reduces like ZeRO 0
        assert sorted(by_op[1]["all_gather"]) == full
        assert sorted(by_op[2]["reduce_scatter"]) == full2
        assert sorted(by_op[2]["all_gather"]) == full2
        assert set(by_op[2]) == {"reduce_scatter", "all_gather"}
        # and the bus bandwidth of a reduce-scatter is (n-1)/n of full bytes over time: half of it at dp2
        op, nbytes, seconds = next(c for c in result[2]["calls"] if c[0] == "reduce_scatter")
        assert stepstats.bus_bandwidth(op, nbytes, seconds, 2) == pytest.approx(
            nbytes / seconds / 2
        )
