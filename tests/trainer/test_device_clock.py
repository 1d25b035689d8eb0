"""The CUDA timing path, run on CPU ranks: the same events, inside the step, as the host clock reports.

No GPU here, so the engine's CUDA clock runs on a stand-in device whose
events read ``perf_counter`` (tests/unit/fake_device.py); everything else is
the real engine on four gloo ranks: the pipeline, the data-parallel buckets
launched from the "side stream", ZeRO-2, tensor and sequence parallelism, and
the DeferredRecorder that resolves the stamps at step end.  On gloo
``work.wait()`` on the side stream blocks the host, so the buckets stop
overlapping backward; what is compared is what the telemetry receives: how
many events of each sort per step, times inside the step window, and
(unchanged) losses.
"""

from __future__ import annotations

import collections

import mt_harness
import pytest
import torch

from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import clocks, recording
from tests.builders import JobBuilder
from tests.unit import fake_device

STEPS = 3
cpu = JobBuilder.cpu_run
CASES = [  # (case, run): every call site that reports a time
    ("dp2-pp2", cpu().layout(data=2, pipeline=2).parallelism(microBatches=2, zeroStage=0)),
    ("dp2-tp2-sp", cpu().layout(data=2, tensor=2).parallelism(sequenceParallel=True, zeroStage=0)),
    (
        "dp2-tp2-sp-zero2",
        cpu().layout(data=2, tensor=2).parallelism(sequenceParallel=True, zeroStage=2),
    ),
]


def _engine(
    job: api_spec.TrainingJobSpec,
    mesh: mesh_mod.Mesh,
    recorder: recording.MemoryRecorder,
    clock: str,
) -> engine.Engine:
    """An engine on ``mesh`` whose clock is the host's or the CUDA clock on a stand-in device."""
    if clock == "host":
        return engine.Engine(job, mesh, recorder=recorder)
    real = clocks.for_device
    clocks.for_device = lambda device: clocks.CudaClock(device, device_api=fake_device.FakeDevice())
    try:
        return engine.Engine(job, mesh, recorder=recorder)
    finally:
        clocks.for_device = real


def run_cases(steps: int) -> dict:
    """On every rank, per case and clock: what the recorder received in each step."""
    out, meshes = {}, {}
    for case, run in CASES:
        raw = run.clone().parallelism(bucketMb=0.05).training(steps=steps).raw()  # several buckets
        job = loading.parse_spec(raw)
        shape = job.parallelism.layout
        if shape not in meshes:
            meshes[shape] = mesh_mod.build_mesh(shape, torch.device("cpu"))
        for clock in ("host", "device"):
            recorder = recording.MemoryRecorder()
            eng = _engine(job, meshes[shape], recorder, clock)
            records = []
            for _ in range(steps):
                result = eng.train_step()
                records.append(
                    {
                        "loss": result.loss,
                        "start": recorder.step_started,
                        "seconds": result.seconds,
                        "counts": collections.Counter(
                            (e.what, e.kind, e.group) for e in recorder.events
                        ),
                        "spans": [(e.start, e.end) for e in recorder.events],
                        "compute_seconds": recorder.steps[-1]["compute_seconds"],
                    }
                )
            out[(case, clock)] = {
                "deferred": isinstance(eng.recorder, recording.DeferredRecorder),
                "steps": records,
            }
    return out


@pytest.mark.slow
def test_cuda_clock_path_reports_what_the_host_clock_reports():
    for rank_result in mt_harness.run_distributed(run_cases, 4, STEPS):
        for case, _ in CASES:
            host, device = rank_result[(case, "host")], rank_result[(case, "device")]
            assert not host["deferred"] and device["deferred"]
            for h, d in zip(host["steps"], device["steps"], strict=True):
                assert d["counts"] == h["counts"], case
                assert d["loss"] == pytest.approx(h["loss"], rel=1e-6), case
                assert sum(n for (what, _, group), n in h["counts"].items() if group == "dp") > 1, (
                    case
                )
                for step in (h, d):
                    window_end = step["start"] + step["seconds"]
                    for start, end in step["spans"]:
                        where = (
                            case,
                            "device" if step is d else "host",
                            start,
                            end,
                            step["start"],
                            window_end,
                        )
                        assert step["start"] <= start <= end <= window_end, where
                    assert 0 < step["compute_seconds"] <= step["seconds"], case
