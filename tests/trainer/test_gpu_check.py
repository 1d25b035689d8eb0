"""``benchmarks/gpu_check.sh``: the one-shot GPU script, rehearsed here.

A lent GPU machine gives a few minutes once; the script that spends them
must not fail on a path, an argument or an import.  Its rehearsal
(``--cpu``) runs the same steps with ``--device cpu`` and tiny presets; a
test runs it as a user would (bash, the venv's ``python3`` first on PATH)
and reads what it wrote: a results file per bench_mfu step, the fused-loss
results, the device tests' JUnit report, and its exit status.  The GPU
run's own presets and micro-batches never run here, so another test takes
its commands from ``--dry-run`` and builds each one's job through
bench_mfu's own option parsing and the spec's validation.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from benchmarks import bench_mfu, gpu_check_issue35
from meshtrain.planner import estimate, memory, profiles

ROOT = Path(__file__).resolve().parents[2]
MFU_STEPS = ("1.3b-b16", "llama3.2-1b-b2", "1.3b-b8", "125m-b16", "350m-b8")
PROFILED = ("1.3b-b16", "llama3.2-1b-b2")


REHEARSAL_SECONDS = 150
"""GPU_CHECK_SECONDS for the rehearsal: its deadline is three times that on a CPU, inside the
test's own limit, so a slow machine skips steps (and fails) instead of being killed."""


def _gpu_check(mode: str, out: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "GPU_CHECK_SECONDS": str(REHEARSAL_SECONDS),
    }
    command = ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), mode, str(out)]
    # its own session, so a timeout takes the steps' processes down with the script
    with subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=3 * REHEARSAL_SECONDS + 60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def test_the_gpu_runs_commands_build_valid_jobs(tmp_path: Path) -> None:
    run = _gpu_check("--dry-run", tmp_path / "out")
    assert run.returncode == 0, run.stdout + run.stderr
    commands = [
        shlex.split(line.removeprefix("DRY-RUN: "))
        for line in run.stdout.splitlines()
        if line.startswith("DRY-RUN: python3 benchmarks/bench_mfu.py")
    ]
    seen = set()
    for command in commands:
        args = bench_mfu.parse_args(command[2:])
        assert args.device == "cuda" or "--device" not in command, command
        for preset in args.presets:
            job = bench_mfu._spec(preset, args, args.sizes[preset], 1, "cuda", args.steps)
            assert job.training.micro_batch == args.sizes[preset]
            assert job.training.precision == "bf16" and job.training.compile
            seen.add(f"{preset}-b{args.sizes[preset]}")
    assert seen == set(MFU_STEPS)
    assert not (tmp_path / "out" / "mfu-1.3b-b16").exists(), "a dry run ran something"


@pytest.mark.gpu_rehearsal
@pytest.mark.timeout(3 * REHEARSAL_SECONDS + 120)
def test_the_gpu_check_rehearsal_runs_every_step(tmp_path: Path) -> None:
    run = _gpu_check("--cpu", tmp_path / "out")
    out = tmp_path / "out"
    log = (out / "gpu-check-log.txt").read_text()
    assert run.returncode == 0, log[-4000:]
    assert not (ROOT / "meshtrain" / "trainer").exists(), "links made where meshtrain is installed"

    for step in MFU_STEPS:
        [results] = (out / f"mfu-{step}").glob("*.json")
        written = json.loads(results.read_text())["results"]
        assert written["device"] == "cpu", step
        [row] = written["rows"]
        assert row["tokens_per_second"] > 0 and row["compiled"], step
        assert row["compile_fallbacks"] == 0, step
        assert row["memory"]["planned_peak_gib"] > 0, (step, row["memory"])
        assert ("profile" in row) == (step in PROFILED), step
    [fused] = out.glob("fused_loss-bf16-*.json")
    rows = json.loads(fused.read_text())["results"]["rows"]
    assert rows and all(r["compiled_seconds"] > 0 for r in rows.values()), rows

    files = [path for path in out.rglob("*") if path.is_file()]
    assert len(files) <= 8, f"a device command returns 8 files from $OUT at most: {files}"

    suite = ET.parse(out / "test-on-device.xml").getroot().find("testsuite")
    assert suite is not None
    ran_on = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert ran_on.get("device") == "cpu", ran_on
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    every = {"tests": _device_tests(), "failures": 0, "errors": 0, "skipped": 0}
    assert counts == every, counts


def _device_tests() -> int:
    """How many tests pytest collects from tests/trainer/test_on_device.py."""
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["tests/trainer/test_on_device.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum("::" in line for line in listed.splitlines())


ISSUE35_RUNS = {"bf16-compile", "fp8-compile", "bf16-eager", "fp8-eager"}
HEADROOM = 0.05
"""Share of the H200's tensor memory the llama shape leaves free: the planner prices allocated
bytes, not the allocator's fragmentation or compile's and the matmuls' workspaces."""


def _dry_run_jobs(out: Path, suite: str) -> list:
    run = _gpu_check_suite("--dry-run", suite, out)
    assert run.returncode == 0, run.stdout + run.stderr
    jobs = []
    for line in run.stdout.splitlines():
        if line.startswith("DRY-RUN: python3 benchmarks/bench_mfu.py"):
            args = bench_mfu.parse_args(shlex.split(line.removeprefix("DRY-RUN: "))[2:])
            [preset] = args.presets
            jobs.append((args, bench_mfu._spec(preset, args, args.sizes[preset], 1, "cuda", 0)))
    assert "NOT MEASURABLE on one GPU" in run.stdout
    assert "tests/trainer/test_on_device_issue35.py" in run.stdout
    return jobs


def _gpu_check_suite(mode: str, suite: str, out: Path) -> subprocess.CompletedProcess:
    command = ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), mode, "--suite", suite, str(out)]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def test_the_issue35_suite_trains_the_planners_largest_llama_on_one_h200(tmp_path: Path) -> None:
    """The llama runs: one shape (Llama 3.1 8B's blocks at seq 8192, as TorchTitan's figures), bf16
    and fp8, compiled and eager; the planner fits it on an H200 with 5% of its memory left, and
    one layer more does not leave that."""
    jobs = _dry_run_jobs(tmp_path / "out", "issue35")
    h200 = profiles.get("h200")
    shapes = {job.model.shape() for _, job in jobs}
    assert len(jobs) == 4 and len(shapes) == 1
    [shape] = shapes
    assert (shape.hidden, shape.ffn_hidden, shape.seq_len) == (4096, 14336, 8192)
    kinds = {
        ("fp8" if job.training.float8 else "bf16")
        + ("-compile" if job.training.compile else "-eager")
        for _, job in jobs
    }
    assert kinds == ISSUE35_RUNS
    for args, job in jobs:
        assert job.training.precision == "bf16"
        planned = memory.plan_memory(job, h200)
        assert planned.worst.total <= (1 - HEADROOM) * planned.capacity, args
        deeper = memory.plan_memory(
            bench_mfu._spec("llama3-8b", _deeper(args), 1, 1, "cuda", 0), h200
        )
        assert deeper.worst.total > (1 - HEADROOM) * deeper.capacity, (
            "not the largest with headroom"
        )
    assert not (tmp_path / "out" / "llama-bf16-compile").exists(), "a dry run ran something"


def _deeper(args):
    deeper = copy.copy(args)
    deeper.layers = args.layers + 1
    return deeper


@pytest.mark.gpu_rehearsal
@pytest.mark.timeout(3 * 480 + 120)
def test_the_issue35_rehearsal_runs_every_step_and_names_the_device(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _gpu_check_suite("--cpu", "issue35", out)
    log = (out / "gpu-check-log.txt").read_text()
    assert run.returncode == 0, log[-4000:]
    for name in ("bf16-compile", "bf16-eager"):
        [results] = (out / f"llama-{name}").glob("*.json")
        [row] = json.loads(results.read_text())["results"]["rows"]
        assert row["tokens_per_second"] > 0 and row["float8"] is None, name
    assert log.count("training.float8 is set but this rank runs on cpu") == 2, log[-4000:]
    [summary] = out.glob("issue35-*.json")
    written = json.loads(summary.read_text())
    assert written["device"].startswith("CPU rehearsal")
    assert set(written["runs"]) == {"bf16-compile", "bf16-eager"}
    assert set(written["not_measured_runs"]) == {"fp8-compile", "fp8-eager"}
    assert "multi-rank NCCL" in written["not_measurable_on_one_gpu"]
    assert written["device_tests"] and not any(
        v.startswith(("failure", "error")) for v in written["device_tests"].values()
    ), written["device_tests"]
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8


@pytest.mark.parametrize(
    "torch_version,chosen",
    [("2.11.0+cu130", "0.18.0"), ("2.15.0", "0.18.0"), ("2.9.1", "0.15.0"), ("2.8.0", None)],
)
def test_the_torchao_wheel_is_the_newest_built_for_the_devices_torch(
    tmp_path: Path, torch_version: str, chosen: str | None
) -> None:
    for version in ("0.14.1", "0.15.0", "0.18.0"):
        (tmp_path / f"torchao-{version}-cp39-abi3-manylinux_2_28_x86_64.whl").touch()
    wheel = gpu_check_issue35.torchao_wheel(tmp_path, torch_version)
    assert (wheel.name.split("-")[1] if wheel else None) == chosen


def _measured_row(args, job, tokens_per_second: float, mfu: float) -> dict:
    """A bench_mfu row of the GPU run's command ``args`` (the figures made up, the shape its job's)."""
    shape = job.model.shape()
    tokens = job.training.micro_batch * job.parallelism.micro_batches * shape.seq_len
    return {
        "preset": args.presets[0],
        "params": 0,
        "layers": shape.layers,
        "seq_len": shape.seq_len,
        "micro_batch": job.training.micro_batch,
        "micro_batches": job.parallelism.micro_batches,
        "timed_steps": args.steps,
        "compiled": job.training.compile,
        "selective_recompute": list(args.selective_recompute),
        "float8": args.float8,
        "tokens_per_step": tokens,
        "tokens_per_second": tokens_per_second,
        "median_step_seconds": tokens / tokens_per_second,
        "flops_per_token": 6.0 * 8e9,
        "mfu": mfu,
    }


def test_the_issue35_summary_sets_the_planners_predictions_beside_the_measurements(
    tmp_path: Path,
) -> None:
    """On an H200's results: each run's planned step beside its measured one, the fp8/bf16 ratio
    predicted and measured, and the issue's targets passed or failed."""
    jobs = _dry_run_jobs(tmp_path / "dry", "issue35")
    results = tmp_path / "out"
    measured = {"bf16-compile": (3000.0, 0.45), "fp8-compile": (3900.0, 0.58)}
    planned = {}
    for args, job in jobs:
        name = ("fp8" if args.float8 else "bf16") + ("-compile" if args.compile else "-eager")
        if name not in measured:
            continue
        planned[name] = estimate.make_plan(job, profiles.get("h200")).time.step_seconds
        row = _measured_row(args, job, *measured[name])
        (results / f"llama-{name}").mkdir(parents=True)
        document = {
            "machine": {"gpu": "NVIDIA H200", "torch": "2.15.0"},
            "results": {"rows": [row]},
        }
        (results / f"llama-{name}" / "mfu.json").write_text(json.dumps(document))
    written = json.loads(gpu_check_issue35.summary(results).read_text())
    planner = written["planner"]
    assert planner["profile"] == "h200"
    for name, step in planned.items():
        assert planner[name]["predicted_step_seconds"] == pytest.approx(step)
        measured_step = planner[name]["measured_step_seconds"]
        assert planner[name]["step_seconds_relative_error"] == pytest.approx(
            step / measured_step - 1
        )
    ratio = planner["fp8_over_bf16_compiled"]
    assert ratio["measured"] == pytest.approx(1.3)
    assert ratio["predicted"] == pytest.approx(planned["bf16-compile"] / planned["fp8-compile"])
    assert written["verdicts"]["bf16_mfu"] == {"target": 0.5, "measured": 0.45, "passed": False}
    assert written["verdicts"]["fp8_over_bf16_compiled"]["passed"] is True
    titan = {
        name: run["torchtitan_h200_tokens_per_second_per_gpu"]
        for name, run in written["runs"].items()
    }
    assert titan == {"bf16-compile": None, "fp8-compile": 10938}  # H100's rows beside it
