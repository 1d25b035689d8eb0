"""The compression sweep's reading of its runs: each gap against the same seed's uncompressed run,
the spread over the seeds, and the committed result that the spec's PowerSGD defaults cite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_compression_sweep as sweep
from meshtrain.api.spec import parallelism

RESULT = Path(__file__).resolve().parents[2] / "benchmarks/results/compression_sweep-vm.json"


def _row(seed: int, mode: str, loss: float, nbytes: int, **kw: int) -> dict:
    return {"model": "tiny", "seed": seed, "mode": mode, "final_loss": loss, **kw} | {
        "last_step_bytes": nbytes,
        "run_bytes": 10 * nbytes,
    }


def test_each_gap_is_against_its_own_seeds_uncompressed_run_and_spread_over_the_seeds() -> None:
    rows = [
        _row(1, "none", 2.0, 400),
        _row(1, "bf16", 2.0, 200),
        _row(1, "powersgd", 2.02, 50, rank=8, warmupSteps=10),
        _row(2, "none", 4.0, 400),
        _row(2, "bf16", 4.0, 200),
        _row(2, "powersgd", 3.96, 50, rank=8, warmupSteps=10),
    ]
    sweep.compare(rows)
    assert [r["loss_vs_none"] for r in rows if r["mode"] == "powersgd"] == pytest.approx(
        [0.01, -0.01]
    )
    summary = {r["config"]: r for r in sweep.spread(rows)}
    psgd = summary["powersgd r8 w10"]
    assert psgd["seeds"] == 2
    assert (psgd["loss_vs_none_min"], psgd["loss_vs_none_max"]) == pytest.approx((-0.01, 0.01))
    assert psgd["loss_vs_none_mean"] == pytest.approx(0.0)
    assert psgd["step_bytes_vs_bf16"] == pytest.approx(0.25)


def test_the_committed_sweep_has_three_seeds_and_the_spec_defaults_among_its_rows() -> None:
    results = json.loads(RESULT.read_text())["results"]
    assert len(results["seeds"]) >= 3
    configs = {(r["model"], r["config"]): r for r in results["summary"]}
    default = f"powersgd r{parallelism.POWERSGD_RANK} w{parallelism.POWERSGD_WARMUP_STEPS}"
    for model in results["models"]:
        assert configs[model, default]["seeds"] == len(results["seeds"])
