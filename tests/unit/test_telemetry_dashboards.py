"""The Grafana dashboards and Prometheus rules: generated, consistent, about real metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import prometheus_client
import yaml

from meshtrain import layout as layout_mod
from meshtrain.operator import metrics as operator_metrics
from meshtrain.trainer.telemetry import context, exporter

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
METRIC = re.compile(r"\b(meshtrain_[a-z_]+|DCGM_[A-Z_]+)\b")
HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")
GROUPING = re.compile(r"\bby \(([^)]*)\)")


def load(name: str) -> dict:
    return json.loads((DASHBOARDS / name).read_text())


def sample_names(registry: prometheus_client.CollectorRegistry) -> set[str]:
    """Sample names a registry serves (families with no labelled child yet included)."""
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}
    return {
        f.name + suffix for f in registry.collect() for suffix in ("", *suffixes.get(f.type, ()))
    }


def exported_names() -> set[str]:
    """Sample names the trainer's exporter serves."""
    identity = context.RankIdentity.from_env(layout_mod.ParallelLayout(1, 1, 1), 0, 0, env={})
    return sample_names(exporter.Metrics(identity).registry)


def operator_names() -> set[str]:
    """``meshtrain_operator_*`` sample names the operator serves (its process-wide registry)."""
    assert operator_metrics.RECONCILE_SECONDS  # registers the operator's metrics
    return {
        n for n in sample_names(prometheus_client.REGISTRY) if n.startswith("meshtrain_operator_")
    }


def exported_labels() -> dict[str, set[str]]:
    """Label names of every sample name the trainer's exporter serves (``le`` on histogram buckets)."""
    identity = context.RankIdentity.from_env(layout_mod.ParallelLayout(1, 1, 1), 0, 0, env={})
    metrics = exporter.Metrics(identity)
    labels: dict[str, set[str]] = {}
    for family in vars(metrics).values():
        names = getattr(family, "_labelnames", None)
        if names is None or not hasattr(family, "_name"):
            continue
        kind = getattr(family, "_type", "")
        base = family._name
        for suffix in {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}.get(
            kind, ("",)
        ):
            labels[base + suffix] = set(names) | ({"le"} if suffix == "_bucket" else set())
    return labels


def test_json_files_are_what_build_py_generates():
    sys.path.insert(0, str(DASHBOARDS))
    try:
        import build  # noqa: PLC0415 - the generator is a script beside the JSON, not a package module
    finally:
        sys.path.pop(0)
    for name, board in build.build().items():
        assert (DASHBOARDS / name).read_text() == build.render(board), (
            f"{name} is stale: run python dashboards/build.py"
        )


def test_training_dashboard_variables_and_datasource():
    board = load("meshtrain-training.json")
    variables = [v["name"] for v in board["templating"]["list"]]
    assert variables == ["datasource", "namespace", "job"]
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            if "DCGM" not in target["expr"]:
                assert (
                    'namespace="$namespace"' in target["expr"] and 'job="$job"' in target["expr"]
                ), panel["title"]


def test_training_dashboard_queries_only_exported_metrics():
    names = exported_names()
    board = load("meshtrain-training.json")
    for panel in board["panels"]:
        for target in panel["targets"]:
            for metric in METRIC.findall(target["expr"]):
                if metric.startswith("DCGM_"):
                    assert panel.get("meshtrainOptional") == "dcgm", panel["title"]
                else:
                    assert metric in names, f"{panel['title']}: {metric} is not exported"


def test_training_dashboard_groups_by_labels_the_metrics_carry():
    """``max by (pp, kind)`` of a metric without ``kind`` still returns data: check the label names here."""
    labels = exported_labels()
    for panel in load("meshtrain-training.json")["panels"]:
        if panel.get("meshtrainOptional") == "dcgm":
            continue
        for target in panel["targets"]:
            metrics = METRIC.findall(target["expr"])
            carried = set.union(*(labels[m] for m in metrics))
            for group in GROUPING.findall(target["expr"]):
                wanted = {name.strip() for name in group.split(",")}
                assert wanted <= carried, (
                    f"{panel['title']}: grouping by {wanted - carried} that {metrics} do not carry"
                )


def test_training_dashboard_covers_the_issue():
    titles = " | ".join(p["title"] for p in load("meshtrain-training.json")["panels"]).lower()
    for words in (
        "throughput",
        "flops",
        "loss",
        "step time p50 / p99",
        "all-reduce time p50 / p99",
        "bus bandwidth",
        "exposed communication",
        "measured vs theoretical",
        "stragglers",
        "memory",
        "gpu utilisation",
        "tensor core",
    ):
        assert words in titles, words


def test_operator_dashboard_queries_only_what_the_operator_exports():
    names = operator_names()
    for panel in load("meshtrain-operator.json")["panels"]:
        for target in panel["targets"]:
            for metric in METRIC.findall(target["expr"]):
                assert metric in names, (
                    f"{panel['title']}: {metric} is not exported by the operator"
                )


def test_every_operator_metric_is_on_the_operator_dashboard():
    board = load("meshtrain-operator.json")
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in board["annotations"]["list"]]
    used = {HISTOGRAM_SUFFIX.sub("", m) for e in exprs for m in METRIC.findall(e)}
    families = {HISTOGRAM_SUFFIX.sub("", n).removesuffix("_total") for n in operator_names()}
    missing = {f for f in families if f not in used and f + "_total" not in used}
    assert not missing, f"exported by the operator but on no panel or annotation: {sorted(missing)}"


def test_rules_reference_exported_metrics_or_recorded_series():
    doc = yaml.safe_load((DASHBOARDS / "rules.yaml").read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    names = exported_names()
    for rule in rules:
        for metric in METRIC.findall(rule["expr"]):
            assert metric in names, (rule.get("record") or rule.get("alert"), metric)
        for series in re.findall(r"\bmeshtrain:[a-z_0-9:]+", rule["expr"]):
            assert series in recorded, series
    assert {r["alert"] for r in rules if "alert" in r} == {
        "MeshtrainJobStalled",
        "MeshtrainStragglerRank",
        "MeshtrainPipelineBubbleAboveTheory",
        "MeshtrainAllreduceBandwidthCollapse",
    }


def test_promtool_checks_and_unit_tests_the_rules():
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: apt-get install -y prometheus (make bootstrap does it)"
    for args in (["check", "rules", "rules.yaml"], ["test", "rules", "rules_test.yaml"]):
        done = subprocess.run([promtool, *args], cwd=DASHBOARDS, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
