"""Static checks of the chart's templates (every template has a test; helm renders them in tests/integration).

Reading the template source catches the hardening and least-privilege rules
even where helm is not installed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

import yaml

from meshtrain.api import limits
from meshtrain.operator import command, planning
from meshtrain.operator.policy import naming
from meshtrain.planner import profiles

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "meshtrain"
TEMPLATES = CHART / "templates"


def _text(name: str) -> str:
    return (TEMPLATES / name).read_text()


def test_deployment_is_hardened() -> None:
    text = _text("deployment.yaml")
    for needle in (
        "runAsNonRoot: true",
        "readOnlyRootFilesystem: true",
        "allowPrivilegeEscalation: false",
        'drop: ["ALL"]',
        "type: RuntimeDefault",
        "livenessProbe:",
        'command: ["meshtrain", "operator"]',
        "resources:",
    ):
        assert needle in text, needle


def test_rbac_has_no_wildcards_and_no_secrets() -> None:
    rules = _text("_helpers.tpl") + _text("rbac.yaml")
    assert '"*"' not in rules and "'*'" not in rules
    assert "secrets" not in rules


def test_namespaced_rules_are_shared_by_both_watch_modes() -> None:
    text = _text("rbac.yaml")
    assert text.count('include "meshtrain.namespacedRules"') == 2
    assert "kind: Role\n" in text and "kind: ClusterRole\n" in text


def test_monitoring_objects_carry_the_selector_labels() -> None:
    text = _text("monitoring.yaml")
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert f"kind: {kind}" in text
    assert text.count('include "meshtrain.monitoringLabels"') == 3
    assert '.Files.Get "files/rules.yaml"' in text


def test_trainer_pod_monitor_scrapes_every_rank_port_and_keeps_the_targets_labels() -> None:
    text = _text("monitoring.yaml")
    monitor = text[text.index("kind: PodMonitor") : text.index("kind: PrometheusRule")]
    endpoints = monitor[monitor.index("podMetricsEndpoints:") :]
    # Prometheus' job, namespace and pod win, in every monitor
    assert not re.search(r"^\s*honorLabels:", text, re.M)
    assert "regex: exported_(namespace|pod|node)" in endpoints
    assert (
        "- port:" not in endpoints and "port: metrics\n" not in endpoints
    )  # not only one rank's port
    assert "sourceLabels: [__meta_kubernetes_pod_container_port_name]" in endpoints
    assert "regex: metrics-[0-9]+" in endpoints and "action: keep" in endpoints
    # the names the operator gives the ports match the keep rule
    assert re.fullmatch("metrics-[0-9]+", naming.metrics_port_name(0)) and re.fullmatch(
        "metrics-[0-9]+", naming.metrics_port_name(7)
    )


def test_operator_is_given_the_default_gpu_profile() -> None:
    assert "--gpu-profile={{ .Values.operator.gpuProfile }}" in _text("deployment.yaml")


def test_device_profiles_are_mounted_where_the_operator_reads_them() -> None:
    text = _text("deployment.yaml")
    assert f"- name: {profiles.ENV_VAR}\n              value: /etc/meshtrain/profiles" in text
    assert "mountPath: /etc/meshtrain/profiles\n              readOnly: true" in text
    assert 'checksum/profiles: {{ include (print $.Template.BasePath "/profiles.yaml")' in text
    assert "{{ $file }}.yaml: |" in _text("profiles.yaml")


def test_dashboards_are_configmaps_for_the_grafana_sidecar() -> None:
    text = _text("dashboards.yaml")
    assert "kind: ConfigMap" in text and '.Files.Glob "files/dashboards/*.json"' in text
    assert "$dash.folderAnnotation" in text and "$dash.label" in text


def test_every_template_is_tested() -> None:
    tested = {
        "deployment.yaml",
        "rbac.yaml",
        "monitoring.yaml",
        "dashboards.yaml",
        "serviceaccount.yaml",
        "_helpers.tpl",
        "NOTES.txt",
        # rendered and applied against a real API server in tests/integration/test_chart_production.py
        "user-roles.yaml",
        "pdb.yaml",
        "admission-policy.yaml",
        # applied to a real API server (with Kueue) in test_operator_kueue_fit.py
        "kueue-queue-policy.yaml",
        # installed on a real API server, refusing unlabelled jobs, in test_chart_production.py
        "kueue-required-policy.yaml",
        # server-side dry-run, selectors evaluated by a real API server in test_chart.py
        "network-policy.yaml",
        # rendered, projected and read by the operator in test_operator_admission.py
        "profiles.yaml",
        # every check run through helm template and lint in test_chart_messages.py
        "validate.yaml",
    }
    assert {p.name for p in TEMPLATES.iterdir()} == tested


def test_notes_say_what_to_apply_next_from_files_the_packaged_chart_carries() -> None:
    """NOTES name paths inside the chart (helm pull --untar of an OCI install has them), never
    the repository's manifests/; test_chart_messages.py renders them and packages the chart."""
    text = _text("NOTES.txt")
    assert "manifests/" not in text
    assert "helm pull CHART --version {{ .Chart.Version }} --untar" in text
    assert "{{ .Chart.Name }}/files/examples/gpt-1.3b-dp8-tp2.yaml" in text
    assert (CHART / "files" / "examples" / "gpt-1.3b-dp8-tp2.yaml").is_file()
    assert re.search(r"kubectl get trainingjobs -w", text)


def test_leader_election_has_its_lease_rbac_and_a_stable_identity() -> None:
    deployment = _text("deployment.yaml")
    assert "--lease=" in deployment and "--standalone" in deployment
    assert "name: POD_NAME" in deployment and "fieldPath: metadata.name" in deployment
    rbac = _text("rbac.yaml")
    assert 'resources: ["leases"]' in rbac and 'verbs: ["create"]' in rbac
    # get and update only the Lease the Deployment names (--lease=<fullname>)
    assert '--lease={{ include "meshtrain.fullname" . }}' in deployment
    lease_rule = 'resourceNames: [{{ include "meshtrain.fullname" . | quote }}]\n    verbs: ["get", "update"]'
    assert lease_rule in rbac


def test_operator_is_given_the_planning_deadline_the_chart_defaults_to_the_operators() -> None:
    assert "--planning-deadline-seconds={{ .Values.operator.planningDeadlineSeconds }}" in _text(
        "deployment.yaml"
    )
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["operator"]["planningDeadlineSeconds"] == planning.DEFAULT_DEADLINE_SECONDS
    schema = json.loads((CHART / "values.schema.json").read_text())
    bounds = schema["properties"]["operator"]["properties"]["planningDeadlineSeconds"]
    assert bounds["maximum"] == command.MAX_PLANNING_DEADLINE  # what the flag refuses above


def test_the_trainer_policy_selects_the_label_the_operator_gives_trainer_pods() -> None:
    text = _text("network-policy.yaml")
    assert f"key: {naming.LABEL_JOB}" in text
    assert 'policyTypes: ["Ingress"]' in text  # egress (API server, storage, DNS) stays open


def test_the_operator_isolates_each_gang_where_the_chart_writes_the_trainer_policy() -> None:
    text = _text("network-policy.yaml")
    assert text.count("operator: Exists") == 1, "trainer pods as targets, never as peers"
    assert 'range include "meshtrain.trainerPolicyNamespaces"' in text
    deployment = _text("deployment.yaml")
    assert 'include "meshtrain.trainerPolicyNamespaces"' in deployment
    assert "- --gang-network-policy-namespace={{ . }}" in deployment
    # granted in those namespaces only (a Role each), never with the cluster-wide rules
    assert 'resources: ["networkpolicies"]' not in _text("_helpers.tpl")
    rbac = _text("rbac.yaml")
    policies = rbac[rbac.index('range include "meshtrain.trainerPolicyNamespaces"') :]
    assert 'resources: ["networkpolicies"]' in policies and "kind: Role\n" in policies
    assert "ClusterRole" not in policies


def test_a_required_queue_is_defaulted_by_the_operator_or_refused_at_admission() -> None:
    assert "- --default-queue=default" in _text("deployment.yaml")
    refused = _text("kueue-required-policy.yaml")
    assert 'eq .Values.kueue.requireQueue "refuse"' in refused
    assert 'metadata.labels["kueue.x-k8s.io/queue-name"] is required' in refused


def test_the_trainer_policy_names_every_exporter_port_a_node_may_run_and_hands_gangs_the_peers(
    monkeypatch,
) -> None:
    helpers = _text("_helpers.tpl")
    assert f"range $rank := until {limits.MAX_GPUS_PER_NODE}" in helpers
    assert f'printf "{naming.METRICS_PORT_PREFIX}%d" $rank' in helpers
    policy = _text("network-policy.yaml")
    assert f'"port": "{naming.metrics_port_name(0)}"' in policy  # the operator: rank 0's /progress
    assert str(naming.MASTER_PORT) not in policy and "rendezvous" not in policy.split("spec:")[-1]
    deployment = _text("deployment.yaml")
    for kind in ("operator", "metrics"):  # the environment the operator's flags read
        name = f"MESHTRAIN_GANG_NETWORK_POLICY_{kind.upper()}_PEERS"
        assert f"- name: {name}" in deployment
        monkeypatch.setenv(name, '[{"podSelector": {}}]')
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    peers = command.gang_peers(parser.parse_args(["operator"]))
    assert peers.operator == peers.metrics == ({"podSelector": {}},)


def test_the_schema_refuses_more_scrapers_than_the_operator_takes() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    extra = schema["properties"]["networkPolicy"]["properties"]["extraIngressFrom"]
    assert extra["maxItems"] + 1 == command.MAX_PEERS  # the Prometheus the values name, then these
