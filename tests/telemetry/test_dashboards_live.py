"""Every panel, annotation and rule of every dashboard, evaluated on real scrapes of the real parts.

The sandbox runs the real control plane, the real operator (the chart's
ServiceAccount) and real trainer processes of a dp2·pp2 TrainingJob, scraped
by a real Prometheus that evaluates ``dashboards/rules.yaml`` (reloaded
with every group evaluated each second).  A second job asks for more GPUs
than the sandbox has, so the operator has an unschedulable job to report.

At a time inside the training run, each panel query of each dashboard (with
its template variables resolved through Prometheus the way Grafana does)
must return data, and so must every recording rule and the signal of every
alert.  The metric names come from the exporters themselves: the trainer's
registry and the operator's registry must all be in Prometheus' scrape, and
every metric a dashboard or rule reads must be among them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import prometheus_client
import pytest
import yaml

from meshtrain.api import job_dir
from meshtrain.api import layout as layout_mod
from meshtrain.operator.cluster import metrics as operator_metrics
from meshtrain.sandbox import example, supervisor
from meshtrain.trainer.telemetry import context, exporter, steplog
from tests.telemetry import conftest, promserver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

REPO = conftest.REPO
DASHBOARDS = sorted((REPO / "dashboards").glob("*.json"))
JOB, WAITING, NAMESPACE = "obs-live", "obs-waiting", "default"
STEPS = 400
RATE_INTERVAL = "10s"
"""``$__rate_interval`` of a 2 s scrape (Grafana: max(4 x scrape, step + scrape))."""
METRIC = re.compile(r"\b(meshtrain_[a-z_]+|DCGM_[A-Z_]+)\b")
ALERT = re.compile(
    r"^(?P<signal>.*\S)\s*(?P<cmp>[<>]=?|[!=]=)\s*(?P<threshold>[0-9.e+-]+)\s*$", re.S
)
ABSENT = re.compile(r"^absent\((?P<signal>.*)\)$", re.S)
HELD_SECONDS = 5
"""An alert's ``for`` scaled to the minute-long run: its condition must hold at each of these 1 s evaluations."""


@dataclasses.dataclass
class LiveRun:
    prom: promserver.PrometheusApi
    at: float
    """Unix time inside the training run at which every query is evaluated."""
    pods: list[str]


def _reload_with_fast_rules(paths: supervisor.Paths, url: str) -> None:
    rules = paths.root / "prometheus" / "rules.yaml"
    conftest.fast_rules(REPO / "dashboards" / "rules.yaml", rules)
    request = urllib.request.Request(f"{url}/-/reload", method="POST")
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200


EVENT_DRIVEN = {
    "meshtrain_operator_replans_total": "a waiting job is planned again only after a capacity "
    "change that could admit it: the run's waiting job asks more GPUs than the sandbox has",
    "meshtrain_operator_reservation_plans_total": "only a job that could fit once meshtrain's "
    "pods are gone holds the reservation, which the run's waiting job cannot",
}
"""Operator series this healthy run cannot produce, and why; their panels' queries must still
be valid here, and tests/telemetry/test_operator_dashboard_scrape.py answers them from the
operator's real registry."""


def _job_manifest(paths: supervisor.Paths) -> Path:
    document = yaml.safe_load(example.DEFAULT_EXAMPLE.read_text())
    document["metadata"]["name"] = JOB
    document["spec"]["checkpoint"].update(claimName="obs-live-ckpt", intervalSteps=100)
    document["spec"]["training"]["steps"] = STEPS
    # Elastic (dp1..2, placed at 2): the operator's data-parallel degree gauges have a job to report.
    document["spec"].setdefault("runPolicy", {})["elastic"] = {"minData": 1, "maxData": 2}
    # Evaluation on: meshtrain_eval_loss (a panel of the training dashboard) exists once a job evaluates.
    document["spec"]["training"]["eval"] = {"interval": 50, "batches": 1, "heldOut": 0.05}
    path = paths.root / f"{JOB}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def _waiting_manifest(paths: supervisor.Paths) -> Path:
    """A valid job for 64 GPUs on a 4-GPU sandbox: InsufficientGPUs."""
    document = yaml.safe_load(example.DEFAULT_EXAMPLE.read_text())
    document["metadata"]["name"] = WAITING
    document["spec"]["parallelism"].update(data=64, pipeline=1, microBatches=1)
    document["spec"]["resources"]["gpusPerNode"] = 4
    document["spec"]["checkpoint"] = {"path": "/checkpoints", "intervalSteps": 0}
    path = paths.root / f"{WAITING}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    paths = supervisor.Paths(tmp_path_factory.mktemp("live-sandbox"))
    paths.root.mkdir(parents=True, exist_ok=True)
    state = supervisor.up(paths)
    try:
        url = state["prometheus_url"]
        _reload_with_fast_rules(paths, url)
        example.kubectl(paths, "apply", "-f", str(_waiting_manifest(paths)))
        namespace, name = example.apply(paths, _job_manifest(paths))
        final = example.follow(paths, namespace, name, timeout=900, on_change=print)
        assert final["status"]["phase"] == "Succeeded", json.dumps(final["status"], indent=2)
        waiting = example.job(paths, NAMESPACE, WAITING) or {}
        assert (waiting.get("status") or {}).get("phase") == "Pending", waiting.get("status")
        claim = paths.root / "volumes" / NAMESPACE / "obs-live-ckpt"  # the job's own logs on it
        records = steplog.read(
            Path(job_dir.log_dir(str(claim), namespace, name)) / steplog.FILENAME
        )
        trained = records[-1]["time"] - records[0]["time"]
        assert trained > 15, f"the job trained only {trained:.1f}s: too short for the rate windows"
        pods = [p["metadata"]["name"] for p in _pods(paths)]
        yield LiveRun(prom=promserver.PrometheusApi(url), at=records[-1]["time"] - 1.5, pods=pods)
    finally:
        leftovers = supervisor.down(paths)
        assert leftovers == [], f"processes left behind after down: {leftovers}"


def _pods(paths: supervisor.Paths) -> list[dict]:
    out = example.kubectl(
        paths, "get", "pods", "-n", NAMESPACE, "-l", f"meshtrain.io/job={JOB}", "-o", "json"
    )
    return json.loads(out)["items"]


def _registry_names(registry: prometheus_client.CollectorRegistry, prefix: str) -> set[str]:
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}
    return {
        f.name + suffix
        for f in registry.collect()
        if f.name.startswith(prefix)
        for suffix in suffixes.get(f.type, ("",))
    }


def trainer_names() -> set[str]:
    identity = context.RankIdentity.from_env(layout_mod.ParallelLayout(1, 1, 1), 0, 0, env={})
    return _registry_names(exporter.Metrics(identity).registry, "meshtrain_")


def operator_names() -> set[str]:
    assert operator_metrics.RECONCILE_SECONDS  # the operator's registry is the process-wide one
    return _registry_names(prometheus_client.REGISTRY, "meshtrain_operator_")


def _resolve(run: LiveRun, board: dict, expr: str) -> str:
    """``expr`` with the board's variables as Grafana would send them (multi-select: a regex of all values)."""
    values = {"__rate_interval": RATE_INTERVAL, "trainingjob": JOB}
    if board["uid"] == "meshtrain-training":  # the operator's: All (the job's and the operator's)
        values["namespace"] = NAMESPACE
    for var in board["templating"]["list"]:
        if var["type"] != "query" or var["name"] in values:
            continue
        match = re.fullmatch(r"label_values\((.*), (\w+)\)", var["definition"])
        selector = _substitute(match.group(1), values)
        found = run.prom.api(
            f"label/{match.group(2)}/values",
            **{"match[]": selector, "start": run.at - 60, "end": run.at},
        )
        assert found, f"{board['title']}: variable {var['name']} finds no values ({selector})"
        values[var["name"]] = "(" + "|".join(_regex_escape(v) for v in found) + ")"
    return _substitute(expr, values)


def _regex_escape(value: str) -> str:
    """A value in a PromQL regex string literal, escaped as Grafana's Prometheus data source does."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", value)


def _substitute(expr: str, values: dict[str, str]) -> str:
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    assert not re.search(r"\$[A-Za-z_{]", expr), (
        f"unresolved variable in {expr}"
    )  # $1: label_replace
    return expr


def rules() -> list[dict]:
    doc = yaml.safe_load((REPO / "dashboards" / "rules.yaml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alert_signal(rule: dict) -> str:
    expr = rule["expr"].strip()
    match = ABSENT.match(expr) or ALERT.match(expr)
    assert match, (
        f"alert {rule['alert']} must read '<signal> <cmp> <threshold>' or 'absent(<signal>)'"
    )
    return match.group("signal")


def test_prometheus_scraped_every_metric_the_exporters_declare(live_run):
    scraped = set(live_run.prom.api("label/__name__/values"))
    labelled_on_event = {  # a child per restarted (resized) job
        "meshtrain_operator_gang_restarts_total",
        "meshtrain_operator_elastic_resizes_total",
        # a child per recovery cause: this run is not faulted
        "meshtrain_recoveries_total",
        # observed only under context parallelism (parallelism.context > 1), which this job has not
        "meshtrain_context_ring_seconds_bucket",
        "meshtrain_context_ring_seconds_count",
        "meshtrain_context_ring_seconds_sum",
        *EVENT_DRIVEN,
    }
    missing = (trainer_names() | operator_names()) - scraped - labelled_on_event
    assert not missing, f"declared by an exporter, never scraped: {sorted(missing)}"


def test_every_metric_a_dashboard_or_rule_reads_is_exported():
    declared = trainer_names() | operator_names()
    exprs = [
        t["expr"]
        for path in DASHBOARDS
        for p in json.loads(path.read_text())["panels"]
        for t in p.get("targets", [])
    ]
    exprs += [r["expr"] for r in rules()]
    unknown = {m for e in exprs for m in METRIC.findall(e) if not m.startswith("DCGM_")} - declared
    assert not unknown, f"read by a dashboard or rule, exported by nobody: {sorted(unknown)}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_panel_query_returns_data(live_run, path):
    board = json.loads(path.read_text())
    empty = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            result = live_run.prom.query(_resolve(live_run, board, target["expr"]), live_run.at)
            event_driven = any(name in target["expr"] for name in EVENT_DRIVEN)
            if not result and panel.get("meshtrainOptional") != "dcgm" and not event_driven:
                empty.append(f"{panel['title']} [{target['refId']}]: {target['expr']}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_annotation_query_is_valid(live_run, path):
    board = json.loads(path.read_text())
    for annotation in board["annotations"]["list"]:
        live_run.prom.query(_resolve(live_run, board, annotation["expr"]), live_run.at)  # raises


def test_every_rule_expression_returns_data(live_run):
    empty = []
    for rule in rules():
        if "record" in rule:
            exprs = [rule["expr"], rule["record"]]
        else:
            live_run.prom.query(rule["expr"], live_run.at)  # the whole expression is valid PromQL
            exprs = [alert_signal(rule)]
        for expr in exprs:
            if not live_run.prom.query(expr, live_run.at):
                empty.append(f"{rule.get('record') or rule.get('alert')}: {expr}")
    assert not empty, "rules without data:\n" + "\n".join(empty)


def test_no_alert_fires_on_a_healthy_run(live_run):
    # `for:` keeps blips quiet in production, so the test asks whether a condition held for HELD_SECONDS,
    # not whether it was true once.  Three alerts measure the machine rather than the job here: on a shared
    # 2-core VM (load averages of 20 and more seen) one CPU rank of a stage really does compute 25 % slower
    # than the other for a minute (and the trainer's own detector then flags it: benchmarks/results/
    # straggler_detection-vm.json saw such flags without any injected slowdown), and the CPU pipeline
    # bubble is far from theory.
    held = f"[{HELD_SECONDS}s:1s]"
    noisy_on_cpu = {
        "MeshtrainPipelineBubbleAboveTheory",
        "MeshtrainStragglerRank",
        "MeshtrainStragglerFlagged",
    }
    firing = [
        r["alert"]
        for r in rules()
        if "alert" in r
        and r["alert"] not in noisy_on_cpu
        and live_run.prom.query(
            f"count_over_time(({r['expr']}){held}) >= {HELD_SECONDS}", live_run.at
        )
    ]
    assert not firing, [  # each firing alert's signal over the last two minutes
        (
            alert,
            live_run.prom.api(
                "query_range",
                query=alert_signal(next(r for r in rules() if r.get("alert") == alert)),
                start=live_run.at - 120,
                end=live_run.at,
                step=2,
            ),
        )
        for alert in firing
    ]


def test_the_waiting_job_is_reported_unschedulable(live_run):
    waited = live_run.prom.query(
        f'meshtrain_operator_job_unschedulable_seconds{{trainingjob="{WAITING}"}}', live_run.at
    )
    assert waited and float(waited[0]["value"][1]) > 0, waited
    failures = live_run.prom.query(
        'meshtrain_operator_placement_failures_total{reason="InsufficientGPUs"}', live_run.at
    )
    assert failures and float(failures[0]["value"][1]) >= 1, failures


def test_the_checkpoint_metrics_follow_the_run(live_run):
    steps = live_run.prom.query(
        f'max(meshtrain_checkpoint_last_step{{trainingjob="{JOB}"}})', live_run.at
    )
    assert steps, "no checkpoint step scraped"
    assert float(steps[0]["value"][1]) % 100 == 0 and float(steps[0]["value"][1]) >= 100


def _render_module():
    spec = importlib.util.spec_from_file_location("render", REPO / "dashboards" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_panels_drawn_without_grafana(live_run, tmp_path):
    """Each dashboard's stat row and a few time series, drawn from the run (look at the PNGs printed)."""
    render = _render_module()
    wanted = {
        "meshtrain-training": [
            "Throughput",
            "Step time per rank (stragglers)",
            "Pipeline bubble: measured vs theoretical",
        ],
        "meshtrain-operator": [
            "Jobs by phase",
            "Unschedulable for",
            "Placement failures by reason",
        ],
    }
    for name, series in wanted.items():
        board = json.loads((REPO / "dashboards" / f"{name}.json").read_text())
        titles = [p["title"] for p in board["panels"] if p["type"] == "stat"] + series
        out = tmp_path / f"{name}.png"
        drawn = render.render(
            live_run.prom.url,
            name,
            titles,
            # the operator's namespace filter: All (.*), its own series are in meshtrain-system
            {"namespace": NAMESPACE, "trainingjob": JOB} if name == "meshtrain-training" else {},
            out,
            end=live_run.at,
            minutes=2,
        )
        print(f"\npanels drawn: {out}")
        assert all(drawn[t] > 0 for t in titles), drawn
        assert out.stat().st_size > 20_000
