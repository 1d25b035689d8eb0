"""Planner validation: predicted against measured step time and bubble, layout by layout, on this machine.

For each layout it does what a user would: ``meshtrain plan --calibrate``
(:func:`meshtrain.trainer.calibration.measure.calibrate` at the job's shapes, group
sizes and process count), the plan with that profile, then ``meshtrain run``
of the same spec (real processes, gloo), and compares the median step time
after warm-up and the bubble the trainer measured on stage 0.  Then it asks
``--search`` for the fastest layouts of ``--search-world`` ranks on this host
and runs the top three, to see whether the top pick is the fastest measured.

It prints the table and writes ``benchmarks/results/planner_time-<host>.json``
(rows: ``layout``, ``predicted_step_seconds``, ``measured_step_seconds``,
ratio, bubbles, the load average around each run) and, from the same numbers,
the error band the plan report quotes (``meshtrain/planner/validation.json``).
It is the planner's validation tier: it exits 1, naming the miss, when a
layout of :data:`REQUIRED` is outside a target.

Run: ``python benchmarks/bench_planner_time.py [--steps N] [--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import io
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks import hostload, machine
from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.planner import estimate, profiles, search, validation
from meshtrain.trainer import launch
from meshtrain.trainer.calibration import measure, step_loop
from meshtrain.trainer.telemetry import loop_trace, recording, steplog, stepstats, trace

MODEL = {"preset": "tiny", "layers": 4, "hidden": 128, "heads": 4, "seqLen": 128}
TRAINING = {"microBatch": 4, "precision": "fp32", "dataset": "stdlib", "warmupSteps": 1}
LAYOUTS: list[tuple[str, dict[str, Any]]] = [
    ("dp2", {"data": 2}),
    ("tp2", {"tensor": 2}),
    ("pp2-gpipe", {"pipeline": 2, "schedule": "gpipe"}),
    ("pp2-1f1b", {"pipeline": 2, "schedule": "1f1b"}),
    ("dp2-zero1", {"data": 2, "zeroStage": 1}),
    ("dp2-zero2", {"data": 2, "zeroStage": 2}),
    ("pp2-1f1b-m8", {"pipeline": 2, "microBatches": 8}),
    ("dp2-tp2", {"data": 2, "tensor": 2}),
    ("dp2-pp2", {"data": 2, "pipeline": 2}),
    ("dp2-pp2-tp2-sp", {"data": 2, "pipeline": 2, "tensor": 2, "sequenceParallel": True}),
]
CALIBRATION_S = 0.3
"""Seconds per calibration measurement (``--calibration-seconds``)."""
WARMUP_STEPS = 2
"""Steps dropped before the median (process-group set-up, first allocations, lazy inits)."""
TARGET_RATIO = 0.25
"""Predicted within 25% of measured (|measured / predicted - 1|)."""
TARGET_BUBBLE = 0.05
"""Predicted stage-0 bubble within 0.05 of the measured one."""
REQUIRED = ("dp2", "tp2", "pp2-gpipe", "pp2-1f1b", "dp2-zero1", "dp2-zero2")
"""The layouts #20 names (dp, pp with gpipe and 1f1b, tp, ZeRO-1/2): a miss fails the run.

The others (more ranks than cores, 8 micro-batches, 3D) are measured and
reported beside them, and their misses are listed, but do not fail it.
"""


def job_raw(parallelism: dict[str, Any], steps: int, checkpoints: str) -> dict[str, Any]:
    """A TrainingJob spec of one layout, every rank on this host (one pod)."""
    par = {"data": 1, "pipeline": 1, "tensor": 1, "microBatches": 4, "bucketMb": 1, **parallelism}
    world = par["data"] * par["pipeline"] * par["tensor"]
    return {
        "parallelism": par,
        "resources": {"gpusPerNode": world},
        "model": MODEL,
        "training": {**TRAINING, "steps": steps},
        "checkpoint": {"path": checkpoints, "intervalSteps": 0},
    }


def measured_run(
    raw: dict[str, Any], workdir: Path, name: str
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Every steps.jsonl record of a real ``meshtrain run`` of the spec, and the host over its steady steps.

    The host figures (:mod:`benchmarks.hostload`) cover the steps after
    warm-up: the cores other tenants left to the job, the job's CPU seconds,
    the load average; ``median_steps`` the same over the steps the median step
    time is made of, ``per_step`` each steady step's.
    """
    path = workdir / f"{name}.yaml"
    document = {
        "apiVersion": "meshtrain.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": f"bench-{name}"},
        "spec": raw,
    }
    path.write_text(yaml.safe_dump(document))
    log_dir = workdir / name
    with hostload.Sampler() as sampler, contextlib.redirect_stdout(io.StringIO()):
        code = launch.run_local(path, log_dir=log_dir)
    if code:
        raise RuntimeError(f"meshtrain run of {name} failed with exit code {code}; see {log_dir}")
    records = steplog.read(log_dir / steplog.FILENAME)
    cores = os.cpu_count() or 1
    start = records[WARMUP_STEPS - 1]["time"] if len(records) > WARMUP_STEPS else records[0]["time"]
    host: dict[str, Any] = sampler.window(start, records[-1]["time"], cores)
    steady = records[WARMUP_STEPS:] or records
    host["steps"] = len(steady)
    host["median_steps"] = sampler.spans([_span(r) for r in median_steps(steady)], cores) | {
        "steps": [r["step"] for r in median_steps(steady)]
    }
    host["per_step"] = [
        {"step": r["step"], "step_seconds": r["step_seconds"]} | sampler.spans([_span(r)], cores)
        for r in steady
    ]
    traces = trace.read_trace(log_dir)
    host["trace_breakdown"] = {
        rank: breakdown(lines[WARMUP_STEPS:] or lines) for rank, lines in sorted(traces.items())
    }
    host["stage0_bubble"] = stage0_bubble(traces)
    return records, host


def stage0_bubble(traces: dict[int, list[dict[str, Any]]]) -> float:
    """Median over the steady steps of the median bubble of stage 0's ranks.

    Every data- and tensor-parallel replica of stage 0 runs stage 0's
    schedule; which of them the scheduler delays is chance (on a host with
    more ranks than cores, two replicas of one step measured 0.31 and 0.20),
    so the stage's bubble is their median, not rank 0's alone.
    """
    by_step: dict[int, list[float]] = {}
    for lines in traces.values():
        for line in lines[WARMUP_STEPS:] or lines:
            if line.get("pp", 0) == 0:
                by_step.setdefault(line["step"], []).append(float(line.get("bubble_ratio", 0.0)))
    return statistics.median(statistics.median(values) for values in by_step.values())


def breakdown(lines: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds per step of one rank's pipeline window by what it was doing (its trace lines).

    ``compute``, ``wait`` (blocked on a pipeline message), ``collective`` and
    ``outside_events`` (the step loop between recorded events), up to the
    rank's last event, as the trainer's bubble counts them.
    """
    figures: dict[str, list[float]] = {}
    for line in lines:
        events = line["events"]
        row = {
            "window": max((float(e["end"]) for e in events), default=0.0),
            "compute": stepstats.union_seconds(
                (e["start"], e["end"]) for e in events if e["what"] == "compute"
            ),
            "wait": sum(  # the pipeline's waits (a tp wait is inside its collective)
                e["end"] - e["start"]
                for e in events
                if e["what"] == "wait" and e["kind"] in recording.PIPELINE_WAITS
            ),
            "collective": sum(e["end"] - e["start"] for e in events if e["what"] == "collective"),
            "outside_events": loop_trace.outside_events(events),
            "actions": sum(e["what"] == "compute" for e in events),
            "bubble": float(line.get("bubble_ratio", 0.0)),
        }
        for key, value in row.items():
            figures.setdefault(key, []).append(float(value))
    return {key: statistics.median(values) for key, values in figures.items()}


def _span(record: dict[str, Any]) -> tuple[float, float]:
    """A step's (start, end) on the step log's clock: the record is written as the step ends."""
    return record["time"] - record["step_seconds"], record["time"]


def median_steps(steady: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps the median step time is made of: the middle one, or the middle two of an even count."""
    ordered = sorted(steady, key=lambda r: r["step_seconds"])
    return ordered[(len(ordered) - 1) // 2 : len(ordered) // 2 + 1]


def bracketed(before: profiles.Profile, after: profiles.Profile) -> profiles.Profile:
    """Geometric means of two calibrations taken just before and just after a run.

    The host's other load changes by the minute; bracketing the run follows it
    better than either calibration alone.
    """

    def mean(a: float, b: float) -> float:
        return (a * b) ** 0.5

    return dataclasses.replace(
        before,
        peak_flops=mean(before.peak_flops, after.peak_flops),
        op_overhead=mean(before.op_overhead, after.op_overhead),
        core_flops=mean(before.core_flops, after.core_flops),
        core_op_overhead=mean(before.core_op_overhead, after.core_op_overhead),
        available_cores=mean(before.available_cores, after.available_cores),
        rank_step_cpu_seconds=(before.rank_step_cpu_seconds + after.rank_step_cpu_seconds) / 2,
        step_loop_between_share=(before.step_loop_between_share + after.step_loop_between_share)
        / 2,
        flops_by_ranks={
            r: mean(f, after.flops_by_ranks.get(r, f)) for r, f in before.flops_by_ranks.items()
        },
        collectives=_mean_fits(before.collectives, after.collectives),
        tp_collectives=_mean_fits(before.tp_collectives, after.tp_collectives),
        activation_message_seconds=_mean_measured(
            before.activation_message_seconds, after.activation_message_seconds
        ),
        gradient_message_seconds=_mean_measured(
            before.gradient_message_seconds, after.gradient_message_seconds
        ),
        calibration={**before.calibration, "bracketed_by": after.calibration["measured_at"]},
    )


def _mean_measured(before: float, after: float) -> float:
    """Mean of the calibrations that measured a figure (0: unmeasured, by neither)."""
    measured = [x for x in (before, after) if x > 0]
    return sum(measured) / len(measured) if measured else 0.0


def _mean_fits(
    before: tuple[profiles.CollectiveFit, ...], after: tuple[profiles.CollectiveFit, ...]
) -> tuple[profiles.CollectiveFit, ...]:
    """Geometric means of the fits both calibrations measured, op by op and group size."""

    def mean(a: float, b: float) -> float:
        return (a * b) ** 0.5

    fits = {(f.op, f.members): f for f in after}
    return tuple(
        dataclasses.replace(
            f,
            alpha=mean(f.alpha, fits[(f.op, f.members)].alpha),
            bandwidth=mean(f.bandwidth, fits[(f.op, f.members)].bandwidth),
            cpu_call_seconds=mean(f.cpu_call_seconds, fits[(f.op, f.members)].cpu_call_seconds),
            cpu_bandwidth=mean(f.cpu_bandwidth, fits[(f.op, f.members)].cpu_bandwidth),
        )
        for f in before
        if (f.op, f.members) in fits
    )


def _median(records: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r.get(key) or 0.0) for r in records)


def validate_layout(name: str, parallelism: dict[str, Any], steps: int, tmp: Path) -> dict:
    """Calibrate, run, calibrate again and plan one layout; the row of the results file.

    The step is predicted at the cores other tenants left to the job during
    the steps its median step time is made of (:func:`median_steps`; measured
    beside the run), so both sides of the ratio describe the same seconds; the
    cores over all steady steps and the prediction at the calibrations' cores
    are kept too (:func:`predictions`).
    """
    raw = job_raw(parallelism, steps, str(tmp / name / "checkpoints"))
    job = loading.parse_spec(raw, name)
    load_before = measure.load_average()
    before = measure.calibrate(job, profiles.get("cpu"), f"cpu-{name}", budget=CALIBRATION_S)
    records, host = measured_run(raw, tmp, name)
    after = measure.calibrate(job, profiles.get("cpu"), f"cpu-{name}", budget=CALIBRATION_S)
    calibrated = bracketed(before, after)
    steady = records[WARMUP_STEPS:] or records
    row = {
        "layout": name,
        "spec_layout": job.parallelism.layout_string,
        "schedule": job.parallelism.schedule,
        "zero_stage": job.parallelism.zero_stage,
        "micro_batches": job.parallelism.micro_batches,
        "world_size": job.world_size,
        "measured_step_seconds": statistics.median(r["step_seconds"] for r in steady),
        "measured_bubble": host["stage0_bubble"],
        "measured_bubble_rank0": _median(steady, "bubble_ratio"),
        "available_cores_run": host["median_steps"]["available_cores"],
        "available_cores_steady_steps": host["available_cores"],
        "measured_cpu_seconds": host["job_cpu_seconds"] / host["steps"],
        "measured_rank0_cpu_seconds": _median(steady, "cpu_seconds"),
        "measured_compute_seconds": _median(steady, "compute_seconds"),
        "measured_tp_seconds": _median(steady, "tp_allreduce_seconds"),
        "measured_dp_seconds": _median(steady, "allreduce_seconds"),
        "measured_exposed_comm_seconds": _median(steady, "exposed_comm_seconds"),
        "measured_update_seconds": _median(steady, "update_seconds"),
        "measured_steps": [r["step_seconds"] for r in records],
        "calibration": profiles.to_mapping(calibrated),
        "calibration_before_run": profiles.to_mapping(before),
        "host_during_run": host,
        "load_average_before": load_before,
        "load_average_after": measure.load_average(),
    }
    return row | predictions(job, calibrated, before, row)


def predictions(
    job: api_spec.TrainingJobSpec,
    calibrated: profiles.Profile,
    before: profiles.Profile,
    row: dict[str, Any],
) -> dict[str, Any]:
    """The predicted columns of a row.

    At the cores measured free during the run, at the calibrations' cores, and
    as a user would have it: from the calibration before the run alone, at
    the cores it measured.
    """
    plan = estimate.make_plan(
        job, dataclasses.replace(calibrated, available_cores=row["available_cores_run"])
    )
    at_calibration = estimate.make_plan(job, calibrated).time
    user = estimate.make_plan(job, before).time
    worst = plan.time.worst
    return {
        "predicted_step_seconds_before_run": user.step_seconds,
        "ratio_before_run": row["measured_step_seconds"] / user.step_seconds,
        "predicted_bubble_before_run": user.bubble_stage0,
        "predicted_step_seconds": plan.time.step_seconds,
        "ratio_measured_over_predicted": row["measured_step_seconds"] / plan.time.step_seconds,
        "predicted_bubble": plan.time.bubble_stage0,
        "theoretical_bubble": plan.time.bubble,
        "available_cores_calibration": calibrated.available_cores,
        "predicted_step_seconds_at_calibration_cores": at_calibration.step_seconds,
        "ratio_at_calibration_cores": row["measured_step_seconds"] / at_calibration.step_seconds,
        "predicted_bubble_at_calibration_cores": at_calibration.bubble_stage0,
        "work_bound": plan.time.work_bound,
        "predicted_dependency_seconds": plan.time.dependency_seconds,
        "predicted_cpu_seconds": plan.time.cpu_seconds,
        "predicted_rank_step_cpu_seconds": calibrated.rank_step_cpu_seconds,
        "predicted_step_loop_between_share": calibrated.step_loop_between_share,
        "predicted_compute_seconds": worst.compute,
        "predicted_overhead_seconds": worst.overhead,
        "predicted_tp_seconds": worst.tp,
        "predicted_pp_seconds": worst.pp,
        "predicted_dp_seconds": worst.dp,
        "predicted_dp_exposed_seconds": worst.dp_exposed,
        "predicted_optimizer_seconds": worst.optimizer,
        "oversubscription": plan.time.oversubscription,
    }


def repredict(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` (a results file) with every row's predictions made again by the current model.

    From what the file recorded (the layout, the bracketed calibration, the
    cores measured free during the run), so a model change is checked against
    existing measurements without running anything.  The ``--search`` rows are
    left as recorded (their calibration is not in the file).
    """
    results = document["results"]
    layouts = dict(LAYOUTS)
    rows = []
    for row in results["layouts"]:
        raw = job_raw(layouts[row["layout"]], results["steps"], "/nonexistent/checkpoints")
        job = loading.parse_spec(raw, row["layout"])
        calibrated = profiles.from_mapping(row["calibration"], f"{row['layout']} calibration")
        if "step_loop_between_share" not in row["calibration"]:
            # Recorded before the share was a profile field: derive it from the step-loop run.
            loop_run = row["calibration"]["calibration"].get("step_loop_run", {})
            calibrated = dataclasses.replace(
                calibrated,
                step_loop_between_share=step_loop.between_share(
                    loop_run, job, calibrated, calibrated.rank_step_cpu_seconds
                ),
            )
        before = (
            profiles.from_mapping(row["calibration_before_run"], f"{row['layout']} pre-run")
            if "calibration_before_run" in row
            else calibrated
        )
        rows.append(row | predictions(job, calibrated, before, row))
    summary = summarise(rows)
    repredicted = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return document | {
        "results": results | {"layouts": rows, "summary": summary},
        "repredicted_at": repredicted,
    }


def check_search(world: int, steps: int, tmp: Path) -> dict[str, Any]:
    """Rank layouts of ``world`` ranks on this host with --search --calibrate; run the three best distinct (dp, pp, tp).

    Variants of one grid (schedule, ZeRO stage) are predicted within a few
    per cent of each other, and which of them measures fastest is noise: the
    check is whether the planner orders different grids right.  As
    ``--search --calibrate`` does, the best grids are priced with a step
    loop measured on their own layout.
    """
    base = loading.parse_spec(job_raw({"data": world}, steps, str(tmp / "search-base")), "base")
    profile = measure.calibrate(base, profiles.get("cpu"), "cpu-search", budget=CALIBRATION_S)
    by_grid: dict[tuple[int, int, int], profiles.Profile] = {}

    def measure_grid(
        layout: api_spec.TrainingJobSpec, calibrated: profiles.Profile
    ) -> profiles.Profile:
        """``--search --calibrate``'s step-loop run of a grid, kept to predict its run again."""
        par = layout.parallelism
        by_grid[par.data, par.pipeline, par.tensor] = measure.measure_step_loop(layout, calibrated)
        return by_grid[par.data, par.pipeline, par.tensor]

    ranked: list[search.Candidate] = []
    for candidate in search.search(
        base, profile, world=world, nodes=None, limit=100, measure=measure_grid
    ):
        grid = [candidate.parallelism[k] for k in ("data", "pipeline", "tensor")]
        if all(grid != [c.parallelism[k] for k in ("data", "pipeline", "tensor")] for c in ranked):
            ranked.append(candidate)
    ranked = ranked[:3]
    rows = []
    for index, candidate in enumerate(ranked):
        name = f"search{index + 1}"
        layout = {k: v for k, v in candidate.parallelism.items() if k != "microBatch"}
        raw = job_raw(layout, steps, str(tmp / name / "checkpoints"))
        raw["training"]["microBatch"] = candidate.parallelism["microBatch"]
        records, host = measured_run(raw, tmp, name)
        steady = records[WARMUP_STEPS:] or records
        priced = by_grid.get(search.grid(candidate.parallelism), profile)
        at_run = estimate.make_plan(
            loading.parse_spec(raw, name),
            dataclasses.replace(priced, available_cores=host["median_steps"]["available_cores"]),
        ).time.step_seconds
        rows.append(
            {
                "rank": index + 1,
                "layout": candidate.label,
                "parallelism": candidate.parallelism,
                "predicted_step_seconds": candidate.step_seconds,
                "predicted_step_seconds_at_run_cores": at_run,
                "grid_measured": candidate.grid_measured,
                "measured_step_seconds": statistics.median(r["step_seconds"] for r in steady),
                "host_during_run": host,
            }
        )
    fastest = min(rows, key=lambda r: r["measured_step_seconds"]) if rows else None
    return {
        "world": world,
        "candidates": rows,
        "top_pick_is_fastest_measured": bool(fastest and fastest["rank"] == 1),
        "top_pick_over_fastest_measured": (
            rows[0]["measured_step_seconds"] / fastest["measured_step_seconds"] if rows else None
        ),
    }


def misses(rows: list[dict[str, Any]]) -> list[str]:
    """One line per target a layout missed: ``layout: step ratio 1.31`` or ``layout: bubble 0.19 vs 0.30``."""
    out = []
    for r in rows:
        piped = r["spec_layout"].split("·")[1] != "pp1"
        if abs(r["ratio_measured_over_predicted"] - 1) > TARGET_RATIO:
            out.append(f"{r['layout']}: step ratio {r['ratio_measured_over_predicted']:.2f}")
        if piped and abs(r["predicted_bubble"] - r["measured_bubble"]) > TARGET_BUBBLE:
            out.append(
                f"{r['layout']}: bubble {r['predicted_bubble']:.3f} predicted, "
                f"{r['measured_bubble']:.3f} measured"
            )
    return out


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Error band of the rows: the ratio's spread and how many meet the targets."""
    ratios = [r["ratio_measured_over_predicted"] for r in rows]
    errors = [abs(x - 1) for x in ratios]
    piped = [r for r in rows if r["spec_layout"].split("·")[1] != "pp1"]
    signed = [r["measured_bubble"] - r["predicted_bubble"] for r in piped]
    bubbles = [abs(b) for b in signed]
    return {
        "layouts": len(rows),
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "within_25_percent": sum(e <= TARGET_RATIO for e in errors),
        "pipeline_layouts": len(piped),
        "max_bubble_error": max(bubbles, default=0.0),
        "bubble_within_0_05": sum(b <= TARGET_BUBBLE for b in bubbles),
        "median_bubble_measured_minus_predicted": statistics.median(signed) if signed else 0.0,
        "within_25_percent_before_run": sum(
            abs(r["ratio_before_run"] - 1) <= TARGET_RATIO for r in rows if "ratio_before_run" in r
        ),
        "bubble_within_0_05_before_run": sum(
            abs(r["predicted_bubble_before_run"] - r["measured_bubble"]) <= TARGET_BUBBLE
            for r in piped
            if "predicted_bubble_before_run" in r
        ),
        "within_25_percent_at_calibration_cores": sum(
            abs(r["ratio_at_calibration_cores"] - 1) <= TARGET_RATIO for r in rows
        ),
        "cpu_work_ratio_min": min(
            r["measured_cpu_seconds"] / r["predicted_cpu_seconds"] for r in rows
        ),
        "cpu_work_ratio_max": max(
            r["measured_cpu_seconds"] / r["predicted_cpu_seconds"] for r in rows
        ),
        "load_during_runs": [
            min(r["host_during_run"]["load_min"] for r in rows),
            max(r["host_during_run"]["load_max"] for r in rows),
        ],
        "required_misses": misses([r for r in rows if r["layout"] in REQUIRED]),
        "other_misses": misses([r for r in rows if r["layout"] not in REQUIRED]),
    }


def markdown(document: dict[str, Any]) -> str:
    """The table and summary docs/planner.md shows, from a results file's document."""
    results, host = document["results"], document["machine"]
    rows, summary = results["layouts"], results["summary"]
    low, high = summary["load_during_runs"]
    lines = [
        f"Committed run (`benchmarks/results/planner_time-{host['host']}.json`, {document['time']}, "
        f"host {host['host']}, {host.get('cpu_model')}, {host['cpu_count']} cores; 1-minute load "
        f"average {low:.1f}–{high:.1f} during the measured steps, the job's own ranks included"
        + (
            f"; predictions re-made by `--repredict` at {document['repredicted_at']}"
            if "repredicted_at" in document
            else ""
        )
        + "):",
        "",
        "| layout | world | predicted s | measured s | measured/predicted | cores left to the job | "
        "predicted/measured CPU s per step | predicted bubble | measured bubble | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        run = r["host_during_run"]
        lines.append(
            f"| {r['layout']} | {r['world_size']} | {r['predicted_step_seconds']:.3f} | "
            f"{r['measured_step_seconds']:.3f} | {r['ratio_measured_over_predicted']:.2f} | "
            f"{r['available_cores_run']:.2f} | {r['predicted_cpu_seconds']:.3f} / "
            f"{r['measured_cpu_seconds']:.3f} | {r['predicted_bubble']:.3f} | "
            f"{r['measured_bubble']:.3f} | {run['load_min']:.1f}–{run['load_max']:.1f} |"
        )
    lines += [
        "",
        f"Within 25%: {summary['within_25_percent']} of {summary['layouts']} layouts (median "
        f"|error| {summary['median_abs_error']:.0%}, ratio {summary['min_ratio']:.2f}–"
        f"{summary['max_ratio']:.2f}); bubble within 0.05: {summary['bubble_within_0_05']} of "
        f"{summary['pipeline_layouts']} pipelines (largest miss {summary['max_bubble_error']:.3f}, "
        f"median measured minus predicted {summary['median_bubble_measured_minus_predicted']:+.3f}); "
        f"measured over predicted CPU work {summary['cpu_work_ratio_min']:.2f}–"
        f"{summary['cpu_work_ratio_max']:.2f}. Predicted at the calibrations' cores instead of the "
        f"run's: {summary['within_25_percent_at_calibration_cores']} of {summary['layouts']} within "
        f"25%. Predicted as a user would, from the calibration before the run alone at the cores it "
        f"measured: {summary['within_25_percent_before_run']} of {summary['layouts']} within 25%, "
        f"bubble {summary['bubble_within_0_05_before_run']} of {summary['pipeline_layouts']}.",
    ]
    searched = results.get("search")
    if searched:
        picks = "; ".join(
            f"#{c['rank']} {c['layout']} predicted {c['predicted_step_seconds']:.2f} s "
            f"({c['predicted_step_seconds_at_run_cores']:.2f} s at the run's cores), "
            f"measured {c['measured_step_seconds']:.2f} s"
            for c in searched["candidates"]
        )
        verdict = (
            "The top pick was the fastest measured."
            if searched["top_pick_is_fastest_measured"]
            else f"The top pick was not the fastest measured (it measured "
            f"{searched['top_pick_over_fastest_measured']:.2f}x the fastest)."
        )
        lines += ["", f"`--search` check ({searched['world']} ranks): {picks}. {verdict}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per run (two are warm-up)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these layouts")
    parser.add_argument("--search-world", type=int, default=4, help="world size for --search")
    parser.add_argument("--no-search", action="store_true", help="skip the --search check")
    parser.add_argument(
        "--table",
        metavar="RESULTS",
        help="print docs/planner.md's table of a results file; run nothing",
    )
    parser.add_argument(
        "--repredict",
        metavar="RESULTS",
        help="predict the recorded runs of a results file again with the current model; run nothing",
    )
    parser.add_argument(
        "--band",
        nargs="+",
        metavar="RESULTS",
        help="write meshtrain/planner/validation.json from these results files (one per run); run nothing",
    )
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="with --repredict: write the re-predicted document here and the error band from it",
    )
    args = parser.parse_args(argv)
    if args.band:
        print(f"error band: {validation.write_band([Path(p) for p in args.band])}")
        return 0
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())))
        return 0
    if args.repredict:
        document = repredict(json.loads(Path(args.repredict).read_text()))
        print(markdown(document))
        print(f"\nsummary: {json.dumps(document['results']['summary'])}")
        if args.out:
            Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
            print(f"results: {args.out}")
            print(f"error band: {validation.write_band([Path(args.out)])}")
        return verdict(document["results"]["summary"])
    layouts = [(n, p) for n, p in LAYOUTS if not args.only or n in args.only]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, parallelism in layouts:
            row = validate_layout(name, parallelism, args.steps, Path(tmp))
            rows.append(row)
            print(
                f"  {name:<16} predicted {row['predicted_step_seconds'] * 1e3:8.1f} ms  "
                f"measured {row['measured_step_seconds'] * 1e3:8.1f} ms  "
                f"ratio {row['ratio_measured_over_predicted']:5.2f}  bubble "
                f"{row['predicted_bubble']:.3f}/{row['measured_bubble']:.3f}  "
                f"cores {row['available_cores_run']:.2f} (cal {row['available_cores_calibration']:.2f}) "
                f"cpu {row['predicted_cpu_seconds']:.3f}/{row['measured_cpu_seconds']:.3f} "
                f"load {row['host_during_run']['load_min']:.1f}-{row['host_during_run']['load_max']:.1f}",
                flush=True,
            )
        searched = (
            None if args.no_search else check_search(args.search_world, args.steps, Path(tmp))
        )
    header = (
        f"{'layout':<16} {'world':>5} {'predicted ms':>12} {'measured ms':>11} {'ratio':>6} "
        f"{'bubble pred':>11} {'bubble meas':>11} {'load':>6}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['layout']:<16} {r['world_size']:>5} {r['predicted_step_seconds'] * 1e3:>12.1f} "
            f"{r['measured_step_seconds'] * 1e3:>11.1f} {r['ratio_measured_over_predicted']:>6.2f} "
            f"{r['predicted_bubble']:>11.3f} {r['measured_bubble']:>11.3f} "
            f"{r['load_average_before'][0] if r['load_average_before'] else float('nan'):>6.1f}"
        )
    summary = summarise(rows)
    print(f"\nsummary: {json.dumps(summary)}")
    if searched:
        print(f"search (world {searched['world']}): {json.dumps(searched['candidates'])}")
        print(f"top pick fastest measured: {searched['top_pick_is_fastest_measured']}")
    results = {
        "model": MODEL,
        "training": TRAINING,
        "steps": args.steps,
        "warmup_steps": WARMUP_STEPS,
        "targets": {"ratio": TARGET_RATIO, "bubble": TARGET_BUBBLE},
        "layouts": rows,
        "summary": summary,
        "search": searched,
    }
    if not args.only:  # a partial run must not replace the whole validation's results file
        path = machine.write_results("planner_time", results)
        print(f"results: {path}")
        if not os.environ.get(machine.RESULTS_ENV):
            print(f"error band: {validation.write_band([path])}")
    else:
        print("--only: results printed, not written")
    return verdict(summary)


def verdict(summary: dict[str, Any]) -> int:
    """Print the misses; 1 when a required layout missed a target."""
    for line in summary["other_misses"]:
        print(f"missed (not a required layout): {line}")
    for line in summary["required_misses"]:
        print(f"MISSED (required layout): {line}")
    return 1 if summary["required_misses"] else 0


if __name__ == "__main__":
    sys.exit(main())
