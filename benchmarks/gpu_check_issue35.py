"""Helpers of ``benchmarks/gpu_check.sh --suite issue35``: the torchao wheel for the device's torch,
and the run's one results file (the device named, the figures beside TorchTitan's, the planner's
predictions beside the measurements, the issue's targets passed or failed, what one GPU cannot
measure).

    python3 benchmarks/gpu_check_issue35.py torchao-wheel WHEEL_DIR     the wheel to install, or exit 1
    python3 -m benchmarks.gpu_check_issue35 summary RESULTS_DIR         write issue35-<device>.json there
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

TORCHAO_MIN_TORCH = {(0, 18): (2, 11), (0, 15): (2, 9), (0, 14): (2, 9)}
"""The oldest torch each torchao release is built for: 0.18 from its own ``__init__`` (it skips its
extensions below torch 2.11), 0.14.1 and 0.15 from torchao's compatibility table (torch 2.9.0 and
2.9.1).  A torch older than every row gets no torchao: fp8 is reported as not measured."""

TORCHTITAN = {
    "source": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1: Llama 3.1 8B, "
    "8 H100 (96 GB HBM2e, 500 W), FSDP, local batch 2, selective activation checkpointing, seq 8192",
    "tokens_per_second_per_gpu": {"bf16": 5762, "bf16+compile": 6667, "fp8+compile": 8532},
    "layers": 32,
}
"""TorchTitan's published per-GPU throughput for Llama 3.1 8B at sequence 8192."""

TORCHTITAN_H200 = {
    "source": "pytorch/torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md (Trainy, June 2025): "
    "Llama 3.1 8B, 32 H200 (4 hosts), FSDP with float8 all-gather, local batch 2, compiled, float8 "
    "converters, seq 8192 (its llama3_8b.toml), TPS/GPU sampled at step 100",
    "tokens_per_second_per_gpu": {"fp8+compile": 10938},
    "layers": 32,
}
"""TorchTitan's H200 figure: the only fp8+compile row on the device the suite is sized for."""

TARGETS = {"bf16_mfu": 0.50, "fp8_over_bf16_compiled": 1.25}
"""The issue's targets on one H100/H200: MFU of the llama shape in bf16, and fp8+compile over bf16+compile."""

RUNS = {
    "bf16-compile": "bf16+compile",
    "fp8-compile": "fp8+compile",
    "bf16-eager": "bf16",
    "fp8-eager": "fp8",
}
"""The llama runs (``llama-<name>/`` under the results) and TorchTitan's name for each."""

NOT_MEASURABLE = {
    "multi-rank NCCL": "one GPU: NCCL refuses two ranks on one device, so tensor, pipeline and "
    "data parallelism, ZeRO and the side-stream reducer over NCCL are not measured here",
    "overlap of collectives with compute": "needs two or more ranks (one rank has no collective to overlap)",
    "context parallelism > 1": "needs two or more ranks (the context=1 path is tested)",
    "compression warm-up and compressed all-reduce": "needs data >= 2 ranks",
}
"""What a machine with one GPU cannot show, reported as such in the results."""


def _version(text: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", text)
    if not found:
        raise ValueError(f"not a version: {text!r}")
    return int(found[1]), int(found[2])


def torchao_wheel(directory: Path, torch_version: str) -> Path | None:
    """The newest torchao wheel in ``directory`` built for ``torch_version`` (None: none is)."""
    torch = _version(torch_version)
    fitting = []
    for wheel in directory.glob("torchao-*.whl"):
        release = _version(wheel.name.split("-")[1])
        minimum = TORCHAO_MIN_TORCH.get(release)
        if minimum is not None and minimum <= torch:
            fitting.append((release, wheel))
    return max(fitting)[1] if fitting else None


def measured_rows(results: Path) -> dict[str, dict[str, Any]]:
    """The one row of each llama run that wrote its results file."""
    rows = {}
    for name in RUNS:
        for path in sorted((results / f"llama-{name}").glob("*.json")):
            document = json.loads(path.read_text())
            rows[name] = {**document["results"]["rows"][0], "machine": document["machine"]}
    return rows


def _tests(results: Path) -> dict[str, str]:
    """Each device test's outcome from the JUnit report (empty when it did not run)."""
    outcomes = {}
    cases = (
        case
        for path in sorted(results.glob("test-on-device-issue35*.xml"))
        for case in ET.parse(path).getroot().iter("testcase")
    )
    for case in cases:
        verdict = "passed"
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                verdict = f"{kind}: {(found.get('message') or '')[:300]}"
        outcomes[case.get("name", "?")] = verdict
    return outcomes


def summary(results: Path) -> Path:
    """Write the run's figures beside TorchTitan's and the targets; returns the file."""
    rows = measured_rows(results)
    machine = next(iter(rows.values()))["machine"] if rows else {}
    device = machine.get("gpu") or f"CPU rehearsal ({machine.get('cpu_model')})"
    runs: dict[str, Any] = {}
    for name, row in rows.items():
        # per-token FLOPs of the 32-layer 8B over this shape's: tokens/s at TorchTitan's depth
        scale = row["flops_per_token"] / _flops_of_32_layers(row)
        titan = TORCHTITAN["tokens_per_second_per_gpu"].get(RUNS[name])
        runs[name] = {
            "tokens_per_second": row["tokens_per_second"],
            "mfu_bf16_peak": row["mfu"],
            "peak_memory_gib": row.get("peak_memory_gib"),
            "last_loss": row.get("last_loss"),
            "tokens_per_second_at_32_layers": row["tokens_per_second"] * scale,
            "torchtitan_tokens_per_second_per_gpu": titan,
            "torchtitan_h200_tokens_per_second_per_gpu": TORCHTITAN_H200[
                "tokens_per_second_per_gpu"
            ].get(RUNS[name]),
        }
    ratio = _ratio(rows, "tokens_per_second")
    predicted = planner_predictions(rows, machine.get("gpu"))
    out = {
        "device": device,
        "torch": machine.get("torch"),
        "shape": _shape(rows),
        "runs": runs,
        "not_measured_runs": [name for name in RUNS if name not in rows],
        "fp8_over_bf16_compiled": ratio,
        "planner": predicted,
        "targets": TARGETS,
        "verdicts": _verdicts(rows, ratio),
        "torchtitan": TORCHTITAN,
        "torchtitan_h200": TORCHTITAN_H200,
        "device_tests": _tests(results),
        "not_measurable_on_one_gpu": NOT_MEASURABLE,
    }
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    path = results / f"issue35-{slug}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    return path


def _ratio(rows: dict[str, dict[str, Any]], key: str) -> float | None:
    """fp8+compile over bf16+compile of ``key`` (None: a run is missing)."""
    if "bf16-compile" not in rows or "fp8-compile" not in rows:
        return None
    return float(rows["fp8-compile"][key]) / float(rows["bf16-compile"][key])


def planner_predictions(rows: dict[str, dict[str, Any]], gpu: str | None) -> dict[str, Any]:
    """The planner's step time, tokens/s and fp8/bf16 ratio of each run beside the measured ones."""
    from benchmarks import bench_mfu  # noqa: PLC0415 - torch and the trainer, only for the summary
    from meshtrain.planner import estimate, mfu, profiles  # noqa: PLC0415

    profile = mfu.gpu_profile(gpu) if gpu else None
    if profile is None:
        return {"not_predicted": f"no built-in planner profile for {gpu or 'a CPU'}"}
    out: dict[str, Any] = {"profile": profile}
    predicted: dict[str, dict[str, float]] = {}
    for name, row in rows.items():
        args = argparse.Namespace(
            layers=row["layers"],
            float8=row["float8"],
            micro_batches=row["micro_batches"],
            steps=row["timed_steps"],
            compile=row["compiled"],
            selective_recompute=row["selective_recompute"],
        )
        job = bench_mfu._spec(row["preset"], args, row["micro_batch"], 1, "cuda", 0)
        step = estimate.make_plan(job, profiles.get(profile)).time.step_seconds
        tokens = row["tokens_per_step"] / step
        predicted[name] = {"step_seconds": step, "tokens_per_second": tokens}
        out[name] = {
            "predicted_step_seconds": step,
            "measured_step_seconds": row["median_step_seconds"],
            "step_seconds_relative_error": step / row["median_step_seconds"] - 1,
            "predicted_tokens_per_second": tokens,
            "measured_tokens_per_second": row["tokens_per_second"],
            "tokens_per_second_relative_error": tokens / row["tokens_per_second"] - 1,
        }
    ratio_predicted = _ratio(predicted, "tokens_per_second")
    ratio_measured = _ratio(rows, "tokens_per_second")
    out["fp8_over_bf16_compiled"] = {
        "predicted": ratio_predicted,
        "measured": ratio_measured,
        "relative_error": ratio_predicted / ratio_measured - 1
        if ratio_predicted and ratio_measured
        else None,
    }
    return out


def _verdicts(rows: dict[str, dict[str, Any]], ratio: float | None) -> dict[str, Any]:
    """Each of :data:`TARGETS` passed or failed (None: its runs did not measure)."""
    bf16 = rows.get("bf16-compile")
    measured = {"bf16_mfu": bf16["mfu"] if bf16 else None, "fp8_over_bf16_compiled": ratio}
    return {
        name: {
            "target": target,
            "measured": measured[name],
            "passed": None if measured[name] is None else measured[name] >= target,
        }
        for name, target in TARGETS.items()
    }


def _flops_of_32_layers(row: dict[str, Any]) -> float:
    """FLOPs per token of the same shape at TorchTitan's 32 layers (the blocks scale, the head not)."""
    layers = row["layers"]
    head = 6 * 128256 * 4096 if row["preset"] == "llama3-8b" else 0
    return head + (row["flops_per_token"] - head) * TORCHTITAN["layers"] / layers


def _shape(rows: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    if not rows:
        return None
    row = next(iter(rows.values()))
    keys = ("preset", "layers", "params", "seq_len", "micro_batch", "micro_batches")
    return {k: row[k] for k in keys} | {"selective_recompute": row["selective_recompute"]}


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "torchao-wheel":
        import torch  # noqa: PLC0415 - the device's own torch, only for this command

        wheel = torchao_wheel(Path(argv[1]), torch.__version__)
        if wheel is None:
            print(f"no torchao wheel in {argv[1]} for torch {torch.__version__}", file=sys.stderr)
            return 1
        print(wheel)
        return 0
    if len(argv) == 2 and argv[0] == "summary":
        print(f"wrote {summary(Path(argv[1]))}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
