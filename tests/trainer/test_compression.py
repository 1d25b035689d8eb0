"""Gradient compression on 2 gloo ranks: each mode against the exact mean, and error feedback conserves mass.

Each rank builds a :class:`~meshtrain.trainer.parallel.compression.CompressedGradReducer`
over a few parameters, writes known per-rank gradients into them and
finishes the reduction; the test compares with the exact mean computed from
both ranks' inputs:

* topk with ratio 1 sends everything: the exact mean;
* bf16 / fp16 within their precision, int8 within one quantisation step;
* PowerSGD recovers matrices whose ranks share a column space of rank <= r
  (one power iteration spans it), and sends fewer bytes than the dense
  all-reduce;
* error feedback: over several steps, what all ranks received plus what
  every rank still holds back equals everything put in (topk, int8, PowerSGD);
* the exported compression ratio equals the parameters' bytes over the dp
  payload the collectives reported (a dp2 engine with the exporter attached).
"""

from __future__ import annotations

import mt_harness
import pytest
import torch
import torch.distributed as dist

from meshtrain.api import loading
from meshtrain.sandbox.controlplane import ports
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import compression, state_bytes
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import context, exporter, recording
from meshtrain.trainer.telemetry.recorder import TelemetryRecorder, job_facts
from tests.builders import JobBuilder

SHAPES = [(48, 16), (16,), (32, 24)]
WORLD = 2


def _reducer(mode: str, **kw) -> tuple[compression.CompressedGradReducer, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    red = compression.CompressedGradReducer(
        params,
        group=dist.group.WORLD,
        group_size=WORLD,
        bucket_mb=25.0,
        recorder=recording.NullRecorder(),
        mode=mode,
        **kw,
    )
    return red, params


def _inputs(step: int, rank: int, low_rank: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    shared = torch.Generator().manual_seed(step)  # the same column space on every rank
    out = []
    for shape in SHAPES:
        if low_rank and len(shape) == 2:
            basis = torch.randn(shape[0], 2, generator=shared)
            out.append(basis @ torch.randn(2, shape[1], generator=gen))
        else:
            out.append(torch.randn(shape, generator=gen))
    return out


def exchange(mode: str, kw: dict, steps: int, low_rank: bool) -> dict:
    """On every rank: the reduced gradients of each step, the inputs, and the error left at the end."""
    rank = dist.get_rank()
    red, params = _reducer(mode, **kw)
    outputs = []
    for step in range(steps):
        red.zero_grad()
        for p, g in zip(params, _inputs(step, rank, low_rank)):
            p.grad.copy_(g)
        red.finish()
        outputs.append([p.grad.clone() for p in params])
    error = sum(float(t.double().sum()) for k, t in red.state.items() if k.startswith("error/"))
    return {"outputs": outputs, "error_sum": error, "ratio": red.compression_ratio}


def _exact_means(steps: int, low_rank: bool) -> list[list[torch.Tensor]]:
    return [
        [
            sum(_inputs(step, r, low_rank)[i] for r in range(WORLD)) / WORLD
            for i in range(len(SHAPES))
        ]
        for step in range(steps)
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "kw", "tolerance"),
    [
        ("topk", {"topk_ratio": 1.0}, 1e-6),
        ("bf16", {}, 1e-2),
        ("fp16", {}, 2e-3),
        ("powersgd", {"rank": 2}, 1e-4),
    ],
)
def test_compressed_mean_matches_the_exact_mean(mode: str, kw: dict, tolerance: float) -> None:
    low_rank = mode == "powersgd"
    results = mt_harness.run_distributed(exchange, WORLD, mode, kw, 1, low_rank)
    exact = _exact_means(1, low_rank)[0]
    for result in results:
        for got, want in zip(result["outputs"][0], exact):
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * want.abs().max())
    if mode == "powersgd":
        assert results[0]["ratio"] > 1


@pytest.mark.slow
def test_int8_is_within_one_quantisation_step() -> None:
    results = mt_harness.run_distributed(exchange, WORLD, "int8", {}, 1, False)
    exact = _exact_means(1, False)[0]
    scales = [max(float(g.abs().max()) for g in _inputs(0, r, False)) for r in range(WORLD)]
    half_step = sum(s / 127 / 2 for s in scales) / WORLD  # each rank rounds on its own scale
    for got, want in zip(results[0]["outputs"][0], exact):
        assert float((got - want).abs().max()) <= half_step + 1e-6


@pytest.mark.parametrize("group_size", [2, 64, 128, 256])
def test_int8_precision_does_not_shrink_with_the_group_size(group_size: int) -> None:
    """The int8 arithmetic of one exchange, for ``group_size`` simulated ranks.

    Each rank rounds to within half a step of its own 127-level scale and the
    receivers sum in fp32, so the mean is within the average half step at any
    group size (summing in int8 left ``127 // N`` levels: 0, and NaN, at 128).
    """
    gen = torch.Generator().manual_seed(group_size)
    grads = torch.randn(group_size, 1000, generator=gen) * torch.rand(group_size, 1, generator=gen)
    quantised = [compression.quantise_int8(g) for g in grads]
    payloads = torch.stack([q for q, _ in quantised])
    scales = torch.cat([s for _, s in quantised])
    got = compression.mean_of_int8(payloads, scales)
    half_step = float(grads.abs().amax(dim=1).sum()) / 127 / 2 / group_size
    assert torch.isfinite(got).all()
    assert float((got - grads.mean(dim=0)).abs().max()) <= half_step * (1 + 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "kw"), [("topk", {"topk_ratio": 0.05}), ("int8", {}), ("powersgd", {"rank": 1})]
)
def test_error_feedback_conserves_what_was_put_in(mode: str, kw: dict) -> None:
    steps = 4
    results = mt_harness.run_distributed(exchange, WORLD, mode, kw, steps, False)
    inputs = [g.double() for s in range(steps) for r in range(WORLD) for g in _inputs(s, r, False)]
    put_in = sum(float(g.sum()) for g in inputs)
    received = WORLD * sum(float(g.double().sum()) for out in results[0]["outputs"] for g in out)
    held_back = sum(r["error_sum"] for r in results)
    # fp32 rounding of ~7,000 elements (summed in varying order) against the mass that moved
    scale = sum(float(g.abs().sum()) for g in inputs)
    assert received + held_back == pytest.approx(put_in, abs=1e-5 * scale)
    assert abs(held_back) > 0  # something was held back: the compression is lossy per step


def exchange_after_skipped_nan(mode: str, kw: dict) -> list[torch.Tensor]:
    """Step 0 has a NaN gradient on rank 0 and is skipped (the loss guard's call); step 1 is clean."""
    rank = dist.get_rank()
    red, params = _reducer(mode, **kw)
    red.zero_grad()
    for p, g in zip(params, _inputs(0, rank, False)):
        p.grad.copy_(g)
    if rank == 0:
        params[0].grad[0, 0] = float("nan")
    red.finish()
    red.discard_step()
    red.zero_grad()
    for p, g in zip(params, _inputs(1, rank, False)):
        p.grad.copy_(g)
    red.finish()
    return [p.grad.clone() for p in params]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "kw"), [("int8", {}), ("powersgd", {"rank": 1})])
def test_a_skipped_non_finite_step_leaves_no_nan_in_the_error_feedback(mode: str, kw: dict) -> None:
    """The loss guard skips a NaN step; error feedback and PowerSGD's Q must not carry the NaN on."""
    results = mt_harness.run_distributed(exchange_after_skipped_nan, WORLD, mode, kw)
    exact = _exact_means(2, False)[1]
    for got, want in zip(results[0], exact):
        assert torch.isfinite(got).all(), mode
        # the next step is a (lossy) estimate of the mean, of its size, not of a NaN or blown-up one
        assert float((got - want).norm()) <= float(want.norm()), mode


def exported_compression(mode: dict) -> dict:
    """On every rank: train 2 steps of a dp2 job with ``mode``, exporter attached; metric values and the truth."""
    job = loading.parse_spec(
        JobBuilder.cpu_run()
        .layout(data=2)
        .parallelism(gradientCompression=mode)
        .training(steps=2)
        .raw()
    )
    layout = job.parallelism.layout
    rank = dist.get_rank()
    identity = context.RankIdentity.from_env(layout, rank, rank)
    facts = job_facts(job, layout, rank, 1.0)
    sink = exporter.Exporter(identity, facts, port=ports.pick_free_port(), progress=None)
    recorder = TelemetryRecorder(identity, facts, [sink])
    eng = engine.Engine(job, mesh_mod.build_mesh(layout, torch.device("cpu")), recorder=recorder)
    recorder.watch(
        state_bytes.meter(eng.model, eng.optimizer, eng.model.reducer),
        eng.model.reducer.payload_bytes,
    )
    try:
        for _ in range(2):
            eng.train_step()
        value = sink.metrics.registry.get_sample_value
        labels = identity.labels()
        uncompressed = value(
            "meshtrain_gradient_reduction_bytes_total", {**labels, "stage": "uncompressed"}
        )
        sent = value("meshtrain_gradient_reduction_bytes_total", {**labels, "stage": "sent"})
        return {
            "ratio": uncompressed / sent,  # the dashboard's rate(uncompressed) / rate(sent)
            "uncompressed": uncompressed,
            "sent": sent,
            # the truth: the parameters' fp32 bytes, and the dp payload the collectives reported
            "dense_truth": sum(p.numel() * p.element_size() for p in eng.params),
            "sent_truth": sum(c.nbytes for c in recorder.last.collectives if c.group == "dp"),
        }
    finally:
        sink.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode", [{"mode": "powersgd", "rank": 2, "warmupSteps": 0}, {"mode": "none"}], ids=str
)
def test_trainer_exports_the_compression_ratio(mode: dict) -> None:
    for r in mt_harness.run_distributed(exported_compression, WORLD, mode):
        assert r["ratio"] == pytest.approx(r["dense_truth"] / r["sent_truth"])
        assert r["uncompressed"] == 2 * r["dense_truth"] and r["sent"] == 2 * r["sent_truth"]
        if mode["mode"] == "none":
            assert r["ratio"] == 1.0
        else:
            assert r["ratio"] > 1.0
