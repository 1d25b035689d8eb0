"""ZeRO-1/2 parameter all-gathers prefetched into the next forward (``parallelism.overlap.paramGather``).

At dp2 with several buckets, each stage with the prefetch on and off trains like one device (losses
against torch's own loop, :func:`mt_workers.reference`), the two paths end on bit-identical weights,
and with the prefetch on every gather of a later step is recorded inside that step and waited for
in its forward, before the first backward (serial: inside the optimizer step, after the last).
"""

from __future__ import annotations

import mt_harness
import mt_workers
import pytest
import torch

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import recording
from tests.builders import JobBuilder

STEPS = 4
LOSS_RTOL = 1e-6
"""As test_equivalence: fp32 summation order differs between layouts."""


def _case(stage: int, prefetch: bool) -> dict:
    return (
        JobBuilder.cpu_run()
        .layout(data=2)
        .training(steps=STEPS)
        .parallelism(
            microBatches=2,
            bucketMb=0.05,  # several buckets, so layers wait for different gathers
            zeroStage=stage,
            overlap={"paramGather": prefetch},
        )
        .raw()
    )


CASES = {
    f"zero{s}-{'prefetch' if p else 'serial'}": _case(s, p) for s in (1, 2) for p in (True, False)
}


def train(cases: dict[str, dict]) -> dict[str, dict]:
    """Per case: losses, final weights (read through named_params) and the gathers' timing."""
    out = {}
    for name, raw in cases.items():
        job = loading.parse_spec(raw)
        recorder = recording.MemoryRecorder()
        eng = engine.Engine(
            job, mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu")), recorder=recorder
        )
        losses, gathers = [], []
        for _ in range(STEPS):
            losses.append(eng.train_step().loss)
            backward = [e for e in recorder.events if e.what == "compute" and e.kind == "backward"]
            first, last = min(e.start for e in backward), max(e.end for e in backward)
            gathers.append(
                [
                    (e.end <= first, e.start >= last, recorder.step_started <= e.start)
                    for e in recorder.events
                    if e.what == "collective" and e.kind == "all_gather"
                ]
            )
        weights = {n: p.detach().clone() for n, p in eng.model.named_params}
        out[name] = {"losses": losses, "weights": weights, "gathers": gathers}
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict]]:
    return mt_harness.run_distributed(train, 2, CASES)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_prefetch_trains_like_one_device_and_like_the_serial_path(runs, stage) -> None:
    reference = mt_workers.reference(_case(stage, False), STEPS)["losses"]
    for rank in runs:
        on, off = rank[f"zero{stage}-prefetch"], rank[f"zero{stage}-serial"]
        for losses in (on["losses"], off["losses"]):
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            assert rel < LOSS_RTOL, (losses, reference)
        assert on["losses"] == off["losses"]
        for name, weight in off["weights"].items():
            assert torch.equal(on["weights"][name], weight), name


@pytest.mark.slow
def test_prefetched_gathers_are_awaited_inside_the_next_forward(runs) -> None:
    for rank in runs:
        for stage in (1, 2):
            prefetch = rank[f"zero{stage}-prefetch"]["gathers"]
            assert prefetch[0] == []  # nothing to gather before the first step
            for step in prefetch[1:]:  # every gather done before the first backward, in the step
                assert len(step) > 1 and all(
                    in_forward and inside for in_forward, _, inside in step
                )
            serial = rank[f"zero{stage}-serial"]["gathers"]
            for step in serial:  # inside the optimizer step, after the last backward
                assert len(step) > 1 and all(after and inside for _, after, inside in step)
