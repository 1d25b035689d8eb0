"""Planner: predicted against measured step time on this machine (CPU, gloo).

What it does:

1. Calibrates the ``cpu`` profile here: achievable FLOP/s per rank from a
   timed matmul of the benchmark model's MLP shape (with the thread count
   ``meshtrain run`` gives each rank, shared cores accounted for), memory
   bandwidth from a large tensor copy, and gloo's alpha/beta from a
   two-process ping-pong fitted to ``T(M) = alpha + M / B``.
2. Trains several layouts of a small GPT with the trainer's ``run_local``
   (real processes, gloo) and takes the median step time after warm-up.
3. Prints predicted against measured step time (and the ratio) for each
   layout, and writes everything to ``benchmarks/results/planner-<host>.json``.

Run: ``python benchmarks/bench_planner.py [--steps N] [--quick]``.
Timings on shared machines are noisy: read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import machine  # noqa: E402
from meshtrain.api import loading  # noqa: E402
from meshtrain.controlplane.ports import pick_free_port
from meshtrain.planner import estimate, profiles  # noqa: E402
from meshtrain.trainer import launch, steplog  # noqa: E402

MODEL = {"preset": "tiny", "layers": 4, "hidden": 128, "heads": 4, "seqLen": 128}
TRAINING = {"microBatch": 4, "precision": "fp32", "dataset": "stdlib", "warmupSteps": 1}
LAYOUTS = [
    # (name, parallelism)
    ("single", {}),
    ("dp2", {"data": 2}),
    ("tp2", {"tensor": 2}),
    ("pp2-1f1b", {"pipeline": 2}),
    ("pp2-gpipe", {"pipeline": 2, "schedule": "gpipe"}),
    ("dp2-tp2", {"data": 2, "tensor": 2}),
    ("pp2-tp2", {"pipeline": 2, "tensor": 2}),
    ("dp2-pp2", {"data": 2, "pipeline": 2}),
]
PING_SIZES = [4, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22]


# --- calibration ------------------------------------------------------------------------------


def matmul_flops(rows: int, inner: int, cols: int, threads: int, seconds: float = 1.0) -> float:
    """FLOP/s of ``(rows x inner) @ (inner x cols)`` forward-and-backward-like matmuls with ``threads`` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(rows, inner), torch.randn(inner, cols)
        for _ in range(5):
            a @ b
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            count += 1
        elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(previous)
    return 2 * rows * inner * cols * count / elapsed


def copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 10) -> float:
    """Bytes/s of a large tensor copy (read + write counted)."""
    src = torch.empty(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def _ping_pong(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    times = {}
    for size in PING_SIZES:
        buf = torch.zeros(max(1, size // 4))
        for _ in range(3):
            (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)
            (dist.recv if rank == 0 else dist.send)(buf, 1 - rank)
        repeats = 50 if size < (1 << 20) else 10
        start = time.perf_counter()
        for _ in range(repeats):
            (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)
            (dist.recv if rank == 0 else dist.send)(buf, 1 - rank)
        times[size] = (time.perf_counter() - start) / repeats / 2  # one way
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def gloo_alpha_beta() -> tuple[float, float, dict[int, float]]:
    """One-way message time ``alpha + M / B`` from a gloo ping-pong: (alpha, B, measured times)."""
    port = pick_free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "pingpong.json")
        mp.spawn(_ping_pong, args=(port, out), nprocs=2, join=True)
        times = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    # Robust on a loaded machine: alpha from the smallest message, beta from the largest.
    alpha = times[PING_SIZES[0]]
    largest = PING_SIZES[-1]
    bandwidth = largest / max(times[largest] - alpha, times[largest] * 0.1)
    return alpha, bandwidth, times


# --- runs -------------------------------------------------------------------------------------


def job_raw(parallelism: dict, steps: int, checkpoints: str = "runs/bench-planner-ckpt") -> dict:
    """A TrainingJob spec for one benchmark layout (all ranks on this host: one pod; fresh checkpoint dir)."""
    par = {"data": 1, "pipeline": 1, "tensor": 1, "microBatches": 4, "bucketMb": 1, **parallelism}
    world = par["data"] * par["pipeline"] * par["tensor"]
    return {
        "parallelism": par,
        "resources": {"gpusPerNode": world},
        "model": MODEL,
        "training": {**TRAINING, "steps": steps},
        "checkpoint": {"path": checkpoints, "intervalSteps": 0},
    }


def measure(raw: dict, workdir: Path, name: str) -> list[float]:
    """Step seconds of every step of a real ``run_local`` of the spec."""
    path = workdir / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "meshtrain.io/v1alpha1",
                "kind": "TrainingJob",
                "metadata": {"name": f"bench-{name}"},
                "spec": raw,
            }
        )
    )
    log_dir = workdir / name
    with contextlib.redirect_stdout(io.StringIO()):
        code = launch.run_local(path, log_dir=log_dir)
    if code:
        raise RuntimeError(f"run_local of {name} failed with exit code {code}; see {log_dir}")
    return [r["step_seconds"] for r in steplog.read(log_dir / steplog.FILENAME)]


def rank_flops_table(rows: int, hidden: int, ffn: int) -> dict[int, float]:
    """Best-of-three matmul FLOP/s for every thread count ``meshtrain run`` may give a rank."""
    cores = os.cpu_count() or 1
    counts = sorted({max(1, cores // world) for world in (1, 2, 4, 8)})
    return {
        t: max(matmul_flops(rows, hidden, ffn, t, seconds=0.3) for _ in range(3)) for t in counts
    }


def calibrated_profile(
    world: int, flops_by_threads: dict[int, float], alpha: float, bandwidth: float, mem_bw: float
) -> tuple[profiles.Profile, float]:
    """The cpu profile with this machine's figures for a job of ``world`` ranks on this host."""
    cores = os.cpu_count() or 1
    threads = max(1, cores // world)  # what meshtrain run gives each rank
    share = min(1.0, cores / (world * threads))  # ranks beyond the cores time-share them
    flops = flops_by_threads[threads] * share
    base = profiles.get("cpu")
    profile = profiles.calibrated(
        base, flops=flops, link_bandwidth=bandwidth, link_latency=alpha, name="cpu-calibrated"
    )
    return dataclasses.replace(profile, memory_bandwidth=mem_bw * share), flops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is warm-up)")
    parser.add_argument("--quick", action="store_true", help="only the first three layouts")
    args = parser.parse_args(argv)
    layouts = LAYOUTS[:3] if args.quick else LAYOUTS

    alpha, bandwidth, pings = gloo_alpha_beta()
    mem_bw = copy_bandwidth()
    probe = loading.parse_spec(job_raw({}, 1), "probe")
    probe_shape = probe.model.shape()
    flops_by_threads = rank_flops_table(
        probe.training.micro_batch * probe_shape.seq_len, probe_shape.hidden, probe_shape.ffn_hidden
    )
    print(
        f"gloo ping-pong: alpha {alpha * 1e6:.1f} us, bandwidth {bandwidth / 1e9:.2f} GB/s; "
        f"copy bandwidth {mem_bw / 1e9:.1f} GB/s; {os.cpu_count()} cores; matmul GFLOP/s by threads "
        + ", ".join(f"{t}: {f / 1e9:.1f}" for t, f in flops_by_threads.items())
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, parallelism in layouts:
            raw = job_raw(parallelism, args.steps, str(Path(tmp) / name / "checkpoints"))
            job = loading.parse_spec(raw, name)
            profile, flops = calibrated_profile(
                job.world_size, flops_by_threads, alpha, bandwidth, mem_bw
            )
            plan = estimate.make_plan(job, profile)
            steps = measure(raw, Path(tmp), name)
            measured = statistics.median(steps[1:] or steps)
            worst = plan.time.worst
            rows.append(
                {
                    "layout": name,
                    "spec_layout": job.parallelism.layout_string,
                    "schedule": job.parallelism.schedule,
                    "world_size": job.world_size,
                    "rank_flops": flops,
                    "predicted_step_seconds": plan.time.step_seconds,
                    "measured_step_seconds": measured,
                    "ratio_measured_over_predicted": measured / plan.time.step_seconds,
                    "predicted_compute_seconds": worst.compute,
                    "predicted_tp_seconds": worst.tp,
                    "predicted_pp_seconds": worst.pp,
                    "predicted_dp_seconds": worst.dp,
                    "predicted_bubble": plan.time.bubble,
                    "measured_steps": steps,
                }
            )
            print(
                f"  {name:<10} predicted {plan.time.step_seconds * 1e3:8.1f} ms  measured {measured * 1e3:8.1f} ms  "
                f"ratio {measured / plan.time.step_seconds:5.2f}",
                flush=True,
            )

    header = (
        f"{'layout':<10} {'world':>5} {'predicted ms':>12} {'measured ms':>11} {'meas/pred':>9} "
        f"{'compute ms':>10} {'tp ms':>7} {'pp ms':>7} {'dp ms':>7} {'bubble':>6}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['layout']:<10} {r['world_size']:>5} {r['predicted_step_seconds'] * 1e3:>12.1f} "
            f"{r['measured_step_seconds'] * 1e3:>11.1f} {r['ratio_measured_over_predicted']:>9.2f} "
            f"{r['predicted_compute_seconds'] * 1e3:>10.1f} {r['predicted_tp_seconds'] * 1e3:>7.1f} "
            f"{r['predicted_pp_seconds'] * 1e3:>7.1f} {r['predicted_dp_seconds'] * 1e3:>7.1f} "
            f"{r['predicted_bubble']:>6.2f}"
        )
    ratios = [r["ratio_measured_over_predicted"] for r in rows]
    print(
        f"\nmeasured/predicted: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}..{max(ratios):.2f}"
    )
    path = machine.write_results(
        "planner",
        {
            "model": MODEL,
            "training": TRAINING,
            "steps": args.steps,
            "calibration": {
                "gloo_alpha_seconds": alpha,
                "gloo_bandwidth_bytes_per_second": bandwidth,
                "ping_pong_one_way_seconds": pings,
                "copy_bandwidth_bytes_per_second": mem_bw,
                "matmul_flops_by_threads": flops_by_threads,
            },
            "layouts": rows,
            "summary": {
                "median_ratio": statistics.median(ratios),
                "min_ratio": min(ratios),
                "max_ratio": max(ratios),
            },
        },
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
