"""Benchmark: tokens/s and model FLOPs utilisation of the engine (bf16, several micro-batches a step).

For each preset (``--presets``, default 125m 350m 1.3b on a GPU) one
process per GPU builds meshtrain's :class:`~meshtrain.trainer.engine.Engine`
(the same code as a multi-GPU job: pipeline executor, chunked loss, AdamW,
clipping, data sampler) with ``--micro-batches`` micro-batches a step, so
the optimizer and the step's one host sync are amortised as in a real run,
bf16 autocast with fp32 master weights, compiled blocks (``--no-compile``
turns that off), optional selective recompute and float8 linears
(``--float8 tensorwise|rowwise``, torchao's; ``--layers`` changes the preset's depth), and trains ``--steps``
steps after 3 warm-up steps (the first compiles).  It reports tokens/s and
MFU = tokens/s x FLOPs per token / (peak x GPUs).  FLOPs per token is
``6N + 12 L T H`` (:func:`meshtrain.trainer.models.gpt.flops_per_token`, full
attention matrix counted); the peak is the GPU's dense bf16 figure
(:mod:`meshtrain.trainer.telemetry.peak`), with ``--float8`` too
(:mod:`meshtrain.planner.mfu`).  Under ``torchrun`` the GPUs are
data-parallel ranks (``--nproc-per-node N``), which adds the bucketed
all-reduce on its side stream.

``--profile`` then runs as many steps again under ``torch.profiler`` (kept
out of tokens/s: the profiler slows the host and parses its trace when it
stops; the first H200 run counted both in, and its 1.3B tokens/s came out
11% below what its own CUDA-event step times give) and checks meshtrain's own
timings (CUDA events: the step, the forward and backward
compute intervals, the data-parallel all-reduces on the side stream)
against the profiler's kernels on the same steps: every kernel is
attributed through its launch to the step and the forward/backward range
(``record_function`` ranges of the executor) it was launched from, and the
relative differences are reported per quantity.

The step's bookkeeping all-reduce (loss and stop flag, ``engine.AGREE_RANGE``)
is left out of the profiler's side, as meshtrain does not time it.

Writes ``benchmarks/results/mfu-<host>.json`` with the device named.  On a
CPU (``--device cpu --presets tiny``) it only shows that the harness runs
(under ``torchrun`` the all-reduce comparison uses gloo's records of its
runs); such a file says ``"device": "cpu"`` and its numbers are no GPU figure.

    python benchmarks/bench_mfu.py [--presets 125m 350m 1.3b] [--steps 10] [--micro-batches 4] [--profile]
    torchrun --nproc-per-node 8 benchmarks/bench_mfu.py --presets 1.3b --profile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine
from meshtrain.api import exitcodes, loading
from meshtrain.planner import admission, memory, mfu, profiles
from meshtrain.sandbox.controlplane.ports import pick_free_port
from meshtrain.trainer import engine
from meshtrain.trainer.calibration import measure
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import float8, pipeline
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import peak, recording

MICRO_BATCH = {
    "tiny": 2,
    "llama-tiny": 2,
    "125m": 8,
    "350m": 4,
    "1.3b": 2,
    "7b": 1,
    "llama3.2-1b": 2,
    "llama3-8b": 1,
}
"""Sequences per micro-batch (of the preset's sequence length) that fit an 80 GB GPU with the chunked loss."""
WARMUP = 3
PROFILE_TOLERANCE = 0.05
"""The issue's bound on |meshtrain - profiler| / profiler for the step, compute and all-reduce times."""


def _spec(
    preset: str,
    args: argparse.Namespace,
    micro_batch: int,
    world: int,
    device: str,
    profiled_steps: int,
) -> Any:
    model: dict[str, Any] = {"preset": preset}
    if args.layers:
        model["layers"] = args.layers
    training: dict[str, Any] = {"float8": {"recipe": args.float8}} if args.float8 else {}
    return loading.parse_spec(
        {
            "model": model,
            "parallelism": {"data": world, "microBatches": args.micro_batches},
            "resources": {"gpusPerNode": world},
            "training": {
                "microBatch": micro_batch,
                "steps": WARMUP + args.steps + profiled_steps,
                "warmupSteps": 2,
                # fp8 on a CPU: bf16, so that the trainer's device check refuses it
                "precision": "bf16" if device == "cuda" or args.float8 else "fp32",
                "compile": args.compile,
                "selectiveRecompute": args.selective_recompute,
                "dataset": "stdlib",
                **training,
            },
        }
    )


class _StepEvents:
    """GPU time of each step: CUDA events around it (host time on a CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[Any, Any]] = []

    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def end(self, begun: Any) -> None:
        self.marks.append((begun, self.start()))

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in self.marks]
        return [b - a for a, b in self.marks]


def _train(trainer: engine.Engine, steps: int, events: _StepEvents) -> tuple[list[Any], float]:
    """Run ``steps`` steps, each inside its profiler range; returns their results and the host seconds they took.

    ``train_step`` ends by reading its results from the device, so the host
    clock covers every step's device work.
    """
    results = []
    begun_wall = time.perf_counter()
    for index in range(steps):
        with torch.profiler.record_function(f"{STEP_RANGE}{index}"):
            begun = events.start()
            results.append(trainer.train_step())
            events.end(begun)
    return results, time.perf_counter() - begun_wall


def run_preset(
    preset: str, micro_batch: int, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """Throughput from ``--steps`` steps run bare; with ``--profile``, as many more under the profiler.

    The profiler slows the host (every op and launch is recorded) and takes
    seconds to parse its trace when it stops, so the steps it watches are
    kept out of tokens/s: they only serve the timing comparison.
    """
    world = dist.get_world_size()
    profiled_steps = args.steps if args.profile else 0
    job = _spec(preset, args, micro_batch, world, device.type, profiled_steps)
    mesh = mesh_mod.build_mesh(job.parallelism.layout, device)
    own = recording.MemoryRecorder()  # fed CUDA-event seconds by the engine's DeferredRecorder
    started = time.perf_counter()
    trainer = engine.Engine(job, mesh, recorder=own)
    build_seconds = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(WARMUP):
        trainer.train_step()
    warmup_seconds = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    events = _StepEvents(device)
    results, wall = _train(trainer, args.steps, events)
    gpu_steps = events.seconds()
    tokens = sum(r.tokens for r in results)
    config = trainer.config
    flops = gpt.flops_per_token(config)
    device_peak = peak.resolve_peak_flops(None, device)  # 0.0: a GPU no profile names
    devices = peak.mfu_devices(world, device)  # the GPUs, or this host's cores the ranks use
    # per rank: the devices the job uses over its ranks (meshtrain.planner.mfu)
    peak_flops = device_peak * devices / world
    tokens_per_second = tokens / wall
    row: dict[str, Any] = {
        "preset": preset,
        "params": gpt.dense_param_count(config),
        "gpus": world,
        "micro_batch": micro_batch,
        "micro_batches": args.micro_batches,
        "seq_len": config.seq_len,
        "precision": trainer.precision,
        "compiled": trainer.compiled,
        "compile_fallbacks": trainer.compile_fallbacks,
        "selective_recompute": list(args.selective_recompute),
        "float8": args.float8,
        "layers": config.layers,
        "tokens_per_step": results[0].tokens,
        "timed_steps": args.steps,
        # the weights drawn and moved, the model parallelised (a device run's time budget)
        "build_seconds": build_seconds,
        "warmup_seconds": warmup_seconds,  # compile's, where compiled
        "wall_seconds": wall,
        "median_step_seconds": statistics.median(gpu_steps),
        "tokens_per_second": tokens_per_second,
        "flops_per_token": flops,
        "peak_flops": peak_flops,
        "mfu": mfu.ratio(tokens * flops, wall, device_peak, devices),
        # the causal half of the attention matrix only: what flash attention computes
        "mfu_causal": mfu.ratio(
            tokens * gpt.flops_per_token(config, causal_half=True), wall, device_peak, devices
        ),
        "first_loss": results[0].loss,
        "last_loss": results[-1].loss,
        "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30)
        if device.type == "cuda"
        else None,
    }
    try:  # after the measurement: a planner or profile problem must not lose the row
        row["memory"] = memory_report(job, device)
    except Exception as err:  # noqa: BLE001 - recorded in the row instead
        row["memory"] = {"error": f"{type(err).__name__}: {err}"}
    if args.profile:
        watched = _StepEvents(device)
        with _profiler(device) as prof:
            _train(trainer, profiled_steps, watched)
        watched_steps = watched.seconds()
        mine = own.steps[-profiled_steps:]
        ours = [
            {
                "step": watched_steps[i],
                "compute": mine[i]["compute_seconds"],
                "allreduce": mine[i].get("dp_collective_seconds", 0.0),
                "allreduce_calls": int(mine[i].get("dp_collective_count", 0)),
            }
            for i in range(profiled_steps)
        ]
        theirs, unattributed = profiler_timings(prof, profiled_steps)
        row["profile"] = compare(ours, theirs)
        row["profile"]["unattributed_kernels"] = unattributed
        row["profile"]["median_step_seconds"] = statistics.median(watched_steps)
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


STEP_RANGE = "meshtrain.bench_step."


def memory_report(job: Any, device: torch.device) -> dict[str, Any]:
    """The planner's peak for the job beside the measured one, and the device's memory beside
    its profile's (``memory_bytes``, ``reserved_bytes``): what admission decides with.

    The planned peak does not depend on the profile (the job names its
    precision); the device's figures are what CUDA reports now, after the
    timed steps: its total, and what this process holds beyond PyTorch's
    allocator (CUDA context, NCCL, library workspaces).
    """
    if device.type == "cuda":
        # CUDA says "NVIDIA A100 80GB PCIe" where the node label says NVIDIA-A100-80GB-PCIe
        product = torch.cuda.get_device_name(device).replace(" ", "-")
        profile = admission.profile_for_labels({admission.PRODUCT_LABEL: product})
    else:
        profile = profiles.get("cpu")
    planned = memory.plan_memory(job, profile or profiles.get("cpu")).worst.total
    report: dict[str, Any] = {"planned_peak_gib": planned / 2**30}
    if device.type == "cuda":
        report["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        for key, value in measure.device_memory(device).items():
            report[f"{key}_gib"] = value / 2**30
    if profile is not None:
        report["profile"] = {
            "name": profile.name,
            "memory_gib": profile.memory_bytes / 2**30,
            "reserved_gib": profile.reserved_bytes / 2**30,
        }
    return report


def _profiler(device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def profiler_timings(
    prof: torch.profiler.profile, steps: int
) -> tuple[list[dict[str, float]], int]:
    """Per step, from the profiler's trace: GPU span, forward/backward compute span, NCCL kernel
    time and calls; and how many kernels no launch could be found for (they are left out).

    Kernels are attributed by their launch (the CUDA runtime or driver call
    with the same correlation id) to the step range and the executor's
    forward/backward range that contain it.  The bench's ranks are
    data-parallel only, so every NCCL kernel outside the step's bookkeeping
    all-reduce is a gradient bucket's.  On a CPU there are no kernels: the
    ranges' own host durations are used.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())["traceEvents"]
    ranges = [e for e in trace if e.get("cat") == "user_annotation" and "dur" in e]
    step_ranges = sorted(
        (e for e in ranges if e["name"].startswith(STEP_RANGE)), key=lambda e: e["ts"]
    )[-steps:]
    compute_ranges = [e for e in ranges if e["name"] in pipeline.COMPUTE_RANGES]
    launches = {  # NCCL and Triton launch through the driver API, ATen through the runtime's
        e["args"]["correlation"]: e["ts"]
        for e in trace
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    device_work = [e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = [
        (launches[e["args"]["correlation"]], e)
        for e in device_work
        if e.get("args", {}).get("correlation") in launches
    ]
    unattributed = len(device_work) - len(kernels)

    def inside(ts: float, r: dict) -> bool:
        return r["ts"] <= ts <= r["ts"] + r["dur"]

    agreements = [r for r in ranges if r["name"] == engine.AGREE_RANGE]

    def training_collective(launch: float) -> bool:
        """Not the step's bookkeeping all-reduce (loss, stop flag), which meshtrain does not time."""
        return not any(inside(launch, r) for r in agreements)

    out = []
    for step in step_ranges:
        own_ranges = [r for r in compute_ranges if inside(r["ts"], step)]
        if not kernels:  # CPU: the ranges themselves, and gloo's record of each collective's run
            gloo = [
                (r["ts"], r["ts"] + r["dur"])
                for r in ranges
                if r["name"].startswith("gloo:")
                and inside(r["ts"], step)
                and training_collective(r["ts"])
            ]
            out.append(
                {
                    "step": step["dur"] / 1e6,
                    "compute": sum(r["dur"] for r in own_ranges) / 1e6,
                    "allreduce": _union(gloo) / 1e6,
                    "allreduce_calls": len(gloo),
                }
            )
            continue
        mine = [k for launch, k in kernels if inside(launch, step)]
        spans = []
        for r in own_ranges:
            launched = [k for launch, k in kernels if inside(launch, r)]
            if launched:
                first = min(k["ts"] for k in launched)
                spans.append(max(k["ts"] + k["dur"] for k in launched) - first)
        nccl = [
            (k["ts"], k["ts"] + k["dur"])
            for launch, k in kernels
            if inside(launch, step) and "nccl" in k["name"].lower() and training_collective(launch)
        ]
        out.append(
            {
                "step": (max(k["ts"] + k["dur"] for k in mine) - min(k["ts"] for k in mine)) / 1e6,
                "compute": sum(spans) / 1e6,
                "allreduce": _union(nccl) / 1e6,
                "allreduce_calls": len(nccl),
            }
        )
    return out, unattributed


def compare(ours: list[dict[str, float]], theirs: list[dict[str, float]]) -> dict[str, Any]:
    """Totals over the profiled steps and the relative difference of each quantity; for the
    all-reduces also how many calls each side counted (one kernel or gloo run per collective)."""
    report: dict[str, Any] = {"steps": len(ours)}
    for key in ("step", "compute", "allreduce"):
        mine, profiled = sum(o[key] for o in ours), sum(t[key] for t in theirs)
        relative = abs(mine - profiled) / profiled if profiled > 0 else None
        report[key] = {
            "meshtrain_seconds": mine,
            "profiler_seconds": profiled,
            "relative_difference": relative,
            "within_tolerance": None if relative is None else relative <= PROFILE_TOLERANCE,
        }
    report["allreduce"]["calls"] = {
        "meshtrain": sum(o["allreduce_calls"] for o in ours),
        "profiler": sum(t["allreduce_calls"] for t in theirs),
    }
    return report


def _init(device_kind: str) -> torch.device:
    """Join torchrun's process group, or make a world of one."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(pick_free_port()),
        )
    cuda = device_kind == "cuda"
    device = mesh_mod.device_for(int(os.environ.get("LOCAL_RANK", "0")), use_cuda=cuda)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    mesh_mod.init_process_group(use_cuda=cuda)
    return device


def _compiled_label(row: dict[str, Any]) -> str:
    """no, yes, or partly: some frames failed to compile and ran eagerly (how many is in the row)."""
    if not row["compiled"]:
        return "no"
    return "partly" if row["compile_fallbacks"] else "yes"


def _print_row(row: dict[str, Any]) -> None:
    memory = f"{row['peak_memory_gib']:.1f}" if row["peak_memory_gib"] is not None else "-"
    print(
        f"{row['preset']:<10} {row['params'] / 1e6:>7.0f}M {row['gpus']:>4} "
        f"{row['micro_batches']:>2}x{row['micro_batch']}x{row['seq_len']:<5} "
        f"{row['median_step_seconds']:>7.3f} {row['tokens_per_second']:>11,.0f} {row['mfu']:>6.1%} "
        f"{memory:>8} {_compiled_label(row):>8}"
    )
    print(f"    MFU counting the causal half of attention: {row['mfu_causal']:.1%}")
    print(f"    built in {row['build_seconds']:.1f} s, warm-up steps {row['warmup_seconds']:.1f} s")
    _print_memory(row["memory"])
    _print_profile(row)


def _print_memory(mem: dict[str, Any]) -> None:
    if "error" in mem:
        print(f"    memory: no report ({mem['error']})")
        return
    parts = [f"planned peak {mem['planned_peak_gib']:.2f} GiB"]
    if "device_memory_gib" in mem:
        parts.append(
            f"device {mem['device_memory_gib']:.2f} GiB, outside PyTorch's allocator "
            f"{mem['outside_tensors_gib']:.2f} GiB, allocator peak {mem['peak_reserved_gib']:.2f} GiB"
        )
    if "profile" in mem:
        parts.append(
            f"profile {mem['profile']['name']}: {mem['profile']['memory_gib']:.2f} GiB, "
            f"{mem['profile']['reserved_gib']:.2f} GiB reserved"
        )
    print("    memory: " + "; ".join(parts))


def _print_profile(row: dict[str, Any]) -> None:
    if "profile" in row:
        print(
            f"    profiled steps' median {row['profile']['median_step_seconds']:.3f}s "
            f"(bare {row['median_step_seconds']:.3f}s)"
        )
        if row["profile"]["unattributed_kernels"]:
            print(
                f"    WARNING: {row['profile']['unattributed_kernels']} kernels had no launch "
                "in the trace and are left out of the profiler's side"
            )
    for key, check in row.get("profile", {}).items():
        if isinstance(check, dict):
            rel = check["relative_difference"]
            print(
                f"    {key:<9} meshtrain {check['meshtrain_seconds']:.4f}s  profiler "
                f"{check['profiler_seconds']:.4f}s  "
                + (
                    "-"
                    if rel is None
                    else f"{rel:.1%} ({'ok' if check['within_tolerance'] else 'OVER 5%'})"
                )
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with ``--presets`` and ``--micro-batch`` checked against the presets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=None, help="default: 125m 350m 1.3b (GPU)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after 3 warm-up steps)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--micro-batch", nargs="*", default=[], metavar="PRESET=N")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument(
        "--selective-recompute", nargs="*", default=[], choices=list(gpt.RECOMPUTABLE)
    )
    parser.add_argument(
        "--profile", action="store_true", help="check the timings against torch.profiler"
    )
    parser.add_argument(
        "--float8", choices=["tensorwise", "rowwise"], default=None, help="training.float8's recipe"
    )
    parser.add_argument("--layers", type=int, default=0, help="the presets' depth (0: theirs)")
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    args = parser.parse_args(argv)
    known = sorted(MICRO_BATCH)
    for preset in args.presets or ():
        if preset not in MICRO_BATCH:
            parser.error(f"--presets {preset}: not one of {known}")
    sizes = dict(MICRO_BATCH)
    for item in args.micro_batch:
        preset, _, n = item.partition("=")
        if preset not in MICRO_BATCH or not n.isdigit() or int(n) < 1:
            parser.error(f"--micro-batch {item}: want PRESET=N, N >= 1, PRESET one of {known}")
        sizes[preset] = int(n)
    args.sizes = sizes
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.presets is None:
        if args.device != "cuda":  # `python -m benchmarks` on a CPU machine: nothing to measure
            print(
                "no GPU: MFU benchmark skipped (harness check on CPU: --device cpu --presets tiny)"
            )
            return 0
        args.presets = ["125m", "350m", "1.3b"]
    device = _init(args.device)
    rank0 = dist.get_rank() == 0
    if rank0:
        print(
            f"{'preset':<10} {'params':>8} {'gpus':>4} {'m x b x T':>12} {'step s':>7} "
            f"{'tokens/s':>11} {'MFU':>6} {'mem GiB':>8} {'compiled':>8}"
        )
    rows = []
    for preset in args.presets:
        try:
            row = run_preset(preset, args.sizes[preset], args, device)
        except float8.Float8Unavailable as err:  # the trainer's own refusal, as a job would see it
            print(err, file=sys.stderr)
            dist.destroy_process_group()
            return exitcodes.SPEC
        rows.append(row)
        if rank0:
            _print_row(row)
    dist.destroy_process_group()
    if rank0:
        described = machine.describe()
        named = described.get("gpu") if args.device == "cuda" else described.get("cpu_model")
        path = machine.write_results(
            "mfu" if args.device == "cuda" else "mfu-cpu-harness",
            {"device": args.device, "device_name": named, "rows": rows},
        )
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
