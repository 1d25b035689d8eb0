"""Presenting a plan: the text report (:func:`to_text`) and the ``meshtrain.plan/v1`` JSON document (:func:`to_json`).

docs/planner.md documents every key; within v1 keys are only ever added, never renamed or removed.
Every number comes from the :class:`~.estimate.Plan` it is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from meshtrain.planner import estimate, failures, memory, profiles, search, validation
from meshtrain.planner.timing import network, step_time

SCHEMA = "meshtrain.plan/v1"
"""Name and version of the JSON document."""

GROUPS = ("dp", "tp", "pp")
"""Group axes every document reports; a job with context parallelism adds ``cp`` (:func:`_groups`)."""


def _groups(plan: estimate.Plan) -> tuple[str, ...]:
    """The group axes of ``plan``'s job: :data:`GROUPS`, and ``cp`` where ``context > 1``."""
    return GROUPS + (("cp",) if plan.job.parallelism.context > 1 else ())


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _stage_groups(plan: estimate.Plan, stage: int) -> dict[str, dict[str, float | str]]:
    stage_comm = plan.comm[stage]
    times = plan.time.stages[stage]
    seconds = {"dp": times.dp, "tp": times.tp, "pp": times.pp, "cp": times.cp_ring}
    return {
        g: {
            "payload_bytes": stage_comm.payload(g),
            "wire_bytes": stage_comm.wire(g),
            "seconds": seconds[g],
            "link": plan.time.links[g].name,
        }
        for g in _groups(plan)
    }


PROFILE_KEYS = (
    "name",
    "source",
    "peak_flops",
    "achievable_fraction",
    "memory_bytes",
    "reserved_bytes",
    "memory_bandwidth",
    "nvlink_bandwidth",
    "nvlink_latency",
    "nic_bandwidth",
    "nic_latency",
    "op_overhead",
    "cores",
    "calibrated",
)
"""The profile's figures the document repeats, in order (``calibration`` follows them)."""


def to_json(plan: estimate.Plan) -> dict[str, Any]:
    """The ``meshtrain.plan/v1`` document of a plan."""
    return {
        "schema": SCHEMA,
        "job": _job_json(plan),
        "model": _model_json(plan),
        "profile": {
            **{key: getattr(plan.profile, key) for key in PROFILE_KEYS},
            "calibration": plan.profile.calibration or None,
        },
        "confidence": plan.confidence.to_json() if plan.confidence else None,
        "memory": _memory_json(plan.memory),
        "communication": _communication_json(plan),
        "time": _time_json(plan.time),
        "batch": {
            "global_batch": plan.batch.sequences,
            "tokens_per_step": plan.batch.tokens,
            "critical_batch_tokens": plan.batch.critical_tokens,
            "gradient_noise_scale": plan.batch.noise_scale,
            "warning": plan.batch.warning,
        },
        "placement": _placement_json(plan.placement),
        "failures": _failures_json(plan.failures),
        "warnings": plan.warnings,
    }


def _interval_json(interval: failures.Interval) -> dict[str, Any]:
    return {
        "save_seconds": interval.save_seconds,
        "save_source": interval.save_source,
        "restart_seconds": interval.restart_seconds,
        "reload_seconds": interval.reload_seconds,
        # infinite (None) where no failure is recovered at that level (--memory-share 0 or 1)
        "young_interval_seconds": _finite(interval.young_seconds),
        "daly_interval_seconds": _finite(interval.daly_seconds),
        "interval_steps": interval.steps,
        "expected_goodput": interval.goodput,
        "configured_interval_steps": interval.configured_steps,
        "configured_goodput": interval.configured_goodput,
    }


def _failures_json(planned: failures.FailurePlan | None) -> dict[str, Any] | None:
    if planned is None:
        return None
    return {
        "failure_rate_per_gpu_hour": planned.failure_rate,
        "failure_rate_source": planned.source,
        "gpus": planned.gpus,
        "mtbf_seconds": planned.mtbf_seconds,
        "step_seconds": planned.step_seconds,
        "storage": _interval_json(planned.storage),
        "memory": _interval_json(planned.memory),
        "memory_share": planned.memory_share,
        "storage_interval_steps_beside_memory": planned.storage_steps_beside_memory,
    }


def _job_json(plan: estimate.Plan) -> dict[str, Any]:
    job = plan.job
    par = job.parallelism
    return {
        "layout": par.layout_string,
        "world_size": job.world_size,
        "pods": job.pods,
        "gpus_per_node": job.resources.gpus_per_node,
        "schedule": par.schedule,
        "virtual_stages": par.virtual_stages,
        "micro_batches": par.micro_batches,
        "micro_batch": job.training.micro_batch,
        "zero_stage": par.zero_stage,
        "sequence_parallel": par.sequence_parallel,
        "activation_checkpointing": job.training.activation_checkpointing,
        "precision": plan.precision,
        "recipe": plan.recipe,
    }


def _model_json(plan: estimate.Plan) -> dict[str, Any]:
    shape, mem = plan.job.model.shape(), plan.memory
    return {
        "layers": shape.layers,
        "hidden": shape.hidden,
        "heads": shape.heads,
        "vocab": shape.vocab,
        "seq_len": shape.seq_len,
        "ffn_hidden": shape.ffn_hidden,
        "parameters": mem.total_params,
        "parameters_per_rank_max": max(s.params for s in mem.stages),
        "flops_per_token": plan.time.model_flops / plan.time.tokens_per_step,
    }


def _memory_json(mem: memory.MemoryPlan) -> dict[str, Any]:
    return {
        "capacity_bytes": mem.capacity,
        "reserved_bytes": mem.reserved,
        "bytes_per_param": {
            "weights": mem.scheme.weights,
            "grads": mem.scheme.grads,
            "optimizer": mem.scheme.optimizer,
        },
        "worst_stage": mem.worst.stage,
        "peak_bytes": mem.worst.total,
        "headroom_bytes": mem.headroom,
        "fits": mem.fits,
        "per_stage": [
            {
                "stage": s.stage,
                "parameters": s.params,
                "weights_bytes": s.weights,
                "grads_bytes": s.grads,
                "optimizer_bytes": s.optimizer,
                "activations_bytes": s.activations,
                "weight_casts_bytes": s.weight_casts,
                "in_flight_microbatches": s.in_flight,
                "total_bytes": s.total,
                **({"ring_bytes": s.ring} if s.ring else {}),  # context parallelism only
            }
            for s in mem.stages
        ],
    }


def _communication_json(plan: estimate.Plan) -> dict[str, Any]:
    return {
        "links": {g: plan.time.links[g].name for g in _groups(plan)},
        "per_stage": [
            {
                "stage": c.stage,
                "groups": _stage_groups(plan, c.stage),
                "collectives": [
                    {
                        "group": x.group,
                        "op": x.op,
                        "calls": x.calls,
                        "payload_bytes": x.nbytes,
                        "wire_bytes": x.wire_bytes,
                        "members": x.members,
                        "after_backward": x.after_backward,
                    }
                    for x in c.collectives
                ],
            }
            for c in plan.comm
        ],
    }


def _time_json(timing: step_time.TimePlan) -> dict[str, Any]:
    worst = timing.worst
    return {
        "step_seconds": timing.step_seconds,
        "pacing_stage": worst.stage,
        "compute_seconds": worst.compute,
        "tp_seconds": worst.tp,
        "pp_seconds": worst.pp,
        "dp_seconds": worst.dp,
        "dp_exposed_seconds": worst.dp_exposed,
        "optimizer_seconds": worst.optimizer,
        "bubble": timing.bubble,
        "predicted_bubble": timing.bubble_stage0,
        "pipeline_seconds": timing.pipeline_seconds,
        "overhead_seconds": worst.overhead,
        "oversubscription": timing.oversubscription,
        "rank_flops": timing.rank_flops,
        "dependency_seconds": timing.dependency_seconds,
        "cpu_seconds": timing.cpu_seconds,
        "available_cores": timing.available_cores,
        "work_bound": timing.work_bound,
        "compute_comm_ratio": _finite(timing.compute_comm_ratio),
        "verdict": timing.verdict,
        "tokens_per_second": timing.tokens_per_second,
        "mfu": timing.mfu,
        # with context parallelism only: the ring's transfers and the part its blocks do not hide
        **(
            {"cp_seconds": worst.cp_ring, "cp_exposed_seconds": worst.cp}
            if "cp" in timing.links
            else {}
        ),
    }


def _placement_json(placed: estimate.PlacementResult | None) -> dict[str, Any] | None:
    if placed is None:
        return None
    return {
        "schedulable": placed.unschedulable_reason is None,
        "nodes": list(placed.nodes),
        "level_bytes": dict(placed.level_bytes),
        "domains_used": dict(placed.domains_used),
        "reason": placed.unschedulable_reason,
        "message": placed.message,
    }


def human_bytes(value: float) -> str:
    """Binary-prefixed bytes: ``1.50 GiB``."""
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_seconds(value: float) -> str:
    """Seconds with a readable unit."""
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} us"


def _count(value: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        lines.append(
            "  "
            + "  ".join(
                cell.rjust(w) if i else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            )
        )
        if index == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return lines


MEMORY_COLUMNS: tuple[tuple[str, Callable[[memory.RankMemory], str]], ...] = (
    ("stage", lambda s: str(s.stage)),
    ("params", lambda s: _count(s.params)),
    ("weights", lambda s: human_bytes(s.weights)),
    ("grads", lambda s: human_bytes(s.grads)),
    ("optimizer", lambda s: human_bytes(s.optimizer)),
    ("activations", lambda s: human_bytes(s.activations)),
    ("bf16 copies", lambda s: human_bytes(s.weight_casts)),
    ("in flight", lambda s: f"{s.in_flight:g}"),
    ("total", lambda s: human_bytes(s.total)),
)
"""The columns of the report's memory table: heading, and the cell of a stage."""


def to_text(plan: estimate.Plan) -> str:
    """The report ``meshtrain plan`` prints."""
    lines = [
        *_heading(plan),
        *_memory_lines(plan),
        *_communication_lines(plan),
        *_time_lines(plan),
        *_batch_lines(plan),
        *_placement_lines(plan),
        *_failure_lines(plan.failures),
    ]
    if plan.warnings:
        lines += [""] + [f"WARNING: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _heading(plan: estimate.Plan) -> list[str]:
    job, mem = plan.job, plan.memory
    par, shape = job.parallelism, job.model.shape()
    return [
        f"meshtrain plan: {par.layout_string} ({job.world_size} GPUs in {job.pods} pod(s) of "
        f"{job.resources.gpus_per_node}), schedule {par.schedule}"
        + (f" v={par.virtual_stages}" if par.schedule == "interleaved-1f1b" else "")
        + f", m={par.micro_batches}, ZeRO-{par.zero_stage}"
        + (", sequence parallel" if par.sequence_parallel else "")
        + (", activation checkpointing" if job.training.activation_checkpointing else ""),
        calibration_headline(plan.profile),
        f"device: {plan.profile.name} ({plan.profile.description}); precision {plan.precision}, "
        f"state {mem.scheme.weights}+{mem.scheme.grads}+{mem.scheme.optimizer} bytes/param ({mem.scheme.name})",
        "",
        f"model: {_count(mem.total_params)} parameters ({mem.total_params:,}): layers {shape.layers}, hidden "
        f"{shape.hidden}, heads {shape.heads}, ffn {shape.ffn_hidden}, vocab {shape.vocab}, seq {shape.seq_len}",
    ]


def calibration_headline(profile: profiles.Profile) -> str:
    """The plan's second line: UNCALIBRATED and how to calibrate, or which calibration the figures come from."""
    if not profile.calibrated:
        return (
            f"UNCALIBRATED: profile {profile.name} holds datasheet or placeholder figures, never "
            "measured on this machine; calibrate with: meshtrain plan JOB.yaml --calibrate"
        )
    measured = profile.calibration
    layout = measured.get("job_layout")
    return (
        f"calibrated: profile {profile.name} measured on {measured.get('host', '?')} "
        f"({measured.get('device', '?')}) at {measured.get('measured_at', '?')}"
        + (f" for {layout}" if layout else "")
        + (f", from {profile.path}" if profile.path else "")
    )


def _memory_lines(plan: estimate.Plan) -> list[str]:
    mem = plan.memory
    rows = [[title for title, _ in MEMORY_COLUMNS]]
    rows += [[cell(s) for _, cell in MEMORY_COLUMNS] for s in mem.stages]
    verdict = "fits" if mem.fits else "DOES NOT FIT"
    return [
        "",
        "memory per GPU by pipeline stage:",
        *_table(rows),
        f"  device memory {mem.describe_capacity()}; worst stage {mem.worst.stage}: headroom "
        f"{human_bytes(mem.headroom)} ({verdict})",
    ]


def _communication_lines(plan: estimate.Plan) -> list[str]:
    rows = [["stage", "group", "link", "op", "calls", "payload", "on the wire", "time"]]
    for c in plan.comm:
        for x in c.collectives:
            link = plan.time.links[x.group]
            rows.append(
                [
                    str(c.stage),
                    x.group,
                    link.name,
                    x.op,
                    str(x.calls),
                    human_bytes(x.nbytes),
                    human_bytes(x.wire_bytes),
                    human_seconds(network.collective_seconds(x, link)),
                ]
            )
        if not c.collectives:
            rows.append([str(c.stage), "-", "-", "(none)", "0", "0 B", "0 B", "0"])
    return ["", "communication per rank per step:", *_table(rows)]


def _time_lines(plan: estimate.Plan) -> list[str]:
    timing, par = plan.time, plan.job.parallelism
    w = timing.worst
    ratio = timing.compute_comm_ratio
    return [
        "",
        f"time per step (pacing stage {w.stage}):",
        f"  compute {human_seconds(w.compute)} at {timing.rank_flops / 1e12:.3g} TFLOP/s per rank"
        f" + op overhead {human_seconds(w.overhead)}; "
        f"tp {human_seconds(w.tp)}, pp {human_seconds(w.pp)}, dp {human_seconds(w.dp)} "
        f"(exposed {human_seconds(w.dp_exposed)}), optimizer {human_seconds(w.optimizer)}"
        + (
            f"; context ring {human_seconds(w.cp_ring)} (exposed {human_seconds(w.cp)})"
            if par.context > 1
            else ""
        ),
        f"  pipeline bubble {timing.bubble:.1%} = (p-1)/(v*m+p-1) with p={par.pipeline}, "
        f"v={par.virtual_stages}, m={par.micro_batches}; "
        f"replayed with each stage's times: stage 0 idle {timing.bubble_stage0:.1%} of "
        f"{human_seconds(timing.pipeline_seconds)}"
        + (
            f"; {timing.oversubscription:.1f}x more threads than cores"
            if timing.oversubscription > 1
            else ""
        ),
        *_cpu_host_lines(timing),
        f"  predicted step {human_seconds(timing.step_seconds)}, {timing.tokens_per_second:,.0f} tokens/s, MFU {timing.mfu:.1%}",
        f"  compute/communication ratio {'inf' if not math.isfinite(ratio) else f'{ratio:.2f}'}: {timing.verdict}",
    ]


def _cpu_host_lines(timing: step_time.TimePlan) -> list[str]:
    """Which bound set a CPU host's step (nothing where CPU time is not priced: a device per rank, a host by core share)."""
    if timing.available_cores <= 0:
        return []
    return [
        f"  CPU host: {human_seconds(timing.cpu_seconds)} of CPU work per step over "
        f"{timing.available_cores:.2f} available cores"
        f" = {human_seconds(timing.cpu_seconds / timing.available_cores)}; schedule's critical path "
        f"{human_seconds(timing.dependency_seconds)}: "
        + ("work-bound" if timing.work_bound else "dependency-bound")
    ]


def _batch_lines(plan: estimate.Plan) -> list[str]:
    batch = plan.batch
    return [
        "",
        f"  confidence: {plan.confidence.statement}"
        if plan.confidence
        else f"  confidence: profile {plan.profile.name}, not stated",
        "",
        f"global batch: {batch.sequences} sequences = {batch.tokens:,} tokens per step "
        + (
            f"(measured gradient noise scale {batch.noise_scale:.3g} sequences)"
            if batch.noise_scale
            else f"(critical batch {batch.critical_tokens:,} tokens)"
        ),
    ]


def _placement_lines(plan: estimate.Plan) -> list[str]:
    placed, per_node = plan.placement, plan.job.resources.gpus_per_node
    if placed is None:
        return []
    lines = ["", "placement (what the operator would do):"]
    if placed.unschedulable_reason:
        return lines + [f"  unschedulable: {placed.unschedulable_reason}: {placed.message}"]
    for index, node in enumerate(placed.nodes):
        ranks = plan.job.parallelism.layout.ranks_of_pod(index, per_node)
        lines.append(f"  pod {index} (ranks {ranks[0]}..{ranks[-1]}) -> {node}")
    for level, nbytes in placed.level_bytes.items():
        lines.append(f"  bytes per step crossing {level}: {human_bytes(nbytes)}")
    return lines


def _human_interval(seconds: float) -> str:
    return human_seconds(seconds) if math.isfinite(seconds) else "never"


def _failure_lines(planned: failures.FailurePlan | None) -> list[str]:
    if planned is None:
        return []
    lines = [
        "",
        f"failures: {planned.failure_rate:.3g} per GPU-hour x {planned.gpus} GPUs = one every "
        f"{planned.mtbf_seconds / 3600:.3g} h (MTBF {human_seconds(planned.mtbf_seconds)})",
        f"  rate from {planned.source}",
    ]
    for interval in (planned.storage, planned.memory):
        configured = (
            f"; the spec's {interval.configured_steps} steps: {interval.configured_goodput:.2%}"
            if interval.configured_goodput is not None
            else ""
        )
        lines += [
            f"  {interval.kind} checkpoints: save {human_seconds(interval.save_seconds)} "
            f"({interval.save_source}), restart {human_seconds(interval.restart_seconds)} "
            f"(reload {human_seconds(interval.reload_seconds)} of it)",
            f"    best interval (Daly) {_human_interval(interval.daly_seconds)} = every "
            f"{interval.steps} steps (Young: {_human_interval(interval.young_seconds)}): expected "
            f"goodput {interval.goodput:.2%}{configured}",
        ]
    lines.append(
        f"  memory recovers {planned.memory_share:.0%} of failures (the rest: storage, best every "
        f"{planned.storage_steps_beside_memory} steps beside it); memory goodput is both levels'"
    )
    return lines


SEARCH_SCHEMA = "meshtrain.plan-search/v1"
"""Name and version of the ``--search --json`` document."""


def search_json(
    found: list[search.Candidate], world: int, confidence: validation.Confidence
) -> dict[str, Any]:
    """The ``meshtrain.plan-search/v1`` document."""
    close = _close_to_best(found, confidence)
    return {
        "schema": SEARCH_SCHEMA,
        "world_size": world,
        "confidence": confidence.to_json(),
        "layouts": [
            {
                "rank": index + 1,
                "layout": c.label,
                "parallelism": {k: v for k, v in c.parallelism.items() if k != "microBatch"},
                "micro_batch": c.parallelism["microBatch"],
                "step_seconds": c.step_seconds,
                "peak_bytes": c.peak_bytes,
                "headroom_bytes": c.headroom_bytes,
                "predicted_bubble": c.bubble,
                "nodes": list(c.nodes),
                "within_error_of_best": close[index] if close else None,
                "grid_measured": c.grid_measured,
            }
            for index, c in enumerate(found)
        ],
    }


def _close_to_best(
    found: list[search.Candidate], confidence: validation.Confidence
) -> list[bool] | None:
    """Per candidate, whether its step is within the validation's median error of the best (None: no band)."""
    if not found or confidence.resolution is None:
        return None
    limit = found[0].step_seconds * (1 + confidence.resolution)
    return [c.step_seconds <= limit for c in found]


def search_text(
    found: list[search.Candidate],
    world: int,
    profile: profiles.Profile,
    confidence: validation.Confidence,
    *,
    placed: bool,
) -> str:
    """The table ``meshtrain plan --search`` prints."""
    where = "memory-feasible and placeable" if placed else "memory-feasible"
    lines = [
        f"meshtrain plan --search: fastest {where} layouts of {world} ranks on {profile.name}",
        calibration_headline(profile),
    ]
    if not found:
        return "\n".join(lines + ["  none: no layout passes the spec's rules and fits in memory"])
    rows = [["#", "layout", "step", "bubble", "peak memory", "headroom"]]
    for index, c in enumerate(found):
        rows.append(
            [
                str(index + 1),
                c.label + (" *" if c.grid_measured else ""),
                human_seconds(c.step_seconds),
                f"{c.bubble:.1%}",
                human_bytes(c.peak_bytes),
                human_bytes(c.headroom_bytes),
            ]
        )
    lines += _table(rows)
    if any(c.grid_measured for c in found):
        lines.append(
            "* priced with a step loop measured on its own dp/pp/tp grid (--search --calibrate)"
        )
    close = _close_to_best(found, confidence)
    if close and sum(close) > 1:
        ranks = ", ".join(f"#{i + 1}" for i, near in enumerate(close) if near)
        lines.append(
            f"{ranks} are predicted within the validation's median error "
            f"({confidence.resolution:.0%}) of the best: the prediction cannot order them; "
            "run each (meshtrain run with its --set) to choose"
        )
    best = found[0].parallelism
    lines += [
        "",
        "try the best: --set "
        + " --set ".join(
            f"{'training' if k == 'microBatch' else 'parallelism'}.{k}={v}" for k, v in best.items()
        ),
        f"confidence: {confidence.statement}",
    ]
    if confidence.calibrated_for:
        measured = (
            "the grids marked * with their own step loop and waits, "
            if any(c.grid_measured for c in found)
            else ""
        )
        lines.append(
            f"  the profile was calibrated for {confidence.calibrated_for}: layouts with other "
            f"tensor or pipeline degrees are priced with its block rate ({measured}the others "
            "with its step loop and waits too); calibrate the pick (--calibrate with its --set) "
            "before trusting its time"
        )
    return "\n".join(lines)
