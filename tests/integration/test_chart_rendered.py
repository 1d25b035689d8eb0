"""The chart's monitors and dashboard ConfigMaps as real ``helm template`` renders them.

- the sandbox's and the telemetry tests' Prometheus relabel exactly as the chart's PodMonitor
  and ServiceMonitor do (their ``metricRelabelings`` in Prometheus' own snake_case), so a rule
  deleted from the chart fails here, not in production;
- every dashboard ConfigMap keys its data by its own name, and an upgrade from an earlier chart
  release (whose ConfigMaps had other names) deletes no data key a new ConfigMap writes: Grafana's
  sidecar writes and deletes dashboard files by data key, so a shared key would lose the dashboard.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import tarfile
from typing import Any

import pytest
import yaml

from meshtrain.sandbox import prometheus as sandbox_prometheus
from meshtrain.sandbox.controlplane import binaries

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "meshtrain"
MONITORS = ("trainerPodMonitor", "operatorServiceMonitor")
PREVIOUS_CHARTS = ("2cf42ad", "0070448^")
"""Chart 0.1.0, and 0.2.0 before its dashboard ConfigMaps were renamed."""


def _render(helm: pathlib.Path, chart: pathlib.Path, *values: str) -> list[dict[str, Any]]:
    sets = [a for v in values for a in ((v,) if v.startswith("--") else ("--set", v))]
    rendered = subprocess.run(
        [str(helm), "template", "mt", str(chart), *sets], capture_output=True, text=True
    )
    assert rendered.returncode == 0, rendered.stderr
    return [d for d in yaml.safe_load_all(rendered.stdout) if d]


def _snake(rule: dict[str, Any]) -> dict[str, Any]:
    """A Prometheus Operator relabel rule (camelCase) as Prometheus' configuration spells it."""
    return {re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), k): v for k, v in rule.items()}


def _endpoint(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (monitor,) = [d for d in documents if d["kind"] == kind]
    endpoints: list[dict[str, Any]] = (
        monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
    )
    (endpoint,) = endpoints
    return endpoint


def test_the_sandbox_and_the_tests_relabel_as_the_charts_monitors(
    control_plane_binaries: binaries.Binaries, tmp_path: pathlib.Path
) -> None:
    documents = _render(
        control_plane_binaries.helm, CHART, *(f"monitoring.{m}.enabled=true" for m in MONITORS)
    )
    config = sandbox_prometheus.build_config(targets_dir=tmp_path, rule_files=[])
    sandbox = {c["job_name"]: c["metric_relabel_configs"] for c in config["scrape_configs"]}
    for kind, constant in (
        ("PodMonitor", sandbox_prometheus.TRAINER_METRIC_RELABEL),
        ("ServiceMonitor", sandbox_prometheus.OPERATOR_METRIC_RELABEL),
    ):
        endpoint = _endpoint(documents, kind)
        chart = [_snake(r) for r in endpoint["metricRelabelings"]]
        assert chart == constant, kind
        (job,) = [
            r["replacement"] for r in endpoint["relabelings"] if r.get("targetLabel") == "job"
        ]
        assert sandbox[job] == chart, f"the sandbox's scrape job {job} relabels otherwise"
    pod = _endpoint(documents, "PodMonitor")
    moved = {
        r["targetLabel"]: r.get("sourceLabels") for r in pod["relabelings"] if "targetLabel" in r
    }
    # The target labels the sandbox's file_sd gives every trainer target (targets()).
    assert moved == {
        "pod": ["__meta_kubernetes_pod_name"],
        "node": ["__meta_kubernetes_pod_node_name"],
        "job": None,
    }
    (group,) = sandbox_prometheus.targets(
        [
            {
                "metadata": {"name": "p", "namespace": "ns"},
                "spec": {
                    "nodeName": "n",
                    "containers": [{"ports": [{"name": "metrics-0", "containerPort": 1}]}],
                },
                "status": {"phase": "Running", "podIP": "10.0.0.1"},
            }
        ],
        sandbox_prometheus.TRAINER_PORTS,
    )
    assert set(group["labels"]) == {"pod", "node", "namespace"}


def _dashboard_keys(documents: list[dict[str, Any]]) -> dict[str, set[str]]:
    """ConfigMap name -> data keys, of the dashboard ConfigMaps."""
    return {
        d["metadata"]["name"]: set(d["data"])
        for d in documents
        if d["kind"] == "ConfigMap" and d["metadata"]["labels"].get("grafana_dashboard")
    }


def previous_chart(commit: str, into: pathlib.Path) -> pathlib.Path:
    """The chart directory of an earlier commit, unpacked under ``into`` (needs the git history)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit, "charts/meshtrain"],
        capture_output=True,
    )
    assert archive.returncode == 0, (
        f"the previous chart releases need the git history ({commit}): run the tests in a full "
        f"clone, not a shallow one: {archive.stderr.decode()}"
    )
    (into / "previous.tar").write_bytes(archive.stdout)
    with tarfile.open(into / "previous.tar") as tar:
        tar.extractall(into, filter="data")
    return into / "charts" / "meshtrain"


@pytest.mark.parametrize("commit", PREVIOUS_CHARTS)
def test_an_upgrade_deletes_no_dashboard_file_the_new_configmaps_write(
    control_plane_binaries: binaries.Binaries, tmp_path: pathlib.Path, commit: str
) -> None:
    helm = control_plane_binaries.helm
    new = _dashboard_keys(_render(helm, CHART, "grafana.dashboards.enabled=true"))
    assert len(new) == 2, new
    for name, keys in new.items():
        assert keys == {f"{name}.json"}, "a dashboard's data key is its ConfigMap's name"
    old = _dashboard_keys(
        _render(helm, previous_chart(commit, tmp_path), "grafana.dashboards.enabled=true")
    )
    assert old, commit
    written = set().union(*new.values())
    deleted = {name: keys for name, keys in old.items() if name not in new}
    shared = {name: keys & written for name, keys in deleted.items() if keys & written}
    assert not shared, f"helm deletes these ConfigMaps, and the sidecar their files: {shared}"


def _notes(helm: pathlib.Path, into: pathlib.Path, *values: str) -> str:
    """NOTES.txt rendered with ``values`` (helm renders NOTES only on install: a copy of the
    chart renders it through ``tpl`` into a ConfigMap instead)."""
    chart = into / "meshtrain"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "files" / "NOTES.txt")
    (chart / "templates" / "notes-rendered.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ tpl (.Files.Get "files/NOTES.txt") . | toJson }}}\n'
    )
    (rendered,) = [
        d["data"]["notes"]
        for d in _render(helm, chart, *values, "--show-only=templates/notes-rendered.yaml")
    ]
    return str(rendered)


def test_notes_follow_jobs_in_the_watched_namespace_and_name_only_what_is_on(
    control_plane_binaries: binaries.Binaries, tmp_path: pathlib.Path
) -> None:
    helm = control_plane_binaries.helm
    watched = _notes(helm, tmp_path / "a", "watch.mode=namespaces", "watch.namespaces={team-a}")
    assert "kubectl get trainingjobs -w -n team-a" in watched
    assert "kubectl describe tj -n team-a <name>" in watched
    assert "kubectl apply -n team-a -f" in watched
    everywhere = _notes(helm, tmp_path / "b", "watch.mode=all")
    assert (
        "kubectl get trainingjobs -w " in everywhere
        and " -n " not in everywhere.split("3. Follow it:")[1]
    )
    dashboards = _notes(helm, tmp_path / "c", "grafana.dashboards.enabled=true")
    assert "Grafana shows the dashboards" in dashboards and "scrapes" not in dashboards
    scraped = _notes(helm, tmp_path / "d", "monitoring.trainerPodMonitor.enabled=true")
    assert "Prometheus scrapes the trainer pods" in scraped and "Grafana" not in scraped


def test_no_example_names_a_namespace() -> None:
    """The NOTES apply an example with ``-n <watched namespace>``: a manifest naming another
    namespace would be refused, so the examples name none."""
    examples = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
    assert examples
    for example in examples:
        for document in yaml.safe_load_all(example.read_text()):
            if document:
                assert "namespace" not in (document.get("metadata") or {}), example.name
