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

from meshtrain.api import layout as layout_mod
from meshtrain.operator.cluster import metrics as operator_metrics
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
    assert variables == ["datasource", "namespace", "trainingjob", "pod", "rank"]
    multi = {v["name"] for v in board["templating"]["list"] if v.get("multi")}
    assert multi == {"pod", "rank"}
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            expr = target["expr"]
            assert 'namespace="$namespace"' in expr, panel["title"]
            assert 'trainingjob="$trainingjob"' in expr, panel["title"]


def test_panels_have_real_units():
    for name in ("meshtrain-training.json", "meshtrain-operator.json"):
        for panel in load(name)["panels"]:
            assert panel["fieldConfig"]["defaults"]["unit"] != "short", (name, panel["title"])


def test_training_dashboard_opens_with_the_stat_row():
    panels = load("meshtrain-training.json")["panels"]
    top = [p for p in panels if p["gridPos"]["y"] == 0]
    assert all(p["type"] == "stat" for p in top)
    titles = " | ".join(p["title"] for p in top).lower()
    for words in ("tokens/s", "mfu", "step", "eta", "restarts", "checkpoint age"):
        assert words in titles, words


DCGM_SERIES = """
      - series: 'meshtrain_step{namespace="ns", job="meshtrain-trainer", trainingjob="j", pod="j-0", rank="0"}'
        values: "1x5"
      - series: 'meshtrain_step{namespace="ns", job="meshtrain-trainer", trainingjob="j", pod="j-1", rank="2"}'
        values: "1x5"
      - series: 'DCGM_FI_DEV_GPU_UTIL{namespace="gpu-operator", pod="dcgm-exporter-x", exported_namespace="ns", exported_pod="j-0", gpu="0"}'
        values: "80x5"
      - series: 'DCGM_FI_DEV_GPU_UTIL{namespace="ns", pod="j-1", gpu="0"}'
        values: "60x5"
      - series: 'DCGM_FI_DEV_GPU_UTIL{namespace="other", pod="j-0", gpu="0"}'
        values: "10x5"
"""


def test_dcgm_join_finds_the_pod_under_pod_or_exported_pod(tmp_path):
    """DCGM scraped with or without honorLabels: both pods of the job are found, another tenant's is not."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: apt-get install -y prometheus (make bootstrap does it)"
    panel = next(
        p
        for p in load("meshtrain-training.json")["panels"]
        if p["title"] == "GPU utilisation (DCGM)"
    )
    expr = panel["targets"][0]["expr"]
    for name, value in (
        ("$namespace", "ns"),
        ("$trainingjob", "j"),
        ("$pod", ".*"),
        ("$rank", ".*"),
    ):
        expr = expr.replace(name, value)
    (tmp_path / "empty.yaml").write_text("groups: []\n")
    test = {
        "rule_files": ["empty.yaml"],
        "tests": [
            {
                "interval": "1m",
                "input_series": yaml.safe_load(DCGM_SERIES),
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "2m",
                        "exp_samples": [
                            {"labels": "{pod='j-0'}", "value": 80},
                            {"labels": "{pod='j-1'}", "value": 60},
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "dcgm_test.yaml").write_text(yaml.safe_dump(test))
    done = subprocess.run(
        [promtool, "test", "rules", "dcgm_test.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_training_dashboard_queries_only_exported_metrics():
    names = exported_names() | operator_names()
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
            if not all(m in labels for m in metrics):
                continue  # the operator's series (namespace, trainingjob): checked on real scrapes
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


def rules() -> list[dict]:
    doc = yaml.safe_load((DASHBOARDS / "rules.yaml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_rules_reference_exported_metrics_or_recorded_series():
    recorded = {r["record"] for r in rules() if "record" in r}
    names = exported_names() | operator_names()
    for rule in rules():
        for metric in METRIC.findall(rule["expr"]):
            assert metric in names, (rule.get("record") or rule.get("alert"), metric)
        for series in re.findall(r"\bmeshtrain:[a-z_0-9:]+", rule["expr"]):
            assert series in recorded, series


def runbook_anchors() -> set[str]:
    """GitHub's anchors of the headings of docs/runbooks.md."""
    text = (REPO / "docs" / "runbooks.md").read_text()
    return {
        re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.*)$", text, re.M)
    }


def test_every_alert_has_severity_summary_description_and_a_runbook():
    anchors = runbook_anchors()
    for rule in (r for r in rules() if "alert" in r):
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        notes = rule["annotations"]
        assert notes.get("summary") and notes.get("description"), name
        page, _, anchor = notes["runbook_url"].partition("#")
        assert page.endswith("/docs/runbooks.md") and anchor in anchors, (
            f"{name}: runbook {notes['runbook_url']} has no heading in docs/runbooks.md"
        )


def test_every_alert_is_unit_tested_firing_and_quiet():
    tests = yaml.safe_load((DASHBOARDS / "rules_test.yaml").read_text())["tests"]
    cases = [case for t in tests for case in t.get("alert_rule_test", [])]
    for name in (r["alert"] for r in rules() if "alert" in r):
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c.get("exp_alerts") for c in mine), f"{name}: no promtool case where it fires"
        assert any(not c.get("exp_alerts") for c in mine), (
            f"{name}: no promtool case where it stays quiet"
        )


def test_promtool_checks_and_unit_tests_the_rules():
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: apt-get install -y prometheus (make bootstrap does it)"
    for args in (["check", "rules", "rules.yaml"], ["test", "rules", "rules_test.yaml"]):
        done = subprocess.run([promtool, *args], cwd=DASHBOARDS, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_every_exported_metric_is_documented():
    documented = (REPO / "docs" / "telemetry.md").read_text()
    families = {HISTOGRAM_SUFFIX.sub("", n) for n in exported_names() | operator_names()}
    missing = sorted(f for f in families if f"`{f}" not in documented)
    assert not missing, f"not in docs/telemetry.md: {missing}"


def test_the_alert_table_of_the_docs_is_the_rules():
    """docs/telemetry.md's alert table lists every alert of dashboards/rules.yaml, no other, each
    with the rule's severity and ``for`` (— without one)."""
    text = (REPO / "docs" / "telemetry.md").read_text()
    rows = re.findall(r"^\s*\| `(Meshtrain\w+)` \| (\w+) \| ([\w—]+) \|", text, re.MULTILINE)
    documented = {name: (severity, held) for name, severity, held in rows}
    assert len(documented) == len(rows), "an alert is listed twice"
    alerts = {
        r["alert"]: (r["labels"]["severity"], r.get("for", "—")) for r in rules() if "alert" in r
    }
    assert documented == alerts
