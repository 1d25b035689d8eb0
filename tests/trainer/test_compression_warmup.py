"""Compression's exact warm-up and compression on ZeRO-2's reduce-scatter, reducer by reducer, on 2 gloo ranks.

The truth for each check is a reducer without the feature:

* during ``warmupSteps`` a compressing reducer gives exactly what the plain reducer of its kind
  gives (fp32 all-reduce, or ZeRO-2's reduce-scatter), and its state stays as built, so the first
  compressed step equals a fresh compressing reducer's first step (torch's PowerSGD hook starts
  its error and Q at its first compressed step too);
* on ZeRO-2 each mode's shard is within the mode's tolerance of the exact mean's shard; topk and
  PowerSGD's shard is ZeRO 0/1's compressed mean cut to the shard (the same arithmetic), and int8's
  per-shard scales are never coarser than ZeRO 0/1's one scale per bucket.
"""

from __future__ import annotations

import mt_harness
import pytest
import torch
import torch.distributed as dist
from test_compression import SHAPES, WORLD, _exact_means, _inputs

from meshtrain.trainer.parallel import compression, compression_sharded, reducer, zero
from meshtrain.trainer.telemetry import recording

MODES = [
    ("bf16", {}, 1e-2),
    ("fp16", {}, 2e-3),
    ("int8", {}, None),
    ("topk", {"topk_ratio": 1.0}, 1e-6),
    ("powersgd", {"rank": 2}, 1e-4),
]


class _WholeTensorZero2(zero.ShardedGradReducer):
    """ZeRO-2's exact reduce-scatter on the compressing reducer's buckets (whole tensors)."""

    split_tensors = False


def _build(kind: str, **kw) -> tuple[reducer.GradReducer, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    cls = {
        "plain": reducer.GradReducer,
        "zero2": _WholeTensorZero2,
        "compressed": compression.CompressedGradReducer,
        "compressed-zero2": compression_sharded.CompressedShardedGradReducer,
    }[kind]
    args = dict(group=dist.group.WORLD, group_size=WORLD, bucket_mb=25.0)
    if kind == "compressed-zero2":
        kw = {"settings": compression.Settings(**kw)}
    return cls(params, recorder=recording.NullRecorder(), **args, **kw), params  # type: ignore[arg-type]


def _full_means(red: reducer.GradReducer, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's reduced gradient; under ZeRO-2 this rank's shard, flat, of the one bucket."""
    if isinstance(red, zero.ShardedGradReducer):
        return [red.buckets[0].buffer.clone()]
    return [p.grad.clone() for p in params]


def _step(red: reducer.GradReducer, params: list[torch.nn.Parameter], step: int, low_rank: bool):
    red.start_step(step + 1)
    red.zero_grad()
    for p, g in zip(params, _inputs(step, dist.get_rank(), low_rank)):
        if isinstance(red, zero.ShardedGradReducer):
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
    red.finish()
    return _full_means(red, params)


def warmup_case(kind: str, plain: str, mode: str, kw: dict) -> dict:
    """Steps 1-3 with warmupSteps=2; the plain reducer's steps 1-2; a fresh compressor's step 1 on step 3's inputs."""
    warm, warm_params = _build(kind, mode=mode, warmup_steps=2, **kw)
    ref, ref_params = _build(plain)
    fresh, fresh_params = _build(kind, mode=mode, **kw)
    out = {"warm": [], "plain": []}
    for step in range(2):
        out["warm"].append(_step(warm, warm_params, step, False))
        out["plain"].append(_step(ref, ref_params, step, False))
    assert isinstance(warm, compression.Compressing)
    out["state_after_warmup"] = {k: t.clone() for k, t in warm.state.items()}
    out["state_built"] = {k: t.clone() for k, t in fresh.state.items()}  # type: ignore[attr-defined]
    out["ratio_in_warmup"] = warm.payload_bytes()
    out["first_compressed"] = _step(warm, warm_params, 2, False)
    fresh.start_step(1)
    fresh.zero_grad()
    for p, g in zip(fresh_params, _inputs(2, dist.get_rank(), False)):
        if isinstance(fresh, zero.ShardedGradReducer):
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
    fresh.finish()
    out["fresh_first"] = _full_means(fresh, fresh_params)
    return out


def zero2_case(mode: str, kw: dict) -> dict:
    """ZeRO-2's compressed shard, and ZeRO 0/1's compressed mean of the same inputs, one step."""
    low_rank = mode == "powersgd"
    sharded, sharded_params = _build("compressed-zero2", mode=mode, **kw)
    whole, whole_params = _build("compressed", mode=mode, **kw)
    return {
        "shard": _step(sharded, sharded_params, 0, low_rank)[0],
        "whole": _step(whole, whole_params, 0, low_rank),
        "rank": dist.get_rank(),
        "ratio": sharded.payload_bytes(),
    }


def in_flight_case(kind: str, **kw) -> bool:
    """Whether the bucket's exchange is still in flight when backward returns (ZeRO-2's async launch)."""
    red, params = _build(kind, **kw)
    red.start_step(1)
    red.zero_grad()
    inputs = _inputs(0, dist.get_rank(), False)
    sum((p * g).sum() for p, g in zip(params, inputs)).backward()  # the hooks launch the bucket
    flying = red.buckets[0].work is not None
    red.finish()
    return flying


def session() -> dict:
    out: dict = {"in-flight-zero2": in_flight_case("zero2")}
    for mode in ("bf16", "fp16"):
        out[f"in-flight-{mode}"] = in_flight_case("compressed-zero2", mode=mode)
    for kind, plain in (("compressed", "plain"), ("compressed-zero2", "zero2")):
        for mode, kw in (("powersgd", {"rank": 1}), ("int8", {})):
            out[f"warmup-{kind}-{mode}"] = warmup_case(kind, plain, mode, kw)
    for mode, kw, _ in MODES:
        out[f"zero2-{mode}"] = zero2_case(mode, kw)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return mt_harness.run_distributed(session, WORLD)


def _shard(full: list[torch.Tensor], rank: int) -> torch.Tensor:
    """``rank``'s ZeRO-2 range of the one bucket of the parameters (given in registration order)."""
    flat = torch.cat([t.reshape(-1) for t in reversed(full)])  # a bucket packs them in reverse
    size = zero.shard_size(flat.numel(), WORLD)
    padded = torch.cat([flat, flat.new_zeros(size * WORLD - flat.numel())])
    return padded[rank * size : (rank + 1) * size]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["compressed", "compressed-zero2"])
@pytest.mark.parametrize("mode", ["powersgd", "int8"])
def test_the_warmup_reduces_exactly_and_then_compresses_from_a_fresh_state(
    results: list[dict], kind: str, mode: str
) -> None:
    for result in results:
        case = result[f"warmup-{kind}-{mode}"]
        for warm, plain in zip(case["warm"], case["plain"]):
            for got, want in zip(warm, plain):
                torch.testing.assert_close(
                    got, want, rtol=0, atol=0
                )  # the plain reducer's, bit for bit
        built, kept = case["state_built"], case["state_after_warmup"]
        assert built.keys() == kept.keys() and built
        for key in built:
            torch.testing.assert_close(kept[key], built[key], rtol=0, atol=0)
        dense, sent = case["ratio_in_warmup"]
        assert dense == sent  # nothing compressed yet
        for got, want in zip(case["first_compressed"], case["fresh_first"]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        exact = _exact_means(3, False)[2]
        if kind == "compressed":
            assert any(not torch.allclose(g, w) for g, w in zip(case["first_compressed"], exact))


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "kw", "tolerance"), MODES, ids=[m[0] for m in MODES])
def test_zero2_compressed_shard_is_the_compressed_mean_of_its_range(
    results: list[dict], mode: str, kw: dict, tolerance: float | None
) -> None:
    low_rank = mode == "powersgd"
    exact = _exact_means(1, low_rank)[0]
    for result in results:
        case = result[f"zero2-{mode}"]
        rank, got = case["rank"], case["shard"]
        want = _shard(exact, rank)
        if tolerance is None:  # int8: within half a step of each rank's scale of this shard
            half = sum(
                float(_shard(_inputs(0, r, False), rank).abs().max()) / 127 / 2
                for r in range(WORLD)
            )
            assert float((got - want).abs().max()) <= half / WORLD + 1e-6
            bucket_half = sum(
                max(float(g.abs().max()) for g in _inputs(0, r, False)) / 127 / 2
                for r in range(WORLD)
            )
            assert half <= bucket_half  # per-shard scales: never coarser than one per bucket
        else:
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * want.abs().max())
        if mode in ("topk", "powersgd"):  # ZeRO 0/1's arithmetic, cut to the shard
            torch.testing.assert_close(got, _shard(case["whole"], rank), rtol=1e-6, atol=1e-6)
        dense, sent = case["ratio"]
        if mode in ("bf16", "fp16", "int8"):
            assert sent < dense


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_zero2s_casts_stay_in_flight_after_backward_as_its_plain_reduce_scatter(
    results: list[dict], mode: str
) -> None:
    for result in results:
        assert result["in-flight-zero2"]  # the truth: plain ZeRO-2 launches asynchronously
        assert result[f"in-flight-{mode}"] == result["in-flight-zero2"]
