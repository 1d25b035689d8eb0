"""Generates the Grafana dashboards in this folder: ``python dashboards/build.py``.

What it is: the panels of ``meshtrain-training.json`` and
``meshtrain-operator.json`` as short Python tables (title, PromQL, unit), so
that every query is written once, the JSON stays consistent (ids, grid,
datasource) and tests/unit/test_telemetry_dashboards.py can check the files
are up to date.

What it is not: a Grafana client; nothing is uploaded.  The JSON files are
imported by hand or provisioned by the Helm chart.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEL = 'namespace="$namespace", job="$job"'
RI = "$__rate_interval"
OPTIONAL_DCGM = "Optional: needs the NVIDIA DCGM exporter in the cluster; empty without it."


def _mean(metric: str, by: str) -> str:
    return (
        f"sum by ({by}) (rate({metric}_sum{{{SEL}}}[{RI}])) / "
        f"sum by ({by}) (rate({metric}_count{{{SEL}}}[{RI}]))"
    )


def _quantile(q: float, metric: str, by: str = "") -> str:
    extra = f", {by}" if by else ""
    return f"histogram_quantile({q}, sum by (le{extra}) (rate({metric}_bucket{{{SEL}}}[{RI}])))"


def _dcgm(metric: str) -> str:
    return f"avg by (pod) ({metric} and on (namespace, pod) group by (namespace, pod) (meshtrain_step{{{SEL}}}))"


# (title, unit, [(legend, expr)], description)
TRAINING_PANELS: list[tuple[str, str, list[tuple[str, str]], str]] = [
    (
        "Throughput",
        "short",
        [("tokens/s", f"max by (namespace, job) (rate(meshtrain_tokens_total{{{SEL}}}[{RI}]))")],
        "Tokens of the global batch per second (every rank counts the whole job, so max over ranks).",
    ),
    (
        "Model FLOPs utilisation",
        "percentunit",
        [
            (
                "MFU",
                f"avg by (namespace, job) (avg_over_time(meshtrain_model_flops_utilization_ratio{{{SEL}}}[{RI}]))",
            )
        ],
        "Model FLOPs (6N + attention, docs/telemetry.md) over world size x peak FLOP/s x step time.",
    ),
    (
        "Loss",
        "short",
        [("loss", f'max by (namespace, job) (meshtrain_loss{{{SEL}, rank="0"}})')],
        "Mean training loss of the last step (identical on every rank).",
    ),
    (
        "Training progress",
        "short",
        [("step", f"max by (namespace, job) (meshtrain_step{{{SEL}}})")],
        "Last completed optimizer step.",
    ),
    (
        "Step time p50 / p99",
        "s",
        [
            ("p50", _quantile(0.5, "meshtrain_step_seconds")),
            ("p99", _quantile(0.99, "meshtrain_step_seconds")),
        ],
        "Wall time of an optimizer step over all ranks.",
    ),
    (
        "All-reduce time p50 / p99 by group",
        "s",
        [
            ("p50 {{group}}", _quantile(0.5, "meshtrain_allreduce_seconds", "group")),
            ("p99 {{group}}", _quantile(0.99, "meshtrain_allreduce_seconds", "group")),
        ],
        "Duration of one collective call: a gradient bucket for dp, a layer's reduction for tp.",
    ),
    (
        "Bus bandwidth by group",
        "Bps",
        [
            (
                "{{group}} {{op}}",
                f'avg by (group, op) (meshtrain_collective_bus_bandwidth_bytes_per_second{{{SEL}, group=~"dp|tp"}})',
            )
        ],
        "nccl-tests bus bandwidth: algbw x 2(n-1)/n (all-reduce), x (n-1)/n (reduce-scatter, all-gather).",
    ),
    (
        "Exposed communication per step",
        "s",
        [("stage {{pp}}", _mean("meshtrain_exposed_comm_seconds", "pp"))],
        "Gradient reduction still running after the last backward (not hidden by compute).",
    ),
    (
        "Exposed communication share of step",
        "percentunit",
        [
            (
                "stage {{pp}}",
                f"sum by (pp) (rate(meshtrain_exposed_comm_seconds_sum{{{SEL}}}[{RI}])) / sum by (pp) (rate(meshtrain_step_seconds_sum{{{SEL}}}[{RI}]))",
            )
        ],
        "Exposed communication over step time, per pipeline stage.",
    ),
    (
        "Pipeline bubble: measured vs theoretical",
        "percentunit",
        [
            ("measured stage {{pp}}", f"avg by (pp) (meshtrain_pipeline_bubble_ratio{{{SEL}}})"),
            (
                "theoretical",
                f"max by (namespace, job) (meshtrain_pipeline_bubble_ratio_theoretical{{{SEL}}})",
            ),
        ],
        "Measured idle share of each stage's step vs (p-1)/(v*m+p-1).",
    ),
    (
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
    (
        "Step time per rank (stragglers)",
        "s",
        [("rank {{rank}}", _mean("meshtrain_step_seconds", "rank"))],
        "Mean step time of each rank; synchronous training makes them equal unless a rank lags at the end.",
    ),
    (
        "Compute time per rank (stragglers)",
        "s",
        [("rank {{rank}} (stage {{pp}})", _mean("meshtrain_compute_seconds", "rank, pp"))],
        "Forward+backward compute per step; ranks of one stage do the same work, so a higher line is a slow device.",
    ),
    (
        "Step-time spread across ranks",
        "percentunit",
        [
            (
                "max/min - 1",
                f"max by (namespace, job) ({_mean('meshtrain_compute_seconds', 'namespace, job, rank')}) / min by (namespace, job) ({_mean('meshtrain_compute_seconds', 'namespace, job, rank')}) - 1",
            )
        ],
        "How much slower the slowest rank computes than the fastest.",
    ),
    (
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
    (
        "GPU utilisation (DCGM)",
        "percent",
        [("{{pod}}", _dcgm("DCGM_FI_DEV_GPU_UTIL"))],
        OPTIONAL_DCGM,
    ),
    (
        "Tensor core activity (DCGM)",
        "percentunit",
        [("{{pod}}", _dcgm("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"))],
        OPTIONAL_DCGM,
    ),
]

OPSEL = 'namespace=~"$namespace"'
OPERATOR_PANELS: list[tuple[str, str, list[tuple[str, str]], str]] = [
    (
        "Unfinished jobs by restarts left",
        "short",
        [
            (
                "{{namespace}}/{{trainingjob}}",
                f"min by (namespace, trainingjob) (meshtrain_operator_job_restarts_remaining{{{OPSEL}}})",
            )
        ],
        "backoffLimit - restarts of every job not yet finished; at 0 the next failure fails the job.",
    ),
    (
        "Failed and unschedulable jobs",
        "short",
        [
            (
                "failed",
                f'sum(meshtrain_operator_job_status_phase{{{OPSEL}, phase="Failed"}})',
            ),
            ("unschedulable", "sum(meshtrain_operator_unschedulable_jobs)"),
        ],
        "Jobs in phase Failed, and jobs waiting for capacity.",
    ),
    (
        "Jobs by phase",
        "short",
        [("{{phase}} {{queue}}", "sum by (phase, queue) (meshtrain_operator_jobs) > 0")],
        "TrainingJobs the operator reconciles, by phase and queue (Kueue's queue-name label).",
    ),
    (
        "Time from apply to Running p50 / p99",
        "s",
        [
            (
                "p50",
                f"histogram_quantile(0.5, sum by (le) (rate(meshtrain_operator_job_apply_to_running_seconds_bucket[{RI}])))",
            ),
            (
                "p99",
                f"histogram_quantile(0.99, sum by (le) (rate(meshtrain_operator_job_apply_to_running_seconds_bucket[{RI}])))",
            ),
        ],
        "From a TrainingJob's creation to its first Running phase (placement, pod start, gang gate).",
    ),
    (
        "Reconcile duration p50 / p99",
        "s",
        [
            (
                "p50",
                f"histogram_quantile(0.5, sum by (le) (rate(meshtrain_operator_reconcile_duration_seconds_bucket[{RI}])))",
            ),
            (
                "p99",
                f"histogram_quantile(0.99, sum by (le) (rate(meshtrain_operator_reconcile_duration_seconds_bucket[{RI}])))",
            ),
        ],
        "Time of one reconcile pass of a TrainingJob.",
    ),
    (
        "Reconciles per second",
        "ops",
        [("reconciles/s", f"sum(rate(meshtrain_operator_reconcile_duration_seconds_count[{RI}]))")],
        "Reconcile rate of the operator.",
    ),
    (
        "Placement duration p50 / p99",
        "s",
        [
            (
                "p50",
                f"histogram_quantile(0.5, sum by (le) (rate(meshtrain_operator_placement_duration_seconds_bucket[{RI}])))",
            ),
            (
                "p99",
                f"histogram_quantile(0.99, sum by (le) (rate(meshtrain_operator_placement_duration_seconds_bucket[{RI}])))",
            ),
        ],
        "Time the planner takes to place a gang (list nodes and pods, plan).",
    ),
    (
        "Placement failures by reason",
        "ops",
        [
            (
                "{{reason}}",
                f"sum by (reason) (rate(meshtrain_operator_placement_failures_total[{RI}]))",
            )
        ],
        "Placement attempts that placed nothing (a waiting job is retried at every resync).",
    ),
    (
        "Gang restarts",
        "short",
        [
            (
                "{{namespace}}/{{trainingjob}}",
                f"sum by (namespace, trainingjob) (meshtrain_operator_job_restarts{{{OPSEL}}})",
            )
        ],
        "status.restarts of each TrainingJob.",
    ),
    (
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
    (
        "Kubernetes API errors by verb",
        "ops",
        [("{{verb}}", f"sum by (verb) (rate(meshtrain_operator_api_errors_total[{RI}]))")],
        "Failed Kubernetes API requests of the operator (expected NotFound/AlreadyExists answers are not errors).",
    ),
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
        "sort": 1,
        "current": {},
        "hide": 0,
        "includeAll": multi,
        "multi": multi,
        **({"allValue": ".*"} if multi else {}),
    }


def _panel(
    index: int, title: str, unit: str, targets: list[tuple[str, str]], description: str
) -> dict:
    panel = {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": (index % 2) * 12, "y": (index // 2) * 8, "w": 12, "h": 8},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "range": True}
            for i, (legend, expr) in enumerate(targets)
        ],
    }
    if description == OPTIONAL_DCGM:
        panel["meshtrainOptional"] = "dcgm"
    return panel


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


OPERATOR_ANNOTATIONS = [
    _annotation(
        "Gang restarts",
        f"sum by (namespace, trainingjob) (increase(meshtrain_operator_gang_restarts_total{{{OPSEL}}}[1m])) > 0",
        "red",
        "{{namespace}}/{{trainingjob}} restarted its gang",
    ),
    _annotation(
        "Spec changes",
        f"max by (namespace, trainingjob) (changes(meshtrain_operator_job_spec_generation{{{OPSEL}}}[1m])) > 0",
        "blue",
        "{{namespace}}/{{trainingjob}}: spec changed",
    ),
]


def dashboard(
    uid: str,
    title: str,
    panels: list,
    variables: list[dict],
    tags: list[str],
    annotations: list[dict] = (),
) -> dict:
    """A Grafana dashboard (schema 39) with the given panels and template variables."""
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
        "annotations": {"list": list(annotations)},
        "panels": [_panel(i, *p) for i, p in enumerate(panels)],
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
            _query_var("job", 'label_values(meshtrain_step{namespace="$namespace"}, job)'),
        ],
        ["meshtrain", "training"],
    )
    operator = dashboard(
        "meshtrain-operator",
        "meshtrain / operator",
        OPERATOR_PANELS,
        [
            _datasource_var(),
            _query_var(
                "namespace",
                "label_values(meshtrain_operator_job_status_phase, namespace)",
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
