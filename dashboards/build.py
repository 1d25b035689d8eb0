"""Generates the Grafana dashboards in this folder: ``python dashboards/build.py``.

The panels of ``meshtrain-training.json`` and ``meshtrain-operator.json``
are tables of :class:`Panel` values (title, unit, PromQL, thresholds), so
every query is written once and the JSON stays consistent (ids, grid,
datasource, variables); tests/unit/test_telemetry_dashboards.py fails when
the files are stale.  Nothing is uploaded: the chart provisions the JSON for
Grafana's sidecar, or it is imported by hand.  Why this is not built with
grafana-foundation-sdk: docs/architecture.md, "Dashboards".
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEL = 'namespace="$namespace", trainingjob="$trainingjob", pod=~"$pod", rank=~"$rank"'
JOBSEL = 'namespace="$namespace", trainingjob="$trainingjob"'
RI = "$__rate_interval"
OPTIONAL_DCGM = "Optional: needs the NVIDIA DCGM exporter in the cluster; empty without it."
TOKENS_PER_SECOND = "suffix: tokens/s"
"""Grafana has no tokens unit; a custom suffix unit keeps SI-free numbers readable."""

Threshold = tuple[float | None, str]
"""(from value, colour); the first step starts at None (minus infinity)."""


@dataclasses.dataclass(frozen=True)
class Panel:
    """One Grafana panel: a stat or a time series of PromQL targets."""

    title: str
    unit: str
    """Grafana unit id (``s``, ``Bps``, ``bytes``, ``percentunit``, ``suffix: ...``)."""
    targets: list[tuple[str, str]]
    """(legend, PromQL) per query."""
    description: str
    kind: str = "timeseries"
    """``timeseries``, ``stat`` or ``row`` (a heading: the panels after it are its own)."""
    thresholds: list[Threshold] | None = None
    """Colour steps; drawn as dashed lines on time series, as the value colour on stats."""
    width: int = 12
    height: int = 8
    optional: str | None = None
    """``dcgm``: the panel needs an exporter meshtrain does not ship (empty without it)."""


def _mean(metric: str, by: str) -> str:
    return (
        f"sum by ({by}) (rate({metric}_sum{{{SEL}}}[{RI}])) / "
        f"sum by ({by}) (rate({metric}_count{{{SEL}}}[{RI}]))"
    )


def _quantile(q: float, metric: str, by: str = "") -> str:
    extra = f", {by}" if by else ""
    return f"histogram_quantile({q}, sum by (le{extra}) (rate({metric}_bucket{{{SEL}}}[{RI}])))"


def _dcgm(metric: str) -> str:
    """A DCGM series of the job's pods, whether Prometheus kept DCGM's pod label or renamed it exported_pod.

    Scraped without ``honorLabels`` the GPU's pod is in ``exported_pod``/``exported_namespace``
    (``pod``/``namespace`` name the exporter's own pod); label_replace copies them over when present.
    """
    moved = f'label_replace({metric}, "pod", "$1", "exported_pod", "(.+)")'
    moved = f'label_replace({moved}, "namespace", "$1", "exported_namespace", "(.+)")'
    return f"avg by (pod) ({moved} and on (namespace, pod) group by (namespace, pod) (meshtrain_step{{{SEL}}}))"


def _stat(
    title: str,
    unit: str,
    expr: str,
    description: str,
    thresholds: list[Threshold] | None = None,
) -> Panel:
    return Panel(title, unit, [(title, expr)], description, "stat", thresholds, width=4, height=4)


STEP_MEAN = f"max by (namespace, trainingjob) ({_mean('meshtrain_step_seconds', 'namespace, trainingjob, rank')})"

TRAINING_PANELS: list[Panel] = [
    _stat(
        "Tokens/s",
        TOKENS_PER_SECOND,
        f"max by (namespace, trainingjob) (rate(meshtrain_tokens_total{{{SEL}}}[{RI}]))",
        "Tokens of the global batch per second.",
    ),
    _stat(
        "MFU",
        "percentunit",
        f"avg by (namespace, trainingjob) (meshtrain_model_flops_utilization_ratio{{{SEL}}})",
        "Model FLOPs utilisation of the last step (40 % and more is good for large dense models).",
        thresholds=[(None, "red"), (0.25, "orange"), (0.4, "green")],
    ),
    _stat(
        "Step",
        "none",
        f"max by (namespace, trainingjob) (meshtrain_step{{{SEL}}})",
        "Last completed optimizer step.",
    ),
    _stat(
        "ETA to training.steps",
        "s",
        f"(max by (namespace, trainingjob) (meshtrain_training_steps{{{SEL}}}) - max by (namespace, trainingjob) "
        f"(meshtrain_step{{{SEL}}})) * {STEP_MEAN}",
        "Steps left times the current mean step time.",
    ),
    _stat(
        "Gang restarts",
        "none",
        'max by (namespace, trainingjob) (meshtrain_operator_job_restarts{namespace="$namespace", '
        'trainingjob="$trainingjob"})',
        "status.restarts, from the operator; each restart loses the steps since the last checkpoint.",
        thresholds=[(None, "green"), (1, "orange"), (3, "red")],
    ),
    _stat(
        "Last checkpoint age",
        "s",
        f"time() - max by (namespace, trainingjob) (meshtrain_checkpoint_last_timestamp_seconds{{{SEL}}})",
        "Since the newest complete checkpoint (or the start of training); the "
        "MeshtrainCheckpointStale alert compares it with twice the interval.",
        thresholds=[(None, "green"), (1800, "orange"), (3600, "red")],
    ),
    Panel(
        "Throughput",
        TOKENS_PER_SECOND,
        [
            (
                "tokens/s",
                f"max by (namespace, trainingjob) (rate(meshtrain_tokens_total{{{SEL}}}[{RI}]))",
            )
        ],
        "Tokens of the global batch per second (every rank counts the whole job, so max over ranks).",
    ),
    Panel(
        "Model FLOPs utilisation",
        "percentunit",
        [
            (
                "MFU",
                f"avg by (namespace, trainingjob) (avg_over_time(meshtrain_model_flops_utilization_ratio{{{SEL}}}[{RI}]))",
            )
        ],
        "Model FLOPs (6N + attention, docs/telemetry.md) over world size x peak FLOP/s x step time.",
        thresholds=[(None, "red"), (0.25, "orange"), (0.4, "green")],
    ),
    Panel(
        "Loss",
        "none",
        [
            ("loss", f'max by (namespace, trainingjob) (meshtrain_loss{{{JOBSEL}, rank="0"}})'),
            (
                "eval loss",
                f'max by (namespace, trainingjob) (meshtrain_eval_loss{{{JOBSEL}, rank="0"}})',
            ),
        ],
        "Mean training loss of the last step, and the validation loss of the last evaluation "
        "(training.eval); both identical on every rank.",
    ),
    Panel(
        "Global batch vs gradient noise scale",
        "none",
        [
            (
                "global batch",
                f'max by (namespace, trainingjob) (meshtrain_global_batch_sequences{{{JOBSEL}, rank="0"}})',
            ),
            (
                "noise scale",
                f'max by (namespace, trainingjob) (meshtrain_gradient_noise_scale{{{JOBSEL}, rank="0"}})',
            ),
        ],
        "Sequences per step beside the measured gradient noise scale (McCandlish et al. 2018; needs "
        "data >= 2): far above it (10x) a larger batch buys little per step. Empty noise scale: not "
        "measured (ZeRO-2/3, sequence parallelism, one replica).",
    ),
    Panel(
        "Goodput",
        "percentunit",
        [
            (
                "goodput",
                f'max by (namespace, trainingjob) (meshtrain_goodput_ratio{{{JOBSEL}, rank="0"}})',
            )
        ],
        "Productive step time (each step's last run) over wall time since the job's start, "
        "across restarts (global rank 0; status.goodput holds the same). Llama 3's pre-training "
        "held above 90 %.",
        thresholds=[(None, "red"), (0.8, "orange"), (0.9, "green")],
    ),
    Panel(
        "Time lost to failures by phase",
        "s",
        [
            (
                "{{phase}}",
                f'max by (phase) (meshtrain_goodput_lost_seconds{{{JOBSEL}, rank="0"}})',
            )
        ],
        "Seconds failures cost the whole run so far, by phase: detection, restart, reload, "
        "recomputed steps (global rank 0's account, across restarts: status.goodput.lostSeconds; "
        "meshtrain_recovery_seconds has each failure's, counted by rank 0's current process).",
    ),
    Panel(
        "Training progress",
        "none",
        [
            ("step", f"max by (namespace, trainingjob) (meshtrain_step{{{SEL}}})"),
            (
                "training.steps",
                f"max by (namespace, trainingjob) (meshtrain_training_steps{{{SEL}}})",
            ),
        ],
        "Last completed optimizer step, and the step the job ends at.",
    ),
    Panel(
        "Step time p50 / p99",
        "s",
        [
            ("p50", _quantile(0.5, "meshtrain_step_seconds")),
            ("p99", _quantile(0.99, "meshtrain_step_seconds")),
        ],
        "Wall time of an optimizer step over the selected ranks.",
    ),
    Panel(
        "All-reduce time p50 / p99 by group",
        "s",
        [
            ("p50 {{group}}", _quantile(0.5, "meshtrain_allreduce_seconds", "group")),
            ("p99 {{group}}", _quantile(0.99, "meshtrain_allreduce_seconds", "group")),
        ],
        "Duration of one collective call: a gradient bucket for dp, a layer's reduction for tp.",
    ),
    Panel(
        "Bus bandwidth by group",
        "Bps",
        [
            (
                "{{group}} {{op}}",
                f'sum by (group, op) (rate(meshtrain_collective_bus_bytes_total{{{SEL}, group=~"dp|tp"}}[{RI}]))'
                f' / sum by (group, op) (rate(meshtrain_collective_busy_seconds_total{{{SEL}, group=~"dp|tp"}}[{RI}]))',
            )
        ],
        "nccl-tests bus bandwidth: algbw x 2(n-1)/n (all-reduce), x (n-1)/n (reduce-scatter, all-gather), "
        "over the time the group's collectives were in flight.",
    ),
    Panel(
        "Gradient compression ratio",
        "none",
        [
            (
                "stage {{pp}}",
                f'sum by (pp) (rate(meshtrain_gradient_reduction_bytes_total{{{SEL}, stage="uncompressed"}}[{RI}]))'
                f' / sum by (pp) (rate(meshtrain_gradient_reduction_bytes_total{{{SEL}, stage="sent"}}[{RI}]))',
            ),
        ],
        "Data-parallel gradient bytes before compression over bytes sent "
        "(parallelism.gradientCompression; 1 when uncompressed).",
    ),
    Panel(
        "Exposed communication per step",
        "s",
        [("stage {{pp}}", _mean("meshtrain_exposed_comm_seconds", "pp"))],
        "Gradient reduction still running after the last backward (not hidden by compute).",
    ),
    Panel(
        "Exposed communication share of step",
        "percentunit",
        [
            (
                "stage {{pp}}",
                f"sum by (pp) (rate(meshtrain_exposed_comm_seconds_sum{{{SEL}}}[{RI}])) / sum by (pp) (rate(meshtrain_step_seconds_sum{{{SEL}}}[{RI}]))",
            )
        ],
        "Exposed communication over step time, per pipeline stage.",
        thresholds=[(None, "green"), (0.1, "orange"), (0.25, "red")],
    ),
    Panel(
        "Pipeline bubble: measured vs theoretical",
        "percentunit",
        [
            ("measured stage {{pp}}", f"avg by (pp) (meshtrain_pipeline_bubble_ratio{{{SEL}}})"),
            (
                "theoretical",
                f"max by (namespace, trainingjob) (meshtrain_pipeline_bubble_ratio_theoretical{{{SEL}}})",
            ),
        ],
        "Measured idle share of each stage's step vs (p-1)/(v*m+p-1).",
    ),
    Panel(
        "Pipeline wait per step",
        "s",
        [
            (
                "stage {{pp}}",
                f"sum by (pp) (rate(meshtrain_pipeline_wait_seconds_total{{{SEL}}}[{RI}])) / sum by (pp) (rate(meshtrain_step_seconds_count{{{SEL}}}[{RI}]))",
            )
        ],
        "Time blocked on pipeline sends/receives per step.",
    ),
    Panel(
        "Step time per rank (stragglers)",
        "s",
        [("rank {{rank}}", _mean("meshtrain_step_seconds", "rank"))],
        "Mean step time of each rank; synchronous training makes them equal unless a rank lags at the end.",
    ),
    Panel(
        "Compute time per rank (stragglers)",
        "s",
        [("rank {{rank}} (stage {{pp}})", _mean("meshtrain_compute_seconds", "rank, pp"))],
        "Forward+backward compute per step; ranks of one stage do the same work, so a higher line is a slow device.",
    ),
    Panel(
        "Step-time spread across ranks",
        "percentunit",
        [
            (
                "max/min - 1",
                f"max by (namespace, trainingjob) ({_mean('meshtrain_compute_seconds', 'namespace, trainingjob, rank')}) / min by (namespace, trainingjob) ({_mean('meshtrain_compute_seconds', 'namespace, trainingjob, rank')}) - 1",
            )
        ],
        "How much slower the slowest rank computes than the fastest (the straggler alert fires at 25 %).",
        thresholds=[(None, "green"), (0.1, "orange"), (0.25, "red")],
    ),
    Panel(
        "Slowdown per rank (straggler detector)",
        "none",
        [
            (
                "rank {{rank}} on {{node}}",
                f"max by (rank, node) (meshtrain_rank_slowdown_ratio{{{SEL}}})",
            )
        ],
        "The trainer's own judgement: each rank's compute time over its data-parallel peers' median, "
        "median over runPolicy.stragglerPolicy.window steps (1 = as fast as its peers). Above the "
        "policy threshold (default 1.25) the rank is flagged and the operator reports or replaces its node.",
        thresholds=[(None, "green"), (1.1, "orange"), (1.25, "red")],
    ),
    Panel(
        "Memory per stage",
        "bytes",
        [
            (
                "stage {{pp}} {{component}}",
                f"max by (pp, component) (meshtrain_memory_bytes{{{SEL}}})",
            ),
            ("stage {{pp}} peak", f"max by (pp) (meshtrain_memory_peak_bytes{{{SEL}}})"),
        ],
        "Parameters, gradients and optimizer state of the largest rank of each stage, and its peak: "
        "CUDA max_memory_allocated on a GPU, the process' peak resident set (ru_maxrss) on CPU.",
    ),
    Panel(
        "GPU utilisation (DCGM)",
        "percent",
        [("{{pod}}", _dcgm("DCGM_FI_DEV_GPU_UTIL"))],
        OPTIONAL_DCGM,
        optional="dcgm",
    ),
    Panel(
        "Tensor core activity (DCGM)",
        "percentunit",
        [("{{pod}}", _dcgm("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"))],
        OPTIONAL_DCGM,
        optional="dcgm",
    ),
]

OPERATOR_JOB = 'job="meshtrain-operator"'
"""The operator's scrape job (the chart's ServiceMonitor pins it): a trainer pod's exporter cannot
pass its own series off as the operator's."""
OPSEL = f'{OPERATOR_JOB}, namespace=~"$namespace"'
"""The filter of every per-job operator panel: those series carry the job's namespace."""
OWNSEL = f'{OPERATOR_JOB}, namespace=~"$operator_namespace"'
"""The filter of the "Operator" row: the process's own series (up, API requests and errors) carry
the namespace the operator runs in (its scrape target's)."""
OPERATOR_OWN = " The operator's own series: filtered by operator_namespace, where it runs."
OPERATOR_PANELS: list[Panel] = [
    _stat(
        "Running jobs",
        "none",
        f'sum(meshtrain_operator_job_status_phase{{{OPSEL}, phase="Running"}})',
        "TrainingJobs in phase Running in the selected namespaces.",
    ),
    _stat(
        "Unschedulable jobs",
        "none",
        f"count(meshtrain_operator_job_unschedulable_seconds{{{OPSEL}}} > 0) or vector(0)",
        "Jobs of the selected namespaces waiting for capacity (InsufficientGPUs or TopologyUnsatisfiable).",
        thresholds=[(None, "green"), (1, "orange")],
    ),
    _stat(
        "Failed jobs",
        "none",
        f'sum(meshtrain_operator_job_status_phase{{{OPSEL}, phase="Failed"}})',
        "Jobs in phase Failed that still exist.",
        thresholds=[(None, "green"), (1, "red")],
    ),
    _stat(
        "Apply to Running p50 (1h)",
        "s",
        f"histogram_quantile(0.5, sum by (le) (rate(meshtrain_operator_job_apply_to_running_seconds_bucket{{{OPSEL}}}[1h])))",
        "Median time from a job's creation to its first Running phase over the last hour.",
    ),
    Panel(
        "Unfinished jobs by restarts left",
        "none",
        [
            (
                "{{namespace}}/{{trainingjob}}",
                f"min by (namespace, trainingjob) (meshtrain_operator_job_restarts_remaining{{{OPSEL}}})",
            )
        ],
        "backoffLimit - restarts of every job not yet finished; at 0 the next failure fails the job.",
    ),
    Panel(
        "Jobs by phase",
        "none",
        [
            (
                "{{phase}} {{queue}}",
                f"sum by (phase, queue) (meshtrain_operator_jobs{{{OPSEL}}}) > 0",
            ),
            ("unschedulable", f"sum(meshtrain_operator_unschedulable_jobs{{{OPSEL}}})"),
        ],
        "TrainingJobs the operator reconciles, by phase and queue (Kueue's queue-name label), and those"
        " waiting for capacity.",
    ),
    Panel(
        "Time from apply to Running p50 / p99",
        "s",
        [
            (
                "p50",
                f"histogram_quantile(0.5, sum by (le) (rate(meshtrain_operator_job_apply_to_running_seconds_bucket{{{OPSEL}}}[{RI}])))",
            ),
            (
                "p99",
                f"histogram_quantile(0.99, sum by (le) (rate(meshtrain_operator_job_apply_to_running_seconds_bucket{{{OPSEL}}}[{RI}])))",
            ),
        ],
        "From a TrainingJob's creation to its first Running phase (placement, pod start, gang gate).",
    ),
    Panel(
        "Reconcile duration p50 / p99",
        "s",
        [
            (
                "p50",
                f"histogram_quantile(0.5, sum by (le) (rate(meshtrain_operator_reconcile_duration_seconds_bucket{{{OPSEL}}}[{RI}])))",
            ),
            (
                "p99",
                f"histogram_quantile(0.99, sum by (le) (rate(meshtrain_operator_reconcile_duration_seconds_bucket{{{OPSEL}}}[{RI}])))",
            ),
        ],
        "Time of one reconcile pass of a TrainingJob.",
    ),
    Panel(
        "Reconciles per second",
        "ops",
        [
            (
                "reconciles/s",
                f"sum(rate(meshtrain_operator_reconcile_duration_seconds_count{{{OPSEL}}}[{RI}]))",
            )
        ],
        "Reconcile rate of the operator.",
    ),
    Panel(
        "Placement duration p50 / p99",
        "s",
        [
            (
                "p50",
                f"histogram_quantile(0.5, sum by (le) (rate(meshtrain_operator_placement_duration_seconds_bucket{{{OPSEL}}}[{RI}])))",
            ),
            (
                "p99",
                f"histogram_quantile(0.99, sum by (le) (rate(meshtrain_operator_placement_duration_seconds_bucket{{{OPSEL}}}[{RI}])))",
            ),
        ],
        "Time the planner takes to place a gang (list nodes and pods, plan).",
    ),
    Panel(
        "Placement failures by reason",
        "ops",
        [
            (
                "{{reason}}",
                f"sum by (reason) (rate(meshtrain_operator_placement_failures_total{{{OPSEL}}}[{RI}]))",
            ),
            (
                "re-plans of waiting jobs",
                f"sum(rate(meshtrain_operator_replans_total{{{OPSEL}}}[{RI}]))",
            ),
            (
                "plans of the reserved node set",
                f"sum(rate(meshtrain_operator_reservation_plans_total{{{OPSEL}}}[{RI}]))",
            ),
            (
                "gangs backfilled onto reserved nodes",
                f"sum(rate(meshtrain_operator_backfills_total{{{OPSEL}}}[{RI}]))",
            ),
        ],
        "Placement attempts that placed nothing, plans of jobs that already waited (woken by "
        "a capacity change that could admit them, or by their resync), plans of the node set "
        "reserved for the job that waited longest, and gangs placed on that set because their "
        "activeDeadlineSeconds ends them before it clears (backfill).",
    ),
    Panel(
        "Gang restarts",
        "none",
        [
            (
                "{{namespace}}/{{trainingjob}}",
                f"sum by (namespace, trainingjob) (meshtrain_operator_job_restarts{{{OPSEL}}})",
            )
        ],
        "status.restarts of each TrainingJob.",
    ),
    Panel(
        "Restarts by tier",
        "none",
        [
            (
                "{{namespace}}/{{trainingjob}} {{tier}}",
                f"sum by (namespace, trainingjob, tier) (increase(meshtrain_operator_restarts_total{{{OPSEL}}}[1h]))",
            )
        ],
        "Restarts in the last hour by tier: gang (the gang rebuilt, counted against backoffLimit), "
        "container (the kubelet restarted a trainer container in place), process and pod (the "
        "trainer recovered in place); status.recovery has the last one's cause.",
    ),
    Panel(
        "Straggler replacements",
        "none",
        [
            (
                "{{namespace}}/{{trainingjob}}",
                f"max by (namespace, trainingjob) (meshtrain_operator_straggler_replacements_total{{{OPSEL}}})",
            )
        ],
        "Gangs rebuilt without a straggler's node (runPolicy.stragglerPolicy replace); the nodes are in "
        "status.excludedNodes.",
    ),
    Panel(
        "Elastic data-parallel degree",
        "none",
        [
            (
                "{{namespace}}/{{trainingjob}} running",
                f"max by (namespace, trainingjob) (meshtrain_operator_job_data_parallel_degree{{{OPSEL}}})",
            ),
            (
                "{{namespace}}/{{trainingjob}} declared",
                f"max by (namespace, trainingjob) (meshtrain_operator_job_declared_data_parallel_degree{{{OPSEL}}})",
            ),
        ],
        "Data-parallel degree each job with runPolicy.elastic runs at, beside its declared parallelism.data "
        "(below: shrunk after a lost node; it grows back at a checkpoint once room returns).",
    ),
    Panel(
        "Unschedulable for",
        "s",
        [
            (
                "{{namespace}}/{{trainingjob}}",
                f"max by (namespace, trainingjob) (meshtrain_operator_job_unschedulable_seconds{{{OPSEL}}})",
            )
        ],
        "How long each unfinished job has waited for capacity (0 once placed).",
    ),
    Panel("Operator", "none", [], "The operator process: replicas, API requests.", kind="row"),
    _stat(
        "Operator replicas up",
        "none",
        f"sum(up{{{OWNSEL}}})",
        "Scraped operator replicas (the Lease holder acts, the others stand by)." + OPERATOR_OWN,
        thresholds=[(None, "red"), (1, "green")],
    ),
    _stat(
        "API errors/s",
        "reqps",
        f"sum(rate(meshtrain_operator_api_errors_total{{{OWNSEL}}}[{RI}]))",
        "Failed Kubernetes API requests of the operator." + OPERATOR_OWN,
        thresholds=[(None, "green"), (0.1, "orange"), (1, "red")],
    ),
    Panel(
        "Kubernetes API requests and errors by verb",
        "reqps",
        [
            (
                "{{verb}}",
                f"sum by (verb) (rate(meshtrain_operator_api_requests_total{{{OWNSEL}}}[{RI}]))",
            ),
            (
                "{{verb}} errors",
                f"sum by (verb) (rate(meshtrain_operator_api_errors_total{{{OWNSEL}}}[{RI}]))",
            ),
        ],
        "Requests the operator sends to the API server, and the failed ones (expected NotFound or"
        " AlreadyExists answers are not errors); the informer cache keeps lists and gets rare."
        + OPERATOR_OWN,
        thresholds=None,
    ),
    Panel(
        "Re-plans per admitting capacity change",
        "none",
        [
            (
                "most, any waiting job",
                f"max(meshtrain_operator_replans_per_admission_max{{{OWNSEL}}})",
            ),
            (
                "p99, jobs that stopped waiting",
                "histogram_quantile(0.99, sum by (le) (rate("
                f"meshtrain_operator_replans_per_admission_bucket{{{OWNSEL}}}[{RI}])))",
            ),
            (
                "admitting wake-ups/s",
                f"sum(rate(meshtrain_operator_replan_admissions_total{{{OWNSEL}}}[{RI}]))",
            ),
            (
                "assumed pods expired/s",
                f"sum(rate(meshtrain_operator_assumed_pods_expired_total{{{OWNSEL}}}[{RI}]))",
            ),
        ],
        "Per waiting job, plans while it waited per capacity change the wake-up rule said could "
        "admit it (the target is 1 at most), the wake-ups themselves, and pods assumed on their "
        "planned node whose assumption ran out before the pod appeared (docs/operator.md)."
        + OPERATOR_OWN,
    ),
]


def _annotation(name: str, expr: str, color: str, text: str) -> dict:
    return {
        "name": name,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "enable": True,
        "iconColor": color,
        "expr": expr,
        "step": "30s",
        "titleFormat": name,
        "textFormat": text,
        "useValueForTime": False,
    }


def _restart_annotation(selector: str) -> dict:
    return _annotation(
        "Gang restarts",
        f"sum by (namespace, trainingjob) (changes(meshtrain_operator_job_restarts{{{selector}}}[1m])) > 0",
        "red",
        "{{namespace}}/{{trainingjob}} restarted its gang",
    )


def _spec_annotation(selector: str) -> dict:
    return _annotation(
        "Spec changes",
        f"max by (namespace, trainingjob) (changes(meshtrain_operator_job_spec_generation{{{selector}}}[1m])) > 0",
        "blue",
        "{{namespace}}/{{trainingjob}}: spec changed",
    )


TRAINING_ANNOTATIONS = [
    _restart_annotation('namespace="$namespace", trainingjob="$trainingjob"'),
    _spec_annotation('namespace="$namespace", trainingjob="$trainingjob"'),
    _annotation(
        "Checkpoints",
        f'max by (namespace, trainingjob) (changes(meshtrain_checkpoint_last_step{{{JOBSEL}, rank="0"}}[1m])) > 0',
        "green",
        "checkpoint saved",
    ),
]
OPERATOR_ANNOTATIONS = [
    _annotation(
        "Gang restarts",
        f"sum by (namespace, trainingjob) (increase(meshtrain_operator_gang_restarts_total{{{OPSEL}}}[1m])) > 0",
        "red",
        "{{namespace}}/{{trainingjob}} restarted its gang",
    ),
    _annotation(
        "In-place restarts",
        f'sum by (namespace, trainingjob, tier) (increase(meshtrain_operator_restarts_total{{{OPSEL}, tier!="gang"}}[1m])) > 0',
        "yellow",
        "{{namespace}}/{{trainingjob}} restarted in place ({{tier}})",
    ),
    _annotation(
        "Straggler replaced",
        f"sum by (namespace, trainingjob) (increase(meshtrain_operator_straggler_replacements_total{{{OPSEL}}}[1m])) > 0",
        "purple",
        "{{namespace}}/{{trainingjob}} replaced a straggler's node",
    ),
    _annotation(
        "Elastic resizes",
        f"sum by (namespace, trainingjob, direction) (increase(meshtrain_operator_elastic_resizes_total{{{OPSEL}}}[1m])) > 0",
        "orange",
        "{{namespace}}/{{trainingjob}} elastic {{direction}}",
    ),
    _spec_annotation(OPSEL),
]


def _datasource_var() -> dict:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
    }


def _query_var(name: str, query: str, *, multi: bool = False) -> dict:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "refresh": 2,
        "sort": 3 if name == "rank" else 1,  # ranks in numeric order
        "current": {},
        "hide": 0,
        "includeAll": multi,
        "multi": multi,
        **({"allValue": ".*"} if multi else {}),
    }


def _thresholds(steps: list[Threshold] | None) -> dict:
    return {
        "mode": "absolute",
        "steps": [{"value": value, "color": color} for value, color in steps or [(None, "green")]],
    }


def _panel(index: int, panel: Panel, x: int, y: int) -> dict:
    if panel.kind == "row":
        return {
            "id": index + 1,
            "type": "row",
            "title": panel.title,
            "description": panel.description,
            "collapsed": False,
            "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "panels": [],
            "targets": [],
        }
    defaults: dict = {"unit": panel.unit, "thresholds": _thresholds(panel.thresholds)}
    if panel.kind == "stat":
        defaults["color"] = {"mode": "thresholds"}
        options: dict = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value" if panel.thresholds else "none",
            "graphMode": "area",
            "textMode": "value",
        }
    else:
        style = "dashed" if panel.thresholds else "off"
        defaults["custom"] = {"thresholdsStyle": {"mode": style}}
        options = {"legend": {"displayMode": "list", "placement": "bottom"}}
    built = {
        "id": index + 1,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": x, "y": y, "w": panel.width, "h": panel.height},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "range": True}
            for i, (legend, expr) in enumerate(panel.targets)
        ],
    }
    if panel.optional:
        built["meshtrainOptional"] = panel.optional
    return built


def _layout(panels: list[Panel]) -> list[dict]:
    """Panels left to right, wrapping at Grafana's 24 columns."""
    out, x, y, row_height = [], 0, 0, 0
    for index, panel in enumerate(panels):
        if panel.kind == "row" or x + panel.width > 24:
            x, y, row_height = 0, y + row_height, 0
        out.append(_panel(index, panel, x, y))
        if panel.kind == "row":
            x, y, row_height = 0, y + 1, 0
            continue
        x, row_height = x + panel.width, max(row_height, panel.height)
    return out


def dashboard(
    uid: str,
    title: str,
    panels: list[Panel],
    variables: list[dict],
    tags: list[str],
    annotations: list[dict],
) -> dict:
    """A Grafana dashboard (schema 39) with the given panels, template variables and annotations."""
    return {
        "uid": uid,
        "title": title,
        "tags": tags,
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "timezone": "browser",
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables},
        "annotations": {"list": annotations},
        "panels": _layout(panels),
    }


def build() -> dict[str, dict]:
    """file name -> dashboard."""
    training = dashboard(
        "meshtrain-training",
        "meshtrain / training",
        TRAINING_PANELS,
        [
            _datasource_var(),
            _query_var("namespace", "label_values(meshtrain_step, namespace)"),
            _query_var(
                "trainingjob", 'label_values(meshtrain_step{namespace="$namespace"}, trainingjob)'
            ),
            _query_var(
                "pod",
                'label_values(meshtrain_step{namespace="$namespace", trainingjob="$trainingjob"}, pod)',
                multi=True,
            ),
            _query_var(
                "rank",
                'label_values(meshtrain_step{namespace="$namespace", trainingjob="$trainingjob", pod=~"$pod"}, rank)',
                multi=True,
            ),
        ],
        ["meshtrain", "training"],
        TRAINING_ANNOTATIONS,
    )
    operator = dashboard(
        "meshtrain-operator",
        "meshtrain / operator",
        OPERATOR_PANELS,
        [
            _datasource_var(),
            _query_var(
                "namespace",  # the jobs' namespaces
                f"label_values(meshtrain_operator_job_status_phase{{{OPERATOR_JOB}}}, namespace)",
                multi=True,
            ),
            _query_var(
                "operator_namespace",  # where the operator's replicas run
                f"label_values(up{{{OPERATOR_JOB}}}, namespace)",
                multi=True,
            ),
        ],
        ["meshtrain", "operator"],
        OPERATOR_ANNOTATIONS,
    )
    return {"meshtrain-training.json": training, "meshtrain-operator.json": operator}


def render(board: dict) -> str:
    """The JSON text of a dashboard as stored in this folder."""
    return json.dumps(board, indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    for name, board in build().items():
        (HERE / name).write_text(render(board), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
