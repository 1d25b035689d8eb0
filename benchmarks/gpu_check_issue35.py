"""Helpers of ``benchmarks/gpu_check.sh --suite issue35``: the torchao wheel for the device's torch,
and the run's one results file (the device named, the figures beside TorchTitan's and the issue's
targets, what one GPU cannot measure).

    python3 benchmarks/gpu_check_issue35.py torchao-wheel WHEEL_DIR   the wheel to install, or exit 1
    python3 benchmarks/gpu_check_issue35.py summary RESULTS_DIR       write issue35-<device>.json there
"""

from __future__ import annotations

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


def _rows(results: Path) -> dict[str, dict[str, Any]]:
    """The one row of each llama run that wrote its results file."""
    rows = {}
    for name in RUNS:
        for path in sorted((results / f"llama-{name}").glob("*.json")):
            document = json.loads(path.read_text())
            rows[name] = {**document["results"]["rows"][0], "machine": document["machine"]}
    return rows


def _tests(results: Path) -> dict[str, str]:
    """Each device test's outcome from the JUnit report (empty when it did not run)."""
    path = results / "test-on-device-issue35.xml"
    if not path.exists():
        return {}
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        verdict = "passed"
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                verdict = f"{kind}: {(found.get('message') or '')[:300]}"
        outcomes[case.get("name", "?")] = verdict
    return outcomes


def summary(results: Path) -> Path:
    """Write the run's figures beside TorchTitan's and the targets; returns the file."""
    rows = _rows(results)
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
        }
    ratio = None
    if "bf16-compile" in rows and "fp8-compile" in rows:
        ratio = rows["fp8-compile"]["tokens_per_second"] / rows["bf16-compile"]["tokens_per_second"]
    out = {
        "device": device,
        "torch": machine.get("torch"),
        "shape": _shape(rows),
        "runs": runs,
        "not_measured_runs": [name for name in RUNS if name not in rows],
        "fp8_over_bf16_compiled": ratio,
        "targets": TARGETS,
        "torchtitan": TORCHTITAN,
        "device_tests": _tests(results),
        "not_measurable_on_one_gpu": NOT_MEASURABLE,
    }
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    path = results / f"issue35-{slug}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    return path


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
