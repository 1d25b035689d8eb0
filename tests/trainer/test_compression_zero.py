"""Compression on ZeRO-2/3 and its warm-up, trained end to end at dp2 (one 2-rank session).

* Resume: a job saved past ``warmupSteps`` compresses at its first resumed step (the counter is
  the restored step, not a restart), one saved inside it finishes the warm-up exactly; both give
  the losses of the uninterrupted run bit for bit, on ZeRO 0 and ZeRO-2.
* The 16-bit casts (and int8) on ZeRO-2's and ZeRO-3's reduce-scatter train as uncompressed ZeRO-0
  does (the layouts' truth, equal to one device) within the cast's precision, and ZeRO-3's
  reduce-scatter then carries half the bytes.
* PowerSGD on ZeRO-2 converges on the tiny model: its final loss is that of the uncompressed run,
  within a few percent.
"""

from __future__ import annotations

from pathlib import Path

import mt_harness
import pytest
import test_resume_exact as resume
import torch
import torch.distributed as dist

from meshtrain.api import loading
from meshtrain.planner import comm, gradient_compression, precision
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import recording
from tests.builders import JobBuilder

RESUMED = [
    (0, {"mode": "powersgd", "rank": 2, "warmupSteps": 1}),  # saved past the warm-up
    (0, {"mode": "powersgd", "rank": 2, "warmupSteps": 3}),  # saved inside it
    (2, {"mode": "powersgd", "rank": 2, "warmupSteps": 1}),
    (2, {"mode": "int8", "warmupSteps": 1}),
]
CASTS = [(2, "bf16"), (2, "fp16"), (2, "int8"), (3, "bf16"), (3, "fp16")]
CONVERGE_STEPS = 30
WARMUP_PLANS = [(0, 2), (0, 1), (2, 2), (2, 1)]
"""(ZeRO stage, warmupSteps) of a 2-step run: its last step inside the warm-up, or after it."""


def _name(stage: int, mode: dict) -> str:
    return f"z{stage}-{mode['mode']}-w{mode.get('warmupSteps', 0)}"


def _train(raw: dict, steps: int) -> dict:
    job = loading.parse_spec(raw)
    recorder = recording.MemoryRecorder()
    mesh = mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
    eng = engine.Engine(job, mesh, recorder=recorder)
    losses = [eng.train_step().loss for _ in range(steps)]
    collectives: dict[str, list[int]] = {}
    for event in recorder.events:  # the last step's
        if event.what == "collective":
            entry = collectives.setdefault(f"{event.group}/{event.kind}", [0, 0])
            entry[0] += 1
            entry[1] += event.nbytes
    return {
        "losses": losses,
        "reduce_scatter_bytes": collectives.get("dp/reduce_scatter", [0, 0])[1],
        "collectives": collectives,
    }


def session(root: str) -> dict:
    out: dict = {}
    dp2 = JobBuilder.cpu_run().layout(data=2)
    for stage, mode in RESUMED:
        raw = (
            dp2.clone()
            .training(steps=resume.STEPS)
            .parallelism(zeroStage=stage, gradientCompression=mode)
            .raw()
        )
        out[f"resume-{_name(stage, mode)}"] = resume.resume_case(
            raw, f"{root}/{_name(stage, mode)}"
        )
    out["plain"] = _train(dp2.clone().raw(), resume.STEPS)
    for stage in (2, 3):
        out[f"z{stage}-none"] = _train(dp2.clone().parallelism(zeroStage=stage).raw(), resume.STEPS)
    for stage, mode in CASTS:
        raw = dp2.clone().parallelism(zeroStage=stage, gradientCompression={"mode": mode}).raw()
        out[f"z{stage}-{mode}"] = _train(raw, resume.STEPS)
    long = dp2.clone().training(steps=CONVERGE_STEPS).parallelism(zeroStage=2)
    out["converge-none"] = _train(long.clone().raw(), CONVERGE_STEPS)
    compressed = {"mode": "powersgd", "rank": 8, "warmupSteps": 5}
    out["converge-powersgd"] = _train(
        long.clone().parallelism(gradientCompression=compressed).raw(), CONVERGE_STEPS
    )
    for name, warmup in (("warm", 3), ("cold", 0)):
        mode = {"mode": "powersgd", "rank": 1, "warmupSteps": warmup}
        out[name] = _train(dp2.clone().parallelism(gradientCompression=mode).raw(), 3)
    for stage, warmup in WARMUP_PLANS:
        mode = {"mode": "powersgd", "rank": 2, "warmupSteps": warmup}
        raw = dp2.clone().parallelism(zeroStage=stage, gradientCompression=mode).raw()
        out[f"plan-z{stage}-w{warmup}"] = _train(raw, 2) | {"raw": raw}
    out["rank"] = dist.get_rank()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root: Path = tmp_path_factory.mktemp("compression-zero")
    return mt_harness.run_distributed(session, 2, str(root))


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "mode"), RESUMED, ids=[_name(s, m) for s, m in RESUMED])
def test_resume_keeps_the_warmup_counted_from_the_restored_step(
    results: list[dict], stage: int, mode: dict
) -> None:
    for result in results:
        case = result[f"resume-{_name(stage, mode)}"]
        assert case["restored"] == resume.SAVE_AT
        assert case["resumed"] == case["uninterrupted"][resume.SAVE_AT :]  # bit for bit


@pytest.mark.slow
def test_the_warmup_changes_the_run_it_delays(results: list[dict]) -> None:
    """The resume cases above could not tell a re-warmed job apart if warming changed nothing."""
    for result in results:
        warm, cold = result["warm"]["losses"], result["cold"]["losses"]
        assert warm[:1] == cold[:1]  # step 1's loss precedes any exchange
        assert warm[1:] != cold[1:]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "mode"), CASTS, ids=[f"z{s}-{m}" for s, m in CASTS])
def test_compressed_reduce_scatter_trains_as_the_plain_all_reduce(
    results: list[dict], stage: int, mode: str
) -> None:
    tolerance = 1e-2 if mode == "int8" else 1e-3
    for result in results:
        got, truth = result[f"z{stage}-{mode}"], result["plain"]
        assert got["losses"] == pytest.approx(truth["losses"], rel=tolerance)
        assert result[f"z{stage}-none"]["losses"] == pytest.approx(truth["losses"], rel=1e-5)
        if stage == 3:  # FSDP2's reduce_dtype: 2-byte elements on the wire
            assert 2 * got["reduce_scatter_bytes"] == result["z3-none"]["reduce_scatter_bytes"]


@pytest.mark.slow
def test_powersgd_on_zero2_converges_on_the_tiny_model(results: list[dict]) -> None:
    for result in results:
        plain, compressed = result["converge-none"]["losses"], result["converge-powersgd"]["losses"]
        final_plain, final = sum(plain[-5:]) / 5, sum(compressed[-5:]) / 5
        assert final < 0.8 * compressed[0]  # it learns
        assert final == pytest.approx(final_plain, rel=0.03)


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "warmup"), WARMUP_PLANS)
def test_the_planner_predicts_the_warmup_step_and_the_compressed_one(
    results: list[dict], stage: int, warmup: int
) -> None:
    for result in results:
        case = result[f"plan-z{stage}-w{warmup}"]
        job = loading.parse_spec(case["raw"])
        last_step = 2
        predicted = comm.stage_comm(
            job,
            0,
            precision.FP32,
            warmup=gradient_compression.in_warmup(job.parallelism.gradient_compression, last_step),
        )
        expected = {f"{g}/{op}": [c.calls, c.nbytes] for (g, op), c in predicted.by_key().items()}
        assert case["collectives"] == expected
