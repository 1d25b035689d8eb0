"""Calibration's step-loop run: a short ``meshtrain run`` of the job's own layout, and what its trace says.

What happens between the micro-benchmarks' pieces in a real step (the Python step loop,
telemetry, gloo's threads, a tensor-parallel call waiting for its peer, a pipeline message
waiting for a core) only a run of the trainer shows (:mod:`meshtrain.trainer.telemetry.loop_trace`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml

from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.planner import estimate, parameters, profiles
from meshtrain.planner.timing import cpu_host, network
from meshtrain.trainer import launch
from meshtrain.trainer.telemetry import loop_trace, steplog, trace

LOOP_STEPS = 6
"""Steps of the small run that measures the step loop's CPU cost; the first half are warm-up."""

LOOP_ACTION_FLOPS = 2e9
"""Forward FLOPs of one block on one micro-batch in that run, at most (about 20 ms on a CPU core)."""


def loop_batch(job: api_spec.TrainingJobSpec) -> tuple[int, int]:
    """Micro-batch and sequence length of the step-loop run: the job's, shrunk to :data:`LOOP_ACTION_FLOPS`.

    At the job's sizes the messages between pipeline stages are the job's:
    posting them and gloo's copies of them are most of what a stage does
    between its actions (with micro-batch 1 and 16 tokens the run measured
    a third of a real run's time outside every event).  A block too large
    for the budget keeps its width and runs fewer tokens: micro-batch first,
    then sequence length (a multiple of the tensor degree).
    """
    shape = job.model.shape()
    tensor = job.parallelism.tensor
    tokens = max(tensor, int(LOOP_ACTION_FLOPS // (2 * parameters.layer_params(shape, tensor))))
    micro = max(1, min(job.training.micro_batch, tokens // shape.seq_len))
    seq = (
        shape.seq_len if micro * shape.seq_len <= tokens else max(tensor, tokens // tensor * tensor)
    )
    return micro, seq


def loop_job(job: api_spec.TrainingJobSpec, checkpoints: str) -> dict[str, Any]:
    """The spec of a short run of ``job``'s layout with one block per stage at :func:`loop_batch`'s sizes.

    Same ranks, groups, schedule, micro-batches and telemetry as the job, so
    its step loop costs what the job's does; its tensor work is one block per
    stage, its tensor-parallel calls serial.  It reads the bundled corpus and starts from random weights, so it
    runs wherever the plan is made.
    """
    raw = job.model_dump(by_alias=True, exclude_none=True)
    par = job.parallelism
    raw["model"]["layers"] = par.pipeline * par.virtual_stages
    micro, raw["model"]["seqLen"] = loop_batch(job)
    raw["model"].pop("init", None)  # random weights: an imported checkpoint has other shapes
    # The bundled corpus: the job's token files need not exist where the plan is made.
    raw["training"].update(microBatch=micro, steps=LOOP_STEPS, warmupSteps=1, dataset="stdlib")
    for key in ("eval", "datasets", "globalBatch"):  # the global batch follows the micro-batch
        raw["training"].pop(key, None)
    raw["checkpoint"] = {"path": checkpoints, "intervalSteps": 0}
    raw["resources"] = {**raw.get("resources", {}), "gpusPerNode": job.world_size}
    # each tensor-parallel call blocks, so it times its own wall and CPU seconds (the planner
    # prices what parallelism.overlap.tensor hides of them)
    overlap = raw["parallelism"].get("overlap", {})
    raw["parallelism"]["overlap"] = {**overlap, "tensor": False}
    return raw


def run(job: api_spec.TrainingJobSpec) -> dict[str, Any]:
    """Run :func:`loop_job` with ``meshtrain run`` (all ranks on this host, as the job would) and read its figures.

    Rank 0's CPU seconds per step after warm-up (``cpu_seconds`` of the step
    log: every thread of the process), the trace's seconds outside every
    event per rank, the tensor-parallel calls and the pipeline messages.
    """
    with tempfile.TemporaryDirectory() as tmp:
        raw = loop_job(job, str(Path(tmp) / "checkpoints"))
        path = Path(tmp) / "loop.yaml"
        document = {"apiVersion": "meshtrain.io/v1alpha1", "kind": "TrainingJob"}
        path.write_text(
            yaml.safe_dump({**document, "metadata": {"name": "calibrate-loop"}, "spec": raw})
        )
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = launch.run_local(path, log_dir=Path(tmp) / "log")
        if code:
            raise RuntimeError(f"the step-loop run of calibration failed with exit code {code}")
        records = steplog.read(Path(tmp) / "log" / steplog.FILENAME)
        traces = trace.read_trace(Path(tmp) / "log")
    loop = loading.parse_spec(raw, "calibration step-loop run")
    steady_traces = {rank: lines[LOOP_STEPS // 2 :] for rank, lines in sorted(traces.items())}
    steady_lines = [line for lines in steady_traces.values() for line in lines]
    return {
        "rank0_cpu_seconds": [float(r["cpu_seconds"]) for r in records[LOOP_STEPS // 2 :]],
        # Where the loop's time goes: outside every recorded event (between actions) or not.
        "outside_events_seconds": {
            rank: statistics.median(loop_trace.outside_events(line["events"]) for line in lines)
            for rank, lines in steady_traces.items()
        },
        "actions": statistics.median(
            sum(e["what"] == "compute" for e in line["events"]) for line in traces.get(0, [])
        )
        if traces.get(0)
        else 0,
        "tp_calls": loop_trace.tp_calls(steady_lines),
        # Each in-flight pipeline message's latency, by what it carried.
        "messages": loop_trace.message_latencies(steady_lines),
        "layers": loop.model.shape().layers,
        "seq_len": loop.model.shape().seq_len,
    }


def rank_step_cpu(
    job: api_spec.TrainingJobSpec, profile: profiles.Profile, loop_run: dict[str, Any]
) -> tuple[float, float]:
    """CPU seconds a rank's step loop costs per step beyond what ``profile`` prices, and what it prices.

    Rank 0's median CPU seconds per step in ``loop_run`` (:func:`run`) less
    the planner's CPU work of rank 0 (a stage-0 rank) in that run at
    ``profile``: what remains is the Python step loop, telemetry and gloo's
    threads, which grow with the number of ranks sharing the cores.
    """
    loop = loading.parse_spec(loop_job(job, "/unused"), "calibration step-loop run")
    predicted = estimate.make_plan(loop, profile).time.rank_cpu_seconds[0]
    return max(0.0, statistics.median(loop_run["rank0_cpu_seconds"]) - predicted), predicted


def in_situ_tp_fits(
    calls: dict[str, dict[str, float]], tensor: int, profile: profiles.Profile
) -> tuple[profiles.CollectiveFit, ...]:
    """Fits of the tensor-parallel ops whose calls the step-loop run timed: the calibrated bandwidths, per-call costs from the calls.

    Alpha is what makes the ring formula's sum over the calls their measured
    wall seconds: a call after the trainer's own compute waits for its peer
    to arrive and be woken, which the micro-benchmark after one GEMM
    reproduces poorly (docs/planner.md, Limits).  Where calls recorded the
    CPU their process spent over them (none of its asynchronous collectives
    in flight), ``cpu_call_seconds`` likewise makes ``calls x cpu_call +
    bytes / cpu_bandwidth`` their CPU, which the micro-benchmark under-counts
    too (docs/planner.md, Calibration).
    """
    fits = []
    for op, total in sorted(calls.items()):
        measured = profile.collective_fit(op, tensor)
        if measured is None or tensor < 2 or not total["calls"]:
            continue
        moving = network.bus_factor(op, tensor) * total["bytes"] / measured.bandwidth
        steps = network.ring_steps(op, tensor) * total["calls"]
        fit = dataclasses.replace(
            measured, members=tensor, alpha=max(0.0, total["seconds"] - moving) / steps
        )
        if total.get("cpu_calls") and measured.cpu_bandwidth > 0:
            copying = total["cpu_bytes"] / measured.cpu_bandwidth
            cpu_call = max(0.0, total["cpu_seconds"] - copying) / total["cpu_calls"]
            fit = dataclasses.replace(fit, cpu_call_seconds=cpu_call)
        fits.append(fit)
    return tuple(fits)


def between_share(
    loop_run: dict[str, Any],
    loop: api_spec.TrainingJobSpec,
    profile: profiles.Profile,
    loop_cpu: float,
) -> float:
    """Share of the step loop's CPU seconds (``loop_cpu``) a rank spends outside every recorded event.

    ``loop_run`` holds the step-loop run's wall seconds outside events per
    rank; the median rank's, at the CPU rate a rank gets while all of the
    job's ranks are runnable (:func:`~meshtrain.planner.timing.cpu_host.sharing`),
    is CPU seconds.  1 (all between actions) where nothing was measured.
    """
    outside = loop_run.get("outside_events_seconds") or {}
    if not outside or loop_cpu <= 0:
        return 1.0
    rate = cpu_host.sharing(loop, profile).rate(loop.world_size)
    return min(1.0, statistics.median(float(v) for v in outside.values()) * rate / loop_cpu)


def message_seconds(loop_run: dict[str, Any], kind: str) -> float:
    """Mean latency of the step-loop run's in-flight ``kind`` messages (``activations``/``gradients``; 0: none).

    The mean, not the median: the window pays the sum of its exposed hops, and
    the slow ones are those the host's load delayed.
    """
    samples = loop_run.get("messages", {}).get(kind) or []
    return statistics.fmean(samples) if samples else 0.0
